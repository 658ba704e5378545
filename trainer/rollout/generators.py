"""Where rollouts are generated during training: the policy itself, or vLLM servers.

`make_generator(config, trainer, work_dir)` gives the trainer an object with these methods:

- `sample(items, n, seed, version)`: `n` rollouts of each item with the current weights
  (the trainer's `rollout_context`, a `RolloutContext`, holds the rest: chat format,
  tools, grader, settings);
- `sync(step)`: called after each optimizer step (and after a resume), so that the next
  rollouts see the new weights;
- `metrics()`: what each step logs about it (`infra/replicas_alive` on vLLM; on the embedded
  engine `rollout/prefix_cache_hit_tokens` and `rollout/prefix_cache_hit_share`, the prompt
  tokens the prefix cache gave since the last call and their share of all prompt tokens);
- `reads_training_model`: whether sampling runs the training model itself (then nothing
  may sample while it trains).

`rollout.backend: transformers` samples with the training model in this process (a fresh
engine per batch: a KV cache filled before an update is stale after it), and `sync` has
nothing to do. With `training.max_staleness: 1` it samples with a frozen copy of the
weights instead (one more copy of the model in memory), which `sync` refreshes, so that
the next step's rollouts can run beside an update: in a thread of the trainer, or
(`rollout.overlap_sampler`) in a child process that holds the copy in shared memory.
A thread shares Python's GIL with the update: where both are Python-bound (a small model
on CPU) they take turns, and the overlap gains little. The process has its own
interpreter; it is started once (spawn: a script that trains must guard its entry point
with `if __name__ == "__main__"`), and a sampler that dies is an `InfraError`.
`rollout.backend: vllm` sends token ids to vLLM servers (trainer/generation/vllm_backend.py) and
pushes the weights to them after every step.
"""

from __future__ import annotations

import asyncio
import copy
import shutil
import threading
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from trainer.config.tools import ToolEndpoint
from trainer.errors import ConfigError, InfraError
from trainer.generation.backend import GenerationBackend
from trainer.generation.engine import TransformersBackend
from trainer.rollout.loop import run_rollouts_async
from trainer.rollout.record import RolloutRecord, RolloutSettings
from trainer.rollout.tool_client import ToolClient


@dataclass
class RolloutContext:
    """What a batch of rollouts needs besides the weights; picklable, so that a sampler
    process gets it whole."""

    chat: Any  # trainer.chat_formats.ChatFormat
    config: Any  # trainer.config.PipelineConfig
    endpoints: list[ToolEndpoint]
    settings: RolloutSettings
    stop_token_ids: list[int]

    def engine(self, model: torch.nn.Module, seed: int) -> TransformersBackend:
        """The embedded engine over `model`, as the rollout settings size it."""
        rollout = self.config.rollout
        return TransformersBackend(model, stop_token_ids=self.stop_token_ids, max_slots=rollout.max_concurrent_rollouts,
                                   max_len=rollout.max_total_tokens, seed=seed,
                                   prefix_cache_tokens=rollout.prefix_cache_tokens)

    def run(self, backend: GenerationBackend, items: list[dict[str, Any]], n: int, seed: int,
            version: int) -> list[RolloutRecord]:
        """`n` rollouts of each item on `backend`, through the real tools and the grader."""
        rollout, tools = self.config.rollout, self.config.tools

        async def run() -> list[RolloutRecord]:
            async with ToolClient.from_config(tools, self.endpoints, seed=seed) as client:
                return await run_rollouts_async(
                    backend, self.chat, items, n_per_item=n, tool_client=client, grader=self.config.grader,
                    settings=self.settings, tools=tools.schemas, max_concurrent=rollout.max_concurrent_rollouts,
                    policy_version=version,
                )

        return asyncio.run(run())


class LocalGenerator:
    """Rollouts from the policy in this process: the live weights, or (`frozen`) a copy
    that only `sync` changes."""

    def __init__(self, trainer: Any, *, frozen: bool = False):
        self.trainer = trainer
        self.copy = None
        self._prefix_lock = threading.Lock()  # sample() may run in a thread beside the update
        self._prefix = {"prompt_tokens": 0, "hit_tokens": 0}  # since the last metrics()
        if frozen:
            self.copy = copy.deepcopy(trainer.sampling_model()).requires_grad_(False).eval()

    @property
    def reads_training_model(self) -> bool:
        """Whether sampling runs the training model itself (which must then be in eval mode)."""
        return self.copy is None

    def backend(self, seed: int) -> GenerationBackend:
        model = self.trainer.sampling_model() if self.copy is None else self.copy
        return self.trainer.rollout_context.engine(model, seed)

    def sample(self, items: list[dict[str, Any]], n: int, seed: int, version: int) -> list[RolloutRecord]:
        backend = self.backend(seed)
        records = self.trainer.rollout_context.run(backend, items, n, seed, version)
        self._count_prefix(backend.prefix_stats())
        return records

    def _count_prefix(self, stats: dict[str, float]) -> None:
        with self._prefix_lock:
            for name in self._prefix:
                self._prefix[name] += stats[name]

    def sync(self, step: int) -> None:
        """The live weights need nothing; a frozen copy takes the trainer's current ones."""
        if self.copy is not None:
            with torch.no_grad():
                own = self.copy.state_dict()
                for name, tensor in self.trainer.sampling_model().state_dict().items():
                    own[name].copy_(tensor)

    def metrics(self) -> dict[str, float]:
        """The prefix cache's hits since the last call (none when nothing was sampled)."""
        with self._prefix_lock:
            counts, self._prefix = self._prefix, dict.fromkeys(self._prefix, 0)
        if not counts["prompt_tokens"]:
            return {}
        return {"rollout/prefix_cache_hit_tokens": float(counts["hit_tokens"]),
                "rollout/prefix_cache_hit_share": counts["hit_tokens"] / counts["prompt_tokens"]}


