"""Secrets and isolation (issue 6, item 5), against the real FinQA tool server on loopback.

- A header secret from the environment (`${AGENTRFT_TEST_SECRET}`) reaches the tool
  server and nowhere else: not the config's params, dump or stage hashes, not the tool
  client's logs or errors when the server answers 5xx, not the server's trace record or
  logs. (The pipeline's MLflow and Prefect records are the lead's test.)
- The python grader, run the way the trainer runs it (concurrently, inside a multi
  grader), turns a socket to a live loopback server, a fork bomb that goes around the
  Python-level guard (`posix.fork`), a 10 GB allocation and a busy loop into grader
  errors: no score, the test process unharmed, nothing connected, no child left.
- The tool client refuses endpoints outside the allowlist (from the config too, at load
  time) and bodies over 1 MB: an oversized request is never sent, an oversized answer is
  an infrastructure error at the first attempt, and a huge page served with the demo's
  settings is cut visibly by the server.
- Tool state is per `trace_id`: concurrent rollouts each see only their own calls, and
  the model's tools cannot reach the trace record.

What tests elsewhere already cover is not repeated here: the echoing-server scrub and
repr of ToolClient (tests/trainer/test_tools.py), the grader's sandbox one attack at a
time (tests/trainer/graders/test_python_grader.py), the server's 413 and bounded trace
store (tests/envs/test_finqa_server.py).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import socket
import threading
import time
from pathlib import Path

import httpx
import pytest
from prefect.cache_policies import INPUTS

from envs.finqa.faults import FaultConfig
from envs.finqa.search import SearchIndex
from envs.finqa.server import create_app
from envs.finqa.tool_schemas import TOOL_NAMES, TOOL_SCHEMAS
from envs.tool_server import serve_in_thread
from tasks.tracking import flat_params
from trainer.config.loading import config_from_dict, merge_overrides
from trainer.config.tools import ToolEndpoint
from trainer.errors import ConfigError, DataError, InfraError
from trainer.graders import GraderContext, grade_async
from trainer.rollout.tool_client import ToolClient
from trainer.wire import new_trace_id

SECRET = "agentrft-planted-secret-7f3c9e1d"
ENV_VAR = "AGENTRFT_TEST_SECRET"
BIG_PAGE = "reports/BIG/2020/page_1.txt"
BIG_CHARS = 1_500_000
# What every config must name besides the tools under test.
REQUIRED = {"model": {"base_model": "some/model"},
            "grader": {"type": "numeric", "name": "n", "input": "{{sample.output_text}}",
                       "reference": "{{item.reference_answer}}"}}


@pytest.fixture(scope="module")
def corpus(demo_data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two real reports and one page of 1.5 MB."""
    root = tmp_path_factory.mktemp("corpus")
    shutil.copytree(demo_data_dir / "corpus/reports/ACME", root / "reports/ACME")
    (root / BIG_PAGE).parent.mkdir(parents=True)
    (root / BIG_PAGE).write_text("BIG Corp annual report 2020\n" + "revenue 1,234 " * (BIG_CHARS // 14))
    return root


@pytest.fixture(scope="module")
def index(corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> SearchIndex:
    return SearchIndex.from_corpus(corpus, cache_dir=tmp_path_factory.mktemp("index"))


class HeaderRecorder:
    """ASGI middleware around the real app: keeps the Authorization header each tool call
    carried, so the test knows the secret did reach the server."""

    def __init__(self, app, seen: list[str]):
        self.app, self.seen = app, seen

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            self.seen.append(dict(scope["headers"]).get(b"authorization", b"").decode())
        await self.app(scope, receive, send)


def endpoints_at(base_url: str, headers: dict[str, str] | None = None) -> list[ToolEndpoint]:
    return [
        ToolEndpoint(name=name, server_url=f"{base_url}/tools/{name}", headers=headers or {})
        for name in TOOL_NAMES
    ]


def traces(base_url: str, trace_id: str) -> httpx.Response:
    return httpx.get(f"{base_url}/traces/{trace_id}", timeout=10)


# --- secrets -----------------------------------------------------------------------------------


def test_header_secret_stays_out_of_config_params_dump_and_hashes(monkeypatch) -> None:
    """flat_params and the dump are covered in tests/trainer/test_config.py; here: every
    stage hash input, and the hash does not move with the secret's value."""
    monkeypatch.setenv(ENV_VAR, SECRET)
    raw = {
        **REQUIRED,
        "tools": {
            "endpoints": [
                {
                    "name": "search",
                    "server_url": "http://127.0.0.1:9/tools/search",
                    "headers": {"Authorization": f"Bearer ${{{ENV_VAR}}}"},
                }
            ]
        }
    }
    config = config_from_dict(raw, source="secret.yaml")
    params = flat_params(dict(config))  # what the pipeline logs to MLflow
    texts = [json.dumps(params), config.model_dump_json(), repr(config), str(config)]
    texts += [json.dumps(config.model_dump(mode="json")[section]) for section in config.model_dump()]
    assert not [t for t in texts if SECRET in t]
    assert params["tools.endpoints"].count(f"${{{ENV_VAR}}}") == 1
    # A stage's cache key hashes the sections it is given (Prefect's INPUTS policy): the
    # templates, so the key neither holds the secret nor moves with its value.
    def input_key(config):
        return INPUTS.compute_key(task_ctx=None, inputs={"tools": config.tools}, flow_parameters={})

    before = (config.section_hash("tools"), input_key(config))
    monkeypatch.setenv(ENV_VAR, "another-value-entirely")
    again = config_from_dict(raw)
    assert (again.section_hash("tools"), input_key(again)) == before
    assert input_key(config_from_dict(merge_overrides(raw, {"tools": {"max_retries": 2}}))) != before[1]


@pytest.mark.integration
def test_header_secret_reaches_the_server_and_no_log_record_or_error(
    corpus: Path, index: SearchIndex, monkeypatch, caplog
) -> None:
    monkeypatch.setenv(ENV_VAR, SECRET)
    caplog.set_level(logging.DEBUG)
    seen: list[str] = []
    headers = {"Authorization": f"Bearer ${{{ENV_VAR}}}"}
    healthy = HeaderRecorder(create_app(corpus, index=index), seen)
    failing = HeaderRecorder(create_app(corpus, index=index, faults=FaultConfig(error_rate=1.0)), seen)
    ok_trace, failed_trace = new_trace_id(), new_trace_id()

    async def rollout(base_url: str, trace_id: str) -> list:
        async with ToolClient(endpoints_at(base_url, headers), TOOL_SCHEMAS, backoff_s=0.01) as client:
            shown = [repr(client), str(client)]
            try:
                results = await client.call_many(
                    [("search", '{"query": "net revenue"}', None), ("list", '{"path": "reports"}', None)],
                    item={"id": "secret-item"},
                    trace_id=trace_id,
                )
                shown += [json.dumps(r.__dict__) for r in results]
            except InfraError as exc:
                shown += [str(exc), repr(exc), repr(exc.args)]
            return shown

    with serve_in_thread(healthy) as ok_url, serve_in_thread(failing) as bad_url:
        shown = asyncio.run(rollout(ok_url, ok_trace)) + asyncio.run(rollout(bad_url, failed_trace))
        shown += [traces(ok_url, ok_trace).text, traces(bad_url, failed_trace).text]

    assert seen and all(value == f"Bearer {SECRET}" for value in seen)  # it was sent
    assert len(seen) == 2 + 2 * 3  # two good calls; two failing ones, three attempts each
    assert any("failed after 3 attempts" in text for text in shown)
    assert "retrying" in caplog.text  # the retries were logged...
    assert SECRET not in caplog.text  # ...without the secret
    leaks = [text[:200] for text in shown if SECRET in text]
    assert leaks == []
    # The server's own record of both rollouts holds the calls, not the headers.
    assert '"name":"search"' in shown[-2].replace(" ", "") and "Bearer" not in shown[-2] + shown[-1]


# --- the python grader's fence -------------------------------------------------------------------


def _python(source: str) -> dict:
    return {"type": "python", "name": "probe", "source": source}


@pytest.mark.integration
def test_python_grader_attacks_are_grader_errors_not_scores() -> None:
    """Four graders at once, each inside a multi grader as a config would nest it."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]
    accepted: list[socket.socket] = []

    def accept() -> None:
        listener.settimeout(0.2)
        while not stop.is_set():
            try:
                accepted.append(listener.accept()[0])
            except OSError:
                continue

    stop = threading.Event()
    acceptor = threading.Thread(target=accept, daemon=True)
    acceptor.start()
    attacks = {
        # `socket` and `_socket` are guarded in Python; their C type (socket.socket's base)
        # goes below both, to the kernel
        "socket": "import socket\ndef grade(sample, item):\n"
        f"    s = socket.socket.__mro__[1]()\n    s.connect(('127.0.0.1', {port}))\n    return 1.0\n",
        # `posix.fork` is the builtin the Python guard replaced in `os` only: the kernel
        # filter must refuse it; bounded, in case it does not
        "fork_bomb": "import posix\ndef grade(sample, item):\n"
        "    for _ in range(64):\n        if posix.fork() == 0:\n            posix._exit(0)\n"
        "    return 1.0\n",
        "memory": "def grade(sample, item):\n    block = bytearray(10 * 1024 ** 3)\n    return 1.0\n",
        "busy_loop": "def grade(sample, item):\n    while True:\n        pass\n",
    }
    context = GraderContext(python_timeout_s=3.0, python_memory_mb=512)
    children_before = _children()

    async def run_all() -> dict:
        results = await asyncio.gather(*(
            grade_async(
                {"type": "multi", "graders": {"probe": _python(source)}, "calculate_output": "probe"},
                {"output_text": "42"}, {"id": "i1"}, context=context,
            )
            for source in attacks.values()
        ))  # fmt: skip
        return dict(zip(attacks, results, strict=True))

    try:
        started = time.monotonic()
        results = asyncio.run(run_all())
        elapsed = time.monotonic() - started
    finally:
        stop.set()
        acceptor.join(timeout=5)
        listener.close()

    errors = {name: result.errors for name, result in results.items()}
    assert all(result.reward is None for result in results.values()), errors
    assert "Permission denied" in json.dumps(errors["socket"]), errors["socket"]
    assert "Operation not permitted" in json.dumps(errors["fork_bomb"]), errors["fork_bomb"]
    assert "MemoryError" in json.dumps(errors["memory"]), errors["memory"]
    assert "timeout" in json.dumps(errors["busy_loop"]), errors["busy_loop"]
    assert accepted == []  # nothing ever connected to the live server
    assert elapsed < 30  # the busy loop was killed at its limit, not waited for
    assert _children() == children_before  # no grader process (or fork) left behind


def _children() -> set[int]:
    """Child processes of this test process (Linux /proc)."""
    me = str(os.getpid())
    found = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if (entry / "stat").read_text().rsplit(")", 1)[1].split()[1] == me:
                    found.add(int(entry.name))
            except (OSError, IndexError):
                continue
    return found


# --- allowlist and body caps -----------------------------------------------------------------------


def test_config_refuses_endpoints_outside_its_allowlist_at_load_time() -> None:
    """Checked when the config loads, so every stage (baseline and evaluation too, whose
    tool clients are built without the allowlist) is protected, not only training."""
    endpoint = {"name": "search", "server_url": "http://127.0.0.1:8765/tools/search"}
    with pytest.raises(ConfigError, match=r"job\.yaml: tools\.endpoints\[0\]\.server_url: host '127\.0\.0\.1'"):
        config_from_dict(
            merge_overrides(REQUIRED, {"tools": {"endpoints": [endpoint], "allowed_hosts": ["localhost"]}}),
            source="job.yaml",
        )
    allowed = config_from_dict(merge_overrides(REQUIRED, {"tools": {"endpoints": [endpoint],
                                                                     "allowed_hosts": ["127.0.0.1"]}}))
    assert allowed.tools.allowed_hosts == ["127.0.0.1"]


@pytest.mark.integration
def test_tool_client_allowlist_and_1mb_caps_against_the_real_server(corpus: Path, index: SearchIndex) -> None:
    generous = create_app(corpus, index=index, max_output_chars=10 * BIG_CHARS)
    demo_like = create_app(corpus, index=index)  # the demo's max_output_chars (2000)
    unbounded_calculator = {
        "type": "function",
        "function": {"name": "calculator", "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}}},
    }  # fmt: skip
    trace_id = new_trace_id()

    async def go(big_url: str, demo_url: str) -> dict:
        outcomes = {}
        # Hostnames are compared as written: "localhost" does not admit 127.0.0.1.
        for allowed in (["tools.internal"], ["localhost"]):
            with pytest.raises(ConfigError, match="is not in allowed_hosts"):
                ToolClient(endpoints_at(big_url), TOOL_SCHEMAS, allowed_hosts=allowed)
        async with ToolClient(endpoints_at(big_url), TOOL_SCHEMAS, allowed_hosts=["127.0.0.1"], backoff_s=0.01) as client:
            with pytest.raises(InfraError) as too_big:
                await client.call("cat", json.dumps({"path": BIG_PAGE}), item={"id": "i"}, trace_id=trace_id)
            outcomes["answer_too_big"] = too_big.value
            with pytest.raises(DataError) as fat_item:
                await client.call("list", '{"path": "reports"}', item={"id": "fat", "blob": "x" * 1_100_000}, trace_id=trace_id)
            outcomes["item_too_big"] = fat_item.value
        async with ToolClient(endpoints_at(big_url), [unbounded_calculator]) as client:
            outcomes["arguments_too_big"] = await client.call(
                "calculator", json.dumps({"expression": "1+" * 600_000 + "1"}), item={"id": "i"}, trace_id=trace_id
            )
        async with ToolClient(endpoints_at(demo_url), TOOL_SCHEMAS, max_output_chars=500) as client:
            outcomes["cut"] = await client.call("cat", json.dumps({"path": BIG_PAGE}), item={"id": "i"}, trace_id=trace_id)
        return outcomes

    with serve_in_thread(generous) as big_url, serve_in_thread(demo_like) as demo_url:
        outcomes = asyncio.run(go(big_url, demo_url))
        big_trace = traces(big_url, trace_id).json()

    answer_too_big = outcomes["answer_too_big"]
    assert answer_too_big.attempts == 1 and "max_body_bytes=1000000" in str(answer_too_big)
    assert "item 'fat'" in str(outcomes["item_too_big"])
    refused = outcomes["arguments_too_big"]
    assert refused.error == "request_too_large" and refused.attempts == 0
    assert "over the 1000000-byte limit" in refused.output
    # Only the oversized answer reached the server: the oversized requests were never sent.
    assert [call["name"] for call in big_trace["calls"]] == ["cat"]
    cut = outcomes["cut"]
    assert cut.error is None and cut.truncated
    assert cut.output.startswith("BIG Corp annual report 2020")
    assert cut.output.endswith("more chars]") and len(cut.output) < 600


# --- tool state per trace_id ------------------------------------------------------------------------


@pytest.mark.integration
def test_rollouts_see_only_their_own_trace(corpus: Path, index: SearchIndex) -> None:
    rollouts = {new_trace_id(): f"reports/ACME/{year}" for year in sorted(os.listdir(corpus / "reports/ACME"))}
    assert len(rollouts) >= 2 and len(set(rollouts)) == len(rollouts)

    async def rollout(client: ToolClient, trace_id: str, folder: str) -> list:
        results = []
        for step in range(3):  # interleaved with the other rollouts at every await
            calls = [("list", json.dumps({"path": folder}), None),
                     ("calculator", json.dumps({"expression": f"{step}+{len(folder)}"}), None)]  # fmt: skip
            results += await client.call_many(calls, item={"id": trace_id}, trace_id=trace_id)
        # The model's tools cannot reach another rollout's record.
        other = next(t for t in rollouts if t != trace_id)
        for name, path in (("cat", f"traces/{other}"), ("list", "/traces"), ("cat", f"../../traces/{other}")):
            results.append(await client.call(name, json.dumps({"path": path}), item={"id": trace_id}, trace_id=trace_id))
        return results

    async def run_all(base_url: str) -> dict:
        async with ToolClient(endpoints_at(base_url), TOOL_SCHEMAS) as client:
            outputs = await asyncio.gather(*(rollout(client, t, f) for t, f in rollouts.items()))
        return dict(zip(rollouts, outputs, strict=True))

    with serve_in_thread(create_app(corpus, index=index)) as base_url:
        results = asyncio.run(run_all(base_url))
        records = {trace_id: traces(base_url, trace_id).json() for trace_id in rollouts}

    for trace_id, folder in rollouts.items():
        calls = records[trace_id]["calls"]
        assert len(calls) == 9 and records[trace_id]["trace_id"] == trace_id
        listed = [c["arguments"]["path"] for c in calls if c["name"] == "list" and c["status_code"] == 200]
        assert listed == [folder] * 3  # only this rollout's own calls
        sums = [c["output"] for c in calls if c["name"] == "calculator"]
        assert sums == [str(step + len(folder)) for step in range(3)]
        probes = results[trace_id][-3:]
        assert [p.error for p in probes] == ["http_4xx"] * 3
        # Refused as paths outside the corpus or pages that do not exist: nothing else.
        expected = ("no such page", "absolute path", "'..' is not allowed")
        assert [any(text in p.output for text in expected) for p in probes] == [True] * 3
