"""API keys for the servers this project starts (tool server, model server).

Every server binds to loopback by default; one that faces a network (or a shared
machine) takes an API key (`--api-key KEY`, or `--api-key '${VAR}'` to read it from the
environment). `RequireApiKey` is ASGI middleware that answers 401 to any request without
`Authorization: Bearer <key>` (or `x-api-key: <key>`, as some OpenAI-compatible clients
send it), except `GET /health`. Keys are compared in constant time and never logged.
"""

from __future__ import annotations

import hmac
import json
import os
import re
from typing import Any

from trainer.errors import ConfigError

_ENV_REF = re.compile(r"^\$\{([A-Za-z_][A-Za-z0-9_]*)\}$")


def resolve_api_key(value: str | None) -> str | None:
    """The key itself, or the value of the environment variable `${VAR}` names."""
    if not value:
        return None
    match = _ENV_REF.match(value)
    if not match:
        return value
    key = os.environ.get(match.group(1))
    if not key:
        raise ConfigError(f"--api-key names ${{{match.group(1)}}}, which is not set in the environment")
    return key


class RequireApiKey:
    """ASGI middleware: 401 unless the request carries the key."""

    def __init__(self, app: Any, *, key: str, open_paths: tuple[str, ...] = ("/health",)):
        self.app, self.key, self.open_paths = app, key.encode(), open_paths

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] in self.open_paths:
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        given = headers.get(b"x-api-key", b"")
        authorization = headers.get(b"authorization", b"")
        if authorization[:7].lower() == b"bearer ":
            given = authorization[7:].strip()
        if given and hmac.compare_digest(given, self.key):
            await self.app(scope, receive, send)
            return
        body = json.dumps({"error": {"message": "missing or wrong API key", "type": "authentication_error",
                                     "param": None, "code": "invalid_api_key"}}).encode()
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": body})
