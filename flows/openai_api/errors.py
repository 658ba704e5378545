"""OpenAI's error shape: `{"error": {"message", "type", "param", "code"}}` with its status, and
OpenAI's names for the graders' error kinds."""

from __future__ import annotations

from typing import Any

from trainer.errors import AgentRFTError

# Our grader error kinds -> OpenAI's graders/run `metadata.errors` flags.
ERROR_FLAGS = {
    "sample_parse_error": "sample_parse_error",
    "invalid_variable_error": "invalid_variable_error",
    "formula_parse_error": "formula_parse_error",
    "reference_parse_error": "other_error",
    "python_grader_runtime_error": "python_grader_runtime_error",
    "python_grader_server_error": "python_grader_server_error",
    "python_grader_timeout_error": "python_grader_server_error",
    "model_grader_server_error": "model_grader_server_error",
    "model_grader_refusal_error": "model_grader_refusal_error",
    "model_grader_parse_error": "model_grader_parse_error",
    "endpoint_grader_server_error": "unresponsive_reward_error",
    "other_error": "other_error",
}


# OpenAI's grader error flags (graders/run `metadata.errors`, the metrics events' `errors`).
OPENAI_ERROR_FLAGS = ("formula_parse_error", "invalid_variable_error", "model_grader_parse_error",
                      "model_grader_refusal_error", "model_grader_server_error", "other_error",
                      "python_grader_runtime_error", "python_grader_server_error", "sample_parse_error",
                      "truncated_observation_error", "unresponsive_reward_error")


class ApiError(AgentRFTError):
    """An error answered in OpenAI's shape: HTTP status, message, param, code."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.param, self.code, self.kind = status, param, code, kind

    def body(self) -> dict[str, Any]:
        return {"error": {"message": str(self), "type": self.kind, "param": self.param, "code": self.code}}


def not_found(what: str, ident: str) -> ApiError:
    return ApiError(404, f"No such {what}: {ident!r}", param="id", code="not_found", kind="not_found_error")
