"""The grader as an MLflow scorer (tasks/scoring.py), against the pipeline's own grading.

The taught model's rollouts of the demo's items, graded by the demo's grader as the
stages grade them, are logged as the stages keep them (traces with the item as the
expectation `item`); `mlflow.genai.evaluate` then scores those traces with the scorer made
from the same grader: every trace's score equals its rollout's, and its reward the
rollout's reward.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tasks.scoring import grader_scorer
from tests.pipeline_world import micro
from trainer.data import split_items
from trainer.errors import ConfigError
from trainer.graders import GraderConfigError

REPO = Path(__file__).resolve().parents[2]
DEMO_GRADER = yaml.safe_load((REPO / "envs" / "finqa" / "demo.yaml").read_text())["grader"]

pytestmark = pytest.mark.integration


def _assessments(trace_id: str, name: str) -> list:
    import mlflow

    return [a for a in mlflow.get_trace(trace_id).info.assessments if a.name == name]


def test_the_scorer_gives_the_pipelines_score_and_reward_on_every_rollout(world, endpoints, taught_model, tmp_path):
    import mlflow

    from tasks.rollout_eval import evaluate_model
    from trainer.rollout.traces import log_rollout_traces

    config = micro(world, endpoints, taught_model, grader=DEMO_GRADER, penalties={"per_tool_call": 0.05},
                   mlflow={"tracking_uri": f"sqlite:///{tmp_path / 'mlflow.db'}", "experiment": "scoring"})
    items = split_items(config.data, "validation")
    _, records = evaluate_model(str(taught_model), items, tracking_uri=None, model_section=config.model,
                                tools=config.tools, grader=config.grader, rollout=config.rollout,
                                penalties=config.penalties, k=4, seed=0, prefix="eval")
    assert {r.score for r in records} - {None} and all(r.score is not None for r in records)
    assert len({r.score for r in records}) > 1 or len({r.reward for r in records}) > 1  # not all alike

    mlflow.set_tracking_uri(config.mlflow.tracking_uri)
    experiment = mlflow.set_experiment("scoring").experiment_id
    client = mlflow.MlflowClient()
    run_id = client.create_run(experiment).info.run_id
    ids = log_rollout_traces(records, experiment_id=experiment, run_id=run_id, step=0, kind="baseline",
                             tracking_uri=config.mlflow.tracking_uri, items={str(i["id"]): i for i in items})
    traces = mlflow.search_traces(run_id=run_id)
    assert len(traces) == len(records)
    result = mlflow.genai.evaluate(data=traces, scorers=[grader_scorer(config.grader, name="demo_grader")])
    assert result.metrics["demo_grader/mean"] == pytest.approx(sum(r.score for r in records) / len(records))
    for trace_id, record in zip(ids, records, strict=True):
        [scored] = _assessments(trace_id, "demo_grader")
        [reward] = _assessments(trace_id, "demo_grader_reward")
        assert scored.value == pytest.approx(record.score, abs=1e-12), record.trace_id
        assert reward.value == pytest.approx(record.reward, abs=1e-12), record.trace_id
        # what the stage logged itself: its grade and the item it graded against
        assert _assessments(trace_id, "score")[0].value == pytest.approx(record.score)
        assert _assessments(trace_id, "item")[0].value["reference_answer"] is not None


def test_rows_without_a_trace_are_scored_from_outputs_and_expectations():
    from mlflow.entities import Feedback

    scorer = grader_scorer(DEMO_GRADER)
    [right] = scorer.run(outputs="Answer: 12.5", expectations={"reference_answer": "12.5"})
    [wrong] = scorer.run(outputs={"choices": [{"message": {"content": "Answer: 3"}}]},
                         expectations={"reference_answer": "12.5"})
    assert isinstance(right, Feedback) and right.value == 1.0 and wrong.value < 1.0
    # a grader that cannot score says why instead of a 0
    [failed] = scorer.run(outputs="Answer: 12.5", expectations={})
    assert failed.value is None and failed.error is not None


def test_a_bad_grader_is_refused_when_the_scorer_is_made():
    with pytest.raises((GraderConfigError, ConfigError), match="type"):
        grader_scorer({"type": "no_such_grader"})
