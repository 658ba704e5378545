"""The seam between the agent loop and whatever generates: `GenerationBackend` takes a
sequence's new token ids and gives back a sampled turn (`TurnOutput`), for the embedded
engine and vLLM alike."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from trainer.errors import ConfigError


@dataclass(frozen=True)
class SamplingParams:
    """How one turn is sampled."""

    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0  # nucleus: keep the smallest set of tokens whose probability reaches top_p
    top_k: int = 0  # keep the k most likely tokens; 0 = all
    max_new_tokens: int = 256  # tokens generated in this turn at most, the stop token included
    return_logits: bool = False  # also return the raw logits of each sampled step (for tests)

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ConfigError(f"sampling temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"sampling top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ConfigError(f"sampling top_k must be >= 0 (0 = off), got {self.top_k}")
        if self.max_new_tokens < 1:
            raise ConfigError(f"sampling max_new_tokens must be >= 1, got {self.max_new_tokens}")


@dataclass
class TurnOutput:
    """The tokens one turn generated. finish_reason: "stop" (a stop token, the last of token_ids),
    "length" (max_new_tokens) or "context" (the sequence reached max_len; token_ids may be empty
    when the appended tokens alone did not fit, in which case they were not appended)."""

    seq_id: str
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    seq_len: int  # tokens in the sequence after this turn: prompt, appended and generated
    logits: torch.Tensor | None = None  # [len(token_ids), vocab] float32 on CPU, if return_logits


class GenerationBackend(ABC):
    """A multi-turn generation engine: sequences keep their context between turns until released."""

    @abstractmethod
    def submit(self, seq_id: str, append_ids: list[int], params: SamplingParams) -> None:
        """Start a turn. A new seq_id: append_ids is the prompt. An idle one (its last turn was
        returned by step): append_ids (tool output, next prompt piece) are appended after the
        tokens it generated, and generation continues."""

    @abstractmethod
    def step(self) -> list[TurnOutput]:
        """Run one scheduling iteration; return the turns that finished in it."""

    @abstractmethod
    def release(self, seq_id: str) -> None:
        """Forget the sequence and free its cache; a turn in flight is dropped."""

    @abstractmethod
    def has_work(self) -> bool:
        """Whether step() would make progress now (False while every live sequence is idle or
        waiting for a slot that only a release can free)."""
