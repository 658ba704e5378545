"""The HTTP side of a tool server in OpenAI's Agent RFT wire format, for any set of tools.

An environment brings a `ToolSet` (its tools' Chat Completions schemas and a `run(name,
arguments, item)` that returns the output text or raises `ToolError`); `create_tool_app`
serves it. A `ToolSet` whose `schemas` is None serves whatever tools each data row offers (its
`tools`, as a benchmark's rows each bring their own functions), checked against the row the
call carries. A tool call is `POST /tools/<name>` (one server_url per tool, as an Agent RFT
job declares them) or `POST /call` (the tool named in the body), with the body
`{"type": "function_call", "id", "call_id", "name", "arguments": "<JSON string>", "item",
"trace_id"}`; the answer is `{"type": "function_call_output", "call_id", "id", "output"}`.
Status codes carry the blame: 4xx is the model's mistake (arguments that fail the tool's
schema, or a `ToolError` the tool raised) and its `output` goes back to the model as the
tool's answer; 5xx is the server's. Every call of a rollout shares one `trace_id`; the
server keeps each trace's calls (bounded, least recently used traces go first) and
`GET /traces/<trace_id>` shows what the model did. With a `grader`, `POST /grade` is an
endpoint grader (`{"sample", "item", "trace_id"}` -> `{"score"}`).

Tools run in the threadpool, so a slow tool does not stop the event loop; injected latency
and faults (envs/finqa/faults.py) sleep with asyncio for the same reason. Tests serve an app
with `serve_in_thread(app)`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from typing import Any, Literal, Protocol

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from jsonschema import Draft202012Validator
from jsonschema.exceptions import SchemaError, best_match
from pydantic import BaseModel, ConfigDict, Field, StrictStr, ValidationError
from starlette.concurrency import run_in_threadpool

from envs.finqa.faults import Fault, FaultConfig, FaultInjector
from trainer.api_key import RequireApiKey
from trainer.graders import grade_async

MAX_BODY_BYTES = 1024 * 1024
MAX_CALLS_PER_TRACE = 1000
_RAW_SEND = "agentrft.raw_send"  # scope key: the server's own `send`, to drop a connection
log = logging.getLogger(__name__)


class ToolSet(Protocol):
    """What an environment's tools give the server: their schemas and a way to run one.
    `schemas` None: every data row offers tools of its own (its `tools`), and a call is checked
    against the schemas of the row it carries."""

    schemas: list[dict] | None

    def run(self, name: str, args: dict[str, Any], item: dict[str, Any] | None = None) -> str: ...


class ToolError(Exception):
    """A tool call that is answered with an error status; the message goes to the model."""

    def __init__(self, status_code: int, message: str):
        super().__init__(message)
        self.status_code = status_code
        self.message = message


class FunctionCallBody(BaseModel):
    """The Agent RFT tool-call body; unknown extra fields are ignored."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["function_call"]
    name: StrictStr | None = None
    arguments: StrictStr
    item: dict[str, Any]
    trace_id: StrictStr = Field(min_length=1)
    call_id: StrictStr = ""
    id: StrictStr = ""


class GradeBody(BaseModel):
    """The endpoint-grader request: the model's sample and the data row."""

    sample: dict[str, Any]
    item: dict[str, Any]
    trace_id: StrictStr | None = None


def truncate(text: str, max_chars: int) -> str:
    """`text` cut at `max_chars`, with a marker saying how much was left out."""
    if len(text) <= max_chars:
        return text
    return f"{text[:max_chars]}\n[truncated: {len(text) - max_chars} more chars]"


class TraceStore:
    """The calls of the most recent `max_traces` traces, each capped at `max_calls`."""

    def __init__(self, max_traces: int = 10_000, max_calls: int = MAX_CALLS_PER_TRACE):
        self.max_traces = max_traces
        self.max_calls = max_calls
        self._traces: OrderedDict[str, dict] = OrderedDict()
        self._lock = threading.Lock()

    def record(self, trace_id: str, call: dict) -> None:
        with self._lock:
            trace = self._traces.pop(trace_id, None) or {"calls": [], "dropped_calls": 0}
            self._traces[trace_id] = trace
            if len(trace["calls"]) < self.max_calls:
                trace["calls"].append(call)
            else:
                trace["dropped_calls"] += 1
            while len(self._traces) > self.max_traces:
                self._traces.popitem(last=False)

    def get(self, trace_id: str) -> dict | None:
        with self._lock:
            trace = self._traces.get(trace_id)
            if trace is None:
                return None
            self._traces.move_to_end(trace_id)
            return {"trace_id": trace_id, "calls": list(trace["calls"]),
                    "dropped_calls": trace["dropped_calls"]}

    def __len__(self) -> int:
        return len(self._traces)


