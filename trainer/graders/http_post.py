"""One JSON POST with retries, shared by the judge (model) graders and the endpoint grader.

Infrastructure failures (5xx, 408, 429, timeouts, refused or dropped connections) are
retried with exponential backoff, `GraderContext.http_attempts` tries in all; a 4xx is
the request's fault and is not retried. Whatever fails in the end is a GraderError of
the caller's kind (`model_grader_server_error`, `endpoint_grader_server_error`) with the
status and the start of the answer. Messages show the URL without its query string and
never the headers: those hold API keys.
"""

from __future__ import annotations

import asyncio
from typing import Any
from urllib.parse import urlsplit

import httpx

from trainer.graders.context import GraderContext
from trainer.graders.result import GraderError

_RETRIED_STATUS = frozenset({408, 429})
_QUOTED_BODY_CHARS = 300


async def post_json(
    url: str, body: dict[str, Any], *, headers: dict[str, str], context: GraderContext, kind: str
) -> Any:
    """POST `body` as JSON and return the parsed JSON answer of a 2xx response."""
    context.check_host(url)
    shown = _without_query(url)
    failure = ""
    async with httpx.AsyncClient(timeout=context.http_timeout_s) as client:
        for attempt in range(1, context.http_attempts + 1):
            try:
                response = await client.post(url, json=body, headers=headers)
            except httpx.TimeoutException:
                failure = f"timed out after {context.http_timeout_s:g} s"
            except httpx.TransportError as exc:
                failure = f"connection failed ({type(exc).__name__}: {exc})"
            else:
                status = response.status_code
                if status >= 500 or status in _RETRIED_STATUS:
                    failure = f"HTTP {status}: {_quote(response.text)}"
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
            if attempt < context.http_attempts:
                await asyncio.sleep(context.retry_backoff_s * 2 ** (attempt - 1))
    raise GraderError(
        kind, f"POST {shown} failed after {context.http_attempts} attempts: {failure}"
    )


def _without_query(url: str) -> str:
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc.rpartition('@')[2]}{parts.path}"


def _quote(text: str) -> str:
    text = " ".join(text.split())
    return repr(text[:_QUOTED_BODY_CHARS] + ("..." if len(text) > _QUOTED_BODY_CHARS else ""))
