"""Async HTTP client for the user's tools, wire-compatible with OpenAI Agent RFT.

During a rollout the model emits tool calls; this module turns each one into
`POST server_url` with the body `{"type": "function_call", "id", "call_id", "name",
"arguments": "<JSON string>", "item", "trace_id"}` and reads back
`{"type": "function_call_output", "call_id", "id", "output": "<string>"}`.

The one idea that shapes it: a failed call is either the *model's* fault or the
*infrastructure's*, and the two must never be confused.

- The model's mistakes become a `ToolCallResult` with `error` set and an `output` the
  model reads on its next turn, exactly as a 4xx answer would be: `unknown_tool`,
  `invalid_json`, `invalid_arguments` (checked locally against the tool's JSON schema,
  before any request is sent), `request_too_large` (the arguments make the request
  body exceed `max_body_bytes`) and `http_4xx` (the server's error text, e.g. FastAPI's
  `detail`, formatted as `Error 404: <detail>`).
- Infrastructure failures (5xx, 408/429, timeouts, refused or dropped connections, a 2xx
  answer that is not `{"output": "<string>"}`) are retried with exponential backoff and
  then raise `InfraError`; an answer bigger than `max_body_bytes` raises at once. The
  caller marks the rollout `infra_error` and leaves it out of the loss.

Busy servers are met halfway. `max_requests_per_second` spaces the requests to each
endpoint URL (a token bucket of one token: no window sees more than the rate), and a 429
or 503 with `Retry-After` (seconds or an HTTP date; OpenAI's `retry-after-ms` too) holds
back every request to that endpoint until then, within the retry budget and never past
the call's `timeout_s`. Pooled keep-alive connections expire before common servers close
them, and a request that a reused connection drops before any answer is sent again at
once, uncounted (see `_post_once`). `ToolClient.stats` counts what all this absorbed.

Header values may name environment variables (`"Bearer ${FINQA_TOKEN}"`); they are
resolved once, when the client is built, and the resolved values live only in a private
attribute: they never appear in a repr, a log line or an exception message.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import random
import re
import time
import uuid
from collections import Counter
from collections.abc import Collection
from dataclasses import dataclass, field
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime
from types import TracebackType
from typing import Any
from urllib.parse import urlparse

import httpx
import jsonschema
from jsonschema.exceptions import best_match
from pydantic import BaseModel, ConfigDict, Field, field_validator

from trainer.errors import AgentRFTError, ConfigError, DataError, InfraError

logger = logging.getLogger(__name__)

_ENV_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")
# 408 and 429 are 4xx by number but say "the server is busy", not "the model erred".
_RETRIED_4XX = frozenset({408, 429})
# How much of a failing answer's body an InfraError quotes: enough to read the cause.
_QUOTED_BODY_CHARS = 300
# Shorter environment values (a region, a flag) are not secrets; scrubbing them would
# garble outputs.
_MIN_SECRET_CHARS = 8
# Seconds an idle pooled connection is kept. Servers close idle keep-alive connections
# after their own timeout (uvicorn, hypercorn, Node and Apache 5 s, gunicorn 2 s); a
# client that keeps them as long (httpx's default is 5 s, the same as uvicorn's) sends
# requests on connections the server is closing at that moment. Below 5 s with a margin
# for a busy event loop on either side; reconnecting after 2 idle seconds costs one
# round trip.
KEEPALIVE_EXPIRY_S = 2.0


class ToolEndpoint(BaseModel):
    """Where one tool is served: the job's `{"name", "server_url", "headers"}` entry."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(description="Tool name, as in the tool's schema (`function.name`).")
    server_url: str = Field(description="URL the tool calls are POSTed to (http or https).")
    headers: dict[str, str] = Field(
        default_factory=dict,
        description="HTTP headers sent with every call; values may name environment "
        "variables as ${NAME}, resolved when the client starts (keep secrets out of configs).",
    )

    @field_validator("server_url")
    @classmethod
    def _http_url(cls, url: str) -> str:
        parsed = urlparse(url)
        if parsed.scheme not in ("http", "https") or not parsed.hostname:
            raise ValueError(f"server_url must be an http(s) URL with a host, got {url!r}")
        return url


