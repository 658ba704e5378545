"""Rollouts on vLLM servers: token ids in, token ids and log-probabilities out, and the
trainer's weights pushed to the servers after every optimizer step.

The agent loop (trainer/rollout.py) renders the chat template itself and hands the
backend token ids, so what the trainer scores is exactly what the server sampled. Each
turn of a rollout is one `POST /v1/completions` whose prompt is the sequence's whole
token list (prompt, earlier turns, tool outputs); vLLM's prefix cache finds the earlier
tokens' keys and values, so a turn costs about its new tokens, like the embedded engine's
kept KV cache. Every request asks for `return_token_ids` and `logprobs: 0` (the sampled
token's log-probability); the stop token comes back as the last token id, as our engine
returns it. The server must run with `--logprobs-mode processed_logprobs`: vLLM then
reports log_softmax(logits / temperature), which is our engine's definition as long as
top-p and top-k are off (with them vLLM renormalizes over the kept tokens, ours does not);
the default `raw_logprobs` would be at temperature 1.

Several servers (replicas) share the rollouts: a new sequence goes to the replica with
the fewest live sequences and stays there (its cached prefix is there), and every request
carries vLLM's session header `X-Session-ID` with the sequence's key, so a router in front
of many replicas can keep a rollout on one of them too. Each turn is sampled with a seed
derived from (backend seed, seq id, turn), so a run is reproducible up to the kernels'
batch-dependent rounding. A refused connection, a timeout or a 5xx is retried with
backoff (3 attempts, on another replica when there is one); then `InfraError` names the
servers, and the rollout batch stops with it rather than waiting forever.

Weight sync (`rollout.vllm.sync`; unset: `lora` when training LoRA, else `full`), after
each optimizer step and after a resume:
- `full`: the policy's weights (LoRA merged) are written as one safetensors file in the
  run directory and every server reloads them in place through the worker extension
  (trainer/vllm_worker.py, `POST /collective_rpc`), then its prefix cache is reset
  (cached keys and values of the old weights would otherwise be reused). The servers must
  read the run directory: loopback, or a shared filesystem for servers on other machines.
  With LoRA on a bf16 server this rounds the merged weights to bf16, dropping the adapter's
  small early changes: a warning says so.
- `lora`: the adapter is saved and loaded under a new name per step
  (`/v1/load_lora_adapter`), requests name it, and the previous one is unloaded.
- `nccl` (GPUs, untested here): vLLM's weight transfer (`/init_weight_transfer_engine`,
  `/start_weight_update`, `/update_weights`, `/finish_weight_update`) broadcasts the
  weights from the trainer's GPU to the servers' GPUs; it needs `vllm` importable in the
  training process.
A sync that fails leaves the generator refusing to hand out a backend: no rollout is
sampled with weights that are not the trainer's.

Processes: with `accelerate launch` every process runs its share of the rollouts against
the same servers, but only the main process starts servers and pushes weights (DDP keeps
every replica of the model identical); the others wait for it at each sync and learn the
URLs and the adapter's name from it, so no process samples before the sync is done and an
error on the main process stops every process instead of hanging them.

    VLLM_SERVER_DEV_MODE=1 PYTHONPATH=/path/to/agentrft python -m vllm.entrypoints.openai.api_server \
        --model MODEL_DIR --logprobs-mode processed_logprobs \
        --worker-extension-cls trainer.vllm_worker.WeightSyncExtension
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import socket
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import torch

from trainer.engine import GenerationBackend, SamplingParams, TurnOutput
from trainer.errors import ConfigError, InfraError
from trainer.vllm_servers import (
    SESSION_HEADER,
    LaunchedServer,
    ServerInfo,
    VllmServers,
    free_port,
    launched_server,
    reset_prefix_cache,
    server_args,
)

_POLL_S = 0.02  # how long step() waits for a turn before handing control back to the loop

T = TypeVar("T")


# ----------------------------------------------------------------------------------------------
# The servers: HTTP, retries, replica choice.






# ----------------------------------------------------------------------------------------------
# The generation backend.


def turn_seed(seed: int, seq_id: str, turn: int) -> int:
    """The sampling seed of one turn: a function of (seed, seq_id, turn) only."""
    digest = hashlib.sha256(f"{seed}\x00{seq_id}\x00{turn}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


@dataclass
class _Sequence:
    key: str  # what the servers see of it (session header)
    url: str
    epoch: int
    tokens: list[int] = field(default_factory=list)
    turns: int = 0
    busy: bool = False


class VllmBackend(GenerationBackend):
    """`GenerationBackend` over vLLM servers: each turn is one completion request whose
    prompt is the sequence's tokens so far. `submit` sends the request (from any thread);
    `step` waits briefly for requests to finish and returns their turns."""

    def __init__(
        self,
        servers: VllmServers,
        *,
        model: str,
        stop_token_ids: list[int],
        max_len: int,
        seed: int = 0,
        deadline: tuple[float, float] = (60.0, 0.5),
    ):
        self.servers = servers
        self.deadline = deadline  # a turn's: seconds, plus seconds per requested token
        self.model = model
        self.stop_token_ids = sorted(set(stop_token_ids))
        self.max_len = max_len
        self.seed = seed
        self._prefix = hashlib.sha256(os.urandom(16)).hexdigest()[:12]  # this backend's sessions
        self._lock = threading.Lock()
        self._seqs: dict[str, _Sequence] = {}
        self._inflight: dict[Future, tuple[str, int, int]] = {}  # future -> (seq_id, epoch, turn limit)
        self._ready: list[TurnOutput] = []  # turns refused at submit (no room), delivered by step
        self._epochs = 0

    def submit(self, seq_id: str, append_ids: list[int], params: SamplingParams) -> None:
        with self._lock:
            seq = self._seqs.get(seq_id)
            if seq is not None and seq.busy:
                raise ValueError(f"sequence {seq_id!r} is generating; submit again after its turn")
            if seq is None:
                if not append_ids:
                    raise ValueError(f"new sequence {seq_id!r} needs a non-empty prompt")
                self._epochs += 1
                seq = _Sequence(f"{self._prefix}/{seq_id}", self.servers.assign(), self._epochs)
                self._seqs[seq_id] = seq
            total = len(seq.tokens) + len(append_ids)
            if total + 1 > self.max_len:  # no room for one generated token: refuse, append nothing
                self._ready.append(TurnOutput(seq_id, [], [], "context", len(seq.tokens)))
                return
            seq.tokens.extend(append_ids)
            seq.busy = True
            max_tokens = min(params.max_new_tokens, self.max_len - total)
            body = {
                "model": self.model,
                "prompt": list(seq.tokens),
                "max_tokens": max_tokens,
                "temperature": params.temperature,
                "top_p": params.top_p,
                "top_k": params.top_k or -1,
                # Explicit neutral values: a server's generation config must not add its own.
                "min_p": 0.0,
                "repetition_penalty": 1.0,
                "presence_penalty": 0.0,
                "frequency_penalty": 0.0,
                "seed": turn_seed(self.seed, seq_id, seq.turns),
                "stop_token_ids": self.stop_token_ids,
                "logprobs": 0,
                "return_token_ids": True,
                "skip_special_tokens": False,
                "session_id": seq.key,
            }
            future = self.servers.pool.submit(self._complete, seq_id, seq, body)
            self._inflight[future] = (seq_id, seq.epoch, params.max_new_tokens)

    def _complete(self, seq_id: str, seq: _Sequence, body: dict[str, Any]) -> dict[str, Any]:
        def failover(url: str) -> str:
            # The sequence moves to another replica (its prefix is recomputed there once),
            # unless it was released meanwhile (its answer will be dropped).
            with self._lock:
                if self._seqs.get(seq_id) is seq:
                    self.servers.unassign(url)
                    seq.url = self.servers.assign(avoid=url)
                return seq.url

        base, per_token = self.deadline
        _, answer = self.servers.request(
            "POST", seq.url, "/v1/completions", json=body, headers={SESSION_HEADER: seq.key}, failover=failover,
            timeout_s=base + per_token * body["max_tokens"],
        )
        return answer

    def step(self) -> list[TurnOutput]:
        with self._lock:
            finished, self._ready = self._ready, []
            pending = list(self._inflight)
        if pending and not finished:
            wait(pending, timeout=_POLL_S, return_when=FIRST_COMPLETED)
        for future in [f for f in pending if f.done()]:
            with self._lock:
                seq_id, epoch, turn_limit = self._inflight.pop(future)
            answer = future.result()  # InfraError / ConfigError end the batch here
            with self._lock:
                seq = self._seqs.get(seq_id)
                if seq is None or seq.epoch != epoch:
                    continue  # released (or released and re-created) meanwhile: dropped
                finished.append(self._turn(seq_id, seq, answer, turn_limit))
        return finished

    def _turn(self, seq_id: str, seq: _Sequence, answer: dict[str, Any], turn_limit: int) -> TurnOutput:
        choice = answer["choices"][0]
        token_ids = [int(t) for t in choice.get("token_ids") or []]
        logprobs = [float(lp) for lp in ((choice.get("logprobs") or {}).get("token_logprobs") or [])]
        if len(logprobs) != len(token_ids):
            raise InfraError(
                f"vLLM server {seq.url} returned {len(token_ids)} token ids but {len(logprobs)} log-probabilities "
                "(it must accept return_token_ids and logprobs)", endpoint=seq.url,
            )
        seq.tokens.extend(token_ids)
        seq.turns += 1
        seq.busy = False
        # The engine's order: a stop token, then the turn's own limit, then the context.
        if token_ids and token_ids[-1] in self.stop_token_ids:
            reason = "stop"
        elif len(token_ids) >= turn_limit:
            reason = "length"
        elif len(seq.tokens) >= self.max_len:
            reason = "context"
        else:
            reason = "length"
        return TurnOutput(seq_id, token_ids, logprobs, reason, len(seq.tokens))

    def release(self, seq_id: str) -> None:
        with self._lock:
            seq = self._seqs.pop(seq_id, None)
            if seq is None:
                raise KeyError(f"unknown or already released sequence {seq_id!r}")
            self.servers.unassign(seq.url)

    def has_work(self) -> bool:
        with self._lock:
            return bool(self._ready or self._inflight)


# ----------------------------------------------------------------------------------------------
# A server started for the run.
















# ----------------------------------------------------------------------------------------------
# Weights.


def merged_state_dict(
    model: torch.nn.Module, dtype: torch.dtype | None = None, *, merge_adapters: bool = True, device: str = "cpu"
) -> dict[str, torch.Tensor]:
    """The model's weights under the checkpoint names transformers saves, on `device`, in
    `dtype` if given, LoRA adapters merged (W + scale * B @ A, computed aside: the training model is
    not touched) or, with `merge_adapters=False`, left out. A tied LM head is left out too
    (the server ties it again)."""
    peft = hasattr(model, "get_base_model")  # a PeftModel
    base = model.get_base_model() if peft else model
    deltas: dict[str, torch.Tensor] = {}
    if peft and merge_adapters:
        from peft.tuners.lora import LoraLayer

        for name, module in base.named_modules():
            if isinstance(module, LoraLayer):
                adapters = [a for a in module.active_adapters if a in module.lora_A]
                if adapters:
                    deltas[f"{name}.weight"] = sum(module.get_delta_weight(a) for a in adapters)
    tied = bool(getattr(base.config, "tie_word_embeddings", False))
    weights: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for name, tensor in base.state_dict().items():
            if ".lora_" in name or (tied and name == "lm_head.weight"):
                continue
            name = name.replace(".base_layer.", ".")
            if name in deltas:
                tensor = tensor + deltas[name].to(tensor.dtype)
            weights[name] = tensor.detach().to(device, dtype=dtype or tensor.dtype).contiguous()
    return weights


def save_weights(weights: dict[str, torch.Tensor], directory: Path) -> Path:
    """Write `weights` as `directory/model.safetensors`, replacing the last step's file at once
    (a server never reads half a file)."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    partial = directory / "model.safetensors.partial"
    save_file(weights, str(partial))
    os.replace(partial, directory / "model.safetensors")
    return directory


