"""`agentrft api` on a network: what a key holder can and cannot make the server do.

Each test drives the real app on loopback (the official `openai` SDK or plain HTTP) and
checks the server's files afterwards: bounded uploads streamed to disk, python graders
fenced off the server's files (and refused where the kernel offers no fence), jobs checked
when they are made, a job's grader and tools replacing the server's, and chat completions
past the queue answered 429.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
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
METHOD = {"type": "reinforcement", "reinforcement": {"grader": GRADER}}


def _app(tmp_path: Path, **api: object):
    from flows.openai_api.app import create_api_app
    from trainer.config.loading import config_from_dict

    config = config_from_dict({"work_dir": str(tmp_path / "runs"), "model": {"base_model": "tiny"}, "grader": GRADER,
                               "mlflow": {"tracking_uri": f"sqlite:///{tmp_path / 'mlflow.db'}"}, "api": api})
    return create_api_app(config, work_dir=tmp_path / "api", api_key=KEY)


@pytest.fixture()
def served(tmp_path):
    from envs.tool_server import serve_in_thread

    def serve(**api: object):
        return serve_in_thread(_app(tmp_path, **api))

    return serve


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)


def _left_behind(tmp_path: Path) -> list[str]:
    files = tmp_path / "api" / "files"
    return sorted(p.name for p in files.rglob("*") if p.is_file())


# --- uploads ----------------------------------------------------------------------------------


def test_an_upload_past_the_limit_is_a_413_and_leaves_nothing(served, tmp_path):
    with served(max_file_bytes=100_000) as url:
        client = _client(url)
        with pytest.raises(openai.APIStatusError) as refused:
            client.files.create(file=("big.jsonl", _rows(4000)), purpose="fine-tune")  # ~270 KB
        assert refused.value.status_code == 413
        error = _error(refused.value)
        assert (error["code"], error["param"]) == ("file_too_large", "file") and "100000 bytes" in error["message"]
        assert _left_behind(tmp_path) == [] and client.files.list().data == []
        small = client.files.create(file=("small.jsonl", _rows(50)), purpose="fine-tune")
        assert small.bytes == len(_rows(50)) and len(_left_behind(tmp_path)) == 2  # its blob and its record


def test_an_upload_is_checked_line_by_line_while_it_streams(served, tmp_path):
    with served() as url:
        client = _client(url)
        for content, where in ((_rows(2) + b"[1, 2]\n", "bad.jsonl:3"), (b"\xff\xfe\n", "bad.jsonl:1"),
                               (_rows(1) + b'{"unfinished": ', "bad.jsonl:2")):
            with pytest.raises(openai.BadRequestError) as refused:
                client.files.create(file=("bad.jsonl", content), purpose="fine-tune")
            assert where in _error(refused.value)["message"]
        answer = httpx.post(f"{url}/v1/files", headers={"Authorization": f"Bearer {KEY}"},
                            files={"file": ("x.jsonl", _rows(1))}, data={"purpose": "batch"})
        assert answer.status_code == 400 and answer.json()["error"]["param"] == "purpose"
        assert _left_behind(tmp_path) == []


def test_a_large_upload_streams_in_bounded_memory(tmp_path):
    """60 MB through a real `agentrft api` process: its memory grows by a few read buffers,
    not by the file (the old server held it about six times over)."""
    config = tmp_path / "api.yaml"
    config.write_text(json.dumps({"work_dir": str(tmp_path / "runs"), "model": {"base_model": "tiny"},
                                  "grader": GRADER, "mlflow": {"tracking_uri": f"sqlite:///{tmp_path / 'm.db'}"}}))
    script = tmp_path / "app_only.py"  # the app alone: no Prefect server needed to take files
    script.write_text(textwrap.dedent(f"""
        import sys, uvicorn
        from pathlib import Path
        from flows.openai_api.app import create_api_app
        from trainer.config.loading import load_config
        app = create_api_app(load_config({str(config)!r}), work_dir=Path({str(tmp_path / 'api')!r}), api_key=None)
        uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
    """))
    port = _free_port()
    server = subprocess.Popen([sys.executable, str(script), str(port)], cwd=REPO)
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_until(lambda: _answers(url), server)
        process = psutil.Process(server.pid)
        before = process.memory_info().rss
        line = json.dumps({"messages": [{"role": "user", "content": "x" * 900}]}).encode() + b"\n"
        body = line * (60_000_000 // len(line))
        peak = [before]
        stop = threading.Event()

        def watch() -> None:
            while not stop.is_set():
                peak[0] = max(peak[0], process.memory_info().rss)
                stop.wait(0.02)

        watcher = threading.Thread(target=watch)
        watcher.start()
        try:
            answer = httpx.post(f"{url}/v1/files", files={"file": ("big.jsonl", body)}, data={"purpose": "fine-tune"},
                                timeout=300)
        finally:
            stop.set()
            watcher.join()
        assert answer.status_code == 200 and answer.json()["bytes"] == len(body)
        assert peak[0] - before < 30_000_000, f"grew by {(peak[0] - before) / 1e6:.0f} MB for a 60 MB file"
    finally:
        server.terminate()
        server.wait(timeout=30)


def test_path_like_file_ids_are_not_found(served):
    with served() as url:
        headers = {"Authorization": f"Bearer {KEY}"}
        for file_id in ("..%2F..%2Fetc%2Fpasswd", "file-%00", "file-..%2F..%2Fmlflow.db", "%2Fetc%2Fpasswd"):
            for suffix in ("", "/content"):
                answer = httpx.get(f"{url}/v1/files/{file_id}{suffix}", headers=headers)
                assert answer.status_code == 404, (file_id, suffix, answer.text[:200])


# --- python graders --------------------------------------------------------------------------


def _python(source: str) -> dict:
    return {"type": "python", "name": "probe", "source": textwrap.dedent(source)}


def test_python_graders_cannot_read_or_write_the_servers_files(served, tmp_path, monkeypatch):
    monkeypatch.setenv("AGENTRFT_API_KEY", KEY)  # the server's key, in the server's environment
    outside = tmp_path / "outside.txt"
    store = tmp_path / "mlflow.db"
    store.write_bytes(b"SQLite format 3\x00" + b"\x00" * 100)
    hostile = {
        "passwd": "def grade(sample, item):\n    return float(len(open('/etc/passwd').read()) > 0)\n",
        "write": f"def grade(sample, item):\n    open({str(outside)!r}, 'w').write('x')\n    return 1.0\n",
        "store": f"def grade(sample, item):\n    return float(open({str(store)!r}, 'rb').read(6) == b'SQLite')\n",
    }
    with served() as url:
        client = _client(url)
        for name, source in hostile.items():
            run = client.fine_tuning.alpha.graders.run(grader=_python(source), model_sample="1", item={})
            assert run.reward == 0.0 and run.metadata.errors.python_grader_runtime_error, name
            assert "Permission denied" in run.metadata.errors.python_grader_runtime_error_details, name
        looks_for_the_key = "def grade(sample, item):\n    import os\n    return float(any('sk-test' in v for v in os.environ.values()))\n"
        assert client.fine_tuning.alpha.graders.run(grader=_python(looks_for_the_key), model_sample="1",
                                                    item={}).reward == 0.0  # the server's key is not in its env
        normal = "def grade(sample, item):\n    import math\n    return float(sample['output_text'] == item['ref'])\n"
        assert client.fine_tuning.alpha.graders.run(grader=_python(normal), model_sample="42",
                                                    item={"ref": "42"}).reward == 1.0
    assert not outside.exists() and store.read_bytes().startswith(b"SQLite format 3")


NO_LANDLOCK = textwrap.dedent("""
    # Start `agentrft api` in a process whose kernel interface has no Landlock: a seccomp
    # filter answers its three system calls with ENOSYS, as a kernel without it does.
    import ctypes, os, struct, sys
    program = [(0x20, 0, 0, 0)]  # load the system call number
    for number in (444, 445, 446):
        program.append((0x15, 0, 1, number))  # == number: next instruction, else skip it
        program.append((0x06, 0, 0, 0x00050000 | 38))  # ERRNO(ENOSYS)
    program.append((0x06, 0, 0, 0x7FFF0000))  # ALLOW
    filters = ctypes.create_string_buffer(b"".join(struct.pack("=HBBI", *op) for op in program))
    class Prog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]
    prog = Prog(len(program), ctypes.addressof(filters))
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    assert libc.prctl(38, 1, 0, 0, 0) == 0 and libc.prctl(22, 2, ctypes.addressof(prog), 0, 0) == 0
    os.execv(sys.executable, [sys.executable, *sys.argv[1:]])
