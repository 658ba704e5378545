"""Tests of the async tool client against a real tool server on loopback.

The server is a small FastAPI app run by uvicorn in a background thread; it records every
request it receives, so the tests can check the wire body, the headers, how many attempts
arrived and when each call ran. The keep-alive race is played by a raw-socket server
that drops a connection the way a server whose keep-alive timer fires does.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import socket
import struct
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime

import httpx
import pytest
import uvicorn
from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse, PlainTextResponse

from trainer.config.tools import ToolEndpoint
from trainer.errors import ConfigError, DataError, InfraError
from trainer.rollout.tool_client import ToolCallResult, ToolClient
from trainer.wire import RateLimit, new_call_id, new_trace_id, resolve_headers, retry_after_s

SECRET = "s3cr3t-token-0123456789"
ITEM = {"id": "item-7", "question": "What was ACME's revenue growth in 2019?", "year": 2019}


def _schema(name: str, properties: dict, required: list[str] = ()) -> dict:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": f"test tool {name}",
            "parameters": {
                "type": "object",
                "properties": properties,
                "required": list(required),
                "additionalProperties": False,
            },
        },
    }


SCHEMAS = [
    _schema("echo", {"query": {"type": "string"}, "top_k": {"type": "integer"}}, ["query"]),
    _schema("flaky", {"fails": {"type": "integer"}, "status": {"type": "integer"}}),
    _schema("always500", {}),
    _schema("leaky500", {}),
    _schema("garbage", {}),
    _schema("sleep", {"seconds": {"type": "number"}}, ["seconds"]),
    _schema("big", {}),
    _schema("long", {}),
    _schema("notfound", {"path": {"type": "string"}}, ["path"]),
    _schema("busy", {"fails": {"type": "integer"}, "wait": {"type": "string"}, "header": {"type": "string"}}),
]
TOOL_NAMES = [s["function"]["name"] for s in SCHEMAS]


def make_app() -> tuple[FastAPI, dict]:
    """The test tool server; `log` holds what it received, keyed by call_id."""
    app = FastAPI()
    log: dict = {"requests": {}, "attempts": Counter(), "intervals": {}, "arrivals": {}}

    async def receive(request: Request) -> dict:
        body = await request.json()
        log["requests"][body["call_id"]] = {
            "path": request.url.path,
            "body": body,
            "headers": dict(request.headers),
        }
        log["attempts"][body["call_id"]] += 1
        log["arrivals"].setdefault(body["call_id"], []).append(time.monotonic())
        return body

    def reply(body: dict, output: str) -> dict:
        return {
            "type": "function_call_output",
            "call_id": body["call_id"],
            "id": body["id"],
            "output": output,
        }

    @app.post("/echo")
    async def echo(request: Request) -> dict:
        body = await receive(request)
        seen = {"arguments": body["arguments"], "auth": request.headers.get("authorization")}
        return reply(body, json.dumps(seen))

    @app.post("/flaky")
    async def flaky(request: Request):
        body = await receive(request)
        args = json.loads(body["arguments"])
        count = log["attempts"][body["call_id"]]
        if count <= args["fails"]:
            return PlainTextResponse("try again", status_code=args["status"])
        return reply(body, f"ok after {count} attempts")

    @app.post("/always500")
    async def always500(request: Request):
        await receive(request)
        return PlainTextResponse("database down", status_code=500)

    @app.post("/leaky500")
    async def leaky500(request: Request):
        # A careless server that quotes the caller's credentials in its error page.
        await receive(request)
        return PlainTextResponse(
            f"bad auth header {request.headers.get('authorization')}", status_code=500
        )

    @app.post("/garbage")
    async def garbage(request: Request):
        await receive(request)
        return PlainTextResponse("<html>maintenance</html>", status_code=200)

    @app.post("/sleep")
    async def sleep(request: Request) -> dict:
        body = await receive(request)
        start = time.perf_counter()
        await asyncio.sleep(json.loads(body["arguments"])["seconds"])
        log["intervals"][body["call_id"]] = (start, time.perf_counter())
        return reply(body, "slept")

    @app.post("/big")
    async def big(request: Request) -> JSONResponse:
        body = await receive(request)
        return JSONResponse(reply(body, "x" * 2_000_000))

    @app.post("/long")
    async def long(request: Request) -> dict:
        body = await receive(request)
        return reply(body, "y" * 10_000)

    @app.post("/busy")
    async def busy(request: Request):
        # 429 with a Retry-After header for the first `fails` attempts of a call
        body = await receive(request)
        args = json.loads(body["arguments"])
        if log["attempts"][body["call_id"]] <= args["fails"]:
            return PlainTextResponse("slow down", status_code=429, headers={args["header"]: args["wait"]})
        return reply(body, "served")

    @app.post("/notfound")
    async def notfound(request: Request) -> dict:
        body = await receive(request)
        path = json.loads(body["arguments"])["path"]
        raise HTTPException(status_code=404, detail=f"no such page: {path}")

    return app, log


@pytest.fixture(scope="module")
def server():
    """(base_url, log) of the test tool server, running for the whole module."""
    app, log = make_app()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=1)
    uv = uvicorn.Server(config)
    thread = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not uv.started:
        assert time.monotonic() < deadline, "test tool server did not start"
        time.sleep(0.01)
    yield f"http://127.0.0.1:{port}", log
    uv.should_exit = True
    thread.join(timeout=5)
    sock.close()


def endpoints(base_url: str, headers: dict[str, str] | None = None) -> list[ToolEndpoint]:
    return [
        ToolEndpoint(name=name, server_url=f"{base_url}/{name}", headers=headers or {})
        for name in TOOL_NAMES
    ]


def call(base_url: str, name: str, arguments: str, **client_kwargs) -> ToolCallResult:
    """One call through a fresh client, driven by asyncio.run."""
    headers = client_kwargs.pop("headers", None)
    client_kwargs.setdefault("backoff_s", 0.01)

    async def go() -> ToolCallResult:
        async with ToolClient(endpoints(base_url, headers), SCHEMAS, **client_kwargs) as client:
            return await client.call(name, arguments, item=ITEM, trace_id="trace_test")

    return asyncio.run(go())


def test_ids_have_openai_shape():
    assert re.fullmatch(r"trace_[0-9a-f]{32}", new_trace_id())
    assert re.fullmatch(r"call_[0-9a-f]{32}", new_call_id())
    assert new_trace_id() != new_trace_id()


def test_wire_body_follows_the_contract(server):
    base_url, log = server
    arguments = '{"query":  "revenue 2019", "top_k": 2}'  # odd spacing: must arrive unchanged
    trace_id = new_trace_id()

    async def go() -> list[ToolCallResult]:
        async with ToolClient(endpoints(base_url), SCHEMAS) as client:
            first = await client.call(
                "echo", arguments, item=ITEM, trace_id=trace_id, call_id="call_a"
            )
            second = await client.call("echo", '{"query": "x"}', item=ITEM, trace_id=trace_id)
            return [first, second]

    first, second = asyncio.run(go())
    body = log["requests"]["call_a"]["body"]
    assert set(body) == {"type", "id", "call_id", "name", "arguments", "item", "trace_id"}
    assert body["type"] == "function_call"
    assert body["call_id"] == "call_a"
    assert body["name"] == "echo"
    assert body["arguments"] == arguments
    assert body["item"] == ITEM
    assert body["trace_id"] == trace_id
    assert body["id"].startswith("fc_")
    assert log["requests"]["call_a"]["headers"]["content-type"] == "application/json"
    assert log["requests"][second.call_id]["body"]["trace_id"] == trace_id
    assert second.call_id.startswith("call_")

    assert first.error is None and first.status_code == 200 and first.attempts == 1
    assert first.call_id == "call_a" and first.name == "echo" and first.arguments == arguments
    assert json.loads(first.output) == {"arguments": arguments, "auth": None}
    assert first.truncated is False
    assert first.latency_s > 0


def test_headers_interpolate_env_and_never_leak(server, monkeypatch, caplog):
    base_url, log = server
    monkeypatch.setenv("TOOL_TOKEN", SECRET)
    headers = {"Authorization": "Bearer ${TOOL_TOKEN}", "X-Team": "finqa"}
    caplog.set_level(logging.DEBUG)

    async def go() -> tuple[str, ToolCallResult, InfraError]:
        async with ToolClient(endpoints(base_url, headers), SCHEMAS, backoff_s=0.01) as client:
            shown = repr(client) + str(client)
            echoed = await client.call(
                "echo", '{"query": "q"}', item=ITEM, trace_id="trace_s", call_id="call_secret"
            )
            with pytest.raises(InfraError) as failure:
                await client.call("leaky500", "{}", item=ITEM, trace_id="trace_s")
            return shown, echoed, failure.value

    shown, echoed, failure = asyncio.run(go())
    seen = log["requests"]["call_secret"]["headers"]
    assert seen["authorization"] == f"Bearer {SECRET}"
    assert seen["x-team"] == "finqa"
    assert "Bearer ${TOOL_TOKEN}" in shown
    assert SECRET not in shown
    # The echoing server's copy of the secret is scrubbed before the model sees it.
    assert json.loads(echoed.output)["auth"] == "Bearer [redacted]"
    assert "bad auth header Bearer [redacted]" in str(failure)
    assert SECRET not in str(failure) and SECRET not in repr(failure)
    assert "retrying" in caplog.text
    assert SECRET not in caplog.text


def test_missing_env_var_is_a_config_error_naming_it(server, monkeypatch):
    base_url, _ = server
    monkeypatch.delenv("NO_SUCH_TOKEN", raising=False)
    with pytest.raises(ConfigError) as failure:
        ToolClient(endpoints(base_url, {"Authorization": "Bearer ${NO_SUCH_TOKEN}"}), SCHEMAS)
    message = str(failure.value)
    assert "NO_SUCH_TOKEN" in message
    assert "tools.endpoints[0].headers.Authorization" in message

    monkeypatch.setenv("REGION", "eu")
    assert resolve_headers({"X-R": "${REGION}-1", "X-P": "$plain"}, where="w") == {
        "X-R": "eu-1",
        "X-P": "$plain",
    }


def test_invalid_arguments_are_answered_before_any_request(server):
    base_url, log = server
    before = sum(log["attempts"].values())

    missing = call(base_url, "echo", '{"top_k": 3}')
    assert missing.error == "invalid_arguments"
    assert missing.output == "Error: invalid arguments for echo: 'query' is a required property"
    assert missing.attempts == 0 and missing.status_code is None

    wrong_type = call(base_url, "echo", '{"query": 5}')
    assert wrong_type.error == "invalid_arguments"
    assert wrong_type.output == (
        "Error: invalid arguments for echo: 5 is not of type 'string' (at $.query)"
    )

    bad_json = call(base_url, "echo", '{"query": ')
    assert bad_json.error == "invalid_json"
    assert bad_json.output.startswith("Error: arguments for echo are not valid JSON")

    unknown = call(base_url, "grep", '{"pattern": "x"}')
    assert unknown.error == "unknown_tool"
    assert (
        unknown.output
        == f"Error: unknown tool 'grep'; available tools: {', '.join(sorted(TOOL_NAMES))}"
    )
    assert unknown.attempts == 0

    assert sum(log["attempts"].values()) == before  # the server saw none of them


def test_4xx_goes_back_to_the_model(server):
    base_url, _ = server
    result = call(base_url, "notfound", '{"path": "reports/ACME/2019/page_99.txt"}')
    assert result.error == "http_4xx"
    assert result.status_code == 404
    assert result.output == "Error 404: no such page: reports/ACME/2019/page_99.txt"
    assert result.attempts == 1


def test_5xx_is_retried_until_it_succeeds(server):
    base_url, log = server
    result = call(base_url, "flaky", '{"fails": 2, "status": 500}')
    assert result.error is None
    assert result.output == "ok after 3 attempts"
    assert result.attempts == 3
    assert log["attempts"][result.call_id] == 3

    # 429 says "busy", not "the model erred": retried like a 5xx.
    throttled = call(base_url, "flaky", '{"fails": 1, "status": 429}')
    assert throttled.error is None and throttled.attempts == 2


def test_persistent_5xx_raises_infra_error_after_three_attempts(server):
    base_url, log = server

    async def go() -> None:
        async with ToolClient(endpoints(base_url), SCHEMAS, backoff_s=0.01) as client:
            await client.call("always500", "{}", item=ITEM, trace_id="t", call_id="call_down")

    with pytest.raises(InfraError) as failure:
        asyncio.run(go())
    assert failure.value.endpoint == "always500"
    assert failure.value.attempts == 3
    assert "failed after 3 attempts" in str(failure.value)
    assert "HTTP 500: database down" in str(failure.value)
    assert log["attempts"]["call_down"] == 3


def test_malformed_2xx_answer_is_infrastructure(server):
    base_url, _ = server
    with pytest.raises(InfraError) as failure:
        call(base_url, "garbage", "{}")
    assert failure.value.attempts == 3
    assert "not JSON" in str(failure.value)


def test_refused_connection_raises_infra_error():
    # A bound socket that never listens: connections to it are refused.
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        base_url = f"http://127.0.0.1:{closed.getsockname()[1]}"
        with pytest.raises(InfraError) as failure:
            call(base_url, "echo", '{"query": "q"}', max_retries=2)
    assert failure.value.attempts == 2
    assert "ConnectError" in str(failure.value)


def test_timeout_raises_infra_error(server):
    base_url, _ = server
    with pytest.raises(InfraError) as failure:
        call(base_url, "sleep", '{"seconds": 2}', timeout_s=0.2, max_retries=2)
    assert failure.value.attempts == 2
    assert "timed out after 0.2 s" in str(failure.value)


def test_call_many_runs_concurrently_and_keeps_order(server):
    base_url, log = server
    calls = [
        ("sleep", json.dumps({"seconds": s}), f"call_par_{i}")
        for i, s in enumerate([0.3, 0.1, 0.2])
    ]

    async def go() -> list[ToolCallResult]:
        async with ToolClient(endpoints(base_url), SCHEMAS) as client:
            return await client.call_many(calls, item=ITEM, trace_id="trace_par")

    results = asyncio.run(go())
    assert [r.call_id for r in results] == ["call_par_0", "call_par_1", "call_par_2"]
    assert [r.output for r in results] == ["slept"] * 3
    assert results[0].latency_s >= 0.3
    intervals = [log["intervals"][cid] for _, _, cid in calls]
    # All three were running on the server at the same moment.
    assert max(start for start, _ in intervals) < min(end for _, end in intervals)


def test_concurrency_limit_one_serialises(server):
    base_url, log = server
    calls = [("sleep", '{"seconds": 0.1}', f"call_ser_{i}") for i in range(3)]

    async def go() -> list[ToolCallResult]:
        async with ToolClient(
            endpoints(base_url), SCHEMAS, max_concurrency_per_endpoint=1
        ) as client:
            return await client.call_many(calls, item=ITEM, trace_id="trace_ser")

    asyncio.run(go())
    intervals = sorted(log["intervals"][cid] for _, _, cid in calls)
    for (_, end), (next_start, _) in zip(intervals, intervals[1:], strict=False):
        assert next_start >= end


def test_call_many_raises_infra_error_after_every_call_ends(server):
    base_url, log = server
    calls = [("always500", "{}", "call_many_down"), ("sleep", '{"seconds": 0.2}', "call_many_ok")]

    async def go() -> None:
        async with ToolClient(endpoints(base_url), SCHEMAS, backoff_s=0.01) as client:
            await client.call_many(calls, item=ITEM, trace_id="trace_m")

    with pytest.raises(InfraError):
        asyncio.run(go())
    assert "call_many_ok" in log["intervals"]  # the good call was not abandoned midway


def test_long_output_is_truncated_visibly(server):
    base_url, _ = server
    result = call(base_url, "long", "{}", max_output_chars=100)
    assert result.output == "y" * 100 + "\n[output truncated: 9900 more chars]"
    assert result.truncated is True
    assert result.error is None


def test_oversize_response_raises_without_retry(server):
    base_url, _ = server
    with pytest.raises(InfraError) as failure:
        call(base_url, "big", "{}")
    assert failure.value.attempts == 1
    assert "max_body_bytes=1000000" in str(failure.value)


def test_oversize_request(server):
    base_url, log = server
    before = sum(log["attempts"].values())
    too_long = call(base_url, "echo", json.dumps({"query": "q" * 2000}), max_body_bytes=1000)
    assert too_long.error == "request_too_large"
    assert "over the 1000-byte limit" in too_long.output

    async def go() -> None:
        async with ToolClient(endpoints(base_url), SCHEMAS, max_body_bytes=1000) as client:
            await client.call(
                "echo", '{"query": "q"}', item={"id": "fat", "blob": "b" * 2000}, trace_id="t"
            )

    with pytest.raises(DataError, match="item 'fat'"):
        asyncio.run(go())
    assert sum(log["attempts"].values()) == before


def test_allowlist_refuses_other_hosts(server):
    base_url, _ = server
    with pytest.raises(
        ConfigError, match=r"host '127\.0\.0\.1' of tool 'echo' is not in allowed_hosts"
    ):
        ToolClient(endpoints(base_url), SCHEMAS, allowed_hosts=["tools.internal"])
    result = call(base_url, "echo", '{"query": "q"}', allowed_hosts=["127.0.0.1"])
    assert result.error is None


def test_schema_checks_at_construction(server):
    base_url, _ = server
    with pytest.raises(ConfigError, match="'search' is offered to the model but tools.endpoints"):
        ToolClient(endpoints(base_url), [*SCHEMAS, _schema("search", {})])
    bad = {"type": "function", "function": {"name": "echo", "parameters": {"type": "nope"}}}
    with pytest.raises(
        ConfigError, match=r"tools.schemas\[0\] \(echo\): parameters is not a valid"
    ):
        ToolClient(endpoints(base_url), [bad])


def test_item_tools_are_used_when_no_schemas_are_configured(server):
    base_url, _ = server
    item = {**ITEM, "tools": [SCHEMAS[0]]}  # this item offers only `echo`

    async def go() -> list[ToolCallResult]:
        async with ToolClient(endpoints(base_url), None) as client:
            ok = await client.call("echo", '{"query": "q"}', item=item, trace_id="t")
            bad = await client.call("echo", '{"top_k": 1}', item=item, trace_id="t")
            hidden = await client.call("long", "{}", item=item, trace_id="t")
            with pytest.raises(DataError, match="has no `tools` list"):
                await client.call("echo", '{"query": "q"}', item=ITEM, trace_id="t")
            return [ok, bad, hidden]

    ok, bad, hidden = asyncio.run(go())
    assert ok.error is None
    assert bad.error == "invalid_arguments"
    assert hidden.error == "unknown_tool" and hidden.output.endswith("available tools: echo")


# --- busy servers: Retry-After and rate limits -------------------------------------------


def test_retry_after_forms():
    assert retry_after_s(httpx.Headers({"Retry-After": "2"})) == 2.0
    assert retry_after_s(httpx.Headers({"Retry-After": "0.5"})) == 0.5
    assert retry_after_s(httpx.Headers({"retry-after-ms": "250", "Retry-After": "9"})) == 0.25
    in_a_minute = format_datetime(datetime.now(UTC) + timedelta(seconds=60), usegmt=True)
    assert 55 < retry_after_s(httpx.Headers({"Retry-After": in_a_minute})) <= 60
    past = format_datetime(datetime.now(UTC) - timedelta(seconds=60), usegmt=True)
    assert retry_after_s(httpx.Headers({"Retry-After": past})) == 0.0
    for junk in ("soon", "-3", "nan", ""):
        assert retry_after_s(httpx.Headers({"Retry-After": junk})) is None
    assert retry_after_s(httpx.Headers({})) is None


def busy(fails: int, wait: str, header: str = "Retry-After") -> str:
    return json.dumps({"fails": fails, "wait": wait, "header": header})


def test_429_waits_as_long_as_retry_after_asks(server):
    base_url, log = server
    seconds = call(base_url, "busy", busy(1, "1"), backoff_s=0.01)
    assert seconds.error is None and seconds.output == "served" and seconds.attempts == 2
    first, second = log["arrivals"][seconds.call_id]
    assert second - first >= 1.0  # not the 0.01 s backoff

    date = (datetime.now(UTC) + timedelta(seconds=2)).replace(microsecond=0)  # an HTTP date has whole seconds
    dated = call(base_url, "busy", busy(1, format_datetime(date, usegmt=True)), backoff_s=0.01)
    first, second = log["arrivals"][dated.call_id]
    # the retry came at the date it was given (the server's clock is monotonic: a loaded machine may
    # send the first request late, so the wait is measured against the date, not the first arrival)
    retried_at = datetime.now(UTC) - timedelta(seconds=time.monotonic() - second)
    assert dated.attempts == 2 and retried_at >= date - timedelta(seconds=0.05) and second - first > 0.01

    millis = call(base_url, "busy", busy(2, "300", "retry-after-ms"), backoff_s=0.01)
    arrivals = log["arrivals"][millis.call_id]
    assert millis.attempts == 3
    assert all(later - earlier >= 0.3 for earlier, later in zip(arrivals, arrivals[1:], strict=False))


def test_retry_after_never_goes_past_the_timeout_or_the_attempts(server):
    base_url, log = server

    async def go(arguments: str, **options) -> tuple[ToolClient, InfraError, float]:
        async with ToolClient(endpoints(base_url), SCHEMAS, backoff_s=0.01, **options) as client:
            start = time.perf_counter()
            with pytest.raises(InfraError) as failure:
                await client.call("busy", arguments, item=ITEM, trace_id="t", call_id=arguments)
            return client, failure.value, time.perf_counter() - start

    client, failure, took = asyncio.run(go(busy(5, "30"), timeout_s=5))
    assert took < 5  # gave up at once rather than sleep past the deadline
    assert failure.attempts == 1 and log["attempts"][busy(5, "30")] == 1
    assert "asked to retry after 30 s" in str(failure) and "timeout_s=5" in str(failure)
    assert client.stats.failed_attempts == Counter({"HTTP 429": 1}) and client.stats.infra_errors == 1

    client, failure, _ = asyncio.run(go(busy(5, "150", "retry-after-ms"), max_retries=2))
    assert failure.attempts == 2 and "failed after 2 attempts" in str(failure)
    assert "HTTP 429: slow down" in str(failure)


def test_retry_after_pauses_the_whole_endpoint(server):
    base_url, log = server

    async def go() -> None:
        async with ToolClient(endpoints(base_url), SCHEMAS, backoff_s=0.01) as client:
            paused = asyncio.create_task(
                client.call("busy", busy(1, "600", "retry-after-ms"), item=ITEM, trace_id="t", call_id="call_paused")
            )
            while "call_paused" not in log["arrivals"]:
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.1)  # the 429 is back at the client by now
            other, echo = await asyncio.gather(
                client.call("busy", busy(0, "0"), item=ITEM, trace_id="t", call_id="call_other"),
                client.call("echo", '{"query": "q"}', item=ITEM, trace_id="t", call_id="call_echo"),
            )
            assert other.attempts == echo.attempts == 1 and (await paused).attempts == 2

    asyncio.run(go())
    refused = log["arrivals"]["call_paused"][0]
    assert log["arrivals"]["call_other"][0] - refused >= 0.6  # it waited for the pause too
    # the pause held back only the endpoint that asked for it
    assert log["arrivals"]["call_echo"][0] - refused < 0.6


def test_rate_limit_spaces_requests(server):
    base_url, log = server
    rate, n = 20.0, 30
    ids = [f"call_rate_{i}" for i in range(n)]

    async def go() -> ToolClient:
        async with ToolClient(endpoints(base_url), SCHEMAS, max_requests_per_second=rate) as client:
            await asyncio.gather(
                *(client.call("echo", '{"query": "q"}', item=ITEM, trace_id="t", call_id=cid) for cid in ids)
            )
            return client

    client = asyncio.run(go())
    arrivals = sorted(log["arrivals"][cid][0] for cid in ids)
    # departures are at least 1/rate apart; arrivals may bunch by the loopback's jitter
    assert arrivals[-1] - arrivals[0] >= (n - 1) / rate - 0.05
    assert client.stats.rate_limit_wait_s > 0
    assert client.stats.requests == n and not client.stats.failed_attempts


def test_rate_limit_is_per_url_and_validated():
    with pytest.raises(ConfigError, match="max_requests_per_second must be > 0"):
        ToolClient([], None, max_requests_per_second=0)
    shared = [
        ToolEndpoint(name="echo", server_url="http://127.0.0.1:9/call"),
        ToolEndpoint(name="long", server_url="http://127.0.0.1:9/call"),
        ToolEndpoint(name="big", server_url="http://127.0.0.1:9/big"),
    ]
    client = ToolClient(shared, None, max_requests_per_second=5)
    limits = {name: tool.limit for name, tool in client._tools.items()}
    assert limits["echo"] is limits["long"] and limits["big"] is not limits["echo"]
    assert limits["echo"].interval == 0.2


def test_rate_limit_never_bursts_after_a_stall():
    """A blocked event loop wakes every waiter at once; they still leave 1/rate apart."""

    async def go() -> list[float]:
        limit = RateLimit(50.0)
        left: list[float] = []

        async def one() -> None:
            await limit.wait()
            left.append(time.monotonic())

        tasks = [asyncio.create_task(one()) for _ in range(6)]
        await asyncio.sleep(0)
        time.sleep(0.2)  # the loop stalls while every turn comes due
        await asyncio.gather(*tasks)
        return left

    left = asyncio.run(go())
    assert all(b - a >= 0.02 - 1e-3 for a, b in zip(left, left[1:], strict=False))


# --- the keep-alive race ----------------------------------------------------------------


def _read_request(conn: socket.socket, buffer: bytes) -> tuple[bytes | None, bytes]:
    """One HTTP/1.1 request (head and body) from `conn`; None when the client closed."""
    while b"\r\n\r\n" not in buffer:
        chunk = conn.recv(65536)
        if not chunk:
            return None, b""
        buffer += chunk
    head, _, rest = buffer.partition(b"\r\n\r\n")
    length = int(re.search(rb"(?i)content-length: *(\d+)", head).group(1))
    while len(rest) < length:
        rest += conn.recv(65536)
    return head + b"\r\n\r\n" + rest[:length], rest[length:]


@contextmanager
def raw_server(serve: Callable[[socket.socket, list], None]) -> Iterator[tuple[str, list]]:
    """A TCP server on loopback running `serve(connection, log)` per connection."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    log: list = []

    def accept() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            threading.Thread(target=serve, args=(conn, log), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}", log
    finally:
        listener.close()


