"""What a grader returns, and the error a grader raises when it cannot score.

A grade is a `GraderResult` shaped like OpenAI's `graders/run` answer: a `reward`, the
`errors` that stopped scoring (kind -> message), and the `sub_rewards` of a multi
grader. A grader that cannot run (the sample is not JSON, the judge refused, the
endpoint is down) reports an error of that kind and a reward of None, never a 0: a
0 would teach the policy that its answer was wrong when the grader was at fault.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from trainer.errors import AgentRFTError

# The error kinds, named as OpenAI's graders/run names them (plus our numeric grader's
# reference_parse_error). Listed so that the docs and tests can say "every kind".
ERROR_KINDS = (
    "sample_parse_error",
    "invalid_variable_error",
    "formula_parse_error",
    "reference_parse_error",
    "python_grader_runtime_error",
    "python_grader_server_error",
    "python_grader_timeout_error",
    "model_grader_server_error",
    "model_grader_refusal_error",
    "model_grader_parse_error",
    "endpoint_grader_server_error",
    "other_error",
)


class GraderError(AgentRFTError):
    """A grader could not score a sample; `kind` is one of ERROR_KINDS."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


@dataclass
class GraderResult:
    """One sample's grade. `reward` is None exactly when `errors` is not empty."""

    reward: float | None
    errors: dict[str, str] = field(default_factory=dict)
    sub_rewards: dict[str, float] = field(default_factory=dict)
    # pass/fail against the grader's pass_threshold; None when it has none or errored
    passed: bool | None = None

    def to_json(self) -> dict[str, Any]:
        """The `{"reward", "errors", "sub_rewards"}` mapping, like OpenAI's graders/run."""
        return {
            "reward": self.reward,
            "errors": dict(self.errors),
            "sub_rewards": dict(self.sub_rewards),
        }

    @classmethod
    def failed(cls, kind: str, message: str) -> GraderResult:
        return cls(reward=None, errors={kind: message})