@dataclass
class ToolCallResult:
    """One answered tool call, as the rollout records it and the model reads it."""

    call_id: str
    name: str
    arguments: str  # the JSON string the model wrote, unchanged
    output: str  # what the model sees next (the tool's output or the error text)
    latency_s: float  # whole call: validation, queueing, every attempt and backoff
    error: str | None  # None, or the model-mistake kind (see the module docstring)
    status_code: int | None  # HTTP status of the answer; None when nothing was sent
    truncated: bool  # output was cut to max_output_chars
    attempts: int  # HTTP requests sent (0 when the call was refused locally)


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

        resolved[key] = _ENV_REF.sub(lookup, template)
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


@dataclass
class ToolClientStats:
    """What a client's retries and limits absorbed since it started; results do not show
    it (a call that succeeded on its second attempt looks like any other)."""

    requests: int = 0  # HTTP requests sent: every attempt and every stale-connection resend
    failed_attempts: Counter[str] = field(default_factory=Counter)  # by kind: "HTTP 429", "ReadError", "timeout"...
    stale_connection_resends: int = 0  # reused connections dropped before answering; resent at once
    rate_limit_wait_s: float = 0.0  # waiting for turns and for the servers' Retry-After pauses
    infra_errors: int = 0  # calls that raised InfraError


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


@dataclass
class _Tool:
    endpoint: ToolEndpoint
    headers: dict[str, str]  # resolved: holds secrets, never printed
    semaphore: asyncio.Semaphore
    limit: RateLimit  # shared by the tools served at one URL


