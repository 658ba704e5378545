"""One tool request over HTTP: attempts, retries and what they absorbed.

`ToolTransport.post` sends one call's body to its endpoint until a 2xx or a model-fault
4xx answers, and raises `InfraError` when the endpoint keeps failing. The retry policy is
tenacity's (`AsyncRetrying`): `max_retries` attempts in all; between them
`backoff_s * 2**(attempt-1)` scaled by a jitter factor in [0.5, 1) from an RNG seeded with
the client's seed (concurrent rollouts do not retry in lockstep, and runs stay
reproducible); or, when the answer carried `Retry-After`, as long as the server asked,
held for every request to that endpoint (`RateLimit.pause_until`), unless the pause
would end past `timeout_s` after the first attempt (then it raises at once).

A request that a *reused* pooled connection drops before any answer arrived is sent
again at once and not counted as an attempt (`_send`): the server closed that idle
keep-alive connection just as the request left, so it never saw it. Expiring idle
connections before the server does (`KEEPALIVE_EXPIRY_S`) prevents the race with common
servers; the resend covers servers with shorter timeouts and proxies that drop idle
connections. A resend may run a call twice only where the failure was something else on
the server's side, which the counted retries already risk.

Every text taken from a server (outputs, error bodies quoted in errors) has the client's
secrets scrubbed from it, so an echoing server cannot carry one into records or logs.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import httpx
from tenacity import AsyncRetrying, RetryCallState, retry_if_exception_type, stop_after_attempt

from trainer.config.tools import ToolEndpoint
from trainer.errors import InfraError
from trainer.outbound import HostPolicy, OutboundRefused, policed_client
from trainer.wire import RateLimit, retry_after_s

logger = logging.getLogger(__name__)

# 408 and 429 are 4xx by number but say "the server is busy", not "the model erred".
_RETRIED_4XX = frozenset({408, 429})
# How much of a failing answer's body an InfraError quotes: enough to read the cause.
_QUOTED_BODY_CHARS = 300
# Seconds an idle pooled connection is kept. Servers close idle keep-alive connections
# after their own timeout (uvicorn, hypercorn, Node and Apache 5 s, gunicorn 2 s); a
# client that keeps them as long (httpx's default is 5 s, the same as uvicorn's) sends
# requests on connections the server is closing at that moment. Below 5 s with a margin
# for a busy event loop on either side; reconnecting after 2 idle seconds costs one
# round trip.
KEEPALIVE_EXPIRY_S = 2.0


@dataclass
class ToolClientStats:
    """What a client's retries and limits absorbed since it started; results do not show
    it (a call that succeeded on its second attempt looks like any other)."""

    requests: int = 0  # HTTP requests sent: every attempt and every stale-connection resend
    failed_attempts: Counter[str] = field(default_factory=Counter)  # by kind: "HTTP 429", "ReadError", "timeout"...
    stale_connection_resends: int = 0  # reused connections dropped before answering; resent at once
    rate_limit_wait_s: float = 0.0  # waiting for turns and for the servers' Retry-After pauses
    infra_errors: int = 0  # calls that raised InfraError


@dataclass
class Endpoint:
    """One tool's endpoint as the transport uses it."""

    endpoint: ToolEndpoint
    headers: dict[str, str]  # resolved: holds secrets, never printed
    semaphore: asyncio.Semaphore
    limit: RateLimit  # shared by the tools served at one URL


class _InfraFailure(Exception):
    """One failed attempt that is worth retrying; `reason` is safe to show, `kind` groups
    it in the stats and `retry_after` is the wait the server asked for, if it did."""

    def __init__(self, reason: str, kind: str, retry_after: float | None = None):
        super().__init__(reason)
        self.reason = reason
        self.kind = kind
        self.retry_after = retry_after


class _StaleConnection(_InfraFailure):
    """A pooled connection failed before any of the answer arrived."""


class _PastDeadline(Exception):
    """The server asked for a pause that would end past the call's timeout."""

    def __init__(self, failure: _InfraFailure):
        super().__init__(failure.reason)
        self.failure = failure


