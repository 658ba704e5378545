"""OpenAI job bodies run as this pipeline: the mapping, its errors, and a whole run with a
`multi` grader and endpoint tools (the real tool server on loopback)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from flows.openai_job import config_from_openai_job
from tasks.tracking import mlflow_client
from tests.pipeline_world import micro
from trainer.errors import ConfigError

MULTI_GRADER = {
    "type": "multi",
    "graders": {
        "number": {"type": "numeric", "name": "number", "input": "{{sample.output_text}}",
                   "reference": "{{item.reference_answer}}"},
        "format": {"type": "string_check", "name": "format", "input": "{{sample.output_text}}",
                   "reference": "answer", "operation": "ilike"},
    },
    "calculate_output": "0.9 * number + 0.1 * format",
}


def job_body(world: Path, endpoints, model: str | None = None) -> dict:
    return {
        "model": model,
        "training_file": str(world / "data" / "train.jsonl"),
        "validation_file": str(world / "data" / "validation.jsonl"),
        "suffix": "openai-job",
        "seed": 7,
        "method": {"type": "reinforcement", "reinforcement": {
            "grader": json.loads(json.dumps(MULTI_GRADER)),  # a copy: tests mutate it
            "hyperparameters": {"n_epochs": 2, "batch_size": 2, "learning_rate_multiplier": 1e-7,
                                "compute_multiplier": 0.5, "eval_interval": 2, "eval_samples": 2,
                                "reasoning_effort": "low"},
            "tools": [{"name": e.name, "server_url": e.server_url, "headers": {"Authorization": "Bearer ${JOB_TOKEN}"}}
                      for e in endpoints],
            "max_episode_steps": 4,
        }},
    }


def test_job_fields_map_onto_the_config(world, endpoints):
    config, notes = config_from_openai_job(job_body(world, endpoints, "some/model"), source="job.json")
    assert config.model.base_model == "some/model"
    assert config.data.train_file.endswith("train.jsonl") and config.data.dvc_file is None
    assert config.grader["type"] == "multi"
    assert config.training.n_epochs == 2 and config.training.learning_rate_multiplier == 1e-7
    assert config.training.seed == 7 and config.rollout.max_episode_steps == 4
    assert [e.name for e in config.tools.endpoints] == [e.name for e in endpoints] and not config.tools.demo_server
    assert config.tools.endpoints[0].headers == {"Authorization": "Bearer ${JOB_TOKEN}"}  # a template, not a secret
    assert config.promotion.registered_model == "openai-job"
    assert notes == ["method.reinforcement.hyperparameters.reasoning_effort has no equivalent here and is ignored"]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda j: j.update(training_file="file-abc123"), "training_file 'file-abc123' is not a local file"),
        (lambda j: j["method"].update(type="supervised"), "method.type must be 'reinforcement'"),
        (lambda j: j["method"]["reinforcement"]["hyperparameters"].update(lr=1), r"unknown keys \['lr'\]"),
        (lambda j: j["method"]["reinforcement"]["tools"].append({"name": "x"}), r"tools\[4\]: a tool needs"),
        (lambda j: j["method"]["reinforcement"]["grader"].update(type="nope"), "grader"),
        (lambda j: j.update(model=None), "model is required"),
    ],
)
def test_bad_jobs_name_the_field(world, endpoints, change, message):
    job = job_body(world, endpoints, "some/model")
    change(job)
    with pytest.raises(ConfigError, match=message):
        config_from_openai_job(job, source="job.json")


@pytest.mark.integration
def test_openai_job_runs_as_the_pipeline(harness, world, endpoints, taught_model, monkeypatch, capsys):
    from flows.cli import main

    monkeypatch.setenv("JOB_TOKEN", "job-secret-token")
    job = world / "job.json"
    job.write_text(json.dumps(job_body(world, endpoints, str(taught_model))))
    base = micro(world, endpoints, taught_model).model_dump(mode="json")
    for section in ("model", "data", "grader", "training"):
        base.pop(section)
    base["tools"].pop("endpoints")
    (world / "job-base.yaml").write_text(yaml.safe_dump(base))
    assert main(["run", "--openai-job", str(job), "--config", str(world / "job-base.yaml")]) == 0
    out = capsys.readouterr()
    assert "outcome: promoted" in out.out, out
    client = mlflow_client(base["mlflow"]["tracking_uri"])
    version = client.get_model_version_by_alias("openai-job", "champion")
    parent = client.get_run(version.tags["pipeline_run_id"])
    assert parent.data.params["grader.type"] == "multi"
    assert parent.data.params["training.learning_rate_multiplier"] == "1e-07"
    assert "job-secret-token" not in json.dumps(parent.data.params)
