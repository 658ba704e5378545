"""`warm_start`: supervised fine-tuning on demonstrations before RFT, for a base model the
baseline finds without signal (it never calls the tools, or never answers right).

The demonstrations are OpenAI's supervised fine-tuning format (one conversation a line:
`messages` with the assistant's `tool_calls`, and `tools`); `trainer.data.read_demonstrations`
checks them. The hyperparameters carry OpenAI's supervised names. How the weights train
(LoRA or full, processes, FSDP2, mixed precision, gradient checkpointing) is the `training`
section's, so the warm start and RFT shard and save one model the same way.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, PositiveFloat, PositiveInt, model_validator

from trainer.config.section import Auto, Section
from trainer.errors import ConfigError


class WarmStartConfig(Section):
    demonstrations_file: str | None = Field(
        None, description="Demonstrations (OpenAI supervised JSONL: one conversation a line, `messages` with the "
        "assistant's turns and their `tool_calls`, the tool results as `tool` messages, and `tools`). None: no warm "
        "start; a baseline without signal stops the pipeline.")
    validation_file: str | None = Field(
        None, description="Held-out demonstrations, same format: their loss and token accuracy are measured every "
        "eval_interval steps and at the end (warm_start/valid_loss). None: train figures only.")
    when: Literal["no_signal", "always"] = Field(
        "no_signal", description="no_signal: warm-start only when the baseline finds no signal (its nonzero_baseline "
        "gate fails); always: whenever demonstrations are given (a supervised job). Either way the baseline is "
        "measured again on the warm-started model, and its gates decide whether RFT runs.")
    n_epochs: PositiveInt | Auto = Field("auto", description="Passes over the demonstrations (auto: 3).")
    batch_size: PositiveInt | Auto = Field("auto", description="Conversations per optimizer step (auto: 8).")
    learning_rate_multiplier: PositiveFloat | Auto = Field(
        "auto", description="Times the base learning rate of 1e-4 (auto: 1.0).")
    learning_rate: float | None = Field(None, gt=0, description="Absolute learning rate; overrides the multiplier.")
    warmup_steps: int = Field(0, ge=0, description="Linear warmup steps.")
    lr_schedule: Literal["constant", "linear", "cosine"] = Field("linear", description="After warmup.")
    max_steps: int | None = Field(None, ge=1, description="Stop after this many optimizer steps.")
    max_tokens: int = Field(
        4096, ge=16, description="Longest conversation, in tokens as the chat format renders it: a longer one is an "
        "error naming its line (nothing is cut silently).")
    micro_batch_size: int = Field(4, ge=1, description="Conversations per forward/backward.")
    eval_interval: int | None = Field(
        None, ge=1, description="Steps between validation measurements (None: at the end only).")
    checkpoint_interval: int = Field(10, ge=1, description="Steps between checkpoints (a stopped run resumes from "
                                     "the last one).")
    seed: int = Field(42, description="Seed of the data order.")
    output_dir: str = Field("runs/warm_start", description="Checkpoints, metrics and the warm-started model.")

    @model_validator(mode="after")
    def _validation_needs_demonstrations(self) -> WarmStartConfig:
        if self.validation_file and not self.demonstrations_file:
            raise ConfigError("warm_start.validation_file is set but warm_start.demonstrations_file is not: name the "
                              "demonstrations to train on")
        return self

    @property
    def enabled(self) -> bool:
        return self.demonstrations_file is not None


BASE_LEARNING_RATE = 1e-4

AUTO_DEFAULTS = {"n_epochs": 3, "batch_size": 8, "learning_rate_multiplier": 1.0}


def resolved_warm_start(warm_start: WarmStartConfig) -> dict[str, Any]:
    """OpenAI's supervised hyperparameters with "auto" replaced by the documented defaults,
    plus the learning rate they map to."""
    values = {name: AUTO_DEFAULTS[name] if getattr(warm_start, name) == "auto" else getattr(warm_start, name)
              for name in AUTO_DEFAULTS}
    values["learning_rate"] = warm_start.learning_rate or BASE_LEARNING_RATE * values["learning_rate_multiplier"]
    values["seed"] = warm_start.seed
    return values
