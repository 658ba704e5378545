"""`tools`: the tool endpoints (OpenAI Agent RFT's `{name, server_url, headers}`), their
schemas and the client's limits.

`tool_validators` compiles Chat Completions tool schemas to jsonschema validators; the
config checks its schemas with it when the file loads and the tool client again, with the
endpoints it really has, when it starts.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any
from urllib.parse import urlparse

import jsonschema
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from trainer.config.section import Section
from trainer.errors import AgentRFTError, ConfigError
from trainer.outbound import check_entries, policy_of

# The endpoint name that serves every tool without an endpoint of its own: for data whose rows
# offer tools of their own (a benchmark with a thousand functions), one server that takes the
# tool's name from the body (`POST /call`) rather than one entry per name.
ANY_TOOL = "*"


class ToolEndpoint(BaseModel):
    """Where one tool is served: the job's `{"name", "server_url", "headers"}` entry."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(
        description="Tool name, as in the tool's schema (`function.name`); `*` serves every tool "
        "that has no endpoint of its own (the server reads the tool's name from the call's body)."
    )
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
        if endpoints is not None and name not in endpoints and ANY_TOOL not in endpoints:
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


class ToolsConfig(Section):
    endpoints: list[ToolEndpoint] = Field(
        default_factory=list, description="One endpoint per tool (OpenAI Agent RFT shape)."
    )
    schemas: list[dict[str, Any]] | None = Field(
        None, description="Chat Completions tool schemas; when absent each data row's `tools` is used."
    )
    timeout_s: float = Field(600.0, gt=0, description="Per-request timeout (OpenAI: 10 minutes).")
    max_retries: int = Field(3, ge=1, le=10, description="Attempts on 5xx, 429, timeouts before infra_error.")
    max_output_chars: int = Field(2000, ge=64, description="Tool outputs are cut to this length, visibly.")
    max_concurrency_per_endpoint: int = Field(32, ge=1, description="Concurrent requests per endpoint.")
    max_requests_per_second: float | None = Field(
        None, gt=0, description="Rate limit per endpoint (token bucket); None: unlimited. OpenAI asks tool "
        "servers to take about 50."
    )
    allowed_hosts: list[str] | None = Field(
        None, description="Where tool calls may connect: host, host:port or CIDR entries (as api.allowed_hosts), "
        "checked on each endpoint's URL when the config loads and on the resolved address at connect time; None: "
        "the configured endpoints, wherever they are. `agentrft api` writes its own list here into every job."
    )

    @field_validator("allowed_hosts")
    @classmethod
    def _entries(cls, entries: list[str] | None) -> list[str] | None:
        return check_entries(entries, "tools.allowed_hosts")

    @model_validator(mode="after")
    def _endpoints_and_schemas_agree(self) -> ToolsConfig:
        # Checked at load time so that a bad tool section fails `config validate` and every
        # stage before any model is loaded, not at the first rollout.
        names: set[str] = set()
        policy = policy_of(self.allowed_hosts)
        for index, endpoint in enumerate(self.endpoints):
            where = f"tools.endpoints[{index}]"
            if endpoint.name in names:
                raise ConfigError(f"{where}: tool {endpoint.name!r} has two endpoints; keep one")
            names.add(endpoint.name)
            # The name alone here (no DNS lookup when a file loads); its addresses are checked
            # when the connection is made.
            refusal = policy.url_refusal(endpoint.server_url, resolve=False) if policy else None
            if refusal:
                raise ConfigError(
                    f"{where}.server_url: host {urlparse(endpoint.server_url).hostname!r} of tool "
                    f"{endpoint.name!r} is not in tools.allowed_hosts "
                    f"{self.allowed_hosts}: {refusal}; add it there or fix the URL"
                )
        if self.schemas is not None:
            tool_validators(self.schemas, where="tools.schemas", endpoints=names or None)
        return self