class BodySizeLimit:
    """ASGI middleware: answers 413 to a body over `max_bytes`, by its Content-Length or by
    the bytes that actually arrive (a chunked body has no length), before any route
    parses it."""

    def __init__(self, app, max_bytes: int = MAX_BODY_BYTES):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            await self._too_large(send, int(length))
            return
        body = bytearray()
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            if len(body) > self.max_bytes:
                await self._too_large(send, len(body))
                return
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> dict:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": bytes(body), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _too_large(self, send, size: int) -> None:
        response = JSONResponse(
            {"detail": f"request body is {size} bytes; at most {self.max_bytes}",
             "output": f"Error: request body is over {self.max_bytes} bytes"},
            status_code=413,
            headers={"connection": "close"},  # the rest of the body is never read
        )
        await response({"type": "http"}, _no_receive, send)


async def _no_receive() -> dict:
    return {"type": "http.disconnect"}


class ToolServerApp(FastAPI):
    """FastAPI that keeps the server's own `send` in the scope: dropping a connection
    without an answer needs the transport behind it, which middleware wrappers hide."""

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            scope[_RAW_SEND] = send
        await super().__call__(scope, receive, send)


async def _drop_connection(request: Request) -> bool:
    """Abort the client's TCP connection (uvicorn's transport); False when the server
    does not expose one."""
    send = request.scope.get(_RAW_SEND)
    transport = getattr(getattr(send, "__self__", None), "transport", None)
    if transport is None:
        return False
    transport.abort()
    # let the server see the connection lost, so it discards the response we return
    for _ in range(3):
        await asyncio.sleep(0)
    return True


def _validation_message(exc: ValidationError, prefix: str = "") -> str:
    return "; ".join(
        f"{prefix}{'.'.join(str(p) for p in err['loc']) or 'body'}: {err['msg']}"
        for err in exc.errors()
    )


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="milliseconds")


