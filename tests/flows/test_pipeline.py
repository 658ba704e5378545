"""The pipeline end to end on a micro preset, under Prefect's test harness (a real API
server) with MLflow on a temporary SQLite store and the real tool server on loopback.

A tiny taught model, ten GRPO steps in an `accelerate launch`ed subprocess, the default
promotion gates. The first run trains a candidate clearly better than the base and
promotes it on the test items; only the regression stage reads them; the unchanged second
run is served from cache, read from the tasks' Prefect states; a run whose training
destroys the model registers it as challenger but never as champion; a rollback moves
champion back; a drifted dataset stops at validation and a failed baseline gate stops at
the baseline.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import mlflow
import pytest
import yaml

from envs.finqa.generate import generate_dataset
from tasks.data_version import add
from tasks.expectations import derive_and_save
from tasks.tracking import git_commit, mlflow_client
from tests.kernel_features import SUPPORTED, python_without
from tests.pipeline_world import LEARNS, micro
from trainer.data import read_items, read_jsonl

pytestmark = pytest.mark.integration

STAGE_NAMES = ["validate_data", "baseline", "prompt_optimization", "rft_training", "regression_eval", "promotion"]


def _own_store(world: Path) -> dict:
    """These tests count runs and versions: a store of their own, so stages that other
    tests of the session ran are not served to them from cache."""
    return {"tracking_uri": f"sqlite:///{world / 'pipeline-tests.db'}", "experiment": "micro"}


def _stage_runs(client, parent_run_id: str) -> dict:
    runs = client.search_runs(
        [client.get_run(parent_run_id).info.experiment_id],
        filter_string=f"tags.mlflow.parentRunId = '{parent_run_id}'",
    )
    return {run.info.run_name: run for run in runs}


@pytest.fixture(scope="module")
def first_run(harness, world, endpoints, taught_model):
    from flows.pipeline import agent_rft_pipeline, pipeline_parameters

    config = micro(world, endpoints, taught_model, mlflow=_own_store(world), **LEARNS)
    outcome = agent_rft_pipeline(**pipeline_parameters(config))
    return config, outcome


def test_first_run_records_six_stages_and_promotes(first_run):
    config, outcome = first_run
    client = mlflow_client(config.mlflow.tracking_uri)
    assert outcome["outcome"] == "promoted", outcome
    stages = _stage_runs(client, outcome["parent_run_id"])
    assert sorted(stages) == sorted(STAGE_NAMES)
    parent = client.get_run(outcome["parent_run_id"])
    for run in [parent, *stages.values()]:
        tags = run.data.tags
        assert tags["data_md5"] == yaml.safe_load(Path(config.data.dvc_file).read_text())["outs"][0]["md5"].removesuffix(".dir")
        assert tags["git_commit"] and tags["config_hash"] == config.section_hash()
        assert tags["prefect_flow_run_id"] and tags["prefect_flow_run_url"]
        assert run.info.status == "FINISHED"
    assert parent.data.params["training.learning_rate"] == "0.005"
    assert stages["rft_training"].data.params["training.learning_rate"] == "0.005"
    baseline = stages["baseline"].data.metrics
    assert baseline["baseline/rollouts"] == 4 and 0 <= baseline["baseline/score_mean"] <= 1
    assert baseline["baseline/best_of_k_mean"] >= baseline["baseline/score_mean"]
    training = client.get_metric_history(stages["rft_training"].info.run_id, "train/reward_mean")
    assert sorted(m.step for m in training) == list(range(1, 11))
    regression = stages["regression_eval"].data.metrics
    assert regression["regression/gain_low"] > 0 and regression["regression/gates_passed"] == 1.0
    assert outcome["score_gain"]["gain"] > 0.1
    inputs = {d.dataset.name: d.dataset.digest for d in stages["validate_data"].inputs.dataset_inputs
              if d.dataset.name.endswith(".jsonl")}
    assert set(inputs) == {"train.jsonl", "validation.jsonl", "test.jsonl"} and len(set(inputs.values())) == 1
    # the validation and test splits as MLflow evaluation datasets of this data version,
    # linked to every stage run that read them
    from mlflow.genai.datasets import search_datasets

    md5 = parent.data.tags["data_md5"]
    for stage, splits_read in (("validate_data", {"validation", "test"}), ("baseline", {"validation"}),
                               ("prompt_optimization", {"validation"}), ("rft_training", {"validation"}),
                               ("regression_eval", {"test"})):
        named = {d.dataset.name for d in stages[stage].inputs.dataset_inputs if "@" in d.dataset.name}
        assert named == {f"{split}@{md5[:12]}" for split in splits_read}, stage
    for split in ("validation", "test"):
        [dataset] = search_datasets(experiment_ids=[parent.info.experiment_id],
                                    filter_string=f"name = '{split}@{md5[:12]}'")
        assert dataset.tags["dvc_md5"] == md5 and dataset.tags["split"] == split
        records = dataset.to_df()
        assert len(records) == len(read_items(Path(getattr(config.data, f"{split}_file"))))
        assert all(row["item"]["reference_answer"] is not None for row in records["expectations"])
    for stage, artifact in (("validate_data", "validation_report.md"), ("baseline", "per_item_spread.png"),
                            ("prompt_optimization", "variants.md"), ("regression_eval", "regression_report.md"),
                            ("regression_eval", "hack_patterns.json"), ("promotion", "promotion.json")):
        assert artifact in {a.path for a in client.list_artifacts(stages[stage].info.run_id)}, (stage, artifact)

    # the reading of the test split is in the ledger and on the run, and the report says it
    # (the session's world is shared: other tests' readings of the same split count too)
    ledger = read_jsonl(Path(config.data.test_ledger))
    regression = stages["regression_eval"]
    [reading] = [r for r in ledger if r["mlflow_run_id"] == regression.info.run_id]
    assert reading["command"] == "regression_eval" and reading["config_hash"] == config.section_hash()
    assert reading["config"] == config.name  # the config's name, as shift readings record it
    assert reading["git_commit"] == git_commit()
    count = len([r for r in ledger[: ledger.index(reading) + 1] if r["split_sha256"] == reading["split_sha256"]])
    assert regression.data.tags["test_split.readings"] == str(count)
    report = Path(client.download_artifacts(regression.info.run_id, "regression_report.md")).read_text()
    assert f"has been read {'once' if count == 1 else f'{count} times'}" in report

    # the test items are read by the regression evaluation alone: every other stage's rollouts
    # come from the validation (or training) items
    splits = {name: {row["id"] for row in read_items(Path(getattr(config.data, f"{name}_file")))}
              for name in ("train", "validation", "test")}
    for stage, artifact in (("baseline", "rollouts.jsonl"), ("regression_eval", "candidate/rollouts.jsonl"),
                            ("regression_eval", "baseline/rollouts.jsonl")):
        ids = {row["item_id"] for row in read_jsonl(client.download_artifacts(stages[stage].info.run_id, artifact))}
        assert ids <= (splits["test"] if stage == "regression_eval" else splits["validation"]), (stage, ids)
    evaluated = {row["item_id"] for path in ("rollouts/eval_step_0.jsonl", "rollouts/eval_step_10.jsonl")
                 for row in read_jsonl(client.download_artifacts(stages["rft_training"].info.run_id, path))}
    assert evaluated <= splits["validation"]
    traces = mlflow.search_traces(locations=[parent.info.experiment_id], return_type="list",
                                  filter_string="tags.kind = 'candidate'")
    assert traces and {s.name.split(" ")[0] for s in traces[0].data.spans} >= {"rollout", "turn", "grade"}
    # the trainer exports its traces in the background and flushes once at the end: every step's arrived
    trained = mlflow.search_traces(locations=[parent.info.experiment_id], return_type="list",
                                   filter_string="tags.kind = 'train'", max_results=1000)
    assert {t.info.tags["step"] for t in trained} == {str(step) for step in range(1, 11)}

    version = client.get_model_version_by_alias("micro-agent", "champion")
    assert str(version.version) == outcome["version"] == "1"
    assert str(client.get_model_version_by_alias("micro-agent", "challenger").version) == "1"
    assert version.tags["pipeline_run_id"] == outcome["parent_run_id"]
    assert version.tags["data_md5"] == parent.data.tags["data_md5"]
    assert version.tags["gates_passed"] == "true"


def test_unchanged_second_run_is_served_from_cache(first_run, world, endpoints, taught_model):
    from flows.pipeline import agent_rft_pipeline, pipeline_parameters

    config, first = first_run
    again = agent_rft_pipeline(**pipeline_parameters(config))
    assert all(stage["cached"] for stage in again["stages"].values()), again["stages"]
    assert [s["run_id"] for s in again["stages"].values()] == [s["run_id"] for s in first["stages"].values()]
    client = mlflow_client(config.mlflow.tracking_uri)
    assert _stage_runs(client, again["parent_run_id"]) == {}
    assert client.get_run(again["parent_run_id"]).data.tags["stage.rft_training.cached"] == "true"
    assert len(client.search_model_versions("name = 'micro-agent'")) == 1


def test_a_run_stopped_after_training_never_reads_the_test_split(first_run, world, endpoints, taught_model):
    """`stop_after: rft_training` (`agentrft run --stop-after`): the candidate, its validation
    figure, and no regression stage, no reading in the ledger, no new registry version."""
    from flows.pipeline import agent_rft_pipeline, pipeline_parameters

    config, first = first_run
    readings = len(read_jsonl(Path(config.data.test_ledger)))
    stopped = agent_rft_pipeline(**pipeline_parameters(config, stop_after="rft_training"))
    assert stopped["outcome"] == "stopped_after" and stopped["stopped_after"] == "rft_training", stopped
    assert list(stopped["stages"]) == STAGE_NAMES[:4]
    assert stopped["stages"]["rft_training"]["run_id"] == first["stages"]["rft_training"]["run_id"]
    assert stopped["candidate"]["model_uri"].startswith("models:/") and stopped["candidate"]["score"] is not None
    assert len(read_jsonl(Path(config.data.test_ledger))) == readings
    client = mlflow_client(config.mlflow.tracking_uri)
    parent = client.get_run(stopped["parent_run_id"])
    assert parent.info.status == "FINISHED" and "stage.regression_eval.run_id" not in parent.data.tags
    assert len(client.search_model_versions("name = 'micro-agent'")) == 1


def test_worse_candidate_is_never_champion_and_rollback_works(first_run, world, endpoints, taught_model):
    from flows.pipeline import agent_rft_pipeline, pipeline_parameters, promote_model

    config, first = first_run
    # the first run's rollout settings, so that its first three stages are served from cache
    worse = micro(world, endpoints, taught_model, mlflow=_own_store(world), rollout=LEARNS["rollout"],
                  training={"learning_rate": 3.0, "ppo_epochs": 4})
    outcome = agent_rft_pipeline(**pipeline_parameters(worse))
    cached = {name for name, stage in outcome["stages"].items() if stage["cached"]}
    assert cached == {"validate_data", "baseline", "prompt_optimization"}
    assert outcome["outcome"] == "not_promoted", outcome
    client = mlflow_client(config.mlflow.tracking_uri)
    assert str(client.get_model_version_by_alias("micro-agent", "champion").version) == "1"
    assert str(client.get_model_version_by_alias("micro-agent", "challenger").version) == "2"
    assert client.get_model_version("micro-agent", "2").tags["not_promoted_reason"]

    # by hand: promote the challenger, then roll back to the previous champion
    promoted = promote_model(name="micro-agent", version_or_alias="challenger", action="promote",
                             tracking_uri=config.mlflow.tracking_uri)
    assert promoted == {"action": "promote", "champion": "2", "previous_champion": "1"}
    rolled = promote_model(name="micro-agent", version_or_alias="", action="rollback",
                           tracking_uri=config.mlflow.tracking_uri)
    assert rolled == {"action": "rollback", "champion": "1", "rolled_back_from": "2"}
    assert str(client.get_model_version_by_alias("micro-agent", "champion").version) == "1"


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def test_drifted_data_stops_at_validation(harness, world, endpoints, taught_model):
    from flows.pipeline import agent_rft_pipeline, pipeline_parameters

    drifted = world / "drifted"
    generate_dataset(drifted, seed=0, drift=True, n_train=300, n_validation=250, n_test=250, n_traffic=10)
    add(drifted)
    production = world / "production"
    generate_dataset(production, seed=0, n_train=10, n_validation=10, n_test=10, n_traffic=1000)
    derive_and_save(production / "production_traffic.jsonl", world / "expectations", name="traffic",
                    required=["reference_answer"])
    config = micro(world, endpoints, taught_model, mlflow=_own_store(world), data={
        "dvc_file": str(world / "drifted.dvc"), "train_file": str(drifted / "train.jsonl"),
        "validation_file": str(drifted / "validation.jsonl"), "test_file": str(drifted / "test.jsonl"),
        "expectations_dir": str(world / "expectations"), "expectations_suite": "traffic"})
    # What the run logs (Prefect's flow and task run loggers, whatever stream they print to)
    records = _Records()
    loggers = [logging.getLogger(name) for name in ("prefect", "prefect.flow_runs", "prefect.task_runs")]
    for logger in loggers:
        logger.addHandler(records)
    try:
        state = agent_rft_pipeline(**pipeline_parameters(config), return_state=True)
    finally:
        for logger in loggers:
            logger.removeHandler(records)
    assert state.is_failed() and state.name == "Stopped"  # a verdict on the data, as a gate's
    with pytest.raises(Exception, match="validate_data: .* failed checks"):
        state.result()
    # a verdict, not a crash: no record carries a traceback, and the report's line is logged
    # (Prefect logs a failed state with exc_info=True, which outside an exception carries none)
    assert not [r.getMessage() for r in records.records if r.exc_info and r.exc_info[0] is not None]
    assert any("validate_data: " in r.getMessage() and "failed checks" in r.getMessage() for r in records.records)
    client = mlflow_client(config.mlflow.tracking_uri)
    parent = client.search_runs([client.get_experiment_by_name("micro").experiment_id],
                                filter_string="tags.stopped_at = 'validate_data'")[0]
    assert parent.info.status == "FAILED"
    stages = _stage_runs(client, parent.info.run_id)
    assert list(stages) == ["validate_data"] and stages["validate_data"].info.status == "FAILED"
    report = client.download_artifacts(stages["validate_data"].info.run_id, "validation_report.md")
    assert "expect_column_kl_divergence" in Path(report).read_text().lower().replace("kldivergence", "kl_divergence")


@pytest.mark.skipif(not SUPPORTED, reason="the kernel features are taken away on x86_64 Linux")
def test_a_hackable_python_grader_stops_at_validation_and_unfenced_is_said_once(
        harness, world, endpoints, taught_model, monkeypatch):
    """A python grader that pays the words "score: 1.0", on a kernel without Landlock: the
    run says once, before its first stage and in its own log, that its python graders run
    unfenced (not once per grade, nor only in the children's stderr), and validate_data
    stops it naming the probe, the item and what the grader paid."""
    from flows.pipeline import agent_rft_pipeline, pipeline_parameters

    monkeypatch.delenv("AGENTRFT_PYTHON_GRADER_UNFENCED_SAID", raising=False)
    monkeypatch.setattr(sys, "executable", str(python_without(world, "landlock")))
    gullible = {"type": "python", "name": "gullible",
                "source": "def grade(sample, item):\n    return 1.0 if 'score: 1.0' in sample['output_text'] else 0.0\n"}
    config = micro(world, endpoints, taught_model, mlflow=_own_store(world), data={"probe_items": 1})
    config = config.model_copy(update={"grader": gullible})  # whole: an override would merge into the numeric one
    records = _Records()
    loggers = [logging.getLogger(name) for name in ("prefect", "prefect.flow_runs", "prefect.task_runs",
                                                    "trainer.graders.python_grader")]
    for logger in loggers:
        logger.addHandler(records)
    try:
        state = agent_rft_pipeline(**pipeline_parameters(config), return_state=True)
    finally:
        for logger in loggers:
            logger.removeHandler(records)
    assert state.is_failed() and state.name == "Stopped"
    with pytest.raises(Exception, match=r"grader_pays_no_probe_beyond_its_plain_content.*probe judge_addressed.*"
                                        r"item '[^']+': scored 1, its plain content 0"):
        state.result()
    # a record reaches the handler once for each logger it passes on its way up
    said = [r.getMessage() for r in {id(r): r for r in records.records}.values() if "run unfenced" in r.getMessage()]
    assert len(said) == 1 and "no Landlock" in said[0], said
    client = mlflow_client(config.mlflow.tracking_uri)
    parent = client.search_runs([client.get_experiment_by_name("micro").experiment_id],
                                filter_string="tags.stopped_at = 'validate_data'", order_by=["start_time DESC"])[0]
    assert parent.data.tags["python_grader_fence"].startswith("unfenced: no file-system fence")


def test_failed_baseline_gate_stops_with_its_reason(harness, world, endpoints, taught_model):
    from flows.pipeline import agent_rft_pipeline, pipeline_parameters

    config = micro(world, endpoints, taught_model, mlflow=_own_store(world), baseline={"k": 2, "min_nonzero_share": 1.0, "min_headroom": 0.9})
    state = agent_rft_pipeline(**pipeline_parameters(config), return_state=True)
    assert state.is_failed()
    with pytest.raises(Exception, match="baseline gate failed: .*headroom|baseline gate failed: .*GRPO"):
        state.result()
    client = mlflow_client(config.mlflow.tracking_uri)
    parent = client.search_runs([client.get_experiment_by_name("micro").experiment_id],
                                filter_string="tags.stopped_at = 'baseline'")[0]
    assert sorted(_stage_runs(client, parent.info.run_id)) == ["baseline"]  # validation came from cache


def test_a_stage_whose_cached_run_is_gone_runs_again(harness, world, endpoints, taught_model):
    """Prefect's cache outlives the store (it is machine-wide, keyed by the store's URI): a
    cached stage whose MLflow run was deleted, or whose store was made anew at the same
    path, runs again instead of pointing the new pipeline run at a run that is not there."""
    from flows.pipeline import _run_in_store, agent_rft_pipeline, pipeline_parameters

    store = {"tracking_uri": f"sqlite:///{world / 'run-gone.db'}", "experiment": "micro"}
    # stops at the baseline gate: two stages, a few seconds
    config = micro(world, endpoints, taught_model, mlflow=store,
                   baseline={"k": 2, "min_nonzero_share": 1.0, "min_headroom": 0.9})
    client = mlflow_client(store["tracking_uri"])
    assert not _run_in_store(client, "0" * 32)  # a run the store never held

    def stage_tags() -> dict:
        state = agent_rft_pipeline(**pipeline_parameters(config), return_state=True)
        assert state.is_failed()
        parent = client.search_runs([client.get_experiment_by_name("micro").experiment_id],
                                    filter_string="tags.stopped_at = 'baseline'", order_by=["start_time DESC"])[0]
        return parent.data.tags

    first = stage_tags()
    assert first["stage.validate_data.cached"] == "false"
    client.delete_run(first["stage.validate_data.run_id"])
    again = stage_tags()
    assert again["stage.validate_data.cached"] == "false", "served a deleted run from cache"
    assert again["stage.validate_data.run_id"] != first["stage.validate_data.run_id"]
    assert _run_in_store(client, again["stage.validate_data.run_id"])
