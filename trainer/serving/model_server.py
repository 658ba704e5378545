"""An OpenAI-compatible chat server for a trained agent (or a judge model).

`POST /v1/chat/completions` takes OpenAI's request shape (`messages`, `tools`,
`temperature`, `top_p`, `max_tokens` / `max_completion_tokens`, `stop` is not supported)
and answers with OpenAI's response shape, tool calls included (`message.tool_calls`,
`finish_reason: "tool_calls"`), so the official `openai` client, agent frameworks and
our `score_model` graders can talk to it. `GET /v1/models` lists the one model served.

All requests share one generation engine: a driver thread runs `step()` while request
handlers submit sequences and await their turns, so concurrent requests are batched.
The model is a local path, a hub id, or an MLflow registry URI (`models:/name@alias`,
`models:/name/3`) loaded through MLflow's transformers flavour. It binds to loopback by
default; `--api-key` makes every route but /health require the key.

With `trace_to` (`serve-model --trace-to URI`), every answered request becomes an MLflow
trace in that store (experiment `trace_experiment`), shaped as a rollout's: an AGENT root
span with the request's messages as inputs and the chat completion as outputs, one
CHAT_MODEL span for the turn (tokens, finish_reason, content, tool calls), tags `kind:
served`, `model` and `finish_reason`. Traces are written by one background thread, so a
request never waits on the store; the server flushes them when it stops. The monitor
(`agentrft monitor`) and `mlflow.genai.evaluate` with the grader's scorer read them.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from trainer.api_key import RequireApiKey, resolve_api_key
from trainer.chat_formats import tool_calls_to_openai
from trainer.errors import ConfigError
from trainer.generation.backend import SamplingParams, TurnOutput
from trainer.generation.policy import Policy, load_policy, load_registered_policy

# A chat request's JSON is read whole before it is parsed; past this it is a 413 instead. 1 MiB
# of text is far more tokens than any context served here.
MAX_JSON_BYTES = 1024 * 1024


class ChatRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    messages: list[dict[str, Any]] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    n: int = Field(1, ge=1, le=1)
    stream: bool = False


class Busy(Exception):
    """More requests than the engine's slots and its queue hold: answered 429, not queued."""


class EngineService:
    """One engine shared by all requests; a daemon thread drives it. At most `max_slots`
    requests generate at once and `max_queue` more wait; a request past those is refused
    (`Busy`), so a burst of clients gets 429s rather than an ever-growing backlog."""

    def __init__(self, policy: Policy, *, max_slots: int = 32, max_len: int = 4096, seed: int = 0,
                 max_queue: int = 64):
        self.policy = policy
        self.backend = policy.backend(max_slots=max_slots, max_len=max_len, seed=seed)
        self.max_len = max_len
        self.capacity = max_slots + max_queue
        self._waiting: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = False
        self._thread = threading.Thread(target=self._drive, daemon=True, name="engine-driver")
        self._thread.start()

    def _drive(self) -> None:
        while not self._stop:
            if not self.backend.has_work():
                self._wake.wait(timeout=0.05)
                self._wake.clear()
                continue
            try:
                outputs = self.backend.step()
            except Exception as exc:  # fail every waiting request rather than hang them
                with self._lock:
                    waiting, self._waiting = self._waiting, {}
                for loop, future in waiting.values():
                    loop.call_soon_threadsafe(_fail, future, exc)
                continue
            for output in outputs:
                with self._lock:
                    entry = self._waiting.pop(output.seq_id, None)
                self.backend.release(output.seq_id)
                if entry:
                    loop, future = entry
                    loop.call_soon_threadsafe(_resolve, future, output)

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> TurnOutput:
        loop = asyncio.get_running_loop()
        future: asyncio.Future = loop.create_future()
        seq_id = uuid.uuid4().hex
        with self._lock:
            if len(self._waiting) >= self.capacity:
                raise Busy(f"{len(self._waiting)} requests are generating or waiting, this server's limit; "
                           "retry shortly")
            self._waiting[seq_id] = (loop, future)
        self.backend.submit(seq_id, prompt_ids, params)
        self._wake.set()
        return await future

    def close(self) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=10)


def _resolve(future: asyncio.Future, output: TurnOutput) -> None:
    if not future.done():
        future.set_result(output)


def _fail(future: asyncio.Future, exc: Exception) -> None:
    if not future.done():
        future.set_exception(exc)


def _error(status: int, message: str, kind: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": None, "code": None}},
                        status_code=status)