# ----------------------------------------------------------------------------------------------
# The trainer's generator.


def _on_main(accelerator: Any, work: Callable[[], T]) -> T:
    """Run `work` on the main process and give its result, or its failure, to every process."""
    result: Any = None
    error: Exception | None = None
    if accelerator is None or accelerator.is_main_process:
        try:
            result = work()
        except Exception as exc:  # handed to the other processes before it is raised here
            error = exc
    if accelerator is not None and accelerator.num_processes > 1:
        from accelerate.utils import broadcast_object_list

        box = [(result, None if error is None else f"{type(error).__name__}: {error}")]
        broadcast_object_list(box)
        result, message = box[0]
        if message is not None and error is None:
            raise InfraError(f"the main process failed to prepare the vLLM servers: {message}")
    if error is not None:
        raise error
    return result


class VllmGenerator:
    """Rollouts on vLLM servers for one training run: `backend(seed)` before each batch of
    rollouts, `sync(step)` after each optimizer step (see the module docstring)."""

    reads_training_model = False  # the servers hold their own copy: sampling may run beside an update

    def __init__(self, servers: VllmServers, *, trainer: Any, work_dir: Path, model: str, mode: str):
        self.servers = servers
        self.trainer = trainer
        self.work_dir = Path(work_dir).resolve() / "vllm"
        self.model = model  # the name requests carry: the base model's, or the current adapter's
        self.mode = mode
        self.version: int | None = 0  # the step whose weights the servers hold; None: unknown
        self.failure = ""
        self.sync_seconds: list[float] = []
        self.launched: list[LaunchedServer] = []  # servers this process started (main process only)
        self._dtype: torch.dtype | None = None
        self._nccl: list[Any] = []

    @classmethod
    @contextlib.contextmanager
    def for_trainer(cls, config: Any, trainer: Any, work_dir: Path) -> Iterator[VllmGenerator]:
        """Connect to `rollout.vllm.urls`, or launch one server (`launch: true`) on the main
        process; check the servers; stop what was started on exit."""
        rollout, vcfg = config.rollout, config.rollout.vllm
        lora = config.training.lora
        mode = resolved_sync(vcfg, lora)
        if mode == "lora" and lora is None:
            raise ConfigError("rollout.vllm.sync: lora needs training.lora (an adapter to load); use sync: full")
        if rollout.top_p < 1:
            raise ConfigError(
                f"rollout.top_p is {rollout.top_p} on the vLLM backend: vLLM's log-probabilities are renormalised "
                "over the nucleus, so truncated importance sampling against the trainer's (over the whole "
                "vocabulary) would be biased; train with top_p 1 (evaluations may use less)"
            )
        if vcfg.launch and vcfg.urls:
            raise ConfigError("rollout.vllm: set either launch: true or urls, not both")
        accelerator = getattr(trainer, "accelerator", None)
        with contextlib.ExitStack() as stack:
            launched: list[LaunchedServer] = []

            def start() -> list[str]:
                if not vcfg.launch:
                    return list(vcfg.urls)
                model_dir = _servable_dir(trainer, Path(work_dir).resolve() / "vllm" / "base")
                args, env = server_args(
                    max_model_len=rollout.max_total_tokens, dtype=config.model.dtype,
                    lora_rank=lora.r if mode == "lora" else None, nccl=mode == "nccl",
                    extra_args=vcfg.extra_args, model_dir=model_dir, max_concurrent=rollout.max_concurrent_rollouts,
                )
                launched.append(stack.enter_context(launched_server(
                    vcfg.python, model_dir, args=args, log_path=Path(work_dir) / "vllm" / "server.log",
                    startup_timeout_s=vcfg.startup_timeout_s, api_key=vcfg.api_key, env=env,
                )))
                return [launched[0].url]

            urls = _on_main(accelerator, start)
            servers = VllmServers(urls, api_key=vcfg.api_key, request_timeout_s=vcfg.request_timeout_s,
                                  max_concurrent=rollout.max_concurrent_rollouts,
                                  logs={server.url: server.log for server in launched})
            stack.callback(servers.close)
            infos = _on_main(accelerator, lambda: servers.check(
                max_total_tokens=rollout.max_total_tokens, temperature=rollout.temperature, top_p=rollout.top_p,
            ))
            generator = cls(servers, trainer=trainer, work_dir=work_dir, model=infos[0].model, mode=mode)
            if mode == "full" and lora is not None:
                _on_main(accelerator, generator._warn_if_rounded)
            generator.launched = launched
            stack.callback(generator._close_nccl)
            # Servers the user runs may hold any weights, and an adapter is loaded only by a sync:
            # make the servers hold the trainer's policy before the first rollout.
            if not vcfg.launch or mode != "full":
                generator.sync(0)
            yield generator

    def backend(self, seed: int) -> VllmBackend:
        if self.version is None:
            raise InfraError(f"the vLLM servers may not hold the trainer's weights: {self.failure}; "
                             "no rollouts are sampled until a sync succeeds")
        trainer = self.trainer
        vcfg = trainer.config.rollout.vllm
        return VllmBackend(
            self.servers, model=self.model, stop_token_ids=trainer.stop_token_ids,
            max_len=trainer.config.rollout.max_total_tokens, seed=seed,
            deadline=(vcfg.turn_deadline_s, vcfg.turn_deadline_per_token_s),
        )

    def sample(self, items: list[dict[str, Any]], n: int, seed: int, version: int) -> list[Any]:
        """`n` rollouts of each item on the servers (the trainer's `rollout_context` runs them)."""
        return self.trainer.rollout_context.run(self.backend(seed), items, n, seed, version)

    def metrics(self) -> dict[str, float]:
        """What the step logs about the servers (this process's view)."""
        return {"infra/replicas_alive": float(len(self.servers.alive()))}

    def _each_alive(self, what: str, action: Callable[[str], None]) -> None:
        """`action` on every replica in rotation; one that fails it is taken out (it would
        serve other weights than the trainer's); an error when none is left."""
        for url in self.servers.alive():
            if not self.servers.healthy(url):  # a hung server would hold the sync for request_timeout_s
                self.servers.mark_dead(url, f"no answer to /health before {what}")
                continue
            try:
                action(url)
            except InfraError as exc:
                self.servers.mark_dead(url, f"{what} failed: {exc}")
        if not self.servers.alive():
            raise self.servers.no_replica()

    def sync(self, step: int) -> None:
        """Push the trainer's current weights to every server (main process), then let every
        process go on; a failure leaves the generator refusing to sample."""
        started = time.perf_counter()
        self.version = None
        self.failure = f"the weight sync of step {step} did not complete"
        work = {"full": self._sync_full, "lora": self._sync_lora, "nccl": self._sync_nccl}[self.mode]
        self.model = _on_main(getattr(self.trainer, "accelerator", None), lambda: work(step))
        self.version = step
        self.failure = ""
        self.sync_seconds.append(time.perf_counter() - started)

    # -- the three ways -------------------------------------------------------------------------

    def _warn_if_rounded(self) -> None:
        dtype = self._served_dtype()
        if dtype in (torch.bfloat16, torch.float16):
            warnings.warn(
                f"training.lora with rollout.vllm.sync: full on a {dtype} server: the merged weights are rounded "
                f"to {dtype}, which drops an adapter's small early changes (about 1e-3 of a weight and less); use "
                "sync: lora (the default with LoRA)", stacklevel=3)

    def _policy(self) -> torch.nn.Module:
        return self.trainer.sampling_model()

    def _served_dtype(self) -> torch.dtype:
        if self._dtype is None:
            results = self.servers.post(self.servers.urls[0], "/collective_rpc", {"method": "agentrft_info"})
            self._dtype = getattr(torch, results["results"][0]["dtype"])
        return self._dtype

    def _sync_full(self, step: int) -> str:
        weights = merged_state_dict(self._policy(), self._served_dtype())
        directory = save_weights(weights, self.work_dir / "weights")

        def reload(url: str) -> None:
            answer = self.servers.post(url, "/collective_rpc", {
                "method": "agentrft_reload_weights", "args": [str(directory), str(step)],
            })
            for result in answer["results"]:
                if not isinstance(result, dict) or result.get("tensors") != len(weights):
                    raise InfraError(f"vLLM server {url} did not load the weights of step {step}: {result}",
                                     endpoint=url)
            reset_prefix_cache(self.servers, url)

        self._each_alive(f"the weight sync of step {step}", reload)
        return self.model

    def _sync_lora(self, step: int) -> str:
        name = f"policy-step-{step}"
        directory = self.work_dir / "lora" / name
        self._policy().save_pretrained(str(directory))
        previous = self.model if self.model.startswith("policy-step-") else None
        # load_inplace: the same step again (a resume) replaces what was loaded under its name
        self._each_alive(f"the adapter sync of step {step}", lambda url: self.servers.post(
            url, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(directory), "load_inplace": True}))
        if previous and previous != name:
            for url in self.servers.alive():
                with contextlib.suppress(ConfigError):  # already gone (a restarted server)
                    self.servers.post(url, "/v1/unload_lora_adapter", {"lora_name": previous})
            shutil.rmtree(self.work_dir / "lora" / previous, ignore_errors=True)
        return name

    def _sync_nccl(self, step: int) -> str:
        """vLLM's NCCL weight transfer (untested here: it needs GPUs and NCCL). The trainer
        joins one NCCL group per server as rank 0 and broadcasts every tensor."""
        if not self._nccl:
            self._nccl = [self._nccl_engine(url) for url in self.servers.urls]
        for engine in self._nccl:
            engine.send_weights()
        for url in self.servers.alive():
            self.servers.post(url, "/update_weight_version", {"new_version": str(step)})
            reset_prefix_cache(self.servers, url)
        return self.model

    def _nccl_engine(self, url: str) -> Any:
        try:
            from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource
            from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
            from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo
        except ImportError as exc:
            raise ConfigError(
                "rollout.vllm.sync: nccl needs `vllm` importable in the training process (its weight-transfer "
                f"client; {exc}); use sync: full or lora, or train from an environment with vllm installed"
            ) from exc
        policy = self._policy

        class MergedWeights(WeightSource):
            """The policy's tensors, LoRA merged, on its device: computed when the transfer asks
            for their metadata, then sent."""

            def __init__(self) -> None:
                self.weights: dict[str, torch.Tensor] = {}

            def metadata(self) -> list[ParamMeta]:
                device = str(next(policy().parameters()).device)
                self.weights = merged_state_dict(policy(), device=device)
                return [ParamMeta(n, t.dtype, tuple(t.shape)) for n, t in self.weights.items()]

            def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
                yield from self.weights.items()

        world = self.servers.get(url, "/get_world_size")["world_size"]
        address = "127.0.0.1" if url.startswith("http://127.0.0.1") else socket.gethostbyname(socket.gethostname())
        return WeightTransferTrainerFactory.trainer_init(
            NCCLTrainerInitInfo(master_address=address, master_port=free_port(), world_size=world + 1),
            client=_HttpWeightSyncClient(self.servers, url), source=MergedWeights(),
        )

    def _close_nccl(self) -> None:
        for engine in self._nccl:
            with contextlib.suppress(Exception):  # best effort at exit: the servers stop anyway
                engine.shutdown()
        self._nccl = []


