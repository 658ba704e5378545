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
once, uncounted (trainer/rollout/tool_http.py). `ToolClient.stats` counts what all this absorbed.

Header values may name environment variables (`"Bearer ${FINQA_TOKEN}"`); they are
resolved once, when the client is built, and the resolved values live only in a private
attribute: they never appear in a repr, a log line or an exception message.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
import uuid
from dataclasses import dataclass
from types import TracebackType
from typing import Any
from urllib.parse import urlparse

from jsonschema.exceptions import best_match

from trainer.config.tools import ANY_TOOL, ToolEndpoint, tool_validators
from trainer.errors import ConfigError, DataError
from trainer.outbound import policy_of
from trainer.rollout.tool_http import KEEPALIVE_EXPIRY_S, Endpoint, ToolClientStats, ToolTransport
from trainer.wire import ENV_REF, RateLimit, new_call_id, resolve_headers

logger = logging.getLogger(__name__)


# Shorter environment values (a region, a flag) are not secrets; scrubbing them would
# garble outputs.
_MIN_SECRET_CHARS = 8


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

        self._tools: dict[str, Endpoint] = {}
        limits: dict[str, RateLimit] = {}
        try:
            policy = policy_of(allowed_hosts)
        except ValueError as exc:
            raise ConfigError(f"tool client: allowed_hosts: {exc}") from None
        secrets: set[str] = set()
        for i, endpoint in enumerate(endpoints):
            where = f"tools.endpoints[{i}]"
            if endpoint.name in self._tools:
                raise ConfigError(f"{where}: tool {endpoint.name!r} has two endpoints; keep one")
            refusal = policy.url_refusal(endpoint.server_url, resolve=False) if policy else None
            if refusal:
                raise ConfigError(
                    f"{where}.server_url: host {urlparse(endpoint.server_url).hostname!r} of tool "
                    f"{endpoint.name!r} is not in allowed_hosts "
                    f"{allowed_hosts}: {refusal}; add it there or fix the URL"
                )
            if endpoint.server_url not in limits:
                limits[endpoint.server_url] = RateLimit(max_requests_per_second)
            self._tools[endpoint.name] = Endpoint(
                endpoint=endpoint,
                headers=resolve_headers(endpoint.headers, where=f"{where}.headers"),
                semaphore=asyncio.Semaphore(max_concurrency_per_endpoint),
                limit=limits[endpoint.server_url],
            )
            secrets.update(
                os.environ[var]
                for template in endpoint.headers.values()
                for var in ENV_REF.findall(template)
            )
        # The config's schemas, checked now; None means each item's `tools` (compiled
        # once per distinct list, as rows usually share one).
        self._schemas = (
            None
            if schemas is None
            else tool_validators(schemas, where="tools.schemas", endpoints=self._tools)
        )
        self._item_schemas: dict[str, dict[str, Any]] = {}
        # Values that came from the environment are scrubbed from every text taken from
        # a server (outputs, error texts), so that an echoing server cannot carry a
        # secret into rollout records or logs. Longest first: one may contain another.
        self.transport = ToolTransport(
            # one pool sized so that every endpoint can use its whole concurrency at once
            pool=max_concurrency_per_endpoint * max(len(self._tools), 1),
            timeout_s=timeout_s, max_retries=max_retries, backoff_s=backoff_s, max_body_bytes=max_body_bytes,
            keepalive_expiry_s=keepalive_expiry_s, seed=seed, policy=policy,
            secrets=sorted((v for v in secrets if len(v) >= _MIN_SECRET_CHARS), key=len, reverse=True),
        )

    @property
    def stats(self) -> ToolClientStats:
        """What retries and limits absorbed since the client started."""
        return self.transport.stats

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
        await self.transport.aclose()

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

        endpoint = self._tools.get(name) or self._tools[ANY_TOOL]  # check_call made sure one serves it
        status, text, attempts = await self.transport.post(endpoint, content)
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
