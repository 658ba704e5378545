"""The project's exception types.

Every error a user can cause (a config key, a data row, an endpoint, a grader) is an
`AgentRFTError` whose message names the file, key or row and says what to do. The CLI
prints these without a traceback. Infrastructure failures (a tool server that keeps
answering 5xx) are `InfraError`: they mark a rollout `infra_error`, never a score of 0.
"""

from __future__ import annotations


class AgentRFTError(Exception):
    """A problem the user can fix; the message says where and how."""


class ConfigError(AgentRFTError):
    """A pipeline config (YAML) or job file is invalid."""


class DataError(AgentRFTError):
    """A dataset file or row is invalid."""


class InfraError(AgentRFTError):
    """A tool or grader endpoint failed for reasons that are not the model's fault
    (5xx after retries, timeout, refused connection)."""

    def __init__(self, message: str, *, endpoint: str = "", attempts: int = 0):
        super().__init__(message)
        self.endpoint = endpoint
        self.attempts = attempts


class StorageError(InfraError):
    """Writing a checkpoint or a model directory failed (a full disk, a quota, a
    read-only mount): the message names the path and what to free; whatever was there
    before the write is intact."""

    def __init__(self, message: str, *, path: str, needed_bytes: int | None = None):
        super().__init__(message)
        self.path = path
        self.needed_bytes = needed_bytes