def _answer(conn: socket.socket) -> None:
    body = json.dumps({"type": "function_call_output", "call_id": "c", "id": "i", "output": "ok"}).encode()
    conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                 % (len(body), body))


def keepalive_race(how: str) -> Callable[[socket.socket, list], None]:
    """Answer a connection's first request and keep it open; when the next request on it
    arrives, close it unanswered, as a server whose keep-alive timer fired at that moment
    does: after reading it (`fin`, the client reads end of stream) or with it unread
    (`rst`, the kernel resets the connection)."""

    def serve(conn: socket.socket, log: list) -> None:
        with conn:
            request, buffer = _read_request(conn, b"")
            if request is None:
                return
            log.append("answered")
            _answer(conn)
            if how == "fin":
                if _read_request(conn, buffer)[0] is not None:
                    log.append("dropped")
            else:
                if conn.recv(1, socket.MSG_PEEK):
                    log.append("dropped")
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))

    return serve


@pytest.mark.parametrize(("how", "error"), [("fin", "RemoteProtocolError"), ("rst", "ReadError")])
def test_stale_keepalive_connection_is_resent_at_once_uncounted(how, error, caplog):
    caplog.set_level(logging.INFO, logger="trainer.rollout.tool_http")
    with raw_server(keepalive_race(how)) as (base_url, log):

        async def go() -> tuple[ToolClient, list[ToolCallResult]]:
            async with ToolClient(endpoints(base_url), SCHEMAS, backoff_s=0.5) as client:
                first = await client.call("echo", '{"query": "q"}', item=ITEM, trace_id="t")
                start = time.perf_counter()
                second = await client.call("echo", '{"query": "q"}', item=ITEM, trace_id="t")
                assert time.perf_counter() - start < 0.5  # no backoff
                return client, [first, second]

        client, results = asyncio.run(go())
    assert [r.output for r in results] == ["ok", "ok"] and [r.attempts for r in results] == [1, 1]
    assert log == ["answered", "dropped", "answered"]  # the resend went on a new connection
    assert client.stats.stale_connection_resends == 1 and client.stats.requests == 3
    assert not client.stats.failed_attempts
    assert f"before answering ({error}: " in caplog.text and "sent again at once" in caplog.text
    assert "retrying" not in caplog.text


def test_connection_dropped_on_a_fresh_connection_is_a_counted_failure():
    def drop(conn: socket.socket, log: list) -> None:
        with conn:
            if _read_request(conn, b"")[0] is not None:
                log.append("dropped")

    with raw_server(drop) as (base_url, log):

        async def go() -> ToolClient:
            async with ToolClient(endpoints(base_url), SCHEMAS, backoff_s=0.01) as client:
                with pytest.raises(InfraError, match="RemoteProtocolError"):
                    await client.call("echo", '{"query": "q"}', item=ITEM, trace_id="t")
                return client

        client = asyncio.run(go())
    assert log == ["dropped"] * 3
    assert client.stats.stale_connection_resends == 0
    assert client.stats.failed_attempts == Counter({"RemoteProtocolError": 3})


def test_idle_connections_expire_before_the_servers_keepalive(server):
    """httpx keeps idle connections 5 s by default, exactly uvicorn's keep-alive timeout."""
    base_url, _ = server
    client = ToolClient(endpoints(base_url), SCHEMAS)
    assert client.transport.http._transport._pool._keepalive_expiry < 5.0
