"""What a key holder can make `agentrft api` call, and how much it must read.

One server for the module, configured as an operator who listed only the tool server's
port did (`api.allowed_tool_hosts: [127.0.0.1:8767, 127.0.0.1]`, the old name, read as
`api.allowed_hosts`), and a listener on 127.0.0.9 standing for an internal service nobody
allowed: it records every request that reaches it. Each test sends what a key holder can
send and checks the listener afterwards. Bodies past `api.max_json_bytes` are sent over a
raw socket, so the test sees the 413 arrive before the body is sent.
"""

from __future__ import annotations

import http.server
import json
import select
import socket
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import openai
import psutil
import pytest

from tests.flows.test_openai_api import _error, _rows
from tests.taught_model import GRADER

REPO = Path(__file__).resolve().parents[2]
KEY = "sk-test-agentrft"
MODEL = str(REPO / "envs" / "finqa" / "model")
AUTH = {"Authorization": f"Bearer {KEY}"}


class _Recorder(http.server.BaseHTTPRequestHandler):
    """Answers every POST as a judge, an endpoint grader and a tool would (so a request that
    gets through is paid), and records it; `/redirect` sends the client elsewhere."""

    seen: list[str]
    redirect_to = ""

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.seen.append(self.path)
        if self.path.startswith("/redirect"):
            self.send_response(307)
            self.send_header("Location", self.redirect_to)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        body = json.dumps({"score": 1.0, "output": "ok", "choices": [{"message": {
            "role": "assistant", "content": json.dumps({"result": 1.0, "steps": []})}, "finish_reason": "stop"}]})
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body.encode())

    def log_message(self, *args: object) -> None:
        pass


