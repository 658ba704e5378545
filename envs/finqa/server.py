"""The FinQA-style tool server: search, list, cat and calculator over a corpus of report
pages, wire-compatible with OpenAI Agent RFT tool endpoints, plus an endpoint grader.

A tool call is `POST /tools/<name>` (one server_url per tool, as an Agent RFT job declares
them) or `POST /call` (the tool named in the body), with the body
`{"type": "function_call", "id", "call_id", "name", "arguments": "<JSON string>", "item",
"trace_id"}`; the answer is `{"type": "function_call_output", "call_id", "id", "output"}`.
Status codes carry the blame: 4xx is the model's mistake (a path outside the corpus, a
missing page, arguments that fail the tool's schema) and its `output` goes back to the
model as the tool's answer; 5xx is the server's. Every call of a rollout shares one
`trace_id`; the server keeps each trace's calls (bounded, least recently used traces go
first) and `GET /traces/<trace_id>` shows what the model did.

A corpus may declare filing periods (`periods.json` at its root, `{"periods": [[2016,
2022], [2023, 2027]]}`): a call whose item has a `year` inside a period sees that period's
reports alone (search ranks them as an index of those pages would, `list` and `cat` do not
show the others), so one server holds the demo's earlier filings, which train and
validation ask about, and the later ones its test split asks about, without either
distracting the other. An item without a year, or outside every period, sees everything.

`POST /grade` is an endpoint grader (`{"sample", "item", "trace_id"}` -> `{"score"}`):
the project's numeric grader, partial credit against `item.reference_answer`.

Search embeds the query on the CPU, so tools run in the threadpool and the event loop
keeps serving; injected latency and faults (`faults.py`) sleep with asyncio for the same
reason. Run it with `agentrft env serve finqa --corpus data/corpus`, or in tests with
`serve_in_thread(create_app(corpus_dir))`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import socket
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path, PurePosixPath
from typing import Any, Literal

import numpy as np
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from jsonschema import Draft202012Validator
from jsonschema.exceptions import best_match
from pydantic import BaseModel, ConfigDict, Field, StrictStr, ValidationError
from starlette.concurrency import run_in_threadpool

from envs.finqa.calculator import evaluate, format_number
from envs.finqa.faults import Fault, FaultConfig, FaultInjector
from envs.finqa.search import SearchIndex
from envs.finqa.tool_schemas import TOOL_SCHEMAS
from trainer.api_key import RequireApiKey
from trainer.graders import grade_async

MAX_BODY_BYTES = 1024 * 1024
MAX_CALLS_PER_TRACE = 1000
_RAW_SEND = "agentrft.raw_send"  # scope key: the server's own `send`, to drop a connection
_VALIDATORS = {
    tool["function"]["name"]: Draft202012Validator(tool["function"]["parameters"])
    for tool in TOOL_SCHEMAS
}
# The endpoint grader's score: numeric partial credit against the item's reference
# (full credit within 1% relative error, falling to 0 at 10%).
ANSWER_GRADER = {
    "type": "numeric",
    "name": "answer",
    "input": "{{sample.output_text}}",
    "reference": "{{item.reference_answer}}",
}
log = logging.getLogger(__name__)


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


def _natural_key(name: str) -> list:
    # page_2 before page_10
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def path_year(path: str) -> int | None:
    """The report year a corpus path lies under (its first four-digit part), if any."""
    return next((int(part) for part in PurePosixPath(path).parts if re.fullmatch(r"\d{4}", part)), None)


def read_periods(corpus_dir: Path) -> list[tuple[int, int]]:
    """The corpus's filing periods (`periods.json`), [] when it declares none."""
    file = Path(corpus_dir) / "periods.json"
    if not file.is_file():
        return []
    try:
        periods = [(int(first), int(last)) for first, last in json.loads(file.read_text())["periods"]]
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{file}: expected {{\"periods\": [[first_year, last_year], ...]}} ({exc})") from None
    return periods


class CorpusTools:
    """The four tools over one corpus directory; each returns the output text or raises
    ToolError. With `periods`, an item's `year` scopes search, list and cat to its period."""

    def __init__(self, corpus_dir: Path, index: SearchIndex, max_output_chars: int,
                 periods: list[tuple[int, int]] | None = None):
        self.root = Path(corpus_dir).resolve()
        self.index = index
        self.max_output_chars = max_output_chars
        self.periods = list(periods or [])
        years = [path_year(path) for path in index.paths]
        self._allowed = {period: np.array([year is None or period[0] <= year <= period[1] for year in years])
                         for period in self.periods}

    def period_of(self, item: dict[str, Any] | None) -> tuple[int, int] | None:
        year = (item or {}).get("year")
        if isinstance(year, int) and not isinstance(year, bool):
            return next((period for period in self.periods if period[0] <= year <= period[1]), None)
        return None

    def run(self, name: str, args: dict[str, Any], item: dict[str, Any] | None = None) -> str:
        period = self.period_of(item)
        match name:
            case "search":
                output = self.search(args["query"], args.get("top_k", 3), period)
            case "list":
                output = self.list(args["path"], period)
            case "cat":
                output = self.cat(args["path"], period)
            case "calculator":
                output = self.calculator(args["expression"])
            case _:
                raise ToolError(404, f"unknown tool {name!r}")
        return truncate(output, self.max_output_chars)

    def search(self, query: str, top_k: int, period: tuple[int, int] | None = None) -> str:
        hits = self.index.search(query, top_k, None if period is None else self._allowed[period])
        if not hits:
            return "no pages found"
        return "\n".join(f"{hit.path} | {hit.score:.2f} | {hit.snippet}" for hit in hits)

    @staticmethod
    def _outside(relative: str, period: tuple[int, int] | None) -> bool:
        year = path_year(relative)
        return period is not None and year is not None and not period[0] <= year <= period[1]

    def list(self, path: str, period: tuple[int, int] | None = None) -> str:
        directory = self.resolve(path)
        if not directory.exists() or self._outside(directory.relative_to(self.root).as_posix(), period):
            raise ToolError(404, f"no such directory {path!r}; try list with path 'reports'")
        if not directory.is_dir():
            raise ToolError(400, f"{path!r} is a page, not a directory; use cat to read it")
        lines = []
        for child in sorted(directory.iterdir(), key=lambda p: _natural_key(p.name)):
            if child.name.startswith(".") or not child.resolve().is_relative_to(self.root):
                continue
            if self._outside(child.relative_to(self.root).as_posix(), period) or child == self.root / "periods.json":
                continue
            # Names relative to the listed directory: compact, as `ls` prints them.
            lines.append(f"{child.name}/" if child.is_dir() else child.name)
        return "\n".join(lines) if lines else f"{path!r} is empty"

    def cat(self, path: str, period: tuple[int, int] | None = None) -> str:
        page = self.resolve(path)
        outside = self._outside(page.relative_to(self.root).as_posix(), period)
        if page.is_dir() and not outside:
            raise ToolError(400, f"{path!r} is a directory; use list to see its pages")
        if not page.is_file() or outside:
            raise ToolError(404, f"no such page {path!r}; use search or list to find pages")
        return page.read_text(encoding="utf-8", errors="replace")

    def calculator(self, expression: str) -> str:
        try:
            return format_number(evaluate(expression))
        except ValueError as exc:
            raise ToolError(400, f"calculator: {exc}") from None

    def resolve(self, path: str) -> Path:
        """The file or directory `path` names, refusing anything outside the corpus."""
        if "\0" in path:
            raise ToolError(400, "path contains a NUL character")
        rel = PurePosixPath(path.strip())
        if rel.is_absolute() or path.startswith("\\") or re.match(r"^[A-Za-z]:", path):
            raise ToolError(
                400,
                f"absolute path {path!r} is not allowed; give a path relative to the corpus "
                "root, e.g. 'reports' or 'reports/ACME/2019/page_3.txt'",
            )
        if ".." in rel.parts or "\\" in path:
            raise ToolError(400, f"path {path!r} leaves the corpus; '..' is not allowed")
        full = (self.root / rel).resolve()
        if not full.is_relative_to(self.root):
            raise ToolError(400, f"path {path!r} leads outside the corpus (through a link)")
        return full


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


def create_app(
    corpus_dir: Path,
    *,
    max_output_chars: int = 2000,
    faults: FaultConfig | None = None,
    index_cache_dir: Path | None = None,
    index: SearchIndex | None = None,
    max_seq_length: int = 128,
    max_traces: int = 10_000,
    max_body_bytes: int = MAX_BODY_BYTES,
    api_key: str | None = None,
) -> FastAPI:
    """The tool server over `corpus_dir`. The search index is built (or loaded from the
    cache in `index_cache_dir`) here, before the first request; pass `index` to share one
    already built. With `api_key`, every route but /health (the traces included) needs it."""
    corpus_dir = Path(corpus_dir)
    if not corpus_dir.is_dir():
        raise FileNotFoundError(f"corpus directory {corpus_dir} does not exist")
    if index is None:
        index = SearchIndex.from_corpus(
            corpus_dir, cache_dir=index_cache_dir, max_seq_length=max_seq_length
        )
    tools = CorpusTools(corpus_dir, index, max_output_chars, read_periods(corpus_dir))
    traces = TraceStore(max_traces)
    injector = FaultInjector(faults) if faults is not None else None

    app = ToolServerApp(title="FinQA-style tool server")
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

        if url_tool is not None and url_tool not in _VALIDATORS:
            return answer(404, error=f"unknown tool {url_tool!r}; tools: {', '.join(_VALIDATORS)}")
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
        if url_tool is None:
            if not call.name:
                return answer(422, error="name: the tool name is required for /call")
            name = call.name
            if name not in _VALIDATORS:
                return answer(404, error=f"unknown tool {name!r}; tools: {', '.join(_VALIDATORS)}")
        elif call.name and call.name != url_tool:
            return answer(422, error=f"name: {call.name!r} does not match the URL's tool {url_tool!r}")
        try:
            arguments = json.loads(call.arguments.strip() or "{}")
        except ValueError as exc:
            return answer(422, error=f"arguments: not a valid JSON string: {exc}")
        if not isinstance(arguments, dict):
            return answer(422, error="arguments: must encode a JSON object")
        error = best_match(_VALIDATORS[name].iter_errors(arguments))
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
    def health() -> dict:
        return {"status": "ok", "pages": len(index), "tools": list(_VALIDATORS)}

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
            ANSWER_GRADER, body.sample, body.item, trace_id=body.trace_id
        )
        if result.reward is None:  # e.g. a reference without a number: a data problem
            detail = "; ".join(f"{kind}: {message}" for kind, message in result.errors.items())
            return JSONResponse({"detail": detail, "errors": result.errors}, status_code=422)
        return JSONResponse({"score": result.reward})

    return app


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


def serve(
    corpus_dir: Path,
    host: str = "127.0.0.1",
    port: int = 8000,
    *,
    log_level: str = "info",
    access_log: bool = True,
    **app_options: Any,
) -> None:
    """Build the app over `corpus_dir` and serve it with uvicorn until interrupted;
    `app_options` go to `create_app`."""
    app = create_app(corpus_dir, **app_options)
    uvicorn.run(app, host=host, port=port, log_level=log_level, access_log=access_log)
