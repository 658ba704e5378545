"""Where rollouts are generated during training: the policy itself, or vLLM servers.

`make_generator(config, trainer, work_dir)` gives the trainer an object with three methods:

- `backend(seed)`: a `GenerationBackend` that samples with the current weights;
- `sync(step)`: called after each optimizer step (and after a resume), so that the next
  rollouts see the new weights;
- `metrics()`: what each step logs about it (`infra/replicas_alive` on vLLM).

`rollout.backend: transformers` samples with the training model in this process (a fresh
engine per batch: a KV cache filled before an update is stale after it), and `sync` has
nothing to do. `rollout.backend: vllm` sends token ids to vLLM servers
(trainer/vllm_backend.py) and pushes the weights to them after every step.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from trainer.engine import GenerationBackend, TransformersBackend


class LocalGenerator:
    """Rollouts from the policy in this process."""

    def __init__(self, trainer: Any):
        self.trainer = trainer

    def backend(self, seed: int) -> GenerationBackend:
        trainer, rollout = self.trainer, self.trainer.config.rollout
        model = trainer.sampling_model()
        return TransformersBackend(
            model,
            stop_token_ids=trainer.stop_token_ids,
            max_slots=rollout.max_concurrent_rollouts,
            max_len=rollout.max_total_tokens,
            seed=seed,
        )

    def sync(self, step: int) -> None:
        """The engine reads the live weights: nothing to push."""

    def metrics(self) -> dict[str, float]:
        """What the step logs about the generator: nothing here."""
        return {}


@contextmanager
def make_generator(config: Any, trainer: Any, work_dir: Path) -> Iterator[Any]:
    """The generator the config asks for, stopped (servers it started included) on exit."""
    if config.rollout.backend == "transformers":
        yield LocalGenerator(trainer)
        return
    from trainer.vllm_backend import VllmGenerator

    with VllmGenerator.for_trainer(config, trainer, work_dir) as generator:
        yield generator