class _HttpWeightSyncClient:
    """vLLM's weight-sync control plane over our HTTP client (retries, API key)."""

    def __init__(self, servers: VllmServers, url: str):
        self.servers, self.url = servers, url

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.servers.post(self.url, "/init_weight_transfer_engine", {"init_info": init_info})

    def shutdown_weight_transfer_engine(self) -> None:
        self.servers.post(self.url, "/shutdown_weight_transfer_engine")

    def start_weight_update(self) -> None:
        self.servers.post(self.url, "/start_weight_update")

    def update_weights(self, update_info: Any) -> None:
        self.servers.post(self.url, "/update_weights", {"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.servers.post(self.url, "/finish_weight_update",
                          {"weight_version": weight_version} if weight_version is not None else None)




def _servable_dir(trainer: Any, fallback: Path) -> str:
    """A model directory a launched server can load: the trainer's own model path when it is
    one, else the trainer's weights written to `fallback` (a hub id or a registry URI)."""
    if Path(trainer.model_path, "config.json").is_file():
        return str(Path(trainer.model_path).resolve())
    model = trainer.sampling_model()
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    base.config.save_pretrained(str(fallback))
    if getattr(base, "generation_config", None) is not None:
        base.generation_config.save_pretrained(str(fallback))
    trainer.tokenizer.save_pretrained(str(fallback))
    # The base weights (without adapters): a LoRA sync puts the adapter on top of them.
    save_weights(merged_state_dict(base, merge_adapters=False), fallback)
    return str(fallback)


# ----------------------------------------------------------------------------------------------
def resolved_sync(vllm_config: Any, lora: Any) -> str:
    """`rollout.vllm.sync` with its default: the adapter when training LoRA, else full weights."""
    return vllm_config.sync or ("lora" if lora is not None else "full")


# Evaluations outside training.


@contextlib.contextmanager
def vllm_eval_backend(
    vllm_config: Any,
    model_path: str,
    *,
    rollout: Any,
    tokenizer: Any,
    stop_token_ids: list[int],
    seed: int,
) -> Iterator[VllmBackend]:
    """A backend that samples `model_path` (a local model directory) on vLLM: a server
    launched for it (`launch: true`), or the configured servers after reloading their
    weights from it (full reload through the worker extension). `tokenizer` is accepted
    for symmetry with the embedded engine; the servers take token ids."""
    del tokenizer  # token ids in and out: the caller renders and decodes
    with contextlib.ExitStack() as stack:
        logs: dict[str, tuple[Path, int]] = {}
        if vllm_config.launch:
            args, env = server_args(max_model_len=rollout.max_total_tokens, extra_args=vllm_config.extra_args,
                                    model_dir=model_path, max_concurrent=rollout.max_concurrent_rollouts)
            server = stack.enter_context(launched_server(
                vllm_config.python, str(Path(model_path).resolve()), args=args,
                log_path=Path(tempfile.mkdtemp(prefix="agentrft-vllm-eval-")) / "server.log",
                startup_timeout_s=vllm_config.startup_timeout_s, api_key=vllm_config.api_key, env=env,
            ))
            urls, logs = [server.url], {server.url: server.log}
        else:
            urls = list(vllm_config.urls)
        servers = VllmServers(urls, api_key=vllm_config.api_key, request_timeout_s=vllm_config.request_timeout_s,
                              max_concurrent=rollout.max_concurrent_rollouts, logs=logs)
        stack.callback(servers.close)
        infos = servers.check(max_total_tokens=rollout.max_total_tokens, temperature=rollout.temperature,
                              top_p=rollout.top_p)
        if not vllm_config.launch:
            for url in urls:
                servers.post(url, "/collective_rpc", {
                    "method": "agentrft_reload_weights", "args": [str(Path(model_path).resolve()), "eval"],
                })
                reset_prefix_cache(servers, url)
        yield VllmBackend(servers, model=infos[0].model, stop_token_ids=stop_token_ids,
                          max_len=rollout.max_total_tokens, seed=seed,
                          deadline=(vllm_config.turn_deadline_s, vllm_config.turn_deadline_per_token_s))


__all__ = [
    "LaunchedServer",
    "ServerInfo",
    "VllmBackend",
    "VllmGenerator",
    "VllmServers",
    "launched_server",
    "merged_state_dict",
    "resolved_sync",
    "server_args",
    "turn_seed",
    "vllm_eval_backend",
]
