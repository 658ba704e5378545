"""The warm start in the pipeline, end to end on the micro world (Prefect's test harness,
MLflow on SQLite, the real tool server): a model that never calls stops at the baseline
with the remedy named; given demonstrations the pipeline says so, warm-starts, measures the
baseline again on the warm-started model and gates on that."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tasks.tracking import mlflow_client
from tests.pipeline_world import micro
from tests.taught_model import scripts, silent_scripts, teach_model, write_demonstrations
from trainer.data import read_items
from trainer.errors import DataError

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def silent_model(world: Path, endpoints) -> Path:
    """A tiny model taught to answer "0" at once, every time: it never calls a tool."""
    data = world / "data"
    files = [data / f"{split}.jsonl" for split in ("train", "validation", "test")]
    return teach_model(files, data / "corpus", endpoints, world / "silent-model", epochs=200, batch_share=0.5, ways=silent_scripts,
                       vocabulary=scripts)


def _store(world: Path) -> dict:
    return {"tracking_uri": f"sqlite:///{world / 'warm-start-tests.db'}", "experiment": "warm"}


def _stage_runs(client, parent_run_id: str) -> dict:
    """Each stage's run as the parent names it: a stage served from cache (the first test ran
    validate_data and the baseline on the same inputs) is another parent's child."""
    tags = client.get_run(parent_run_id).data.tags
    return {key.removeprefix("stage.").removesuffix(".run_id"): client.get_run(value) for key, value in tags.items()
            if key.startswith("stage.") and key.endswith(".run_id")}


# Gates the silent model fails on signal; the headroom gate (best-of-2 can exceed the mean by
# 0.5 at most) is one no model passes, so the run stops after the second baseline, wherever
# the warm start leaves the score.
GATES = {"k": 2, "min_nonzero_share": 0.5, "min_headroom": 0.9}


def test_no_signal_and_no_demonstrations_stops_naming_the_warm_start(harness, world, endpoints, silent_model):
    from flows.pipeline import agent_rft_pipeline, pipeline_parameters

    config = micro(world, endpoints, silent_model, mlflow=_store(world), baseline=GATES)
    state = agent_rft_pipeline(**pipeline_parameters(config), return_state=True)
    assert state.is_failed()
    with pytest.raises(Exception, match=r"baseline gate failed: only 0% of items are solved.*warm-start it: write "
                                        r"demonstrations.*warm_start\.demonstrations_file"):
        state.result()


def test_no_signal_warm_starts_and_measures_the_baseline_again(harness, world, endpoints, silent_model):
    from flows.pipeline import agent_rft_pipeline, pipeline_parameters

    demos = write_demonstrations(read_items(world / "data" / "train.jsonl"), endpoints, world / "warm-demos.jsonl",
                                 ways=lambda item: scripts(item)[:2])  # list then answer; read then answer
    config = micro(world, endpoints, silent_model, mlflow=_store(world), baseline=GATES, warm_start={
        "demonstrations_file": str(demos), "n_epochs": 150, "batch_size": 4, "learning_rate": 1e-2, "lr_schedule": "constant",
        "checkpoint_interval": 50})
    state = agent_rft_pipeline(**pipeline_parameters(config), return_state=True)
    assert state.is_failed()
    with pytest.raises(Exception, match=r"baseline gate failed after the warm start on .*warm-demos\.jsonl "
                                        r"\(150 steps, model models:/[^)]*\): (?!.*warm-start it).*best-of-2 is only"):
        state.result()

    client = mlflow_client(config.mlflow.tracking_uri)
    parent = client.search_runs([client.get_experiment_by_name("warm").experiment_id],
                                filter_string="tags.stopped_at = 'baseline_after_warm_start'")[0]
    assert parent.data.tags["warm_start"].startswith("the baseline shows no signal (0% of items solved")
    stages = _stage_runs(client, parent.info.run_id)
    assert sorted(stages) == ["baseline", "baseline_after_warm_start", "prompt_optimization", "validate_data",
                              "warm_start"]
    before, after = stages["baseline"].data.metrics, stages["baseline_after_warm_start"].data.metrics
    # The base never calls; the warm-started model is measured again on the same validation items.
    assert before["baseline/tool_calls_mean"] == 0 and before["baseline/nonzero_best_share"] == 0
    assert after["baseline/rollouts"] == before["baseline/rollouts"]
    assert stages["baseline_after_warm_start"].data.tags["gates"].startswith("failed")
    fit = stages["warm_start"]
    assert fit.data.tags["model"].startswith("models:/")
    history = client.get_metric_history(fit.info.run_id, "warm_start/train_loss")
    assert sorted(m.step for m in history) == list(range(1, 151))
    losses = [m.value for m in sorted(history, key=lambda m: m.step)]
    assert losses[-1] < 0.2 * losses[0]
    accuracy = client.get_metric_history(fit.info.run_id, "warm_start/train_mean_token_accuracy")
    assert max(m.step for m in accuracy) == 150 and sorted(accuracy, key=lambda m: m.step)[-1].value > 0.9


def test_when_the_pipeline_warm_starts(world, endpoints, tmp_path):
    from flows.pipeline import _demonstrations_md5, _warm_start_reason
    from tasks.baseline import baseline_gates
    from tasks.results import BaselineResult

    demos = tmp_path / "demos.jsonl"
    demos.write_text(json.dumps({"messages": [{"role": "user", "content": "2+2?"},
                                              {"role": "assistant", "content": "4"}]}) + "\n")

    def result(config, share: float) -> BaselineResult:
        metrics = {"baseline/nonzero_best_share": share, "baseline/headroom": 0.0, "baseline/tool_calls_mean": 0.0}
        return BaselineResult(run_id="r", model="m", metrics=metrics, gates=baseline_gates(metrics, config.baseline))

    model = world / "model-that-is-not-loaded"
    without = micro(world, endpoints, model, baseline=GATES)
    assert _warm_start_reason(without, result(without, 0.0)) == "" and _demonstrations_md5(without) == ""
    config = micro(world, endpoints, model, baseline=GATES, warm_start={"demonstrations_file": str(demos)})
    assert _warm_start_reason(config, result(config, 0.0)).startswith("the baseline shows no signal (0% of items")
    assert _warm_start_reason(config, result(config, 0.5)) == ""  # signal: the headroom gate alone decides
    always = micro(world, endpoints, model, baseline=GATES, warm_start={"demonstrations_file": str(demos),
                                                                        "when": "always"})
    assert _warm_start_reason(always, result(always, 0.5)).startswith("warm_start.when is always")
    assert len(_demonstrations_md5(config)) == 32
    demos.write_text('{"messages": [{"role": "user", "content": "2+2?"}]}\n')
    with pytest.raises(DataError, match=r"demos\.jsonl:1: no assistant turn to learn from"):
        _demonstrations_md5(config)
