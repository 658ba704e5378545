"""`PipelineConfig`: every section of one job, also the Prefect flow's parameter (its
field descriptions are the UI form and the CLI help)."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from pydantic import Field, field_validator

from trainer.config.baseline import BaselineConfig, PromptOptimizationConfig
from trainer.config.data import DataConfig
from trainer.config.model import ModelConfig
from trainer.config.operations import ApiConfig, MlflowConfig, MonitorConfig, ScheduleConfig
from trainer.config.promotion import PromotionConfig
from trainer.config.rollout import PenaltyConfig, RolloutConfig
from trainer.config.section import Section
from trainer.config.tools import ToolsConfig
from trainer.config.training import TrainingConfig
from trainer.config.warm_start import WarmStartConfig


class PipelineConfig(Section):
    name: str = Field("agent-rft", description="Job name.")
    work_dir: str = Field(
        "runs", description="Where pipeline stages write outputs (rollouts, reports, checkpoints), one folder per "
        "stage and cache key."
    )
    model: ModelConfig
    data: DataConfig = Field(default_factory=DataConfig)
    tools: ToolsConfig = Field(default_factory=ToolsConfig)
    grader: dict[str, Any] = Field(
        description="OpenAI-compatible grader object (string_check, text_similarity, score_model, "
        "label_model, python, multi, endpoint, numeric, f1)."
    )
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    penalties: PenaltyConfig = Field(default_factory=PenaltyConfig)
    baseline: BaselineConfig = Field(default_factory=BaselineConfig)
    prompt_optimization: PromptOptimizationConfig = Field(default_factory=PromptOptimizationConfig)
    warm_start: WarmStartConfig = Field(default_factory=WarmStartConfig)
    training: TrainingConfig = Field(default_factory=TrainingConfig)
    promotion: PromotionConfig = Field(default_factory=PromotionConfig)
    mlflow: MlflowConfig = Field(default_factory=MlflowConfig)
    schedule: ScheduleConfig = Field(default_factory=ScheduleConfig)
    monitor: MonitorConfig = Field(default_factory=MonitorConfig)
    api: ApiConfig = Field(default_factory=ApiConfig)

    @field_validator("grader")
    @classmethod
    def _grader_is_valid(cls, value: dict[str, Any]) -> dict[str, Any]:
        from trainer.graders import validate_grader

        validate_grader(value, where="grader")
        return value

    @property
    def registered_model(self) -> str:
        """The registry name: `promotion.registered_model`, else the job's name."""
        return self.promotion.registered_model or self.name

    def written_hash(self) -> str:
        """Stable hash of what the config sets away from the defaults: a field added later,
        or a default written out, leaves it as it was (`section_hash` is of everything)."""
        text = json.dumps(self.model_dump(mode="json", exclude_defaults=True), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def section_hash(self, *sections: str) -> str:
        """Stable hash of the named sections (all when none)."""
        dumped = self.model_dump(mode="json")
        chosen = {name: dumped[name] for name in (sections or tuple(dumped))}
        text = json.dumps(chosen, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()[:16]
