"""The servers this project starts: API keys, and loopback unless told otherwise.

The demo tool server (its `/traces` show what every rollout did) and the model server
(`serve-model`) take an API key; with one set, every request without it is refused
with 401, `Authorization: Bearer <key>` and `x-api-key: <key>` are both accepted, and
only `/health` stays open. Both run here for real on loopback and are spoken to by the
real clients (the project's tool client, the official `openai` client). Every way of
starting a server binds to 127.0.0.1 unless a host is given.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import socket
from pathlib import Path

import httpx
import openai
import psutil
import pytest
import typer.main
from fastapi import FastAPI

from envs.finqa import server as tool_server_module
from envs.finqa.server import create_app
from envs.finqa.tiny_model import build_model, tiny_config
from envs.finqa.tokenizer import build_tokenizer
from envs.finqa.tool_schemas import TOOL_NAMES, TOOL_SCHEMAS
from envs.tool_server import serve_in_thread
from flows.cli import app as cli
from tests.taught_model import copy_items
from trainer.api_key import resolve_api_key
from trainer.config.tools import ToolEndpoint
from trainer.data import read_items
from trainer.errors import ConfigError
from trainer.generation.policy import Policy
from trainer.rollout.tool_client import ToolClient
from trainer.serving import model_server
from trainer.serving.model_server import create_model_app

pytestmark = pytest.mark.integration

KEY = "k3y-for-the-test-0123456789"
LOOPBACK = "127.0.0.1"


def wire(name: str, arguments: dict, trace_id: str) -> dict:
    return {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": name,
            "arguments": json.dumps(arguments), "item": {"id": "item"}, "trace_id": trace_id}


@pytest.fixture(scope="module")
def tool_server(demo_data_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("ports")
    (item,) = read_items(demo_data_dir / "train.jsonl", 1)
    copy_items(demo_data_dir, [item], root, "items.jsonl")
    with serve_in_thread(create_app(root / "corpus", api_key=KEY)) as url:
        yield url, item


def test_tool_server_refuses_requests_without_its_key(tool_server: tuple[str, dict]) -> None:
    url, item = tool_server
    company = Path(item["gold_pages"][0]).parts[1]  # the one company the copied corpus holds
    body = wire("list", {"path": "reports"}, "trace_keyed")
    for headers in ({}, {"Authorization": "Bearer wrong-key"}, {"x-api-key": "wrong-key"}, {"Authorization": KEY}):
        for method, path, payload in (("POST", "/tools/list", body), ("POST", "/call", body),
                                      ("POST", "/grade", {"sample": {}, "item": {}}),
                                      ("GET", "/traces/trace_keyed", None)):
            answer = httpx.request(method, url + path, json=payload, headers=headers)
            assert answer.status_code == 401, (path, headers)
            assert answer.json()["error"]["type"] == "authentication_error"
            assert KEY not in answer.text

    health = httpx.get(f"{url}/health")
    assert health.status_code == 200 and health.json()["status"] == "ok"

    for headers in ({"Authorization": f"Bearer {KEY}"}, {"x-api-key": KEY}):
        answer = httpx.post(f"{url}/tools/list", json=body, headers=headers)
        assert answer.status_code == 200 and answer.json()["output"] == f"{company}/"
    trace = httpx.get(f"{url}/traces/trace_keyed", headers={"x-api-key": KEY})
    assert trace.status_code == 200 and [c["name"] for c in trace.json()["calls"]] == ["list", "list"]


def test_tool_client_sends_the_key_from_the_environment(tool_server: tuple[str, dict], monkeypatch) -> None:
    url, item = tool_server
    monkeypatch.setenv("FINQA_TOOLS_KEY", KEY)

    async def call(headers: dict[str, str]) -> str:
        endpoints = [ToolEndpoint(name=name, server_url=f"{url}/tools/{name}", headers=headers)
                     for name in TOOL_NAMES]
        async with ToolClient(endpoints, TOOL_SCHEMAS, backoff_s=0.01) as client:
            result = await client.call("calculator", '{"expression": "6 * 7"}', item=item, trace_id="trace_env")
            return result.output if result.error is None else f"{result.error}: {result.output}"

    assert asyncio.run(call({"Authorization": "Bearer ${FINQA_TOOLS_KEY}"})) == "42"
    # without the key it is the caller's configuration that is wrong, not the model
    refused = asyncio.run(call({}))
    assert refused.startswith("http_4xx: Error 401")


def test_api_key_may_name_an_environment_variable(monkeypatch) -> None:
    monkeypatch.setenv("SERVE_KEY", KEY)
    assert resolve_api_key("${SERVE_KEY}") == KEY
    assert resolve_api_key("plain-key") == "plain-key" and resolve_api_key(None) is None
    monkeypatch.delenv("SERVE_KEY")
    with pytest.raises(ConfigError, match="SERVE_KEY"):
        resolve_api_key("${SERVE_KEY}")


@pytest.fixture(scope="module")
def model_server_url():
    tokenizer = build_tokenizer(["revenue grew 12% in 2021", "Answer: 3.5"] * 20, vocab_size=300)
    model = build_model(tiny_config(len(tokenizer), hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1,
                                    intermediate_size=32, pad_token_id=tokenizer.pad_token_id,
                                    eos_token_id=tokenizer.eos_token_id), seed=0)
    app = create_model_app(Policy(model=model, tokenizer=tokenizer, path="tiny"), model_name="tiny",
                           max_slots=2, max_len=256, api_key=KEY)
    with serve_in_thread(app) as url:
        yield url


def test_model_server_refuses_requests_without_its_key(model_server_url: str) -> None:
    url = model_server_url
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "revenue"}], "max_tokens": 2}
    for headers in ({}, {"Authorization": "Bearer wrong-key"}, {"x-api-key": "wrong-key"}):
        assert httpx.get(f"{url}/v1/models", headers=headers).status_code == 401
        assert httpx.post(f"{url}/v1/chat/completions", json=chat, headers=headers).status_code == 401
    assert httpx.get(f"{url}/health").status_code != 401  # open, even where it is not a route

    assert httpx.get(f"{url}/v1/models", headers={"x-api-key": KEY}).json()["data"][0]["id"] == "tiny"
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)  # sends Authorization: Bearer
    assert [m.id for m in client.models.list()] == ["tiny"]
    answer = client.chat.completions.create(model="tiny", messages=chat["messages"], max_tokens=2, temperature=0)
    assert answer.usage.completion_tokens >= 1
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{url}/v1", api_key="wrong-key", max_retries=0).models.list()


def _listening_on(port: int) -> list[str]:
    return [c.laddr.ip for c in psutil.net_connections(kind="inet")
            if c.status == psutil.CONN_LISTEN and c.laddr.port == port]


def test_servers_bind_to_loopback_by_default() -> None:
    app = FastAPI()
    with serve_in_thread(app) as url:
        port = int(url.rsplit(":", 1)[1])
        assert url == f"http://{LOOPBACK}:{port}"
        assert _listening_on(port) == [LOOPBACK]
        others = [a.address for addrs in psutil.net_if_addrs().values() for a in addrs
                  if a.family == socket.AF_INET and not a.address.startswith("127.")]
        for address in others:  # this machine's network addresses do not reach it
            with pytest.raises(OSError), socket.create_connection((address, port), timeout=2):
                pass

    def default_host(function) -> str:
        return inspect.signature(function).parameters["host"].default

    assert default_host(serve_in_thread) == LOOPBACK
    assert default_host(tool_server_module.serve) == LOOPBACK  # `agentrft env serve` calls it
    assert default_host(model_server.serve_model) == LOOPBACK  # `agentrft serve-model` calls it
    command = typer.main.get_command(cli)
    context = typer.Context(command)
    for path in (["serve-model"], ["env", "serve"], ["api"]):
        sub = command
        for name in path:
            sub = sub.get_command(context, name)
        (host,) = [p for p in sub.params if p.name == "host"]
        assert host.default == LOOPBACK, path