def create_tool_app(
    tools: ToolSet,
    *,
    title: str,
    faults: FaultConfig | None = None,
    max_traces: int = 10_000,
    max_body_bytes: int = MAX_BODY_BYTES,
    api_key: str | None = None,
    grader: dict[str, Any] | None = None,
    health: Callable[[], dict[str, Any]] | None = None,
) -> FastAPI:
    """The Agent RFT tool routes over `tools`. With `api_key`, every route but /health (the
    traces included) needs it; with `grader` (an OpenAI grader object), `POST /grade` scores
    a sample with it; `health` adds the environment's own figures to `GET /health`."""
    validators = None if tools.schemas is None else _validators(tools.schemas)
    item_validators: OrderedDict[str, dict[str, Draft202012Validator]] = OrderedDict()

    def validators_for(item: dict[str, Any]) -> dict[str, Draft202012Validator]:
        """The server's tools, else the row's own (compiled once per distinct list, a bounded
        number of lists kept); a row without a `tools` list offers none."""
        if validators is not None:
            return validators
        offered = item.get("tools")
        if not isinstance(offered, list):
            return {}
        key = json.dumps(offered, sort_keys=True)
        if key not in item_validators:
            item_validators[key] = _validators(offered)
            while len(item_validators) > 4096:
                item_validators.popitem(last=False)
        item_validators.move_to_end(key)
        return item_validators[key]
    traces = TraceStore(max_traces)
    injector = FaultInjector(faults) if faults is not None else None

    app = ToolServerApp(title=title)
    app.add_middleware(BodySizeLimit, max_bytes=max_body_bytes)
    if api_key:
        app.add_middleware(RequireApiKey, key=api_key)
    app.state.tools = tools
    app.state.traces = traces

    async def handle_call(request: Request, url_tool: str | None) -> JSONResponse:
        started, t0 = _now(), time.perf_counter()
        call: FunctionCallBody | None = None
        name = url_tool or ""
        arguments: Any = None

        def answer(status: int | None, output: str | None = None, error: str | None = None):
            # status None: the connection was dropped, nothing reaches the client
            if call is not None:
                traces.record(call.trace_id, {
                    "name": name, "call_id": call.call_id, "id": call.id,
                    "arguments": arguments, "output": output, "error": error,
                    "status_code": status, "started_at": started, "finished_at": _now(),
                    "latency_ms": round((time.perf_counter() - t0) * 1000, 3),
                })
            content = {
                "type": "function_call_output",
                "call_id": call.call_id if call else "",
                "id": call.id if call else "",
                "output": output if error is None else f"Error: {error}",
            }
            if error is not None:
                content["detail"] = error
            return JSONResponse(content, status_code=status or 503)

        if url_tool is not None and validators is not None and url_tool not in validators:
            return answer(404, error=f"unknown tool {url_tool!r}; tools: {', '.join(validators)}")
        if injector is not None and injector.config.latency_ms:
            await asyncio.sleep(injector.config.latency_ms / 1000)
        try:
            body = json.loads(await request.body())
        except ValueError as exc:
            return answer(422, error=f"request body is not valid JSON: {exc}")
        try:
            call = FunctionCallBody.model_validate(body)
        except ValidationError as exc:
            return answer(422, error=_validation_message(exc))
        arguments = call.arguments
        try:
            offered = validators_for(call.item)
        except (KeyError, TypeError, SchemaError) as exc:
            return answer(422, error=f"item.tools: not a list of Chat Completions tool schemas ({exc})")
        if url_tool is None:
            if not call.name:
                return answer(422, error="name: the tool name is required for /call")
            name = call.name
        elif call.name and call.name != url_tool:
            return answer(422, error=f"name: {call.name!r} does not match the URL's tool {url_tool!r}")
        if name not in offered:
            return answer(404, error=f"unknown tool {name!r}; tools: {', '.join(offered)}")
        try:
            arguments = json.loads(call.arguments.strip() or "{}")
        except ValueError as exc:
            return answer(422, error=f"arguments: not a valid JSON string: {exc}")
        if not isinstance(arguments, dict):
            return answer(422, error="arguments: must encode a JSON object")
        error = best_match(offered[name].iter_errors(arguments))
        if error is not None:
            field = "".join(f".{p}" for p in error.absolute_path)
            return answer(422, error=f"arguments{field}: {error.message}")

        fault = injector.draw() if injector is not None else None
        match fault:
            case Fault.ERROR:
                return answer(503, error="injected fault: server error")
            case Fault.TIMEOUT:
                await asyncio.sleep(injector.config.timeout_s)
                return answer(504, error="injected fault: timeout")
            case Fault.DROP:
                if await _drop_connection(request):
                    return answer(None, error="injected fault: connection dropped")
                return answer(503, error="injected fault: connection drop (not supported here)")
            case Fault.SLOW:
                await asyncio.sleep(injector.config.slow_ms / 1000)

        try:
            output = await run_in_threadpool(tools.run, name, arguments, call.item)
        except ToolError as exc:
            return answer(exc.status_code, error=exc.message)
        except Exception as exc:  # a bug in a tool must not take the server down
            log.exception("tool %s failed on %r", name, arguments)
            return answer(500, error=f"internal error in tool {name!r}: {type(exc).__name__}")
        return answer(200, output=output)

    @app.get("/health")
    def health_route() -> dict:
        return {"status": "ok", **(health() if health else {}),
                "tools": "each row's own" if validators is None else list(validators)}

    @app.post("/tools/{name}")
    async def call_tool(name: str, request: Request) -> JSONResponse:
        return await handle_call(request, name)

    @app.post("/call")
    async def call_any_tool(request: Request) -> JSONResponse:
        return await handle_call(request, None)

    @app.get("/traces/{trace_id}")
    def get_trace(trace_id: str) -> JSONResponse:
        trace = traces.get(trace_id)
        if trace is None:
            return JSONResponse({"detail": f"no calls recorded for trace {trace_id!r}"}, 404)
        return JSONResponse(trace)

    if grader is None:
        return app

    @app.post("/grade")
    async def grade_endpoint(request: Request) -> JSONResponse:
        try:
            body = GradeBody.model_validate(json.loads(await request.body()))
        except ValueError as exc:  # bad JSON, or a ValidationError (a ValueError too)
            message = (
                _validation_message(exc) if isinstance(exc, ValidationError)
                else f"request body is not valid JSON: {exc}"
            )
            return JSONResponse({"detail": message}, status_code=422)
        result = await grade_async(
            grader, body.sample, body.item, trace_id=body.trace_id
        )
        if result.reward is None:  # e.g. a reference without a number: a data problem
            detail = "; ".join(f"{kind}: {message}" for kind, message in result.errors.items())
            return JSONResponse({"detail": detail, "errors": result.errors}, status_code=422)
        return JSONResponse({"score": result.reward})

    return app


def _validators(schemas: list[dict]) -> dict[str, Draft202012Validator]:
    validators = {}
    for tool in schemas:
        parameters = tool["function"].get("parameters", {"type": "object"})
        Draft202012Validator.check_schema(parameters)
        validators[tool["function"]["name"]] = Draft202012Validator(parameters)
    return validators


@contextmanager
def serve_in_thread(app: FastAPI, host: str = "127.0.0.1", port: int = 0) -> Iterator[str]:
    """Run `app` under uvicorn in a background thread for the duration of the block and
    yield its base URL (`http://127.0.0.1:<port>`); port 0 takes a free port."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    bound_port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            sock.close()
            raise RuntimeError(f"tool server did not start on {host}:{bound_port}")
        time.sleep(0.01)
    url_host = f"[{host}]" if family == socket.AF_INET6 else host
    try:
        yield f"http://{url_host}:{bound_port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()
