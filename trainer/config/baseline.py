"""`baseline` and `prompt_optimization`: the gates on the base model and the prompt and
task variants tried before any training."""

from __future__ import annotations

from pydantic import Field, field_validator

from trainer.config.section import Section
from trainer.errors import ConfigError


class BaselineConfig(Section):
    k: int = Field(4, ge=1, description="Samples per validation item.")
    max_items: int | None = Field(None, ge=1, description="Evaluate only the first N validation items.")
    min_nonzero_share: float = Field(
        0.1, ge=0, le=1, description="Gate: share of items whose best-of-k is above zero."
    )
    min_headroom: float = Field(
        0.05, ge=0, le=1, description="Gate: mean best-of-k must exceed the mean score by this."
    )
    seed: int = Field(1234, description="Sampling seed of evaluation rollouts.")


class PromptVariant(Section):
    name: str = Field(description="Variant name.")
    system_prompt: str | None = Field(None, description="Replaces the system prompt.")
    tools: list[str] | None = Field(None, description="Subset of tools offered to the model.")
    tool_descriptions: dict[str, str] | None = Field(None, description="Replaces tool descriptions.")
    max_episode_steps: int | None = Field(None, ge=1, description="Replaces the tool-call budget.")


class PromptOptimizationConfig(Section):
    variants: list[PromptVariant] = Field(default_factory=list, description="Variants to try before training.")
    target_score: float = Field(
        0.9, ge=0, le=1, description="If the best variant reaches this mean score, RFT is not needed."
    )
    k: int = Field(2, ge=1, description="Samples per validation item for each variant.")
    max_items: int | None = Field(None, ge=1, description="Validation items per variant check.")

    @field_validator("variants")
    @classmethod
    def _names_are_unique(cls, variants: list[PromptVariant]) -> list[PromptVariant]:
        # A variant's name keys its metrics and the stage's choice.
        seen = set()
        for index, variant in enumerate(variants):
            if variant.name in seen:
                raise ConfigError(
                    f"prompt_optimization.variants[{index}].name: {variant.name!r} is used twice; "
                    "give every variant its own name"
                )
            seen.add(variant.name)
        return variants