def _sampler_main(conn: Any, model: torch.nn.Module, context: RolloutContext, threads: int) -> None:
    """The sampler process: answer each (items, n, seed, version) with their rollouts,
    sampled with `model`, whose weights live in memory it shares with the trainer."""
    torch.set_num_threads(threads)
    conn.send(("ready", None, ""))
    while True:
        try:
            request = conn.recv()
        except EOFError:  # the trainer is gone
            return
        if request is None:
            return
        items, n, seed, version = request
        try:
            with torch.no_grad():
                backend = context.engine(model, seed)
                records = context.run(backend, items, n, seed, version)
                reply = ("records", (records, backend.prefix_stats()), "")
        except BaseException as exc:  # the trainer raises it, with this process's traceback
            reply = ("error", exc, traceback.format_exc())
        try:
            conn.send(reply)
        except Exception:  # an exception that does not pickle: its text does
            conn.send(("error", None, reply[2] or repr(reply[1])))


class ProcessSampler(LocalGenerator):
    """A frozen copy of the weights in shared memory, sampled by a child process, so that
    rollouts and the update each have an interpreter of their own. `sync` writes the
    trainer's weights into the shared copy while the child waits for its next request."""

    START_TIMEOUT_S = 300.0

    def __init__(self, trainer: Any):
        super().__init__(trainer, frozen=True)
        import torch.multiprocessing as mp

        self.copy.share_memory()
        spawn = mp.get_context("spawn")
        self.conn, child = spawn.Pipe()
        self.lock = threading.Lock()
        self.process = spawn.Process(target=_sampler_main, name="agentrft-sampler", daemon=True,
                                     args=(child, self.copy, trainer.rollout_context, torch.get_num_threads()))
        self.process.start()
        child.close()
        self._reply(timeout_s=self.START_TIMEOUT_S, doing="starting")

    def sample(self, items: list[dict[str, Any]], n: int, seed: int, version: int) -> list[RolloutRecord]:
        with self.lock:
            try:
                self.conn.send((items, n, seed, version))
            except (BrokenPipeError, OSError) as exc:
                raise self._died("sampling") from exc
            records, prefix = self._reply(timeout_s=None, doing="sampling")
        self._count_prefix(prefix)
        return records

    def _reply(self, *, timeout_s: float | None, doing: str) -> Any:
        begun = time.monotonic()
        while not self.conn.poll(0.2):
            if not self.process.is_alive():
                raise self._died(doing)
            if timeout_s is not None and time.monotonic() - begun > timeout_s:
                self.close()
                raise InfraError(f"the sampler process (rollout.overlap_sampler: process) did not start within "
                                 f"{timeout_s:.0f} s; set rollout.overlap_sampler: thread to sample in the trainer",
                                 endpoint="sampler process")
        try:
            kind, payload, text = self.conn.recv()
        except (EOFError, OSError) as exc:
            raise self._died(doing) from exc
        if kind == "error":
            if isinstance(payload, BaseException):
                payload.add_note(f"raised in the sampler process:\n{text}")
                raise payload
            raise InfraError(f"the sampler process failed while {doing}:\n{text}", endpoint="sampler process")
        return payload

    def _died(self, doing: str) -> InfraError:
        self.process.join(timeout=5)
        return InfraError(
            f"the sampler process (pid {self.process.pid}) died while {doing} (exit code {self.process.exitcode}; "
            "a negative code is the signal that ended it, -9 often the kernel's out-of-memory killer); its output "
            "above says why. Set rollout.overlap_sampler: thread to sample in the trainer instead.",
            endpoint="sampler process",
        )

    def close(self) -> None:
        """Stop the child (it finishes nothing: the trainer only closes between requests)."""
        if self.process.is_alive():
            try:
                self.conn.send(None)
            except (BrokenPipeError, OSError):
                pass
            self.process.join(timeout=10)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(timeout=10)
        self.conn.close()


def overlap_in_process(config: Any, model: torch.nn.Module) -> bool:
    """Whether the frozen copy samples in a child process (`rollout.overlap_sampler`)."""
    choice = config.rollout.overlap_sampler
    on_cpu = all(p.device.type == "cpu" for p in model.parameters())
    if choice == "process" and not on_cpu:
        raise ConfigError("rollout.overlap_sampler: process needs a model on the CPU (the copy is shared through "
                          "/dev/shm); on a GPU use thread or auto")
    if choice != "auto":
        return choice == "process"
    size = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    try:
        free = shutil.disk_usage("/dev/shm").free
    except OSError:  # no /dev/shm (macOS): torch shares through files
        free = size * 2
    return on_cpu and free >= size * 2


@contextmanager
def make_generator(config: Any, trainer: Any, work_dir: Path) -> Iterator[Any]:
    """The generator the config asks for, stopped (servers and processes it started included) on exit."""
    if config.rollout.backend == "transformers":
        if config.training.max_staleness and overlap_in_process(config, trainer.sampling_model()):
            sampler = ProcessSampler(trainer)
            try:
                yield sampler
            finally:
                sampler.close()
            return
        yield LocalGenerator(trainer, frozen=config.training.max_staleness > 0)
        return
    from trainer.generation.vllm_generator import VllmGenerator

    with VllmGenerator.for_trainer(config, trainer, work_dir) as generator:
        yield generator
