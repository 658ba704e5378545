"""OpenAI's supervised fine-tuning jobs on `agentrft api`, driven by the official `openai` SDK.

The fast tests serve the API app on loopback with no Prefect server: the supervised bodies
refused before anything is stored (each bad hyperparameter named), and demonstrations that
are not a supervised file failing the job in `validating_files`. The integration test starts
`agentrft api` itself on Prefect's test harness over the micro world and runs a supervised
job to `succeeded`: upload, create, events and checkpoints in OpenAI's supervised shapes, the
registered `ft:` model (challenger) and chat with it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import openai
import pytest
import yaml

from tests.flows.test_openai_api import (  # noqa: F401
    KEY,
    MODEL,
    REPO,
    _error,
    _free_port,
    _rows,
    _wait,
    api_client,
)
from tests.pipeline_world import micro
from tests.taught_model import SYSTEM, TOOLS, scripts, write_demonstrations
from trainer.data import read_items


def test_bad_supervised_hyperparameters_are_refused_naming_the_field(api_client):  # noqa: F811
    client, _, tmp_path = api_client
    train = client.files.create(file=("train.jsonl", _rows(2)), purpose="fine-tune").id

    def refused(**body) -> dict:
        with pytest.raises(openai.BadRequestError) as exc:
            client.fine_tuning.jobs.create(model=MODEL, training_file=train, **body)
        return _error(exc.value)

    def supervised(**hyper) -> dict:
        return {"type": "supervised", "supervised": {"hyperparameters": hyper}}

    for key, value in (("n_epochs", 0), ("n_epochs", 1.5), ("batch_size", "big"), ("batch_size", True),
                       ("learning_rate_multiplier", -1), ("learning_rate_multiplier", "fast")):
        error = refused(method=supervised(**{key: value}))
        assert error["param"] == f"method.supervised.hyperparameters.{key}", (key, value, error)
        assert repr(value) in error["message"] and '"auto"' in error["message"]
    assert refused(method=supervised(beta=0.1))["param"] == "method.supervised.hyperparameters.beta"
    # No method: OpenAI's legacy form, a supervised job with top-level hyperparameters.
    assert refused(hyperparameters={"n_epochs": -2})["param"] == "hyperparameters.n_epochs"
    assert client.fine_tuning.jobs.list().data == [] and list((tmp_path / "api" / "jobs").iterdir()) == []


def test_a_file_that_is_no_supervised_file_fails_the_job_naming_file_and_line(api_client):  # noqa: F811
    client, _, _ = api_client
    demo = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "42"}]}
    rows = [json.dumps(demo).encode(), json.dumps({"messages": [{"role": "user", "content": "q"}]}).encode()]
    train = client.files.create(file=("demos.jsonl", b"\n".join(rows) + b"\n"), purpose="fine-tune")
    job = client.fine_tuning.jobs.create(model=MODEL, training_file=train.id, hyperparameters={"n_epochs": "auto"})
    assert job.method.type == "supervised" and job.method.supervised.hyperparameters.n_epochs == "auto"
    assert (job.hyperparameters.n_epochs, job.hyperparameters.batch_size) == (3, 8)  # "auto" as resolved
    failed = _wait("validation", lambda: (lambda j: j if j.status != "validating_files" else None)(
        client.fine_tuning.jobs.retrieve(job.id)), 60, every=0.2)
    assert failed.status == "failed" and failed.error.param == "training_file"
    assert failed.error.code == "invalid_training_file"
    assert failed.error.message.startswith(f"training_file {train.id} (demos.jsonl) line 2: ")
    assert failed.prefect_flow_run_ids == []


@pytest.mark.integration
@pytest.mark.timeout(900)
def test_openai_sdk_runs_a_supervised_job_end_to_end(harness, world, endpoints, taught_model, tmp_path):
    from prefect.settings import PREFECT_API_URL, PREFECT_LOCAL_STORAGE_PATH

    items = {split: read_items(world / "data" / f"{split}.jsonl") for split in ("train", "validation")}
    demos = {split: write_demonstrations(rows, endpoints, tmp_path / f"{split}-demos.jsonl",
                                         ways=lambda item: scripts(item)[:1]) for split, rows in items.items()}
    config_file = tmp_path / "api.yaml"
    config = micro(world, endpoints, taught_model, work_dir=str(tmp_path / "runs"),  # no jobs of other tests
                   mlflow={"tracking_uri": f"sqlite:///{tmp_path / 'mlflow.db'}", "experiment": "sft"})
    config_file.write_text(yaml.safe_dump(config.model_dump(mode="json")))
    port = _free_port()
    env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value(), "AGENTRFT_TEST_KEY": KEY,
           "PREFECT_LOCAL_STORAGE_PATH": str(PREFECT_LOCAL_STORAGE_PATH.value())}
    server = subprocess.Popen([sys.executable, "-m", "flows.cli", "api", "--config", str(config_file), "--port",
                               str(port), "--api-key", "${AGENTRFT_TEST_KEY}"], cwd=REPO, env=env)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY, max_retries=0)

    def answering():
        try:
            return client.models.list() is not None
        except openai.APIConnectionError:
            return False

    try:
        _wait("the API", answering, 300, server)
        files = {split: client.files.create(file=open(path, "rb"), purpose="fine-tune").id
                 for split, path in demos.items()}
        # Two demonstrations, batch 1, two epochs: four steps; validation after the last.
        hyper = {"n_epochs": 2, "batch_size": 1, "learning_rate_multiplier": 0.5}
        job = client.fine_tuning.jobs.create(
            model=str(taught_model), training_file=files["train"], validation_file=files["validation"],
            suffix="micro-sft", seed=5, method={"type": "supervised", "supervised": {"hyperparameters": hyper}})
        assert job.status == "validating_files" and job.method.type == "supervised"
        assert (job.hyperparameters.n_epochs, job.hyperparameters.batch_size) == (2, 1)

        done = _wait("the job to finish", lambda: (lambda j: j if j.status in ("succeeded", "failed", "cancelled")
                                                   else None)(client.fine_tuning.jobs.retrieve(job.id)), 800, server, 3)
        assert done.status == "succeeded", done.error
        assert done.fine_tuned_model == f"ft:{taught_model.name}:agentrft:micro-sft:{job.id.removeprefix('ftjob-')}"
        assert done.trained_tokens and done.trained_tokens > 0

        events = list(client.fine_tuning.jobs.list_events(job.id, limit=100))
        metrics = sorted((e for e in events if e.type == "metrics"), key=lambda e: e.data["step"])
        assert [e.data["step"] for e in metrics] == [1, 2, 3, 4]
        assert all(e.data["total_steps"] == 4 and e.data["train_loss"] > 0
                   and 0 <= e.data["train_mean_token_accuracy"] <= 1 for e in metrics)
        last = metrics[-1]
        assert last.data["valid_loss"] > 0 and last.data["full_valid_loss"] == last.data["valid_loss"]
        assert last.data["agentrft"]["warm_start/train_loss"] == last.data["train_loss"]
        assert last.message == (f"Step 4/4: training loss={last.data['train_loss']:.2f}, validation loss="
                                f"{last.data['valid_loss']:.2f}, full validation loss={last.data['valid_loss']:.2f}")
        assert "valid_loss" not in metrics[0].data  # validation at the end only (no eval_interval)

        checkpoints = list(client.fine_tuning.jobs.checkpoints.list(job.id))
        assert [c.step_number for c in checkpoints] == [4]
        checkpoint = checkpoints[0]
        assert checkpoint.fine_tuned_model_checkpoint == f"{done.fine_tuned_model}:ckpt-step-4"
        assert checkpoint.metrics.train_loss == last.data["train_loss"]
        assert checkpoint.metrics.full_valid_loss == last.data["valid_loss"]

        models = {m.id: m for m in client.models.list()}
        assert models[done.fine_tuned_model].model_extra["aliases"] == ["challenger"]  # no grader: not champion

        question = items["validation"][0]["messages"][-1]["content"]
        answer = client.chat.completions.create(
            model=done.fine_tuned_model, tools=TOOLS, max_tokens=48,
            messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}])
        assert answer.model == done.fine_tuned_model and answer.choices[0].finish_reason in ("stop", "tool_calls")
    finally:
        server.terminate()
        server.wait(timeout=60)