class _ConnectionUse:
    """httpcore's trace of one request: whether it opened a connection (else it reused a
    pooled one) and whether the answer's status line and headers arrived."""

    def __init__(self) -> None:
        self.opened = False
        self.answered = False

    async def __call__(self, event: str, info: dict[str, Any]) -> None:
        if event == "connection.connect_tcp.started":
            self.opened = True
        elif event.endswith("receive_response_headers.complete"):
            self.answered = True


class _ResponseTooLarge(Exception):
    """The answer exceeded max_body_bytes; retrying would not shrink it."""


class _Refused(Exception):
    """allowed_hosts refused the connection; retrying would not change that."""


class ToolTransport:
    """The HTTP side of a `ToolClient`: one connection pool, the retry policy, the stats."""

    def __init__(self, *, pool: int, timeout_s: float, max_retries: int, backoff_s: float,
                 max_body_bytes: int, keepalive_expiry_s: float, seed: int, secrets: list[str],
                 policy: HostPolicy | None = None):
        self.timeout_s = timeout_s
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.max_body_bytes = max_body_bytes
        self.stats = ToolClientStats()
        self._rng = random.Random(seed)
        self._secrets = secrets  # longest first: one may contain another
        # Where the connections may go (allowed_hosts), checked on each resolved address.
        self.http = policed_client(
            [policy] if policy else [],
            timeout=httpx.Timeout(timeout_s),
            limits=httpx.Limits(max_connections=pool, max_keepalive_connections=pool,
                                keepalive_expiry=keepalive_expiry_s),
        )

    async def aclose(self) -> None:
        await self.http.aclose()

    def scrub(self, text: str) -> str:
        """Hide any resolved secret a server might have echoed into text we quote."""
        for secret in self._secrets:
            text = text.replace(secret, "[redacted]")
        return text

    async def post(self, tool: Endpoint, content: bytes) -> tuple[int, str, int]:
        """POST until a 2xx or model-fault 4xx; returns (status, output or error text, attempts).

        A call keeps its endpoint slot while it waits to retry, so retried calls go before
        calls that have not started yet."""
        endpoint = tool.endpoint
        started = time.monotonic()  # the deadline for Retry-After waits: from the first attempt

        def wait(state: RetryCallState) -> float:
            attempt = state.attempt_number
            if attempt >= self.max_retries:
                return 0.0  # tenacity asks for the wait before it checks `stop`: no retry follows
            failure = state.outcome.exception()
            asked = failure.retry_after
            if asked is None:
                return self.backoff_s * 2 ** (attempt - 1) * (0.5 + 0.5 * self._rng.random())
            if time.monotonic() - started + asked > self.timeout_s:
                raise _PastDeadline(failure)
            # The server spoke for the endpoint, not for this call alone; the pause is
            # waited out in limit.wait() with every other request to it.
            tool.limit.pause_until(time.monotonic() + asked)
            return 0.0

        def log_retry(state: RetryCallState) -> None:
            failure = state.outcome.exception()
            logger.warning("tool %s attempt %d/%d failed (%s); retrying in %.2f s", endpoint.name,
                           state.attempt_number, self.max_retries, self.scrub(failure.reason),
                           failure.retry_after if failure.retry_after is not None else state.upcoming_sleep)

        retrying = AsyncRetrying(stop=stop_after_attempt(self.max_retries), wait=wait, before_sleep=log_retry,
                                 retry=retry_if_exception_type(_InfraFailure), reraise=True)
        attempts = 0
        async with tool.semaphore:
            try:
                async for attempt in retrying:
                    with attempt:
                        attempts += 1
                        self.stats.rate_limit_wait_s += await tool.limit.wait()
                        try:
                            status, text = await self._send(tool, content)
                        except _InfraFailure as failure:
                            self.stats.failed_attempts[failure.kind] += 1
                            raise
                        return status, text, attempts
            except _ResponseTooLarge:
                raise self._infra_error(
                    f"tool endpoint {endpoint.name!r} ({endpoint.server_url}) answered more than "
                    f"max_body_bytes={self.max_body_bytes} bytes; make the tool return less or raise max_body_bytes",
                    endpoint, attempts) from None
            except _Refused as refused:
                raise self._infra_error(f"tool endpoint {endpoint.name!r} ({endpoint.server_url}): {refused}",
                                        endpoint, attempts) from None
            except _PastDeadline as past:
                failure = past.failure
                raise self._infra_error(
                    f"tool endpoint {endpoint.name!r} ({endpoint.server_url}) asked to retry after "
                    f"{failure.retry_after:g} s ({self.scrub(failure.reason)}), past timeout_s={self.timeout_s:g} "
                    "for the call; lower the request rate (tools.max_requests_per_second) or raise tools.timeout_s",
                    endpoint, attempts) from None
            except _InfraFailure as failure:
                raise self._infra_error(
                    f"tool endpoint {endpoint.name!r} ({endpoint.server_url}) failed after {attempts} attempts; "
                    f"last: {self.scrub(failure.reason)}. Check that the tool server is running and healthy",
                    endpoint, attempts) from None
        raise AssertionError("unreachable: tenacity either returns or reraises")

    def _infra_error(self, message: str, endpoint: ToolEndpoint, attempts: int) -> InfraError:
        self.stats.infra_errors += 1
        return InfraError(message, endpoint=endpoint.name, attempts=attempts)

    async def _send(self, tool: Endpoint, content: bytes) -> tuple[int, str]:
        """One attempt, plus one immediate resend when a reused connection had gone stale."""
        try:
            return await self._post_once(tool, content)
        except _StaleConnection as stale:
            self.stats.stale_connection_resends += 1
            logger.info("tool %s: a pooled connection closed before answering (%s); sent again at once",
                        tool.endpoint.name, stale.reason)
        try:
            return await self._post_once(tool, content)
        except _StaleConnection as stale:
            raise _InfraFailure(stale.reason, stale.kind) from None

    async def _post_once(self, tool: Endpoint, content: bytes) -> tuple[int, str]:
        """One request: (status, output) for a good 2xx, (status, body) for a model-fault 4xx;
        `_StaleConnection` when a reused connection failed before any of the answer arrived."""
        headers = {"Content-Type": "application/json", **tool.headers}
        use = _ConnectionUse()
        self.stats.requests += 1
        try:
            # httpx's timeouts are per operation (connect, each read); this makes the
            # attempt as a whole meet the deadline even if the server trickles bytes.
            async with asyncio.timeout(self.timeout_s):
                async with self.http.stream("POST", tool.endpoint.server_url, content=content, headers=headers,
                                            extensions={"trace": use}) as response:
                    raw = await self._read_capped(response)
        except OutboundRefused as exc:
            raise _Refused(str(exc)) from None
        except (TimeoutError, httpx.TimeoutException):
            raise _InfraFailure(f"timed out after {self.timeout_s} s", "timeout") from None
        except httpx.RequestError as exc:
            kind = type(exc).__name__
            stale = not use.opened and not use.answered
            raise (_StaleConnection if stale else _InfraFailure)(f"{kind}: {exc}", kind) from None

        text = raw.decode(response.encoding or "utf-8", errors="replace")
        status = response.status_code
        if 400 <= status < 500 and status not in _RETRIED_4XX:
            return status, self.scrub(text)
        if not 200 <= status < 300:
            raise _InfraFailure(f"HTTP {status}: {text[:_QUOTED_BODY_CHARS]}", f"HTTP {status}",
                                retry_after_s(response.headers))
        try:
            answer = json.loads(text)
        except json.JSONDecodeError:
            raise _InfraFailure(f"HTTP {status} answer is not JSON: {text[:_QUOTED_BODY_CHARS]!r}",
                                "bad answer") from None
        if not isinstance(answer, dict) or not isinstance(answer.get("output"), str):
            raise _InfraFailure(f'HTTP {status} answer lacks a string "output": {text[:_QUOTED_BODY_CHARS]!r}',
                                "bad answer")
        return status, self.scrub(answer["output"])

    async def _read_capped(self, response: httpx.Response) -> bytes:
        """The response body, refusing (early, where the server says its length) past the cap."""
        declared = response.headers.get("Content-Length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            raise _ResponseTooLarge
        chunks, size = [], 0
        async for chunk in response.aiter_bytes():
            size += len(chunk)
            if size > self.max_body_bytes:
                raise _ResponseTooLarge
            chunks.append(chunk)
        return b"".join(chunks)