""")


@pytest.mark.parametrize("allowed", [False, True])
def test_without_a_fence_python_graders_are_refused_unless_allowed(tmp_path, allowed):
    wrapper = tmp_path / "no_landlock.py"
    wrapper.write_text(NO_LANDLOCK)
    script = tmp_path / "app_only.py"
    script.write_text(textwrap.dedent(f"""
        import sys, uvicorn
        from pathlib import Path
        from flows.openai_api.app import create_api_app
        from trainer.config.loading import config_from_dict
        from trainer.graders.python_runner import landlock_abi
        assert landlock_abi() == 0  # the filter hides it
        config = config_from_dict({{"model": {{"base_model": "tiny"}}, "grader": {GRADER!r},
                                    "api": {{"allow_unfenced_python_graders": {allowed}}}}})
        app = create_api_app(config, work_dir=Path({str(tmp_path / 'api')!r}))
        uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
    """))
    port = _free_port()
    server = subprocess.Popen([sys.executable, str(wrapper), str(script), str(port)], cwd=REPO)
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_until(lambda: _answers(url), server)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        grader = _python("def grade(sample, item):\n    return 1.0\n")
        if allowed:
            assert client.fine_tuning.alpha.graders.run(grader=grader, model_sample="x", item={}).reward == 1.0
        else:
            with pytest.raises(openai.BadRequestError) as refused:
                client.fine_tuning.alpha.graders.run(grader=grader, model_sample="x", item={})
            error = _error(refused.value)
            assert error["code"] == "python_grader_unfenced" and "--allow-unfenced-python-graders" in error["message"]
            assert "Landlock" in error["message"]
            train = client.files.create(file=("t.jsonl", _rows(2)), purpose="fine-tune").id
            multi = {"type": "multi", "graders": {"p": grader}, "calculate_output": "p"}
            with pytest.raises(openai.BadRequestError) as in_a_job:
                client.fine_tuning.jobs.create(model=str(REPO / "envs" / "finqa" / "model"), training_file=train,
                                               method={"type": "reinforcement", "reinforcement": {"grader": multi}})
            assert _error(in_a_job.value)["code"] == "python_grader_unfenced"
    finally:
        server.terminate()
        server.wait(timeout=30)


# --- jobs --------------------------------------------------------------------------------------


def test_a_job_is_checked_when_it_is_made(served, tmp_path):
    model = str(REPO / "envs" / "finqa" / "model")
    with served(allowed_tool_hosts=["127.0.0.1"]) as url:
        client = _client(url)
        train = client.files.create(file=("t.jsonl", _rows(2)), purpose="fine-tune").id

        def refused(**body) -> dict:
            with pytest.raises(openai.BadRequestError) as exc:
                client.fine_tuning.jobs.create(training_file=train, **body)
            return _error(exc.value)

        for name in ("/etc", str(tmp_path / "nowhere"), "someone/unknown-model", "models:/nope@champion",
                     "ft:tiny:agentrft:x:000"):
            error = refused(model=name, method=METHOD)
            assert error["param"] == "model", (name, error)
        elsewhere = {"type": "reinforcement", "reinforcement": {"grader": GRADER, "tools": [
            {"name": "list", "server_url": "http://127.0.0.1:9/list"},
            {"name": "cat", "server_url": "https://tools.example.com/cat"}]}}
        error = refused(model=model, method=elsewhere)
        assert error["param"] == "method.reinforcement.tools[1].server_url" and "tools.example.com" in error["message"]
        assert client.fine_tuning.jobs.list().data == [] and not list((tmp_path / "api" / "jobs").iterdir())


GRADERS = {
    "string_check": {"type": "string_check", "name": "s", "input": "{{sample.output_text}}",
                     "reference": "{{item.reference_answer}}", "operation": "eq"},
    "text_similarity": {"type": "text_similarity", "name": "t", "input": "{{sample.output_text}}",
                        "reference": "{{item.reference_answer}}", "evaluation_metric": "fuzzy_match"},
    "score_model": {"type": "score_model", "name": "j", "model": "judge", "input": [
        {"role": "user", "content": "Score {{sample.output_text}} against {{item.reference_answer}}"}],
        "range": [0, 1]},
    "label_model": {"type": "label_model", "name": "l", "model": "judge", "input": [
        {"role": "user", "content": "Is {{sample.output_text}} right?"}], "labels": ["yes", "no"],
        "passing_labels": ["yes"]},
    "python": _python("def grade(sample, item):\n    return 1.0\n"),
    "multi": {"type": "multi", "name": "m", "graders": {"a": {"type": "string_check", "name": "a",
              "input": "{{sample.output_text}}", "reference": "{{item.reference_answer}}", "operation": "eq"}},
              "calculate_output": "a"},
    "endpoint": {"type": "endpoint", "name": "e", "url": "http://127.0.0.1:9/grade"},
}


@pytest.mark.parametrize("kind", sorted(GRADERS))
def test_a_jobs_grader_and_tools_replace_the_servers(kind, tmp_path):
    """On a server whose config grades with `numeric` and offers its own tool schemas, a job's
    grader of any OpenAI type arrives whole: no field of the server's grader in it, no error
    about fields it never sent; and its tools replace the server's endpoints and schemas."""
    from flows.openai_api.job_body import config_from_openai_job
    from trainer.config.loading import config_from_dict

    schema = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}
    base = config_from_dict({"model": {"base_model": "tiny"}, "grader": GRADER, "tools": {
        "endpoints": [{"name": "lookup", "server_url": "http://127.0.0.1:7/lookup"}], "schemas": [schema],
        "timeout_s": 30}}).model_dump(mode="json")
    data = tmp_path / "t.jsonl"
    data.write_bytes(_rows(2))
    job = {"model": "tiny", "training_file": str(data), "validation_file": str(data), "method": {
        "type": "reinforcement", "reinforcement": {"grader": GRADERS[kind], "tools": [
            {"name": "search", "server_url": "http://127.0.0.1:8/search"}]}}}
    config, _ = config_from_openai_job(job, source="job", base=base)
    assert config.grader == GRADERS[kind]
    assert [e.name for e in config.tools.endpoints] == ["search"] and config.tools.schemas is None
    assert config.tools.timeout_s == 30  # the server's client settings stay


