"""Any data, any tools: the whole pipeline on an order-support job, through one YAML file.

Nothing of FinQA is present: the items carry `messages`, `tools` and the job's own
references, the tools are served by a separate process (tests/order_env/server.py,
standard library only), the grader is a `multi` over the model's JSON answer, a tool
header names `${ORDER_TOKEN}`. Through the CLI as a user would: derive the suite from the
traffic log, validate the config, run. A drifted traffic log stops the run at
validate_data naming the field; a validation file that overlaps the training file is
caught.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from flows.cli import main
from tasks.tracking import mlflow_client
from tests.order_env.world import job_yaml, order_server, teach, write_world

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def order_world(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("orders")
    paths = write_world(root)
    with order_server(paths["orders"]) as base_url:
        yield root, base_url, teach(paths["data"], base_url, root / "model")


@pytest.fixture(autouse=True)
def token(monkeypatch):
    monkeypatch.setenv("ORDER_TOKEN", "order-secret-token-1234")


def test_derive_validate_and_run_a_job_with_no_finqa_field(harness, order_world, capsys):
    root, base_url, model = order_world
    job = job_yaml(root, base_url, model)
    assert main(["expectations", "derive", "--from", str(root / "data" / "traffic.jsonl"), "--config", str(job)]) == 0
    suite = json.loads((root / "expectations" / "expectations" / "orders.json").read_text())
    kinds = {(e["type"], e["kwargs"].get("column")) for e in suite["expectations"]}
    for column in ("messages", "expected_decision", "expected_amount", "tools"):  # the grader's and the tools'
        assert ("expect_column_values_to_not_be_null", column) in kinds
    assert ("expect_column_kl_divergence_to_be_less_than", "expected_decision") in kinds  # low cardinality
    assert ("expect_column_values_to_be_in_set", "channel") in kinds  # production's own field
    assert ("expect_column_quantile_values_to_be_between", "expected_amount") in kinds  # a number
    assert not {c for _, c in kinds} & {"question", "reference_answer", "category"}
    assert main(["config", "validate", str(job)]) == 0

    assert main(["run", "--config", str(job)]) == 0
    printed = capsys.readouterr().out
    assert "outcome: promoted" in printed or "outcome: not_promoted" in printed, printed[-2000:]
    client = mlflow_client(f"sqlite:///{root / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("order-support")
    parent = client.search_runs([experiment.experiment_id], filter_string="tags.stage = 'pipeline'")[0]
    stages = client.search_runs([experiment.experiment_id],
                                filter_string=f"tags.mlflow.parentRunId = '{parent.info.run_id}'")
    assert sorted(r.info.run_name for r in stages) == sorted(
        ["validate_data", "baseline", "prompt_optimization", "rft_training", "regression_eval", "promotion"])
    regression = next(r for r in stages if r.info.run_name == "regression_eval")
    report = Path(client.download_artifacts(regression.info.run_id, "regression_report.md")).read_text()
    assert "per-group gate is skipped" in report  # no group_by in this job
    assert client.get_registered_model("order-support")  # named after the job: no registered_model given
    baseline = next(r for r in stages if r.info.run_name == "baseline").data.metrics
    assert baseline["baseline/score_mean"] > 0 and baseline["baseline/rollouts"] == 12


def test_drifted_traffic_stops_at_validate_data_naming_the_field(harness, order_world):
    root, base_url, model = order_world
    drifted = root / "drifted"
    drifted.mkdir(exist_ok=True)
    job = job_yaml(drifted, base_url, model, data={
        **{k: str(root / "data" / f"{k.split('_')[0]}.jsonl") for k in ("train_file", "validation_file", "test_file")},
        "production_traffic_file": str(root / "data" / "drifted_traffic.jsonl"),
        "expectations_dir": str(drifted / "expectations")})
    assert main(["expectations", "derive", "--from", str(root / "data" / "drifted_traffic.jsonl"),
                 "--config", str(job)]) == 0
    assert main(["run", "--config", str(job)]) == 2  # a clear error, not a traceback
    client = mlflow_client(f"sqlite:///{drifted / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("order-support")
    parent = client.search_runs([experiment.experiment_id], filter_string="tags.stage = 'pipeline'")[0]
    assert parent.data.tags["stopped_at"] == "validate_data" and parent.info.status == "FAILED"
    (stage,) = client.search_runs([experiment.experiment_id],
                                  filter_string=f"tags.mlflow.parentRunId = '{parent.info.run_id}'")
    report = Path(client.download_artifacts(stage.info.run_id, "validation_report.md")).read_text()
    assert "`messages.user_chars`" in report  # production now sends far longer requests
    assert "data_docs" in {a.path for a in client.list_artifacts(stage.info.run_id)}


def test_a_validation_file_overlapping_the_training_file_is_caught(harness, order_world, tmp_path):
    root, base_url, model = order_world
    for name in ("train", "validation", "test"):
        shutil.copy(root / "data" / f"{name}.jsonl", tmp_path / f"{name}.jsonl")
    train_row = (tmp_path / "train.jsonl").read_text().splitlines()[0]
    with (tmp_path / "validation.jsonl").open("a") as handle:
        handle.write(train_row.replace('"train-', '"validation-copy-') + "\n")
    job = job_yaml(tmp_path, base_url, model, data={
        "train_file": str(tmp_path / "train.jsonl"), "validation_file": str(tmp_path / "validation.jsonl"),
        "test_file": str(tmp_path / "test.jsonl"), "production_traffic_file": None, "expectations_suite": None})
    assert main(["run", "--config", str(job)]) == 2
    client = mlflow_client(f"sqlite:///{tmp_path / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("order-support")
    parent = client.search_runs([experiment.experiment_id], filter_string="tags.stage = 'pipeline'")[0]
    assert "train_validation_disjoint" in parent.data.tags["reason"]
