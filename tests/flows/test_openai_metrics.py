"""A job's metrics events and checkpoint metrics in OpenAI's shapes, from the trainer's own
MLflow names (fast: no server). The end-to-end jobs in test_openai_api.py read them back
through the SDK."""

from __future__ import annotations

import pytest

from flows.openai_api.runs import reinforcement_message, reinforcement_metrics, total_steps
from trainer.rollout.evaluate import summarize
from trainer.rollout.record import RolloutRecord

MULTI = {"type": "multi", "name": "both", "calculate_output": "0.5 * exact + 0.5 * near",
         "graders": {"exact": {"type": "string_check", "name": "exact", "operation": "eq",
                               "input": "{{sample.output_text}}", "reference": "{{item.answer}}"},
                     "near": {"type": "text_similarity", "name": "near", "evaluation_metric": "fuzzy_match",
                              "input": "{{sample.output_text}}", "reference": "{{item.answer}}"}}}


def _record(item: str, score: float | None, sub: dict[str, float], *, errors: dict[str, str] | None = None,
            tokens: int = 10, reasoning: int = 4) -> RolloutRecord:
    return RolloutRecord(trace_id=f"trace_{item}", item_id=item, sample_index=0, messages=[], tool_calls=[],
                         final_answer="", status="ok", score=score, reward=score, sub_rewards=sub,
                         grader_errors=errors or {}, tokens_generated=tokens, reasoning_tokens=reasoning)


def test_a_training_step_maps_to_openais_rft_metrics_event():
    train = summarize([_record("a", 1.0, {"exact": 1.0, "near": 1.0}),
                       _record("b", 0.25, {"exact": 0.0, "near": 0.5}, tokens=30, reasoning=8),
                       _record("c", None, {"exact": 0.0}, errors={"sample_parse_error": "no JSON"})],
                      prefix="train").metrics
    valid = summarize([_record("d", 0.5, {"exact": 0.0, "near": 1.0})], prefix="eval").metrics
    assert train["train/sub_reward/exact_mean"] == pytest.approx(1 / 3)  # over every rollout that has it
    assert train["train/grader_error/sample_parse_error"] == 1.0
    metrics = {**train, **valid, "train/loss": 0.1, "timing/sampling_s": 3.0, "timing/training_s": 2.0,
               "timing/eval_s": 1.0, "timing/step_s": 6.5, "progress/total_steps": 20.0}

    data = reinforcement_metrics(metrics, 10, 20, MULTI)

    assert (data["step"], data["total_steps"]) == (10, 20)
    assert data["scores"]["train_reward_mean"] == pytest.approx((1.0 + 0.25) / 2)  # the scored rollouts
    assert data["scores"]["valid_reward_mean"] == 0.5
    assert data["scores"]["graders"] == [
        {"name": "exact", "type": "string_check", "train_reward_mean": pytest.approx(1 / 3), "valid_reward_mean": 0.0},
        {"name": "near", "type": "text_similarity", "train_reward_mean": 0.75, "valid_reward_mean": 1.0}]
    assert data["train_mean_reward"] == data["scores"]["train_reward_mean"]
    assert data["full_valid_mean_reward"] == 0.5
    samples = data["usage"]["samples"]
    assert samples["train_completion_tokens_mean"] == pytest.approx(50 / 3)
    assert samples["train_completion_tokens_count"] == pytest.approx(50)
    assert samples["train_reasoning_tokens_count"] == pytest.approx(16) and samples["valid_reasoning_tokens_mean"] == 4
    errors = data["errors"]["graders"][0]
    assert (errors["name"], errors["type"]) == ("both", "multi")
    assert errors["train_sample_parse_error_count"] == 1.0
    assert errors["train_sample_parse_error_mean"] == pytest.approx(1 / 3)
    assert errors["valid_sample_parse_error_count"] == 0.0 and errors["train_other_error_count"] == 0.0
    assert data["full_valid_mean_parse_error"] == 0.0
    assert data["timing"]["step"] == {"sampling": 3.0, "training": 2.0, "eval": 1.0, "full_iteration": 6.5}
    assert data["agentrft"]["train/loss"] == 0.1 and data["agentrft"]["eval/score_mean"] == 0.5  # ours, beside
    assert reinforcement_message(data) == "Step 10/20, train mean reward=0.62, full validation mean reward=0.50"


def test_the_evaluation_before_the_first_step_has_only_validation_figures():
    valid = summarize([_record("d", 0.5, {})], prefix="eval").metrics
    data = reinforcement_metrics(valid, 0, None, {"type": "string_check", "name": "exact"})
    assert "train_reward_mean" not in data["scores"] and "total_steps" not in data
    assert data["scores"]["graders"] == [{"name": "exact", "type": "string_check", "valid_reward_mean": 0.5}]
    assert reinforcement_message(data) == "Step 0, full validation mean reward=0.50"


def test_total_steps_is_what_the_trainer_logged():
    steps = {0: {"metrics": {"eval/reward_mean": 0.1}}, 1: {"metrics": {"progress/total_steps": 3.0}}}
    assert total_steps(steps) == 3 and total_steps({0: {"metrics": {}}}) is None
