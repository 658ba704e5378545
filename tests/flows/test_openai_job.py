"""OpenAI job bodies run as this pipeline: the mapping, its errors, and a whole run with a
`multi` grader and endpoint tools (the real tool server on loopback)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from flows.openai_api.job_body import config_from_openai_job
from tasks.tracking import mlflow_client
from tests.pipeline_world import JOB_TOOLS, LEARNS, job_rows, micro
from trainer.data import read_items, split_items, write_jsonl
from trainer.errors import ConfigError

MULTI_GRADER = {
    "type": "multi",
    "graders": {
        "number": {"type": "numeric", "name": "number", "input": "{{sample.output_text}}",
                   "reference": "{{item.reference_answer}}"},
        "format": {"type": "string_check", "name": "format", "input": "{{sample.output_text}}",
                   "reference": "answer", "operation": "ilike"},
    },
    # Format is worth something only with the right number: a wrong answer is never paid,
    # so the per-call price cannot make a cheap wrong answer the better policy.
    "calculate_output": "number * (0.9 + 0.1 * format)",
}


def job_body(world: Path, endpoints, model: str | None = None) -> dict:
    # The micro preset's training (tests/pipeline_world.py) in OpenAI's names: ten steps of
    # two items x four rollouts at 500 x 1e-5, enough for a clearly better candidate.
    return {
        "model": model,
        "training_file": str(world / "data" / "train.jsonl"),
        "validation_file": str(world / "data" / "validation.jsonl"),
        "suffix": "openai-job",
        "seed": 7,
        "method": {"type": "reinforcement", "reinforcement": {
            "grader": json.loads(json.dumps(MULTI_GRADER)),  # a copy: tests mutate it
            "hyperparameters": {"n_epochs": 10, "batch_size": 2, "learning_rate_multiplier": 500,
                                "compute_multiplier": 0.5, "eval_interval": 5, "eval_samples": 2,
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
    assert config.training.n_epochs == 10 and config.training.learning_rate_multiplier == 500
    assert config.training.seed == 7 and config.rollout.max_episode_steps == 4
    assert [e.name for e in config.tools.endpoints] == [e.name for e in endpoints]
    assert config.tools.schemas is None  # the rows' own `tools`, as OpenAI reads them
    assert config.tools.endpoints[0].headers == {"Authorization": "Bearer ${JOB_TOKEN}"}  # a template, not a secret
    assert config.promotion.registered_model == "openai-job" == config.registered_model == config.name
    # A job's data is not under DVC and has no traffic log: no suite, versioned by its files.
    assert (config.data.production_traffic_file, config.data.expectations_suite) == (None, None)
    assert notes == ["method.reinforcement.hyperparameters.reasoning_effort has no equivalent here and is ignored"]


def test_without_a_test_file_half_of_validation_is_the_test_split(world, endpoints, tmp_path):
    # Ten items as the validation file: the seeded halves are disjoint, cover it, and do not
    # depend on the order of the rows.
    rows = [row for split in ("validation", "test") for row in read_items(world / "data" / f"{split}.jsonl")]
    job = job_body(world, endpoints, "some/model")
    job["validation_file"] = str(write_jsonl(tmp_path / "validation.jsonl", rows))
    config, _ = config_from_openai_job(job, source="job.json")
    assert config.data.test_file is None
    validation, test = (split_items(config.data, split) for split in ("validation", "test"))
    ids = {item["id"] for item in validation}
    assert validation and test and not ids & {item["id"] for item in test}
    assert sorted(ids | {item["id"] for item in test}) == sorted(row["id"] for row in rows)
    job["validation_file"] = str(write_jsonl(tmp_path / "reversed.jsonl", rows[::-1]))
    reversed_config, _ = config_from_openai_job(job, source="job.json")
    assert [item["id"] for item in split_items(reversed_config.data, "test")] == [item["id"] for item in test][::-1]
    # With one, the job's test file is the test split.
    job["test_file"] = str(world / "data" / "test.jsonl")
    config, _ = config_from_openai_job(job, source="job.json")
    assert split_items(config.data, "test") == read_items(world / "data" / "test.jsonl")


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda j: j.update(training_file="file-abc123"), "training_file 'file-abc123' is not a local file"),
        (lambda j: j.update(test_file="/nowhere/test.jsonl"), "test_file '/nowhere/test.jsonl' is not a local file"),
        (lambda j: j.pop("validation_file"), "validation_file is required"),
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
    # The promotion decision on the world's six test items (ours; OpenAI has no test file),
    # and the micro preset's seed and the steps and samples of its promotion test: this run
    # trains exactly as the pipeline tests' does. The rows carry their tools, the schemas the
    # taught model knows, and the job names their endpoints: what it gives replaces the
    # server config's tools whole.
    rows = job_rows(world)
    body = job_body(world, endpoints, str(taught_model))
    body["method"]["reinforcement"]["tools"] = [t for t in body["method"]["reinforcement"]["tools"]
                                                if t["name"] in JOB_TOOLS]
    job.write_text(json.dumps({**body, "seed": 42, "training_file": str(rows / "train.jsonl"),
                               "validation_file": str(rows / "validation.jsonl"),
                               "test_file": str(rows / "test.jsonl")}))
    base = micro(world, endpoints, taught_model, **LEARNS).model_dump(mode="json")
    for section in ("model", "data", "grader"):
        base.pop(section)
    base["training"].pop("learning_rate")  # the job's learning_rate_multiplier decides
    base["tools"].pop("endpoints")
    (world / "job-base.yaml").write_text(yaml.safe_dump(base))
    assert main(["run", "--openai-job", str(job), "--config", str(world / "job-base.yaml")]) == 0
    out = capsys.readouterr()
    assert "outcome: promoted" in out.out, out
    client = mlflow_client(base["mlflow"]["tracking_uri"])
    version = client.get_model_version_by_alias("openai-job", "champion")
    parent = client.get_run(version.tags["pipeline_run_id"])
    assert parent.data.params["grader.type"] == "multi"
    assert parent.data.params["training.learning_rate_multiplier"] == "500.0"
    assert parent.data.params["data.test_file"] == str(rows / "test.jsonl")
    assert "job-secret-token" not in json.dumps(parent.data.params)
