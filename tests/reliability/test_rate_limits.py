"""Busy tool servers: rate limits, 429 with Retry-After, and the keep-alive race.

1. A tool server limited to 20 requests/s (a token bucket with bursts of 20, as API
   gateways do) that answers 429 with `Retry-After`: a client configured with
   `max_requests_per_second=20` never goes over the rate (measured from the arrival
   times at the server) and is never refused; a client that does not know the limit is
   refused, waits as long as it is told, slows down to the server's rate, and no call
   becomes an infrastructure error. The same for the endpoint grader.
2. The demo tool server (uvicorn, 5 s keep-alive timeout) hit by the real client after
   idle gaps just around that timeout and around the client's own expiry, while other
   calls keep it busy: no request fails on a connection the server has closed.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from envs.finqa.local import local_tool_endpoints
from envs.finqa.tool_schemas import TOOL_SCHEMAS
from envs.tool_server import serve_in_thread
from tests.taught_model import copy_items
from trainer.config.tools import ToolEndpoint
from trainer.data import read_items
from trainer.graders import GraderContext, grade_async
from trainer.rollout.tool_client import ToolClient
from trainer.rollout.tool_http import KEEPALIVE_EXPIRY_S

pytestmark = pytest.mark.integration

RATE = 20.0
ITEM = {"id": "item-1", "reference_answer": "42"}
LOOKUP = {
    "type": "function",
    "function": {
        "name": "lookup",
        "description": "Look a key up.",
        "parameters": {"type": "object", "properties": {"key": {"type": "string"}}, "required": ["key"]},
    },
}


class TokenBucket:
    """The server's limit: `rate` requests a second, bursts of up to `burst`."""

    def __init__(self, rate: float, burst: int):
        self.rate, self.burst = rate, burst
        self.tokens, self.at = float(burst), time.monotonic()
        self.lock = threading.Lock()

    def take(self) -> float | None:
        """None when the request is admitted, else the seconds until it would be."""
        with self.lock:
            now = time.monotonic()
            self.tokens = min(self.burst, self.tokens + (now - self.at) * self.rate)
            self.at = now
            if self.tokens >= 1:
                self.tokens -= 1
                return None
            return (1 - self.tokens) / self.rate


def limited_app(rate: float = RATE) -> FastAPI:
    """A tool (`POST /lookup`) and an endpoint grader (`POST /grade`) behind one limit;
    `app.state.log` holds (arrival time, status) of every request."""
    app = FastAPI()
    app.state.log = []
    bucket = TokenBucket(rate, burst=int(rate))

    def admit(request: Request) -> JSONResponse | None:
        wait = bucket.take()
        app.state.log.append((time.monotonic(), 200 if wait is None else 429))
        if wait is None:
            return None
        return JSONResponse({"detail": "rate limit: 20 requests/s"}, status_code=429,
                            headers={"Retry-After": str(math.ceil(wait))})

    @app.post("/lookup")
    async def lookup(request: Request):
        refused = admit(request)
        if refused is not None:
            return refused
        body = await request.json()
        key = json.loads(body["arguments"])["key"]
        return {"type": "function_call_output", "call_id": body["call_id"], "id": body["id"], "output": key.upper()}

    @app.post("/grade")
    async def grade_sample(request: Request):
        refused = admit(request)
        if refused is not None:
            return refused
        body = await request.json()
        return {"score": float(body["sample"]["output_text"] == body["item"]["reference_answer"])}

    return app


@pytest.fixture
def limited_server() -> Iterator[tuple[str, list]]:
    app = limited_app()
    with serve_in_thread(app) as url:
        yield url, app.state.log


def most_in_any_window(times: list[float], width: float = 1.0) -> int:
    """The most arrivals within any window (t - width, t]."""
    times, first, most = sorted(times), 0, 0
    for last, t in enumerate(times):
        while times[first] <= t - width:
            first += 1
        most = max(most, last - first + 1)
    return most


def refusals_were_waited_out(log: list[tuple[float, int]]) -> bool:
    """No request arrived in the second a 429 asked the client to wait (from 0.3 s after
    it, allowing for requests already on their way)."""
    arrivals = [t for t, _ in log]
    return not any(refused + 0.3 < t < refused + 0.95 for refused, status in log if status == 429 for t in arrivals)


def test_configured_rate_is_never_exceeded(limited_server):
    url, log = limited_server
    n = 100

    async def go() -> tuple[ToolClient, list]:
        endpoints = [ToolEndpoint(name="lookup", server_url=f"{url}/lookup")]
        async with ToolClient(endpoints, [LOOKUP], max_requests_per_second=RATE) as client:
            results = await asyncio.gather(*(
                client.call("lookup", json.dumps({"key": f"k{i}"}), item=ITEM, trace_id=f"trace_{i % 10}")
                for i in range(n)
            ))
            return client, results

    client, results = asyncio.run(go())
    assert [r.output for r in results] == [f"K{i}" for i in range(n)]
    arrivals = [t for t, _ in log]
    most = most_in_any_window(arrivals)
    print(f"\nconfigured {RATE:g}/s: {n} calls in {arrivals[-1] - arrivals[0]:.2f} s, "
          f"most in any 1 s window {most}, 429s {sum(s == 429 for _, s in log)}")
    assert len(log) == n and all(status == 200 for _, status in log)  # never refused
    assert most <= RATE + 1  # one more for the loopback's jitter in arrival times
    assert (n - 1) / (arrivals[-1] - arrivals[0]) <= RATE * 1.01
    assert client.stats.infra_errors == 0 and not client.stats.failed_attempts


