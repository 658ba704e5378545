"""Where rollouts are generated during training: the policy itself, or vLLM servers.

`make_generator(config, trainer, work_dir)` gives the trainer an object with three methods:

- `backend(seed)`: a `GenerationBackend` that samples with the current weights;
- `sync(step)`: called after each optimizer step (and after a resume), so that the next
  rollouts see the new weights;
- `metrics()`: what each step logs about it (`infra/replicas_alive` on vLLM);
- `reads_training_model`: whether sampling runs the training model itself (then nothing
  may sample while it trains).

`rollout.backend: transformers` samples with the training model in this process (a fresh
engine per batch: a KV cache filled before an update is stale after it), and `sync` has
nothing to do; with `training.max_staleness: 1` it samples with a frozen copy of the
weights instead (one more copy of the model in memory), which `sync` refreshes, so that
the next step's rollouts can run beside an update. `rollout.backend: vllm` sends token ids to vLLM servers
(trainer/vllm_backend.py) and pushes the weights to them after every step.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from trainer.engine import GenerationBackend, TransformersBackend


class LocalGenerator:
    """Rollouts from the policy in this process: the live weights, or (`frozen`) a copy
    that only `sync` changes."""

    def __init__(self, trainer: Any, *, frozen: bool = False):
        self.trainer = trainer
        self.copy = None
        if frozen:
            self.copy = copy.deepcopy(trainer.sampling_model()).requires_grad_(False).eval()

    @property
    def reads_training_model(self) -> bool:
        """Whether sampling runs the training model itself (which must then be in eval mode)."""
        return self.copy is None

    def backend(self, seed: int) -> GenerationBackend:
        trainer, rollout = self.trainer, self.trainer.config.rollout
        model = trainer.sampling_model() if self.copy is None else self.copy
        return TransformersBackend(
            model,
            stop_token_ids=trainer.stop_token_ids,
            max_slots=rollout.max_concurrent_rollouts,
            max_len=rollout.max_total_tokens,
            seed=seed,
        )

    def sync(self, step: int) -> None:
        """The live weights need nothing; a frozen copy takes the trainer's current ones."""
        if self.copy is not None:
            with torch.no_grad():
                own = self.copy.state_dict()
                for name, tensor in self.trainer.sampling_model().state_dict().items():
                    own[name].copy_(tensor)

    def metrics(self) -> dict[str, float]:
        """What the step logs about the generator: nothing here."""
        return {}


@contextmanager
def make_generator(config: Any, trainer: Any, work_dir: Path) -> Iterator[Any]:
    """The generator the config asks for, stopped (servers it started included) on exit."""
    if config.rollout.backend == "transformers":
        yield LocalGenerator(trainer, frozen=config.training.max_staleness > 0)
        return
    from trainer.vllm_backend import VllmGenerator

    with VllmGenerator.for_trainer(config, trainer, work_dir) as generator:
        yield generator
