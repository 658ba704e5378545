"""A vLLM server started for the run: its command line and environment (CPU threads, KV
cache size, LoRA rank, the weight-sync worker extension), started on loopback from the
separate vLLM environment (`make vllm`), its log's root cause when it dies, and its whole
process group stopped at the end."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

import trainer.lifeline as lifeline
from trainer.api_key import resolve_api_key
from trainer.errors import ConfigError, InfraError

SERVED_NAME = "agentrft-policy"  # the model name of a server this module launches
WORKER_EXTENSION = "trainer.generation.vllm_worker.WeightSyncExtension"


_REPO_ROOT = Path(__file__).resolve().parents[2]  # holds trainer/, put on the server's PYTHONPATH


_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's --max-lora-rank choices


def vllm_python(python: str) -> str:
    """The interpreter of the vLLM environment: as given, or relative to the project root."""
    for candidate in (Path(python), _REPO_ROOT / python):
        if candidate.is_file():
            return str(candidate.absolute())  # not resolve(): a venv's python is a symlink out of the venv
    raise ConfigError(
        f"rollout.vllm.python: {python} not found; create the vLLM environment with scripts/vllm_env.sh "
        "(`make vllm`), or point it at a python that has vllm installed"
    )


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# vLLM's log prefix: "(EngineCore pid=12) ERROR 12-03 14:18:50 [core.py:1512] "
_LOG_PREFIX = re.compile(r"^(\(\w+ pid=\d+\) )?([A-Z]+ \d\d-\d\d \d\d:\d\d:\d\d \[[^\]]*\] )?")


_EXCEPTION = re.compile(r"^([\w.]+(?:Error|Exception)): \S")


# Exceptions that only say that another one happened ("see the stack trace above").
_WRAPPERS = ("EngineDeadError", "EngineGenerateError")


def root_cause(log_path: Path, offset: int = 0) -> str | None:
    """The first exception a server's log reports from `offset` on (the end of the first
    traceback: where the chain of errors began), or None."""
    try:
        with open(log_path, "rb") as log:
            log.seek(offset)
            text = log.read().decode(errors="replace")
    except OSError:
        return None
    for line in text.splitlines():
        message = _LOG_PREFIX.sub("", line, count=1).strip()
        match = _EXCEPTION.match(message)
        if match and match.group(1).rsplit(".", 1)[-1] not in _WRAPPERS:
            return message[:500]
    return None


def _tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


@dataclass
class LaunchedServer:
    """A vLLM server this process started."""

    url: str
    process: subprocess.Popen
    log_path: Path
    startup_s: float
    log_offset: int = 0  # where this server's part of the log starts

    @property
    def log(self) -> tuple[Path, int]:
        return self.log_path, self.log_offset


@contextlib.contextmanager
def launched_server(
    python: str,
    model_dir: str,
    *,
    args: list[str],
    log_path: Path,
    startup_timeout_s: float,
    api_key: str | None = None,
    env: dict[str, str] | None = None,
) -> Iterator[LaunchedServer]:
    """Start `python -m vllm.entrypoints.openai.api_server` for `model_dir` on a free loopback
    port, wait until it answers /health, and stop it (and its engine processes) on exit.
    A server that exits or is not ready in time raises `InfraError` with the end of its log."""
    port = free_port()
    command = [
        vllm_python(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
        "--host", "127.0.0.1", "--port", str(port), *args,
    ]
    child_env = {
        **os.environ,
        "VLLM_HOST_IP": "127.0.0.1",
        "PYTHONPATH": os.pathsep.join(p for p in (str(_REPO_ROOT), os.environ.get("PYTHONPATH")) if p),
        **(env or {}),
    }
    key = resolve_api_key(api_key)
    if key:
        child_env["VLLM_API_KEY"] = key  # not on the command line, where `ps` would show it
    log_path.parent.mkdir(parents=True, exist_ok=True)
    url = f"http://127.0.0.1:{port}"
    started = time.monotonic()
    offset = log_path.stat().st_size if log_path.is_file() else 0
    with open(log_path, "ab") as log:
        # Under a guard (trainer/lifeline.py): its own process group, stopped as one, and gone
        # with this process however this process ends (a killed flow run leaves no server).
        process = lifeline.start(command, grace=30.0, stdout=log, stderr=subprocess.STDOUT, env=child_env)
    try:
        while True:
            if process.poll() is not None:
                cause = root_cause(log_path, offset)
                raise InfraError(f"the vLLM server for {model_dir} exited with code {process.returncode} while "
                                 f"starting{f': {cause}' if cause else ''}; the end of its log ({log_path}):\n"
                                 f"{_tail(log_path)}", endpoint=url)
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            if time.monotonic() - started > startup_timeout_s:
                raise InfraError(
                    f"the vLLM server for {model_dir} was not ready within rollout.vllm.startup_timeout_s "
                    f"({startup_timeout_s:.0f} s); the end of its log ({log_path}):\n{_tail(log_path)}", endpoint=url,
                )
            time.sleep(1.0)
        startup_s = time.monotonic() - started
        print(f"vLLM server ready at {url} in {startup_s:.0f} s (log: {log_path})", flush=True)
        yield LaunchedServer(url, process, log_path, startup_s, offset)
    finally:
        _stop(process)


def _stop(process: subprocess.Popen) -> None:
    """SIGTERM to the server's process group, SIGKILL if it is still there after 30 s."""
    if process.poll() is not None:
        return
    for sig, grace in ((signal.SIGTERM, 30.0), (signal.SIGKILL, 10.0)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, sig)
        try:
            process.wait(timeout=grace)
            return
        except subprocess.TimeoutExpired:
            continue


_DTYPE_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2}


