"""OpenAI's error shape: `{"error": {"message", "type", "param", "code"}}` with its status."""

from __future__ import annotations

from typing import Any

from trainer.errors import AgentRFTError


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
