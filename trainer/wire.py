"""What the HTTP clients of user endpoints share (the tool client and the endpoint and
model graders): OpenAI-shaped trace and call ids, `${VAR}` header values resolved from the
environment, the server's `Retry-After`, and a per-URL rate limit."""

from __future__ import annotations

import asyncio
import math
import os
import re
import time
import uuid
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime

import httpx

from trainer.errors import ConfigError

ENV_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")


def new_trace_id() -> str:
    """A rollout id in OpenAI's shape; every tool call of one rollout carries it."""
    return "trace_" + uuid.uuid4().hex


def new_call_id() -> str:
    """A tool-call id in OpenAI's shape, for calls whose id the model did not give."""
    return "call_" + uuid.uuid4().hex


def resolve_headers(headers: dict[str, str], *, where: str) -> dict[str, str]:
    """Replace every `${NAME}` in the header values with the environment variable NAME.

    `where` names the headers mapping in the config (e.g. "tools.endpoints[0].headers"); a missing
    variable raises ConfigError naming it and the header, never showing any value.
    """
    resolved = {}
    for key, template in headers.items():

        def lookup(match: re.Match[str], key: str = key) -> str:
            var = match.group(1)
            if var not in os.environ:
                raise ConfigError(
                    f"{where}.{key}: environment variable {var} is not set; "
                    f"export {var} before starting (secrets stay out of config files)"
                )
            return os.environ[var]

        resolved[key] = ENV_REF.sub(lookup, template)
    return resolved


def retry_after_s(headers: httpx.Headers) -> float | None:
    """Seconds a 429 or 503 answer asks the client to wait: OpenAI's `retry-after-ms`,
    else `Retry-After` as seconds or an HTTP date; None when absent or unreadable."""
    millis = headers.get("retry-after-ms")
    if millis is not None:
        try:
            seconds = float(millis) / 1000
        except ValueError:
            seconds = math.nan
        if math.isfinite(seconds) and seconds >= 0:
            return seconds
    value = headers.get("retry-after")
    if value is None:
        return None
    try:
        seconds = float(value)
    except ValueError:
        try:
            when = parsedate_to_datetime(value)
        except (TypeError, ValueError):
            return None
        if when.tzinfo is None:  # HTTP dates are GMT
            when = when.replace(tzinfo=UTC)
        return max(0.0, (when - datetime.now(UTC)).total_seconds())
    return seconds if math.isfinite(seconds) and seconds >= 0 else None


class RateLimit:
    """At most `rate` requests a second to one endpoint, and none while the server has
    asked for a pause.

    A token bucket that holds one token: requests leave at least 1/rate apart, timed from
    when each one really left, so a stalled event loop sends fewer rather than a burst
    and no window of any length sees more than rate x its length + 1 requests. Waiters
    take turns in arrival order (asyncio.Lock is FIFO). `pause_until` holds every request
    back until a time (a 429's Retry-After). `rate` None only honours pauses. Bound to the
    event loop that first waits on it.
    """

    def __init__(self, rate: float | None):
        if rate is not None and not rate > 0:
            raise ConfigError(f"max_requests_per_second must be > 0 or None, got {rate}")
        self.interval = 1.0 / rate if rate is not None else 0.0
        self._lock = asyncio.Lock()
        self._free_at = 0.0  # time.monotonic() before which no request leaves

    async def wait(self) -> float:
        """Wait for this request's turn; returns the seconds waited."""
        start = time.monotonic()
        if self.interval == 0 and self._free_at <= start and not self._lock.locked():
            return 0.0
        async with self._lock:
            # A loop, not one sleep: a pause may come in while this request waits.
            while (delay := self._free_at - time.monotonic()) > 0:
                await asyncio.sleep(delay)
            self._free_at = time.monotonic() + self.interval
        return time.monotonic() - start

    def pause_until(self, when: float) -> None:
        """Send nothing before `when` (a time.monotonic() value)."""
        self._free_at = max(self._free_at, when)