class ChatTraces:
    """Served requests as MLflow traces, written by one background thread."""

    def __init__(self, tracking_uri: str, experiment: str, model_name: str):
        import mlflow
        from mlflow import MlflowClient

        mlflow.set_tracking_uri(tracking_uri)
        self.client = MlflowClient(tracking_uri=tracking_uri)
        found = self.client.get_experiment_by_name(experiment)
        self.experiment_id = found.experiment_id if found else self.client.create_experiment(experiment)
        self.model_name = model_name
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="chat-traces")

    def record(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, response: dict[str, Any],
               started: float, seconds: float) -> None:
        self.pool.submit(self._log, messages, tools, response, started, seconds)

    def _log(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, response: dict[str, Any],
             started: float, seconds: float) -> None:
        choice = response["choices"][0]
        start_ns, end_ns = int(started * 1e9), int((started + seconds) * 1e9)
        root = self.client.start_trace(
            "chat", span_type="AGENT", inputs={"messages": messages, "tools": tools or []},
            tags={"kind": "served", "model": self.model_name, "finish_reason": choice["finish_reason"]},
            experiment_id=self.experiment_id, start_time_ns=start_ns,
            attributes={"response_id": response["id"]},
        )
        turn = self.client.start_span("turn 1", trace_id=root.trace_id, parent_id=root.span_id,
                                      span_type="CHAT_MODEL", start_time_ns=start_ns,
                                      attributes={"tokens": response["usage"]["completion_tokens"],
                                                  "finish_reason": choice["finish_reason"]})
        self.client.end_span(root.trace_id, turn.span_id, outputs={
            "content": choice["message"].get("content") or "", "tool_calls": choice["message"].get("tool_calls", [])},
            end_time_ns=end_ns)
        self.client.end_trace(root.trace_id, outputs=response, end_time_ns=end_ns)

    def close(self) -> None:
        import mlflow

        self.pool.shutdown(wait=True)
        mlflow.flush_trace_async_logging()


def create_model_app(policy: Policy, *, model_name: str, max_slots: int = 32, max_len: int = 4096,
                     api_key: str | None = None, trace_to: str | None = None,
                     trace_experiment: str = "agentrft-served", max_queue: int = 64,
                     max_json_bytes: int = MAX_JSON_BYTES) -> FastAPI:
    service = EngineService(policy, max_slots=max_slots, max_len=max_len, max_queue=max_queue)
    traces = ChatTraces(trace_to, trace_experiment, model_name) if trace_to else None
    app = FastAPI(title="agentrft model server")
    if api_key:
        app.add_middleware(RequireApiKey, key=api_key)
    app.state.service = service
    app.router.on_shutdown.append(service.close)
    if traces is not None:
        app.router.on_shutdown.append(traces.close)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0, "owned_by": "agentrft"}]}

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> JSONResponse:
        try:
            raw = await capped_body(request, max_json_bytes)
        except BodyTooLarge as exc:
            return _error(413, str(exc))
        body = parse_chat_request(raw)
        if isinstance(body, JSONResponse):
            return body
        if body.model and body.model != model_name:
            return _error(404, f"model {body.model!r} is not served here; GET /v1/models lists {model_name!r}", "not_found_error")
        return await chat_completion(service, body, model_name=model_name, traces=traces)

    return app


class BodyTooLarge(Exception):
    """A request body past the server's limit."""


async def capped_body(request: Request, max_bytes: int, *, setting: str = "--max-json-bytes") -> bytes:
    """The request body, read only while it stays within `max_bytes`: past it (by its
    Content-Length, before anything is read, or counted as a chunked body streams in)
    BodyTooLarge, and the rest is never read nor kept."""
    declared = request.headers.get("content-length")
    message = (f"the request body is larger than {max_bytes} bytes, this server's limit for JSON bodies "
               f"({setting}); send less (files go to POST /v1/files)")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise BodyTooLarge(message)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise BodyTooLarge(message)
        chunks.append(chunk)
    return b"".join(chunks)