def test_429s_slow_calls_down_without_infra_errors(limited_server):
    url, log = limited_server
    workers, calls_each = 8, 15  # eight rollouts calling the tool one call after another

    async def go() -> tuple[ToolClient, list, float]:
        endpoints = [ToolEndpoint(name="lookup", server_url=f"{url}/lookup")]
        async with ToolClient(endpoints, [LOOKUP]) as client:  # it does not know the limit

            async def rollout(w: int) -> list:
                return [
                    await client.call("lookup", json.dumps({"key": f"w{w}c{c}"}), item=ITEM, trace_id=f"trace_{w}")
                    for c in range(calls_each)
                ]

            start = time.perf_counter()
            results = await asyncio.gather(*(rollout(w) for w in range(workers)))
            return client, results, time.perf_counter() - start

    client, results, took = asyncio.run(go())
    refused = sum(status == 429 for _, status in log)
    n = workers * calls_each
    print(f"\nunconfigured client: {n} calls in {took:.1f} s, {refused} answered 429, "
          f"attempts per call {sum(r.attempts for rs in results for r in rs) / n:.2f}")
    assert [r.output for rs in results for r in rs] == [f"W{w}C{c}" for w in range(workers) for c in range(calls_each)]
    assert refused > 0 and client.stats.failed_attempts == {"HTTP 429": refused}
    assert client.stats.infra_errors == 0
    assert took >= (n - RATE) / RATE  # held to the server's rate after its burst
    assert refusals_were_waited_out(log)


def test_endpoint_grader_honours_the_limit_and_retry_after(limited_server):
    url, log = limited_server
    grader = {"type": "endpoint", "name": "remote", "url": f"{url}/grade"}

    async def grade_many(n: int, context: GraderContext) -> list:
        return await asyncio.gather(*(
            grade_async(grader, {"output_text": "42"}, ITEM, trace_id=f"trace_{i}", context=context)
            for i in range(n)
        ))

    limited = GraderContext(http_timeout_s=10, max_requests_per_second=RATE)
    results = asyncio.run(grade_many(50, limited))
    assert [r.reward for r in results] == [1.0] * 50
    most = most_in_any_window([t for t, _ in log])
    print(f"\nendpoint grader at {RATE:g}/s: most in any 1 s window {most}")
    assert all(status == 200 for _, status in log) and most <= RATE + 1

    time.sleep(1.0)  # the server's burst refills
    log.clear()
    results = asyncio.run(grade_many(30, GraderContext(http_timeout_s=10, retry_backoff_s=0.01)))
    assert [r.reward for r in results] == [1.0] * 30  # none is a grader error
    assert sum(status == 429 for _, status in log) > 0 and refusals_were_waited_out(log)


@pytest.fixture(scope="module")
def demo_endpoints(demo_data_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("keepalive")
    copy_items(demo_data_dir, read_items(demo_data_dir / "train.jsonl", 2), root, "items.jsonl")
    with local_tool_endpoints(root / "corpus") as endpoints:
        yield endpoints, read_items(root / "items.jsonl")[0]


def test_no_request_meets_a_closed_keepalive_connection(demo_endpoints, caplog):
    """uvicorn closes a connection idle for 5 s; httpx kept them 5 s too, so a request
    sent just before the server's timer fired failed with `ReadError` and was retried."""
    endpoints, item = demo_endpoints
    caplog.set_level(logging.INFO, logger="trainer.rollout.tool_http")
    server_keepalive_s = 5.0  # uvicorn's default timeout_keep_alive
    gaps = [edge + step / 100 for edge in (KEEPALIVE_EXPIRY_S, server_keepalive_s) for step in range(-10, 11)]
    arguments = json.dumps({"path": "reports"})

    async def probe(gap: float) -> ToolClient:
        # one client each: its one connection is idle for exactly `gap`
        async with ToolClient(endpoints, TOOL_SCHEMAS) as client:
            await client.call("list", arguments, item=item, trace_id="trace_probe")
            await asyncio.sleep(gap)
            await client.call("list", arguments, item=item, trace_id="trace_probe")
            return client

    async def go() -> list[ToolClient]:
        probes: list[ToolClient] = []
        async with ToolClient(endpoints, TOOL_SCHEMAS) as busy:
            stop = asyncio.Event()

            async def load() -> None:  # keeps the server's event loop busy meanwhile
                while not stop.is_set():
                    await busy.call("search", json.dumps({"query": "revenue"}), item=item, trace_id="trace_load")
                    await asyncio.sleep(0.05)

            loader = asyncio.create_task(load())
            for _ in range(2):
                probes += await asyncio.gather(*(probe(gap) for gap in gaps))
            stop.set()
            await loader
            return [*probes, busy]

    clients = asyncio.run(go())
    failed = sum(sum(c.stats.failed_attempts.values()) for c in clients)
    resent = sum(c.stats.stale_connection_resends for c in clients)
    print(f"\nkeep-alive: {sum(c.stats.requests for c in clients)} requests, {failed} failed attempts, "
          f"{resent} stale-connection resends")
    assert failed == 0 and resent == 0
    assert "retrying" not in caplog.text and "sent again" not in caplog.text
