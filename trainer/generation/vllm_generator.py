"""Rollouts on vLLM servers for one training run: connect to or launch the servers,
check them, hand out a `VllmBackend` per batch and push the weights after every optimizer
step (`full`, `lora` or `nccl`; see trainer/generation/vllm_backend.py). Only the main
process starts servers and syncs; the others learn the outcome from it."""

from __future__ import annotations

import contextlib
import shutil
import socket
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import torch

from trainer.errors import ConfigError, InfraError
from trainer.generation.vllm_backend import VllmBackend
from trainer.generation.vllm_launch import LaunchedServer, free_port, launched_server, server_args
from trainer.generation.vllm_servers import VllmServers, reset_prefix_cache
from trainer.generation.weight_sync import (
    WeightServer,
    _HttpWeightSyncClient,
    _servable_dir,
    merged_state_dict,
    resolved_sync,
    save_weights,
)

T = TypeVar("T")


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
        self.weights: WeightServer | None = None  # weight_source http: the files over HTTP (main process only)
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
            if vcfg.weight_source == "http" and mode != "nccl" and (accelerator is None or accelerator.is_main_process):
                generator.weights = WeightServer(generator.work_dir, host=vcfg.weight_server_host)
                stack.callback(generator.weights.close)
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

        if self.weights is not None:  # the server downloads the file into a folder of its own
            call = {"method": "agentrft_fetch_and_reload",
                    "args": [self.weights.url(directory), ["model.safetensors"], str(step)]}
        else:
            call = {"method": "agentrft_reload_weights", "args": [str(directory), str(step)]}

        def reload(url: str) -> None:
            answer = self.servers.post(url, "/collective_rpc", call)
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
        files = sorted(p.name for p in directory.iterdir() if p.is_file())

        def load(url: str) -> None:
            path = str(directory)
            if self.weights is not None:  # into a folder of the server's own first
                fetched = self.servers.post(url, "/collective_rpc", {
                    "method": "agentrft_fetch", "args": [self.weights.url(directory), files, name]})["results"]
                path = fetched[0]
            # load_inplace: the same step again (a resume) replaces what was loaded under its name
            self.servers.post(url, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": path,
                                                             "load_inplace": True})

        self._each_alive(f"the adapter sync of step {step}", load)
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
