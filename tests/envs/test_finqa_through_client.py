"""The FinQA tool server driven through the project's tool client, as rollouts drive it:
every tool, parallel calls, the trace record, bad input answered to the model, and
5xx retried then raised as an infrastructure error."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import httpx
import pytest

from envs.finqa.faults import FaultConfig
from envs.finqa.local import local_tool_endpoints
from envs.finqa.tool_schemas import TOOL_SCHEMAS
from trainer.data import read_items
from trainer.errors import InfraError
from trainer.rollout.tool_client import ToolClient
from trainer.wire import new_trace_id


@pytest.fixture(scope="module")
def corpus(demo_data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    item = read_items(demo_data_dir / "validation.jsonl", 1)[0]
    root = tmp_path_factory.mktemp("corpus")
    for ticker in (item["ticker"], "ACME"):
        shutil.copytree(demo_data_dir / "corpus/reports" / ticker, root / "reports" / ticker)
    return root, item


def _args(**kwargs) -> str:
    return json.dumps(kwargs)


def test_every_tool_through_the_client_with_trace_record(corpus) -> None:
    root, item = corpus
    gold = item["gold_pages"][0]
    trace_id = new_trace_id()

    async def go(endpoints):
        async with ToolClient(endpoints, TOOL_SCHEMAS) as client:
            search = await client.call("search", _args(query=item["question"]), item=item, trace_id=trace_id)
            listing = await client.call("list", _args(path=str(Path(gold).parent)), item=item, trace_id=trace_id)
            page = await client.call("cat", _args(path=gold), item=item, trace_id=trace_id)
            calc = await client.call("calculator", _args(expression="(540-480)/480"), item=item, trace_id=trace_id)
            return search, listing, page, calc

    with local_tool_endpoints(root) as endpoints:
        search, listing, page, calc = asyncio.run(go(endpoints))
        base = endpoints[0].server_url.rsplit("/tools/", 1)[0]
        trace = httpx.get(f"{base}/traces/{trace_id}").json()
    assert all(r.error is None for r in (search, listing, page, calc))
    assert gold in search.output.splitlines()[0]  # the question finds its page first
    assert Path(gold).name in listing.output.splitlines()
    assert page.output == (root / gold).read_text()
    assert float(calc.output) == pytest.approx(0.125)
    assert [c["name"] for c in trace["calls"]] == ["search", "list", "cat", "calculator"]


def test_parallel_calls_overlap_on_the_server(corpus) -> None:
    root, item = corpus
    trace_id = new_trace_id()
    calls = [("cat", _args(path=p), None) for p in item["gold_pages"]] + [("list", _args(path="reports"), None)]

    async def go(endpoints):
        async with ToolClient(endpoints, TOOL_SCHEMAS) as client:
            return await client.call_many(calls, item=item, trace_id=trace_id)

    with local_tool_endpoints(root, faults=FaultConfig(latency_ms=300)) as endpoints:
        results = asyncio.run(go(endpoints))
        base = endpoints[0].server_url.rsplit("/tools/", 1)[0]
        recorded = httpx.get(f"{base}/traces/{trace_id}").json()["calls"]
    assert len(results) == len(calls) and all(r.error is None for r in results)
    latest_start = max(c["started_at"] for c in recorded)
    earliest_end = min(c["finished_at"] for c in recorded)
    assert latest_start < earliest_end  # all calls were in flight at once


@pytest.mark.parametrize(
    ("name", "arguments", "error", "text"),
    [
        ("cat", _args(path="../../etc/passwd"), "http_4xx", "Error 400"),
        ("cat", _args(path="/etc/passwd"), "http_4xx", "absolute path"),
        ("cat", _args(path="reports/ACME/1999/page_1.txt"), "http_4xx", "Error 404"),
        ("cat", _args(path=7), "invalid_arguments", "path"),
        ("search", _args(q="x"), "invalid_arguments", "query"),
        ("search", "{not json", "invalid_json", ""),
        ("delete", _args(path="reports"), "unknown_tool", "calculator"),
        ("calculator", _args(expression="__import__('os')"), "http_4xx", "Error 400"),
    ],
)
def test_bad_calls_are_answered_to_the_model(corpus, name, arguments, error, text) -> None:
    root, item = corpus

    async def go(endpoints):
        async with ToolClient(endpoints, TOOL_SCHEMAS) as client:
            return await client.call(name, arguments, item=item, trace_id=new_trace_id())

    with local_tool_endpoints(root) as endpoints:
        result = asyncio.run(go(endpoints))
    assert result.error == error
    assert text in result.output


def test_5xx_is_retried_then_raised_as_infra_error(corpus) -> None:
    root, item = corpus
    trace_id = new_trace_id()

    async def go(endpoints):
        async with ToolClient(endpoints, TOOL_SCHEMAS, backoff_s=0.01, max_retries=3) as client:
            return await client.call("list", _args(path="reports"), item=item, trace_id=trace_id)

    with local_tool_endpoints(root, faults=FaultConfig(error_rate=1.0)) as endpoints:
        with pytest.raises(InfraError) as err:
            asyncio.run(go(endpoints))
        base = endpoints[0].server_url.rsplit("/tools/", 1)[0]
        recorded = httpx.get(f"{base}/traces/{trace_id}").json()["calls"]
    assert err.value.attempts == 3
    assert [c["status_code"] for c in recorded] == [503, 503, 503]


def test_tools_served_from_a_child_process_answer_with_its_faults_and_stop_with_the_block(corpus) -> None:
    """`tool_endpoints_in_process`: the same tools from a spawned process (its own GIL),
    with the latency it was given, gone once the block ends."""
    import time

    from envs.finqa.local import tool_endpoints_in_process

    root, item = corpus

    async def go(endpoints):
        async with ToolClient(endpoints, TOOL_SCHEMAS) as client:
            started = time.perf_counter()
            page = await client.call("cat", _args(path=item["gold_pages"][0]), item=item, trace_id=new_trace_id())
            return page, time.perf_counter() - started

    with tool_endpoints_in_process(root, faults=FaultConfig(latency_ms=200)) as endpoints:
        page, seconds = asyncio.run(go(endpoints))
        base = endpoints[0].server_url.rsplit("/tools/", 1)[0]
    assert page.error is None and page.output == (root / item["gold_pages"][0]).read_text()
    assert seconds >= 0.2  # the child's fault config: its latency, not a wall-time bound
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{base}/health", timeout=2)
