"""What each stage returns: small, typed, persisted by Prefect (the stage cache).

Results carry MLflow run ids, model URIs and figures, never models or rollouts: those
live in MLflow. A cached stage hands its earlier result to the next stage unchanged.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel


class Gate(BaseModel):
    """One gate: the measured value, its limit, the verdict and what it measures."""

    value: float
    limit: float
    passed: bool
    what: str

    def failure(self, name: str) -> str:
        return f"{name}: {self.what} is {self.value:.4g}, limit {self.limit:.4g}"


class ValidationResult(BaseModel):
    run_id: str
    metrics: dict[str, float]
    test_split: str  # where the test items come from: the test file, or a seeded half of validation


class BaselineResult(BaseModel):
    run_id: str
    model: str
    metrics: dict[str, float]
    gates: dict[str, Gate]

    @property
    def passed(self) -> bool:
        return all(gate.passed for gate in self.gates.values())

    @property
    def reason(self) -> str:
        return "; ".join(gate.what for gate in self.gates.values() if not gate.passed)


class PromptResult(BaseModel):
    run_id: str
    best_name: str
    best_variant: dict[str, Any] | None
    best_metrics: dict[str, float]
    rft_needed: bool
    verdict: str
    table: list[dict[str, Any]]


class Candidate(BaseModel):
    """A trained model logged to MLflow: its step, validation figure (`training.metric_for_best_model`),
    local path and URIs."""

    step: int
    score: float | None
    path: str
    model_uri: str
    model_id: str | None = None


class TrainingResult(BaseModel):
    run_id: str
    steps: int
    candidate: Candidate
    checkpoints: list[Candidate]
    final_metrics: dict[str, float]


class RegressionResult(BaseModel):
    run_id: str
    gates: dict[str, Gate]
    score_gain: dict[str, float]
    before_after: dict[str, dict[str, float]]
    champion_version: str | None
    # how many times this test split has been read, this reading included (the ledger's
    # sentence); None without a ledger
    readings: str | None = None

    @property
    def passed(self) -> bool:
        return all(gate.passed for gate in self.gates.values())

    @property
    def reasons(self) -> list[str]:
        return [gate.failure(name) for name, gate in self.gates.items() if not gate.passed]


class PromotionResult(BaseModel):
    run_id: str
    registered_model: str
    version: str
    champion: bool
    previous_champion: str | None
    decision: str


class WarmStartResult(BaseModel):
    """The warm start's model: where RFT starts, and the baseline is measured again."""

    run_id: str
    steps: int
    model_uri: str  # `models:/...` of the warm-started model, logged to the stage's run
    path: str
    metrics: dict[str, float]
