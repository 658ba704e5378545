"""`agentrft api` driven by the official `openai` SDK (unmodified: only base_url and api_key).

The fast tests serve the API app on loopback with no Prefect server: files, graders, auth
and the job bodies refused before anything is stored. The integration test starts
`agentrft api` itself on Prefect's test harness over the micro world (tests/pipeline_world.py:
two training, two validation and six test items, three GRPO steps from the server's config)
and runs the whole client script: upload, create, pause, resume, kill -9 and restart, poll, events,
checkpoints, graders, models, chat with tool calls, and a second job cancelled.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import openai
import psutil
import pytest
import yaml

from tests.pipeline_world import JOB_TOOLS, job_rows, micro
from tests.taught_model import GRADER, SYSTEM, TOOLS

REPO = Path(__file__).resolve().parents[2]
KEY = "sk-test-agentrft"
MODEL = str(REPO / "envs" / "finqa" / "model")  # a model folder: a job's model is checked when it is made


@pytest.fixture()
def api_client(tmp_path):
    from envs.tool_server import serve_in_thread
    from flows.openai_api.app import create_api_app
    from trainer.config.loading import config_from_dict

    config = config_from_dict({"work_dir": str(tmp_path / "runs"), "model": {"base_model": "tiny"}, "grader": GRADER})
    with serve_in_thread(create_api_app(config, work_dir=tmp_path / "api", api_key=KEY)) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0), url, tmp_path


def _rows(n: int) -> bytes:
    return b"".join(json.dumps({"messages": [{"role": "user", "content": f"q{i}"}], "reference_answer": str(i)})
                    .encode() + b"\n" for i in range(n))


def _error(exc: openai.APIStatusError) -> dict:
    body = exc.response.json()
    assert set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]


def test_files_are_stored_once_listed_paged_and_deleted(api_client):
    client, _, tmp_path = api_client
    first = client.files.create(file=("train.jsonl", _rows(3)), purpose="fine-tune")
    second = client.files.create(file=("again.jsonl", _rows(3)), purpose="fine-tune")
    third = client.files.create(file=("other.jsonl", _rows(2)), purpose="fine-tune")
    assert (first.status, first.bytes, first.filename, first.purpose) == ("processed", len(_rows(3)), "train.jsonl",
                                                                        "fine-tune")
    assert len(list((tmp_path / "api" / "files" / "blobs").iterdir())) == 2  # same bytes, one blob
    page = client.files.list(limit=2)
    assert len(page.data) == 2 and page.has_more
    assert {f.id for f in page} == {first.id, second.id, third.id}  # the SDK follows `after`
    assert client.files.retrieve(second.id).filename == "again.jsonl"
    assert client.files.content(first.id).content == _rows(3)
    assert client.files.delete(first.id).deleted
    assert client.files.content(second.id).content == _rows(3)  # the blob stays for the other upload
    with pytest.raises(openai.NotFoundError) as missing:
        client.files.retrieve(first.id)
    assert _error(missing.value)["code"] == "not_found"


def test_a_file_that_is_not_jsonl_is_refused_at_upload_with_its_line(api_client):
    client, _, tmp_path = api_client
    with pytest.raises(openai.BadRequestError) as refused:
        client.files.create(file=("bad.jsonl", _rows(2) + b"{not json\n"), purpose="fine-tune")
    error = _error(refused.value)
    assert error["code"] == "invalid_file_format" and error["param"] == "file"
    assert "bad.jsonl:3" in error["message"]
    assert client.files.list().data == [] and list((tmp_path / "api" / "files" / "blobs").iterdir()) == []


def test_graders_validate_and_run_with_openai_error_flags(api_client):
    client, _, _ = api_client
    grader = {"type": "string_check", "name": "exact", "operation": "eq", "input": "{{sample.output_text}}",
              "reference": "{{item.answer}}"}
    assert client.fine_tuning.alpha.graders.validate(grader=grader).grader.name == "exact"
    run = client.fine_tuning.alpha.graders.run(grader=grader, model_sample="42", item={"answer": "42"})
    assert run.reward == 1.0 and not any(run.metadata.errors.model_dump(exclude_none=True).values())
    # The numeric grader cannot parse this reference: our reference_parse_error, OpenAI's other_error.
    run = client.fine_tuning.alpha.graders.run(grader=GRADER, model_sample="Answer: 3", item={"reference_answer": "n/a"})
    assert run.reward == 0.0 and run.metadata.errors.other_error and not run.metadata.errors.sample_parse_error
    with pytest.raises(openai.BadRequestError) as unknown:
        client.fine_tuning.alpha.graders.validate(grader={"type": "no_such_grader", "name": "x"})
    assert _error(unknown.value)["code"] == "invalid_grader"


def test_bad_job_bodies_get_openai_errors_and_leave_nothing(api_client):
    client, url, tmp_path = api_client
    train = client.files.create(file=("train.jsonl", _rows(2)), purpose="fine-tune").id
    method = {"type": "reinforcement", "reinforcement": {"grader": GRADER}}

    def refused(**body) -> dict:
        with pytest.raises(openai.BadRequestError) as exc:
            client.fine_tuning.jobs.create(model=MODEL, training_file=train, **body)
        return _error(exc.value)

    assert refused(method={"type": "distillation"})["param"] == "method.type"
    dpo = refused(method={"type": "dpo", "dpo": {}})
    assert dpo["param"] == "method.type" and "'dpo'" in dpo["message"] and "'reinforcement'" in dpo["message"]
    bad_grader = {"type": "reinforcement", "reinforcement": {"grader": {"type": "no_such_grader", "name": "x"}}}
    assert refused(method=bad_grader)["code"] == "invalid_grader"
    no_url = {"type": "reinforcement", "reinforcement": {"grader": GRADER, "tools": [{"name": "list"}]}}
    assert refused(method=no_url)["param"] == "method.reinforcement.tools[0].server_url"
    assert refused(method=method, validation_file="file-nope")["param"] == "validation_file"
    assert client.fine_tuning.jobs.list().data == [] and list((tmp_path / "api" / "jobs").iterdir()) == []
    with pytest.raises(openai.NotFoundError) as unknown:
        client.fine_tuning.jobs.retrieve("ftjob-nope")
    assert _error(unknown.value)["code"] == "not_found"
    for key in (None, "sk-wrong"):
        import httpx

        headers = {"Authorization": f"Bearer {key}"} if key else {}
        answer = httpx.get(f"{url}/v1/fine_tuning/jobs", headers=headers)
        assert answer.status_code == 401 and answer.json()["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{url}/v1", api_key="sk-wrong", max_retries=0).models.list()


def test_rft_content_checks_fail_the_job_in_validating_files_naming_file_and_line(api_client):
    client, _, _ = api_client
    rows = _rows(3).splitlines()
    rows[1] = json.dumps({"messages": [], "reference_answer": "1"}).encode()  # line 2: no messages
    train = client.files.create(file=("train.jsonl", b"\n".join(rows) + b"\n"), purpose="fine-tune")
    valid = client.files.create(file=("valid.jsonl", _rows(2)), purpose="fine-tune")
    job = client.fine_tuning.jobs.create(model=MODEL, training_file=train.id, validation_file=valid.id,
                                         method={"type": "reinforcement", "reinforcement": {"grader": GRADER}})
    assert job.status == "validating_files"
    failed = _wait("validation", lambda: (lambda j: j if j.status != "validating_files" else None)(
        client.fine_tuning.jobs.retrieve(job.id)), 60, every=0.2)
    assert failed.status == "failed" and failed.error.param == "training_file"
    assert failed.error.code == "invalid_training_file"
    assert f"{train.id} (train.jsonl) line 2: messages_well_formed" in failed.error.message
    assert failed.prefect_flow_run_ids == []  # no pipeline run was started
    for action in (client.fine_tuning.jobs.pause, client.fine_tuning.jobs.resume, client.fine_tuning.jobs.cancel):
        with pytest.raises(openai.BadRequestError) as refused:
            action(job.id)
        assert _error(refused.value)["code"] == "invalid_state"
    events = [e.message for e in client.fine_tuning.jobs.list_events(job.id)]
    assert any(m.startswith("The job failed: training_file") for m in events) and failed.finished_at


# --- the whole client script on the real pipeline -------------------------------------------------


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait(what: str, check, timeout: float, process: subprocess.Popen | None = None, every: float = 2.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise AssertionError(f"agentrft api exited with {process.returncode} while waiting for {what}")
        value = check()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"timed out waiting for {what}")


def _alive(pids: list[int]) -> list[int]:
    alive = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                alive.append(pid)
        except psutil.NoSuchProcess:
            pass
    return alive


@pytest.mark.integration
@pytest.mark.timeout(1200)  # three pipeline runs (one paused, one cancelled) on a shared 2-core machine
def test_openai_sdk_runs_a_reinforcement_job_end_to_end(harness, world, endpoints, taught_model):
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, PREFECT_LOCAL_STORAGE_PATH

    config_file = world / "api.yaml"
    # The job sets the learning rate (a multiplier, replacing the config's absolute rate): small
    # enough that three steps keep the taught model's habit of listing a folder first, so chat
    # can show a tool call.
    server_config = micro(world, endpoints, taught_model)
    config_file.write_text(yaml.safe_dump(server_config.model_dump(mode="json")))
    port = _free_port()
    env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value(), "AGENTRFT_TEST_KEY": KEY,
           "PREFECT_LOCAL_STORAGE_PATH": str(PREFECT_LOCAL_STORAGE_PATH.value())}
    command = [sys.executable, "-m", "flows.cli", "api", "--config", str(config_file), "--port", str(port),
               "--api-key", "${AGENTRFT_TEST_KEY}"]
    server = subprocess.Popen(command, cwd=REPO, env=env)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY, max_retries=0)

    def answering():
        try:
            return client.models.list() is not None
        except openai.APIConnectionError:
            return False

    try:
        _wait("the API", answering, 300, server)
        data = job_rows(world)  # each row with its tools: the job's tools replace the server config's
        files = {split: client.files.create(file=open(data / f"{split}.jsonl", "rb"), purpose="fine-tune").id
                 for split in ("train", "validation", "test")}
        rft = {"grader": GRADER, "max_episode_steps": 3,
               "tools": [{"name": e.name, "server_url": e.server_url, "headers": e.headers} for e in endpoints
                         if e.name in JOB_TOOLS],
               "hyperparameters": {"batch_size": 2, "learning_rate_multiplier": 0.01, "eval_interval": 3, "eval_samples": 2, "compute_multiplier": 0.5,
                                   "reasoning_effort": "low"}}
        job = client.fine_tuning.jobs.create(
            model=str(taught_model), training_file=files["train"], validation_file=files["validation"],
            suffix="micro-api", seed=3, metadata={"test_file": files["test"], "team": "qa"},
            method={"type": "reinforcement", "reinforcement": rft}, integrations=[{"type": "wandb",
                                                                                  "wandb": {"project": "x"}}])
        assert job.status == "validating_files" and job.object == "fine_tuning.job"

        # Pause while it trains (holding the registered model's lock); resume: a new run of the
        # deployment, from the cached stages and the training's last checkpoint.
        _wait("training", lambda: any(e.message.startswith("training: ")
                                      for e in client.fine_tuning.jobs.list_events(job.id, limit=100)), 300, server, 1)
        assert client.fine_tuning.jobs.retrieve(job.id).status == "running"
        paused = client.fine_tuning.jobs.pause(job.id)
        assert paused.status == "paused"
        first_run = paused.prefect_flow_run_ids[-1]
        with get_client(sync_client=True) as prefect:
            _wait("the paused run to stop", lambda: prefect.read_flow_run(first_run).state.is_final(), 120)
            assert prefect.read_flow_run(first_run).state.is_cancelled()
        resumed = client.fine_tuning.jobs.resume(job.id)
        assert resumed.status in ("queued", "running") and len(resumed.prefect_flow_run_ids) == 2
        assert any("Released the registered model's lock" in e.message for e in client.fine_tuning.jobs.list_events(job.id))

        # kill -9 of the API server while the resumed run runs, then a restart: nothing it
        # started is left (the runner and the run die with it: no run goes on unwatched); the
        # restart marks the orphaned run Crashed and resumes the job, a third run.
        with get_client(sync_client=True) as prefect:
            _wait("the resumed run to start", lambda: prefect.read_flow_run(
                resumed.prefect_flow_run_ids[-1]).state.is_running(), 300, server)
        tree = [p.pid for p in psutil.Process(server.pid).children(recursive=True)]
        assert len(tree) >= 3  # the runner's guard, the runner, the resumed run
        server.kill()
        server.wait(timeout=60)
        _wait("what the killed API started to die", lambda: not _alive(tree), 10, every=0.1)
        server = subprocess.Popen(command, cwd=REPO, env=env)
        _wait("the restarted API", answering, 300, server)
        back = client.fine_tuning.jobs.retrieve(job.id)
        assert back.status in ("queued", "running") and len(back.prefect_flow_run_ids) == 3
        assert back.prefect_flow_run_ids[:2] == resumed.prefect_flow_run_ids
        with get_client(sync_client=True) as prefect:
            assert prefect.read_flow_run(resumed.prefect_flow_run_ids[-1]).state.is_crashed()
        assert any("The API server was killed while the job ran" in e.message
                   for e in client.fine_tuning.jobs.list_events(job.id, limit=100))

        # A second job, cancelled: cancelled in the API and in Prefect.
        other = client.fine_tuning.jobs.create(  # without a validation_file: the server config's
            model=str(taught_model), training_file=files["train"],
            suffix="micro-cancel", method={"type": "reinforcement", "reinforcement": rft})
        assert other.validation_file is None
        assert any("no validation_file" in e.message for e in client.fine_tuning.jobs.list_events(other.id))
        _wait("the second job to queue", lambda: client.fine_tuning.jobs.retrieve(other.id).status
              in ("queued", "running"), 120, server, 1)
        assert client.fine_tuning.jobs.cancel(other.id).status == "cancelled"
        other_run = client.fine_tuning.jobs.retrieve(other.id).prefect_flow_run_ids[-1]
        with get_client(sync_client=True) as prefect:
            _wait("Prefect to cancel", lambda: prefect.read_flow_run(other_run).state.is_cancelled(), 120)
        assert client.fine_tuning.jobs.retrieve(other.id).status == "cancelled"
        assert [j.id for j in client.fine_tuning.jobs.list(metadata={"team": "qa"})] == [job.id]

        done = _wait("the job to finish", lambda: (lambda j: j if j.status in ("succeeded", "failed", "cancelled")
                                                   else None)(client.fine_tuning.jobs.retrieve(job.id)), 1500, server, 5)
        assert done.status == "succeeded", done.error
        assert done.fine_tuned_model == f"ft:{taught_model.name}:agentrft:micro-api:{job.id.removeprefix('ftjob-')}"
        assert done.trained_tokens and done.trained_tokens > 0 and done.finished_at

        events = list(client.fine_tuning.jobs.list_events(job.id, limit=50))
        steps = sorted(e.data["step"] for e in events if e.type == "metrics")
        assert steps == [0, 1, 2, 3]  # step 0: the evaluation before the first update
        step3 = next(e for e in events if e.type == "metrics" and e.data["step"] == 3)
        assert step3.data["total_steps"] == 3 and step3.message.startswith("Step 3/3, train mean reward=")
        assert 0 <= step3.data["scores"]["train_reward_mean"] <= 1 and "valid_reward_mean" in step3.data["scores"]
        assert step3.data["timing"]["step"]["sampling"] > 0
        assert step3.data["agentrft"]["train/reward_mean"] == step3.data["scores"]["train_reward_mean"]
        messages = [e.message for e in events]
        assert any("reasoning_effort" in m for m in messages) and any("integrations" in m for m in messages)
        assert any("learning_rate_multiplier replaces" in m for m in messages)
        assert any(m.startswith("rft_training: done") for m in messages) and any("paused" in m for m in messages)

        checkpoints = list(client.fine_tuning.jobs.checkpoints.list(job.id))
        assert [c.step_number for c in checkpoints] == [3]
        checkpoint = checkpoints[0]
        assert checkpoint.fine_tuned_model_checkpoint == f"{done.fine_tuned_model}:ckpt-step-3"
        assert checkpoint.metrics.step == 3 and checkpoint.metrics.model_extra["valid_score_mean"] >= 0
        assert checkpoint.metrics.model_extra["train_mean_reward"] == step3.data["scores"]["train_reward_mean"]

        models = {m.id: m for m in client.models.list()}
        assert "challenger" in models[done.fine_tuned_model].model_extra["aliases"]

        question = json.loads((data / "test.jsonl").read_text().splitlines()[0])["messages"][-1]["content"]
        calls = []
        for model in (done.fine_tuned_model, checkpoint.fine_tuned_model_checkpoint):
            # Sampled at temperature 1, the taught model opens with a tool call about 1 time in 4
            # here: 40 tries all miss with a probability near 1e-5.
            for _ in range(40):
                answer = client.chat.completions.create(
                    model=model, tools=TOOLS, max_tokens=48,
                    messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}])
                if answer.choices[0].message.tool_calls:
                    calls.append(answer.choices[0].message.tool_calls[0])
                    break
        assert len(calls) == 2 and {c.function.name for c in calls} <= {"list", "cat"}
        assert all("path" in json.loads(c.function.arguments) for c in calls)
    finally:
        server.terminate()
        server.wait(timeout=60)


@pytest.mark.integration
def test_api_starts_a_prefect_server_when_none_is_named(world, endpoints, taught_model, tmp_path):
    import httpx

    config_file = tmp_path / "api.yaml"
    config = micro(world, endpoints, taught_model, work_dir=str(tmp_path / "runs"))  # no jobs of other tests
    config_file.write_text(yaml.safe_dump(config.model_dump(mode="json")))
    port, prefect_port = _free_port(), _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API")}
    env["PREFECT_HOME"] = str(tmp_path / "prefect-home")  # the started server's database
    server = subprocess.Popen([sys.executable, "-m", "flows.cli", "api", "--config", str(config_file), "--port",
                               str(port), "--prefect-port", str(prefect_port)], cwd=REPO, env=env)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)

    def answering():
        try:
            return client.fine_tuning.jobs.list().data == []
        except openai.APIConnectionError:
            return False

    try:
        _wait("the API", answering, 400, server)
        prefect = f"http://127.0.0.1:{prefect_port}/api"
        deployment = httpx.get(f"{prefect}/deployments/name/agent-rft-pipeline/scheduled").json()
        assert deployment["name"] == "scheduled" and deployment["parameters"]["config"]["name"] == "micro"
    finally:
        server.terminate()
        server.wait(timeout=90)
    with pytest.raises(httpx.ConnectError):  # the server it started went with it
        httpx.get(f"{prefect}/health")
