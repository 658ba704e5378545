"""One JSON POST with retries, shared by the judge (model) graders and the endpoint grader.

Infrastructure failures (5xx, 408, 429, timeouts, refused or dropped connections) are
retried with exponential backoff, `GraderContext.http_attempts` tries in all; a 4xx is
the request's fault and is not retried. A 429 or 503 with `Retry-After` (seconds, an
HTTP date, or OpenAI's `retry-after-ms`) is waited out instead of the backoff, and holds
back every request to that URL meanwhile; a wait that would end past `http_timeout_s`
after the first try fails at once. `GraderContext.max_requests_per_second` spaces the
requests to each URL (`trainer.wire.RateLimit`, one per URL and event loop). Whatever
fails in the end is a GraderError of the caller's kind (`model_grader_server_error`,
`endpoint_grader_server_error`) with the status and the start of the answer. Messages
show the URL without its query string and never the headers: those hold API keys.
"""

from __future__ import annotations

import asyncio
import functools
import ssl
import time
import weakref
from typing import Any
from urllib.parse import urlsplit

import httpx

from trainer.graders.context import GraderContext
from trainer.graders.result import GraderError
from trainer.outbound import OutboundRefused, policed_client
from trainer.wire import RateLimit, retry_after_s

_RETRIED_STATUS = frozenset({408, 429})
_QUOTED_BODY_CHARS = 300
# A RateLimit waits on an asyncio.Lock, which belongs to one event loop; graders may run
# in several (grade() starts its own when called from synchronous code).
_LIMITS: weakref.WeakKeyDictionary[
    asyncio.AbstractEventLoop, dict[tuple[str, float | None], RateLimit]
] = weakref.WeakKeyDictionary()


async def post_json(
    url: str, body: dict[str, Any], *, headers: dict[str, str], context: GraderContext, kind: str,
    allowed_hosts: list[str] | None = None,
) -> Any:
    """POST `body` as JSON and return the parsed JSON answer of a 2xx response. The URL must
    pass the context's and the grader's `allowed_hosts`, on its name now and on the address
    it resolves to when the connection is made; no redirect is followed."""
    context.check_host(url, allowed_hosts)
    shown = without_query(url)
    limit = _rate_limit(shown, context.max_requests_per_second)
    started = time.monotonic()
    failure = ""
    async with policed_client(context.policies(allowed_hosts), timeout=context.http_timeout_s,
                              verify=_ssl_context()) as client:
        for attempt in range(1, context.http_attempts + 1):
            await limit.wait()
            asked = None
            try:
                response = await client.post(url, json=body, headers=headers)
            except OutboundRefused as exc:
                raise GraderError("other_error", f"POST {shown}: {exc}") from None
            except httpx.TimeoutException:
                failure = f"timed out after {context.http_timeout_s:g} s"
            except httpx.TransportError as exc:
                failure = f"connection failed ({type(exc).__name__}: {exc})"
            else:
                status = response.status_code
                if status >= 500 or status in _RETRIED_STATUS:
                    failure = f"HTTP {status}: {_quote(response.text)}"
                    asked = retry_after_s(response.headers)
                elif status >= 400:
                    raise GraderError(
                        kind, f"POST {shown} answered HTTP {status}: {_quote(response.text)}"
                    )
                else:
                    try:
                        return response.json()
                    except ValueError:
                        raise GraderError(
                            kind,
                            f"POST {shown} answered HTTP {status} with a body that is not JSON: "
                            f"{_quote(response.text)}",
                        ) from None
            if attempt == context.http_attempts:
                break
            if asked is None:
                await asyncio.sleep(context.retry_backoff_s * 2 ** (attempt - 1))
            elif time.monotonic() - started + asked > context.http_timeout_s:
                raise GraderError(
                    kind,
                    f"POST {shown} asked to retry after {asked:g} s ({failure}), past the "
                    f"{context.http_timeout_s:g} s timeout; lower the request rate "
                    "(GraderContext.max_requests_per_second) or raise the timeout",
                )
            else:
                # The server spoke for the URL, not for this request alone; the next
                # limit.wait() waits the pause out.
                limit.pause_until(time.monotonic() + asked)
    raise GraderError(
        kind, f"POST {shown} failed after {context.http_attempts} attempts: {failure}"
    )


@functools.cache
def _ssl_context() -> ssl.SSLContext:
    """One for the process. httpx builds a new one (loading the CA bundle) for every
    client, about 90 ms of CPU on a busy 2-core machine: per grader call that held up
    the event loop, rollouts and the sends of requests the rate limit had let through."""
    return httpx.create_ssl_context()


def _rate_limit(url: str, rate: float | None) -> RateLimit:
    """The limit every request to `url` in this event loop waits on."""
    limits = _LIMITS.setdefault(asyncio.get_running_loop(), {})
    if (url, rate) not in limits:
        limits[url, rate] = RateLimit(rate)
    return limits[url, rate]


def without_query(url: str) -> str:
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc.rpartition('@')[2]}{parts.path}"


def _quote(text: str) -> str:
    text = " ".join(text.split())
    return repr(text[:_QUOTED_BODY_CHARS] + ("..." if len(text) > _QUOTED_BODY_CHARS else ""))