def _listener(host: str):
    handler = type("Handler", (_Recorder,), {"seen": []})
    server = http.server.ThreadingHTTPServer((host, 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, handler


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """(api url, internal listener's url, what it saw, allowed listener's url, the app's state)."""
    from envs.tool_server import serve_in_thread
    from flows.openai_api.app import create_api_app
    from trainer.config.loading import config_from_dict

    tmp = tmp_path_factory.mktemp("outbound")
    internal, internal_seen = _listener("127.0.0.9")
    allowed, allowed_seen = _listener("127.0.0.1")
    internal_url = f"http://127.0.0.9:{internal.server_port}"
    allowed_seen.redirect_to = f"{internal_url}/after-redirect"
    config = config_from_dict({"work_dir": str(tmp / "runs"), "model": {"base_model": "tiny"}, "grader": GRADER,
                               "mlflow": {"tracking_uri": f"sqlite:///{tmp / 'mlflow.db'}"},
                               "api": {"allowed_tool_hosts": ["127.0.0.1:8767", "127.0.0.1"]}})
    app = create_api_app(config, work_dir=tmp / "api", api_key=KEY)
    try:
        with serve_in_thread(app) as url:
            yield {"url": url, "internal": internal_url, "seen": internal_seen.seen,
                   "allowed": f"http://127.0.0.1:{allowed.server_port}", "allowed_seen": allowed_seen.seen,
                   "api": app.state.api, "tmp": tmp}
    finally:
        internal.shutdown()
        allowed.shutdown()


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)


def _endpoint(url: str) -> dict:
    return {"type": "endpoint", "name": "e", "url": url}


def _judge(base_url: str) -> dict:
    return {"type": "score_model", "name": "j", "model": "judge", "base_url": base_url,
            "input": [{"role": "user", "content": "Score {{sample.output_text}}"}]}


def _refused(call) -> dict:
    with pytest.raises(openai.BadRequestError) as refused:
        call()
    error = _error(refused.value)
    assert error["code"] == "host_not_allowed", error
    return error


# --- the rows: each was sent to the listener or accepted before -----------------------------


def test_graders_run_and_validate_do_not_call_an_internal_host(world):
    client, internal = _client(world["url"]), world["internal"]
    graders = client.fine_tuning.alpha.graders
    for grader, param in ((_endpoint(f"{internal}/grade"), "grader.url"),
                          (_judge(f"{internal}/v1"), "grader.base_url"),
                          ({"type": "multi", "name": "m", "graders": {"inner": _endpoint(f"{internal}/grade")},
                            "calculate_output": "inner"}, "grader.graders.inner.url")):
        error = _refused(lambda g=grader: graders.run(grader=g, model_sample="1", item={}))
        assert error["param"] == param and "127.0.0.9" in error["message"], error
        assert _refused(lambda g=grader: graders.validate(grader=g))["param"] == param
    # The same names through a decimal host name (2130706441 is 127.0.0.9 to the resolver).
    disguised = internal.replace("127.0.0.9", "2130706441")
    error = _refused(lambda: graders.run(grader=_endpoint(f"{disguised}/grade"), model_sample="1", item={}))
    assert "resolves to 127.0.0.9" in error["message"]
    # The metadata address is refused on any port, whatever the grader says it allows.
    metadata = {**_endpoint("http://169.254.169.254/latest"), "allowed_hosts": ["0.0.0.0/0"]}
    assert "link-local or metadata" in _refused(lambda: graders.run(grader=metadata, model_sample="1",
                                                                     item={}))["message"]
    assert world["seen"] == []
    # An allowed host is still called, and graded.
    run = graders.run(grader=_endpoint(f"{world['allowed']}/grade"), model_sample="1", item={})
    assert run.reward == 1.0 and world["allowed_seen"][-1] == "/grade"


def test_a_redirect_to_an_internal_host_is_not_followed(world):
    run = _client(world["url"]).fine_tuning.alpha.graders.run(
        grader=_endpoint(f"{world['allowed']}/redirect"), model_sample="1", item={})
    assert run.metadata.errors.unresponsive_reward_error and "307" in run.metadata.error_messages[
        "endpoint_grader_server_error"]
    assert world["allowed_seen"][-1] == "/redirect" and world["seen"] == []


def test_a_job_naming_an_internal_host_is_refused_when_made(world):
    client, internal = _client(world["url"]), world["internal"]
    train = client.files.create(file=("t.jsonl", _rows(2)), purpose="fine-tune").id

    def job(grader: dict, tools: list | None = None):
        rft = {"grader": grader, **({"tools": tools} if tools else {})}
        return lambda: client.fine_tuning.jobs.create(model=MODEL, training_file=train,
                                                      method={"type": "reinforcement", "reinforcement": rft})

    for grader, tools, param in (
            (_endpoint(f"{internal}/grade"), None, "method.reinforcement.grader.url"),
            (_judge(f"{internal}/v1"), None, "method.reinforcement.grader.base_url"),
            (GRADER, [{"name": "lookup", "server_url": f"{internal}/lookup"}],
             "method.reinforcement.tools[0].server_url"),
            (GRADER, [{"name": "lookup", "server_url": "http://127.0.0.1:8767/lookup"},
                      {"name": "meta", "server_url": "http://169.254.169.254/x"}],
             "method.reinforcement.tools[1].server_url")):
        assert _refused(job(grader, tools))["param"] == param
    assert client.fine_tuning.jobs.list().data == [] and not list((world["tmp"] / "api" / "jobs").iterdir())
    assert world["seen"] == []


def test_the_policy_travels_with_the_jobs_config_to_any_worker(world):
    """The config a job runs with carries the server's list in its tools and HTTP graders,
    whatever the body said: a worker that has only the config (a fresh process here, no API
    around it) refuses the internal host at connect time."""
    from flows.openai_api.jobs import job_config

    api = world["api"]
    train = api.files.commit(_upload(api, _rows(2)), "fine-tune")["id"]
    grader = {**_endpoint("http://127.0.0.1:8767/grade"), "allowed_hosts": ["0.0.0.0/0"]}
    body = {"model": MODEL, "training_file": train, "validation_file": train, "method": {"type": "reinforcement", "reinforcement": {
        "grader": {"type": "multi", "name": "m", "graders": {"e": grader}, "calculate_output": "e"},
        "tools": [{"name": "lookup", "server_url": "http://127.0.0.1:8767/lookup"}]}}}
    config, _ = job_config(body, api.files, api.base, base_model=MODEL, policy=api.outbound)
    entries = ["127.0.0.1:8767", "127.0.0.1"]
    assert config.grader["graders"]["e"]["allowed_hosts"] == entries and config.tools.allowed_hosts == entries
    worker = world["tmp"] / "worker.py"
    worker.write_text(WORKER)
    run = subprocess.run([sys.executable, str(worker), json.dumps(config.model_dump(mode="json")),
                          world["internal"].replace("127.0.0.9", "2130706441")], cwd=REPO, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    grader_error, tool_error = json.loads(run.stdout.splitlines()[-1])
    assert "resolves to 127.0.0.9" in grader_error, grader_error
    assert "not in allowed_hosts" in tool_error and "2130706441" in tool_error, tool_error
    assert world["seen"] == []


# The job's grader and tool client, as a training worker makes them from the job's config
# alone, with the URLs pointed at a name that now resolves to the internal listener.
WORKER = """
import asyncio, json, sys
from trainer.config.pipeline import PipelineConfig
from trainer.config.tools import ToolEndpoint
from trainer.graders import grade, sample_from_text
from trainer.rollout.tool_client import ToolClient

config, moved = PipelineConfig.model_validate(json.loads(sys.argv[1])), sys.argv[2]
grader = config.grader
grader["graders"]["e"]["url"] = moved + "/grade"
result = grade(grader, sample_from_text("1"), {})

async def call():
    endpoint = ToolEndpoint(name="lookup", server_url=moved + "/lookup")
    client = ToolClient.from_config(config.tools, [endpoint])
    async with client:
        return await client.transport.post(client._tools["lookup"], b"{}")

try:
    asyncio.run(call())
    tool = "called"
except Exception as exc:
    tool = str(exc)
print(json.dumps([json.dumps(result.errors), tool]))
"""


def _upload(api, content: bytes):
    upload = api.files.begin("t.jsonl")
    upload.write(content)
    return upload


def test_the_default_is_loopback_and_the_servers_own_hosts_and_any_host_opens_it(tmp_path):
    from flows.openai_api.service import outbound_policy
    from trainer.config.loading import config_from_dict

    config = config_from_dict({"model": {"base_model": "tiny"}, "grader": _judge("https://judge.example:8443/v1"),
                               "tools": {"endpoints": [{"name": "t", "server_url": "http://tools.internal:7000/t"}]}})
    policy = outbound_policy(config)
    assert policy.entries == ("127.0.0.1", "::1", "localhost", "tools.internal:7000", "judge.example:8443")
    for url, refused in (("http://127.0.0.1:4200/api", False), ("http://localhost:9/x", False),
                         ("http://tools.internal:7000/t", False), ("http://tools.internal:7001/t", True),
                         ("https://judge.example:8443/v1", False), ("http://127.0.0.9:80/", True),
                         ("http://169.254.169.254/", True), ("http://[fe80::1]/", True),
                         ("http://[fd00:ec2::254]/", True), ("http://[::ffff:127.0.0.9]/", True)):
        assert (policy.url_refusal(url) is not None) == refused, url
    assert outbound_policy(config.model_copy(update={"api": config.api.model_copy(
        update={"allow_any_host": True})})) is None


def test_allow_any_host_lets_graders_run_call_the_internal_host(world):
    """The other side of the gate: on a server started with --allow-any-host
    (api.allow_any_host) the same grader reaches the listener and is paid."""
    from envs.tool_server import serve_in_thread
    from flows.openai_api.app import create_api_app
    from trainer.config.loading import config_from_dict

    tmp = world["tmp"] / "any"
    config = config_from_dict({"work_dir": str(tmp / "runs"), "model": {"base_model": "tiny"}, "grader": GRADER,
                               "mlflow": {"tracking_uri": f"sqlite:///{tmp / 'mlflow.db'}"},
                               "api": {"allow_any_host": True}})
    with serve_in_thread(create_api_app(config, work_dir=tmp / "api", api_key=KEY)) as url:
        run = _client(url).fine_tuning.alpha.graders.run(grader=_endpoint(f"{world['internal']}/open"),
                                                         model_sample="1", item={})
    assert run.reward == 1.0 and world["seen"] == ["/open"]
    world["seen"].clear()


def test_link_local_needs_an_explicit_entry():
    from trainer.outbound import HostPolicy

    for entries, allowed in ((["0.0.0.0/0", "::/0"], False), (["169.0.0.0/8"], False),
                             (["169.254.169.254"], True), (["169.254.0.0/16"], True),
                             (["169.254.169.254:8080"], False)):
        assert (HostPolicy(entries).url_refusal("http://169.254.169.254/latest") is None) == allowed, entries
    assert HostPolicy(["fd00:ec2::254"]).url_refusal("http://[fd00:ec2::254]/") is None
    assert HostPolicy(["0.0.0.0/0"]).url_refusal("http://10.1.2.3/") is None


def test_bad_entries_are_config_errors_naming_the_entry():
    from trainer.config.loading import config_from_dict
    from trainer.errors import ConfigError

    for bad in ("10.0.0.0/33", "host:99999", "a b", ""):
        with pytest.raises(ConfigError, match=r"api\.allowed_hosts\[1\]"):
            config_from_dict({"model": {"base_model": "tiny"}, "api": {"allowed_hosts": ["127.0.0.1", bad]}})
    with pytest.raises(ConfigError, match="old name"):
        config_from_dict({"model": {"base_model": "tiny"}, "api": {"allowed_hosts": ["a"],
                                                                    "allowed_tool_hosts": ["b"]}})


def test_a_connection_is_checked_on_the_address_the_name_resolves_to(world):
    """The connect-time check alone (no URL check before it): a name that resolves to a
    refused address is refused when the connection is made, and nothing reaches it."""
    import asyncio

    from trainer.outbound import HostPolicy, OutboundRefused, policed_client

    port = world["internal"].rsplit(":", 1)[1]

    async def post(url: str) -> int:
        async with policed_client([HostPolicy(["127.0.0.1"])]) as client:
            return (await client.post(url, json={})).status_code

    for name in ("2130706441", "127.9", "0x7f000009"):  # the resolver's forms of 127.0.0.9
        with pytest.raises(OutboundRefused, match="resolves to 127.0.0.9"):
            asyncio.run(post(f"http://{name}:{port}/x"))
    assert asyncio.run(post(f"http://localhost:{world['allowed'].rsplit(':', 1)[1]}/x")) == 200
    assert world["seen"] == []


# --- bodies ------------------------------------------------------------------------------------


def send_big(url: str, path: str, *, total: int, chunked: bool, headers: dict | None = None) -> tuple[int, int]:
    """POST a `total`-byte JSON body over a raw socket, checking for an answer after every
    64 KiB; returns (status, bytes of the body sent when the answer arrived)."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    lines = [f"POST {path} HTTP/1.1", f"Host: {host}", "Content-Type: application/json",
             *(f"{k}: {v}" for k, v in (headers or {}).items()),
             "Transfer-Encoding: chunked" if chunked else f"Content-Length: {total}"]
    piece = b'{"pad": "' + b"x" * (64 * 1024 - 12) + b'"}\n'
    sent = 0
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall("\r\n".join(lines).encode() + b"\r\n\r\n")
        while sent < total:
            if select.select([sock], [], [], 0)[0]:
                break
            data = f"{len(piece):x}\r\n".encode() + piece + b"\r\n" if chunked else piece
            try:
                sock.sendall(data)
            except OSError:
                break
            sent += len(piece)
        answer = b""
        while b"\r\n" not in answer:
            answer += sock.recv(4096) or b"\r\n"
    return int(answer.split(b" ")[1]), sent


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_a_64_mb_json_body_gets_a_413_before_it_is_sent(world, chunked):
    process = psutil.Process()
    before = process.memory_info().rss
    for path in ("/v1/fine_tuning/jobs", "/v1/fine_tuning/alpha/graders/run", "/v1/chat/completions"):
        status, sent = send_big(world["url"], path, total=64 * 1024 * 1024, chunked=chunked, headers=AUTH)
        assert status == 413 and sent < 16 * 1024 * 1024, (path, status, sent)
    assert process.memory_info().rss - before < 32 * 1024 * 1024
    # Under the limit, a body is read as before; without the key, still a 401 first.
    answer = httpx.post(f"{world['url']}/v1/fine_tuning/alpha/graders/validate", headers=AUTH,
                        json={"grader": GRADER, "pad": "x" * 500_000})
    assert answer.status_code == 200
    assert send_big(world["url"], "/v1/fine_tuning/jobs", total=8 * 1024 * 1024, chunked=chunked)[0] == 401
    refused = httpx.post(f"{world['url']}/v1/fine_tuning/jobs", headers=AUTH, content=b"{" + b" " * 2_000_000 + b"}")
    assert refused.status_code == 413 and refused.json()["error"]["code"] == "request_too_large"
    assert "api.max_json_bytes" in refused.json()["error"]["message"]