def parse_chat_request(raw: bytes) -> ChatRequest | JSONResponse:
    """The request body, or the 400 answer that says what is wrong with it."""
    try:
        body = ChatRequest.model_validate_json(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        return _error(400, f"{'.'.join(str(p) for p in first['loc'])}: {first['msg']}")
    if body.stream:
        return _error(400, "stream=true is not supported by this server")
    return body


async def chat_completion(service: EngineService, body: ChatRequest, *, model_name: str,
                          traces: ChatTraces | None = None) -> JSONResponse:
    """One chat completion on `service`'s engine, in OpenAI's response shape (recorded as a
    trace when `traces` is given)."""
    chat_format = service.policy.chat
    messages = [_normalise(m) for m in body.messages]
    try:
        prompt_ids = chat_format.prompt_ids(messages, body.tools)
    except ConfigError as exc:  # the model's template refused the conversation
        return _error(400, str(exc))
    budget = body.max_completion_tokens or body.max_tokens or 512
    if len(prompt_ids) + budget > service.max_len:
        budget = service.max_len - len(prompt_ids)
        if budget < 1:
            return _error(400, f"the prompt has {len(prompt_ids)} tokens; this model's context is {service.max_len}")
    params = SamplingParams(temperature=body.temperature, top_p=body.top_p, max_new_tokens=budget)
    started, clock = time.time(), time.perf_counter()
    try:
        output = await service.generate(prompt_ids, params)
    except Busy as exc:
        busy = _error(429, str(exc), "rate_limit_error")
        busy.headers["Retry-After"] = "1"
        return busy
    message, finish = _assistant_reply(chat_format, output, tools=body.tools)
    response = {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model_name,
        "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": None}],
        "usage": {
            "prompt_tokens": len(prompt_ids),
            "completion_tokens": len(output.token_ids),
            "total_tokens": len(prompt_ids) + len(output.token_ids),
        },
    }
    if traces is not None:
        traces.record(messages, body.tools, response, started, time.perf_counter() - clock)
    return JSONResponse(response)


def _assistant_reply(chat: Any, output: TurnOutput, *, tools: list[dict[str, Any]] | None) -> tuple[dict[str, Any], str]:
    """The OpenAI message and finish_reason of a generated turn. A turn cut by the token
    limit is `length` with its text as content (a call cut mid-JSON is shown, never lost or
    passed off as a call); reasoning goes to `reasoning_content`."""
    if output.finish_reason != "stop":
        return {"role": "assistant", "content": chat.decode(output.token_ids)}, "length"
    parsed = chat.parse(output.token_ids, tools=tools)
    message: dict[str, Any] = {"role": "assistant", "content": parsed.content or None}
    if parsed.reasoning:
        message["reasoning_content"] = parsed.reasoning
    if parsed.tool_calls and tools:
        message["tool_calls"] = tool_calls_to_openai(parsed.tool_calls)
        return message, "tool_calls"
    if parsed.tool_calls or parsed.errors:
        message["content"] = chat.decode(output.token_ids)  # no tools offered, or a broken call: the text
    return message, "stop"


def _normalise(message: dict[str, Any]) -> dict[str, Any]:
    """OpenAI content parts become text; `developer` is a system message here."""
    message = dict(message)
    if message.get("role") == "developer":
        message["role"] = "system"
    content = message.get("content")
    if isinstance(content, list):
        message["content"] = "".join(part.get("text", "") for part in content if isinstance(part, dict))
    if content is None:
        message["content"] = ""
    return message


def serve_model(model: str, *, host: str = "127.0.0.1", port: int = 8000, device: str = "auto",
                dtype: str = "auto", max_slots: int = 32, max_len: int = 4096, tracking_uri: str | None = None,
                api_key: str | None = None, chat_format: str = "auto", enable_thinking: bool | None = None,
                trace_to: str | None = None, trace_experiment: str = "agentrft-served", max_queue: int = 64,
                max_json_bytes: int = MAX_JSON_BYTES) -> None:
    """Serve `model`: a path or hub id, or a registry URI loaded through MLflow's
    transformers flavour (`mlflow.transformers.load_model`)."""
    import uvicorn

    if model.startswith("models:/"):
        policy = load_registered_policy(model, tracking_uri=tracking_uri, device=device, chat_format=chat_format,
                                        enable_thinking=enable_thinking)
    else:
        policy = load_policy(model, device=device, dtype=dtype, chat_format=chat_format,
                             enable_thinking=enable_thinking)
    app = create_model_app(policy, model_name=model, max_slots=max_slots, max_len=max_len,
                           api_key=resolve_api_key(api_key), trace_to=trace_to, trace_experiment=trace_experiment,
                           max_queue=max_queue, max_json_bytes=max_json_bytes)
    # A generation in progress gets 2 s after SIGTERM; the engine's driver thread is a daemon.
    uvicorn.run(app, host=host, port=port, log_level="info", timeout_graceful_shutdown=2)