class ToolClient:
    """Calls the user's tool endpoints for rollouts; one shared HTTP connection pool.

    `schemas` are the tools offered to the model (Chat Completions shape); None offers
    each item's own `tools` field instead, as OpenAI RFT rows carry them.

    Retries: `max_retries` is the number of attempts *in all*, the first one included
    (retried with backoff), so the default, 3, sends at most 3 requests.
    Between attempts it waits `backoff_s * 2**(attempt-1)`, scaled by a jitter factor in
    [0.5, 1) drawn from a RNG seeded with `seed`, so that concurrent rollouts do not
    retry in lockstep and runs stay reproducible; or, when the answer carried
    `Retry-After`, as long as the server asked, unless that would end past `timeout_s`
    after its first attempt (then it raises at once). `timeout_s` is also a deadline for
    each attempt as a whole (OpenAI gives tools 10 minutes).

    `max_concurrency_per_endpoint` counts calls, and a call keeps its slot while it waits
    to retry: retried calls then go before calls that have not started yet, instead of
    starving behind them when a busy server pauses everyone. `max_requests_per_second`
    (None: unlimited) limits each endpoint URL, the tools that share one URL together.

    Use one client inside one event loop (`async with ToolClient(...) as tools:`): its
    connection pool and semaphores belong to the loop that first uses them.
    """

    def __init__(
        self,
        endpoints: list[ToolEndpoint],
        schemas: list[dict] | None,
        *,
        timeout_s: float = 600.0,
        max_retries: int = 3,
        backoff_s: float = 0.5,
        max_output_chars: int = 4000,
        max_concurrency_per_endpoint: int = 16,
        allowed_hosts: list[str] | None = None,
        max_body_bytes: int = 1_000_000,
        max_requests_per_second: float | None = None,
        keepalive_expiry_s: float = KEEPALIVE_EXPIRY_S,
        seed: int = 0,
    ):
        for key, value, ok, rule in (
            ("timeout_s", timeout_s, timeout_s > 0, "> 0"),
            ("backoff_s", backoff_s, backoff_s >= 0, ">= 0"),
            ("max_retries", max_retries, max_retries >= 1, ">= 1 (attempts in all)"),
            ("max_output_chars", max_output_chars, max_output_chars >= 1, ">= 1"),
            (
                "max_concurrency_per_endpoint",
                max_concurrency_per_endpoint,
                max_concurrency_per_endpoint >= 1,
                ">= 1",
            ),
            ("max_body_bytes", max_body_bytes, max_body_bytes >= 1, ">= 1"),
            (
                "max_requests_per_second",
                max_requests_per_second,
                max_requests_per_second is None or max_requests_per_second > 0,
                "> 0 or None (unlimited)",
            ),
            ("keepalive_expiry_s", keepalive_expiry_s, keepalive_expiry_s >= 0, ">= 0"),
        ):
            if not ok:
                raise ConfigError(f"tool client: {key} must be {rule}, got {value}")
        self.timeout_s = timeout_s
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.max_output_chars = max_output_chars
        self.max_body_bytes = max_body_bytes
        self.max_requests_per_second = max_requests_per_second
        self.stats = ToolClientStats()
        self._rng = random.Random(seed)

        self._tools: dict[str, _Tool] = {}
        limits: dict[str, RateLimit] = {}
        secrets: set[str] = set()
        for i, endpoint in enumerate(endpoints):
            where = f"tools.endpoints[{i}]"
            if endpoint.name in self._tools:
                raise ConfigError(f"{where}: tool {endpoint.name!r} has two endpoints; keep one")
            host = urlparse(endpoint.server_url).hostname
            if allowed_hosts is not None and host not in allowed_hosts:
                raise ConfigError(
                    f"{where}.server_url: host {host!r} of tool {endpoint.name!r} is not in "
                    f"allowed_hosts {allowed_hosts}; add it there or fix the URL"
                )
            if endpoint.server_url not in limits:
                limits[endpoint.server_url] = RateLimit(max_requests_per_second)
            self._tools[endpoint.name] = _Tool(
                endpoint=endpoint,
                headers=resolve_headers(endpoint.headers, where=f"{where}.headers"),
                semaphore=asyncio.Semaphore(max_concurrency_per_endpoint),
                limit=limits[endpoint.server_url],
            )
            secrets.update(
                os.environ[var]
                for template in endpoint.headers.values()
                for var in _ENV_REF.findall(template)
            )
        # The config's schemas, checked now; None means each item's `tools` (compiled
        # once per distinct list, as rows usually share one).
        self._schemas = (
            None
            if schemas is None
            else tool_validators(schemas, where="tools.schemas", endpoints=self._tools)
        )
        self._item_schemas: dict[str, dict[str, Any]] = {}
        # One pool sized so that every endpoint can use its whole concurrency at once.
        pool = max_concurrency_per_endpoint * max(len(self._tools), 1)
        self._http = httpx.AsyncClient(
            timeout=httpx.Timeout(timeout_s),
            limits=httpx.Limits(
                max_connections=pool,
                max_keepalive_connections=pool,
                keepalive_expiry=keepalive_expiry_s,
            ),
        )
        # Values that came from the environment are scrubbed from every text taken from
        # a server (outputs, error texts), so that an echoing server cannot carry a
        # secret into rollout records or logs. Longest first: one may contain another.
        self._secrets = sorted(
            (v for v in secrets if len(v) >= _MIN_SECRET_CHARS), key=len, reverse=True
        )

    @classmethod
    def from_config(cls, tools: Any, endpoints: list[ToolEndpoint] | None = None, *, seed: int = 0) -> ToolClient:
        """The client a config's `tools` section describes (`endpoints` replace its own)."""
        return cls(
            list(tools.endpoints if endpoints is None else endpoints),
            tools.schemas,
            timeout_s=tools.timeout_s,
            max_retries=tools.max_retries,
            max_output_chars=tools.max_output_chars,
            max_concurrency_per_endpoint=tools.max_concurrency_per_endpoint,
            allowed_hosts=tools.allowed_hosts,
            max_requests_per_second=tools.max_requests_per_second,
            seed=seed,
        )

    def __repr__(self) -> str:
        # Header *templates* only: the resolved values may be secrets.
        endpoints = ", ".join(
            f"{t.endpoint.name}={t.endpoint.server_url} headers={t.endpoint.headers}"
            for t in self._tools.values()
        )
        return (
            f"ToolClient({endpoints}; max_retries={self.max_retries}, timeout_s={self.timeout_s}, "
            f"max_requests_per_second={self.max_requests_per_second})"
        )

    async def __aenter__(self) -> ToolClient:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close the shared connection pool."""
        await self._http.aclose()

    def check_call(self, name: str, arguments: str, *, item: dict) -> tuple[str, str] | None:
        """(error kind, message to the model) when a call is malformed: an unknown tool,
        arguments that are not JSON, or arguments that fail the tool's schema. None when it
        can be sent. Nothing goes over the network."""
        validators = self._validators(item)
        if name not in validators:
            return "unknown_tool", f"Error: unknown tool {name!r}; available tools: {', '.join(sorted(validators))}"
        try:
            parsed = json.loads(arguments)
        except json.JSONDecodeError as exc:
            return (
                "invalid_json",
                f"Error: arguments for {name} are not valid JSON ({exc}); send one JSON object matching the "
                "tool's parameters",
            )
        problem = best_match(validators[name].iter_errors(parsed))
        if problem is not None:
            at = f" (at {problem.json_path})" if problem.path else ""
            return "invalid_arguments", f"Error: invalid arguments for {name}: {problem.message}{at}"
        return None

    async def call(
        self,
        name: str,
        arguments: str,
        *,
        item: dict,
        trace_id: str,
        call_id: str | None = None,
    ) -> ToolCallResult:
        """Run one tool call; the model's mistakes come back as results, infra raises.

        Raises InfraError when the endpoint keeps failing or answers too much, and
        DataError when the item alone makes the request larger than max_body_bytes.
        """
        start = time.perf_counter()
        call_id = call_id or new_call_id()

        def answer(
            output: str, error: str | None, status: int | None, attempts: int
        ) -> ToolCallResult:
            output, truncated = self._truncate(output)
            return ToolCallResult(
                call_id=call_id,
                name=name,
                arguments=arguments,
                output=output,
                latency_s=time.perf_counter() - start,
                error=error,
                status_code=status,
                truncated=truncated,
                attempts=attempts,
            )

        mistake = self.check_call(name, arguments, item=item)
        if mistake is not None:
            kind, message = mistake
            return answer(message, kind, None, 0)

        body = {
            "type": "function_call",
            "id": "fc_" + uuid.uuid4().hex,
            "call_id": call_id,
            "name": name,
            "arguments": arguments,
            "item": item,
            "trace_id": trace_id,
        }
        content = json.dumps(body).encode()
        if len(content) > self.max_body_bytes:
            without_arguments = len(json.dumps({**body, "arguments": ""}).encode())
            if without_arguments > self.max_body_bytes:
                raise DataError(
                    f"item {item.get('id')!r}: the row is about {without_arguments} bytes as a "
                    f"tool request, over max_body_bytes={self.max_body_bytes}; shrink the row "
                    "or raise max_body_bytes"
                )
            return answer(
                f"Error: the arguments for {name} make the request {len(content)} bytes, over "
                f"the {self.max_body_bytes}-byte limit; send shorter arguments",
                "request_too_large",
                None,
                0,
            )

        status, text, attempts = await self._post_with_retries(self._tools[name], content)
        if status >= 400:
            return answer(f"Error {status}: {_error_detail(text)}", "http_4xx", status, attempts)
        return answer(text, None, status, attempts)

    async def call_many(
        self,
        calls: list[tuple[str, str, str | None]],
        *,
        item: dict,
        trace_id: str,
    ) -> list[ToolCallResult]:
        """Run the `(name, arguments, call_id)` calls of one assistant turn concurrently.

        Results keep the order of `calls`. Every call runs to its end before the first
        failure (in order) is raised, so no request is left running unobserved.
        """
        outcomes = await asyncio.gather(
            *(
                self.call(name, args, item=item, trace_id=trace_id, call_id=cid)
                for name, args, cid in calls
            ),
            return_exceptions=True,
        )
        for outcome in outcomes:
            if isinstance(outcome, BaseException):
                raise outcome
        return list(outcomes)

    async def _post_with_retries(self, tool: _Tool, content: bytes) -> tuple[int, str, int]:
        """POST until a 2xx or model-fault 4xx; returns (status, output or error text, attempts)."""
        endpoint = tool.endpoint
        async with tool.semaphore:
            started = time.monotonic()  # the deadline for Retry-After waits: from the first attempt
            for attempt in range(1, self.max_retries + 1):
                self.stats.rate_limit_wait_s += await tool.limit.wait()
                try:
                    status, text = await self._send(tool, content)
                    return status, text, attempt
                except _ResponseTooLarge:
                    self.stats.infra_errors += 1
                    raise InfraError(
                        f"tool endpoint {endpoint.name!r} ({endpoint.server_url}) answered more than "
                        f"max_body_bytes={self.max_body_bytes} bytes; make the tool return less or "
                        "raise max_body_bytes",
                        endpoint=endpoint.name,
                        attempts=attempt,
                    ) from None
                except _InfraFailure as failure:
                    self.stats.failed_attempts[failure.kind] += 1
                    reason = self._scrub(failure.reason)
                    asked = failure.retry_after
                if attempt == self.max_retries:
                    break
                if asked is None:
                    delay = self.backoff_s * 2 ** (attempt - 1) * (0.5 + 0.5 * self._rng.random())
                else:
                    delay = asked
                    if time.monotonic() - started + asked > self.timeout_s:
                        self.stats.infra_errors += 1
                        raise InfraError(
                            f"tool endpoint {endpoint.name!r} ({endpoint.server_url}) asked to retry "
                            f"after {asked:g} s ({reason}), past timeout_s={self.timeout_s:g} for the "
                            "call; lower the request rate (tools.max_requests_per_second) or raise "
                            "tools.timeout_s",
                            endpoint=endpoint.name,
                            attempts=attempt,
                        )
                    # The server spoke for the endpoint, not for this call alone.
                    tool.limit.pause_until(time.monotonic() + asked)
                logger.warning(
                    "tool %s attempt %d/%d failed (%s); retrying in %.2f s",
                    endpoint.name,
                    attempt,
                    self.max_retries,
                    reason,
                    delay,
                )
                if asked is None:
                    await asyncio.sleep(delay)  # a Retry-After pause is waited out in limit.wait()
        self.stats.infra_errors += 1
        raise InfraError(
            f"tool endpoint {endpoint.name!r} ({endpoint.server_url}) failed after "
            f"{self.max_retries} attempts; last: {reason}. Check that the tool server is "
            "running and healthy",
            endpoint=endpoint.name,
            attempts=self.max_retries,
        )

    async def _send(self, tool: _Tool, content: bytes) -> tuple[int, str]:
        """One attempt, plus one immediate resend when a reused connection had gone stale."""
        try:
            return await self._post_once(tool, content)
        except _StaleConnection as stale:
            self.stats.stale_connection_resends += 1
            logger.info(
                "tool %s: a pooled connection closed before answering (%s); sent again at once",
                tool.endpoint.name,
                stale.reason,
            )
        try:
            return await self._post_once(tool, content)
        except _StaleConnection as stale:
            raise _InfraFailure(stale.reason, stale.kind) from None

    async def _post_once(self, tool: _Tool, content: bytes) -> tuple[int, str]:
        """One request: (status, output) for a good 2xx, (status, body) for a model-fault 4xx.

        A request that fails on a *reused* connection before any of the answer arrived
        raises _StaleConnection, which `_send` resends at once without counting an attempt:
        the server closed that idle keep-alive connection just as the request left (the
        keep-alive race), so it never saw the request. Expiring idle connections before
        the server does (KEEPALIVE_EXPIRY_S) prevents the race with common servers; the
        resend covers servers with shorter timeouts and proxies that drop idle
        connections. A resend may run a call twice only where the failure was something
        else on the server's side, which the counted retries already risk.
        """
        headers = {"Content-Type": "application/json", **tool.headers}
        use = _ConnectionUse()
        self.stats.requests += 1
        try:
            # httpx's timeouts are per operation (connect, each read); this makes the
            # attempt as a whole meet the deadline even if the server trickles bytes.
            async with asyncio.timeout(self.timeout_s):
                async with self._http.stream(
                    "POST",
                    tool.endpoint.server_url,
                    content=content,
                    headers=headers,
                    extensions={"trace": use},
                ) as response:
                    raw = await self._read_capped(response)
        except (TimeoutError, httpx.TimeoutException):
            raise _InfraFailure(f"timed out after {self.timeout_s} s", "timeout") from None
        except httpx.RequestError as exc:
            kind = type(exc).__name__
            stale = not use.opened and not use.answered
            raise (_StaleConnection if stale else _InfraFailure)(f"{kind}: {exc}", kind) from None

        text = raw.decode(response.encoding or "utf-8", errors="replace")
        status = response.status_code
        if 400 <= status < 500 and status not in _RETRIED_4XX:
            return status, self._scrub(text)
        if not 200 <= status < 300:
            raise _InfraFailure(
                f"HTTP {status}: {text[:_QUOTED_BODY_CHARS]}",
                f"HTTP {status}",
                retry_after_s(response.headers),
            )
        try:
            answer = json.loads(text)
        except json.JSONDecodeError:
            raise _InfraFailure(
                f"HTTP {status} answer is not JSON: {text[:_QUOTED_BODY_CHARS]!r}", "bad answer"
            ) from None
        if not isinstance(answer, dict) or not isinstance(answer.get("output"), str):
            raise _InfraFailure(
                f'HTTP {status} answer lacks a string "output": {text[:_QUOTED_BODY_CHARS]!r}',
                "bad answer",
            )
        return status, self._scrub(answer["output"])

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

    def _validators(self, item: dict) -> dict[str, Any]:
        """The tools offered for this item, by name: the config's, else the item's own."""
        if self._schemas is not None:
            return self._schemas
        tools = item.get("tools")
        if not isinstance(tools, list):
            raise DataError(
                f"item {item.get('id')!r}: has no `tools` list and the config gives no "
                "tools.schemas; add one of them"
            )
        key = json.dumps(tools, sort_keys=True)
        if key not in self._item_schemas:
            self._item_schemas[key] = tool_validators(
                tools,
                where=f"item {item.get('id')!r} tools",
                error=DataError,
                endpoints=self._tools,
            )
        return self._item_schemas[key]

    def _truncate(self, output: str) -> tuple[str, bool]:
        extra = len(output) - self.max_output_chars
        if extra <= 0:
            return output, False
        return output[: self.max_output_chars] + f"\n[output truncated: {extra} more chars]", True

    def _scrub(self, text: str) -> str:
        """Hide any resolved secret a server might have echoed into text we quote."""
        for secret in self._secrets:
            text = text.replace(secret, "[redacted]")
        return text


def tool_validators(
    schemas: Any,
    *,
    where: str,
    error: type[AgentRFTError] = ConfigError,
    endpoints: Collection[str] | None = None,
) -> dict[str, Any]:
    """A jsonschema validator per tool name, for Chat Completions (or flat) schemas.

    `error` is raised naming `where[i]` for a schema without a name, a name declared twice
    or parameters that are not a JSON schema. With `endpoints` (the names that have one),
    every offered tool must be among them; a tool with an endpoint but no schema is simply
    not offered (a prompt variant may offer a subset). The config checks its schemas with
    this at load time, the client again when it starts, with the endpoints it really has.
    """
    if not isinstance(schemas, list):
        raise error(f"{where}: expected a list of tool schemas, got {type(schemas).__name__}")
    validators: dict[str, Any] = {}
    for i, schema in enumerate(schemas):
        function = schema.get("function", schema) if isinstance(schema, dict) else None
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str) or not name:
            raise error(f"{where}[{i}]: function.name is missing")
        if name in validators:
            raise error(f"{where}[{i}]: tool {name!r} is declared twice; keep one")
        if endpoints is not None and name not in endpoints:
            raise ConfigError(
                f"{where}[{i}]: tool {name!r} is offered to the model but tools.endpoints "
                f"has no endpoint for it; add a {{name, server_url}} entry"
            )
        parameters = function.get("parameters", {"type": "object"})
        if not isinstance(parameters, dict):
            raise error(
                f"{where}[{i}] ({name}): parameters must be a JSON schema object, "
                f"got {type(parameters).__name__}"
            )
        cls = jsonschema.validators.validator_for(
            parameters, default=jsonschema.Draft202012Validator
        )
        try:
            cls.check_schema(parameters)
        except jsonschema.SchemaError as exc:
            raise error(
                f"{where}[{i}] ({name}): parameters is not a valid JSON schema: {exc.message}"
            ) from None
        validators[name] = cls(parameters)
    return validators


def _error_detail(text: str) -> str:
    """The part of a 4xx body the model should read: FastAPI's `detail`, else the body."""
    try:
        payload = json.loads(text)
    except json.JSONDecodeError:
        return text
    if isinstance(payload, dict):
        for key in ("detail", "error", "message"):
            if key in payload:
                detail = payload[key]
                return detail if isinstance(detail, str) else json.dumps(detail)
    return text