# --- chat completions under load ------------------------------------------------------------


def test_chat_completions_past_the_queue_get_429(tmp_path):
    """Twelve concurrent requests on a served model with 2 slots and a queue of 2: the four
    the engine holds are answered, the rest get 429 with Retry-After; none is lost."""
    import asyncio

    from envs.tool_server import serve_in_thread
    from trainer.generation.policy import load_policy
    from trainer.serving.model_server import create_model_app

    policy = load_policy(str(REPO / "envs" / "finqa" / "model"), device="cpu", dtype="float32")
    app = create_model_app(policy, model_name="demo", max_slots=2, max_len=1024, max_queue=2)
    with serve_in_thread(app) as url:
        async def ask(http: httpx.AsyncClient) -> httpx.Response:
            return await http.post(f"{url}/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "What was ACME's revenue in 2019?"}], "max_tokens": 64})

        async def burst() -> list[httpx.Response]:
            async with httpx.AsyncClient(timeout=300) as http:
                return await asyncio.gather(*(ask(http) for _ in range(12)))

        answers = asyncio.run(burst())
    codes = sorted(a.status_code for a in answers)
    assert codes.count(200) >= 4 and set(codes) == {200, 429}, codes
    busy = next(a for a in answers if a.status_code == 429)
    assert busy.headers["Retry-After"] == "1" and busy.json()["error"]["type"] == "rate_limit_error"


# --- helpers -------------------------------------------------------------------------------------


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _answers(url: str) -> bool:
    try:
        return httpx.get(f"{url}/v1/files", headers={"Authorization": f"Bearer {KEY}"}, timeout=2).status_code in (
            200, 401)
    except httpx.HTTPError:
        return False


def _wait_until(check, process: subprocess.Popen, timeout: float = 120) -> None:
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert process.poll() is None, f"the server exited with {process.returncode}"
        if check():
            return
        time.sleep(0.5)
    raise AssertionError("the server did not answer")