def kv_cache_bytes(model_dir: str | Path, *, max_model_len: int, max_concurrent: int, dtype: str = "auto",
                   available: int | None = None) -> int:
    """The KV cache a launched server gets: room for `max_concurrent` sequences of
    `max_model_len` tokens, but at most half of what the machine has free (`available`:
    free GPU memory on a GPU, available RAM otherwise, measured when None), since the
    trainer and the pipeline's services share it; at least one whole sequence."""
    config_path = Path(model_dir) / "config.json"
    try:
        config = json.loads(config_path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{config_path}: cannot read the model's config to size the vLLM KV cache ({exc}); "
                          "set --kv-cache-memory-bytes in rollout.vllm.extra_args") from None
    config = config.get("text_config", config)
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    kv_heads = config.get("num_key_value_heads") or heads
    named = dtype if dtype != "auto" else str(config.get("dtype") or config.get("torch_dtype") or "float32")
    per_token = 2 * config["num_hidden_layers"] * kv_heads * head_dim * _DTYPE_BYTES.get(named, 4)
    if available is None:
        import torch

        if torch.cuda.is_available():
            available = torch.cuda.mem_get_info()[0]
        else:
            import psutil

            available = psutil.virtual_memory().available
    one = per_token * max_model_len
    if one > available // 2:
        raise ConfigError(
            f"a vLLM server for {model_dir} needs {one / 2**20:.0f} MiB of KV cache for one sequence of "
            f"{max_model_len} tokens, more than half of the {available / 2**20:.0f} MiB free; lower "
            "rollout.max_total_tokens or free memory"
        )
    return max(one, min(per_token * max_model_len * max_concurrent, available // 2))


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def cpu_thread_env(environ: dict[str, str] | None = None) -> dict[str, str]:
    """OpenMP threads of a launched server on a CPU, which shares the machine with the
    trainer: half the cores, unbound. vLLM's default binds its worker's threads to cores
    (all but one), where a busy trainer thread on the same core stalls them; with the engine
    in the API server's process it spins a thread on every core, and each parallel region
    waits for the thread an update pushed off its core. On 2 cores (bench_vllm_threads.py,
    three runs) a batch of rollouts took 1.7-2.7 s alone with the worker bound, 0.8-0.9 s with
    these settings, and beside an update 1.0-3.7 s against 1.2-1.9 s; with the engine in one
    process, 4.7 s against 0.9 s beside an update. A VLLM_CPU_OMP_THREADS_BIND in the
    environment, vLLM's own setting, is left as set (with any OMP_NUM_THREADS); an
    OMP_NUM_THREADS alone is the trainer's (torchrun sets 1) and the server gets its share."""
    environ = os.environ if environ is None else environ
    if "VLLM_CPU_OMP_THREADS_BIND" in environ:
        return {}
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": str(max(1, cores // 2))}


def server_args(
    *, max_model_len: int, dtype: str = "auto", lora_rank: int | None = None, nccl: bool = False,
    extra_args: Sequence[str] = (), model_dir: str | Path | None = None, max_concurrent: int = 64,
) -> tuple[list[str], dict[str, str]]:
    """Command-line arguments and environment of a server this module launches. With
    `model_dir`, the KV cache is sized to the machine (`kv_cache_bytes`) unless
    `extra_args` say how much memory the server takes (vLLM's default, 92% of the
    memory, fails whenever the trainer or the pipeline's services hold more than 8%)."""
    args = [
        "--served-model-name", SERVED_NAME,
        "--max-model-len", str(max_model_len),
        "--logprobs-mode", "processed_logprobs",
        "--generation-config", "vllm",  # the request's sampling values, not the model's defaults
        "--worker-extension-cls", WORKER_EXTENSION,
    ]
    if dtype != "auto":
        args += ["--dtype", dtype]
    # Dev mode: /collective_rpc, /reset_prefix_cache and the weight-transfer routes. Runtime
    # LoRA loading is allowed whenever --enable-lora is given, here or in extra_args.
    env = {"VLLM_SERVER_DEV_MODE": "1", "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "true"}
    if lora_rank is not None:
        rank = next((r for r in _LORA_RANKS if r >= lora_rank), _LORA_RANKS[-1])
        args += ["--enable-lora", "--max-lora-rank", str(rank), "--max-loras", "2"]
    if nccl:
        args += ["--weight-transfer-config", '{"backend": "nccl"}']
    given = {a.split("=")[0] for a in extra_args}
    if not given & {"--enable-prefix-caching", "--no-enable-prefix-caching"}:
        # vLLM 0.32 turns it on for the models that support it; said here, so that a server
        # that cannot share a group's prompt fails to start rather than recompute it 8 times.
        args += ["--enable-prefix-caching"]
    if not cuda_available() and not given & {"--enable-chunked-prefill", "--no-enable-chunked-prefill"}:
        # vLLM's CPU build cannot rewind a seeded request's generator ("CPU Generator does not
        # use offset"), which it does when a prompt is prefilled in chunks and the token
        # sampled after a partial chunk is discarded: its engine dies as soon as several
        # seeded prompts share a step. Whole prompts only (a step holds up to
        # max_num_batched_tokens of them), so every turn can carry its seed.
        args += ["--no-enable-chunked-prefill"]
        if "--max-num-batched-tokens" not in given:
            args += ["--max-num-batched-tokens", str(max(max_model_len, 8192))]
        env |= cpu_thread_env()
    sized = bool(given & {"--kv-cache-memory-bytes", "--gpu-memory-utilization"})
    if model_dir is not None and not sized:
        args += ["--kv-cache-memory-bytes", str(kv_cache_bytes(
            model_dir, max_model_len=max_model_len, max_concurrent=max_concurrent, dtype=dtype))]
    return args + list(extra_args), env
