"""reward = score - penalties: the budget, per call (with per-tool costs), per token."""

from __future__ import annotations

import pytest

from trainer.config.pipeline import PipelineConfig
from trainer.rollout.record import RolloutRecord, RolloutSettings, ToolCallRecord, compute_reward


def record(score: float | None, calls: list[str], *, status: str = "ok", tokens: int = 0) -> RolloutRecord:
    return RolloutRecord(
        trace_id="t", item_id="i", sample_index=0, messages=[], final_answer="", status=status, score=score,
        tool_calls=[ToolCallRecord(name, "{}", "", 0.0, None, f"c{n}") for n, name in enumerate(calls)],
        tokens_generated=tokens,
    )


def test_per_tool_costs_replace_the_flat_price_for_named_tools():
    settings = RolloutSettings(per_tool_call_penalty=0.05, tool_call_costs={"calculator": 0.0, "cat": 0.1})
    rollout = record(1.0, ["list", "search", "cat", "calculator"])
    compute_reward(rollout, settings)
    assert rollout.penalties == {"tool_calls": pytest.approx(0.05 + 0.05 + 0.1)}
    assert rollout.reward == pytest.approx(0.8)

    free = record(1.0, ["calculator"])
    compute_reward(free, settings)
    assert free.penalties == {} and free.reward == 1.0


def test_correct_only_spares_wrong_answers_and_the_budget_penalty_always_applies():
    settings = RolloutSettings(per_tool_call_penalty=0.02, per_token_penalty=0.001, penalties_correct_only=True)
    wrong = record(0.0, ["search", "search"], tokens=100)
    compute_reward(wrong, settings)
    assert wrong.reward == 0.0 and wrong.penalties == {}

    right = record(1.0, ["search", "search"], tokens=100)
    compute_reward(right, settings)
    assert right.penalties == {"tool_calls": pytest.approx(0.04), "tokens": pytest.approx(0.1)}

    over = record(0.0, ["search"] * 11, status="over_budget")
    compute_reward(over, settings)
    assert over.penalties == {"over_budget": 1.0} and over.reward == -1.0


def test_an_ungraded_rollout_gets_no_reward():
    rollout = record(None, ["search"])
    compute_reward(rollout, RolloutSettings(per_tool_call_penalty=0.1))
    assert rollout.reward is None


MINIMAL = {"model": {"base_model": "m"}, "grader": {"type": "string_check", "name": "g", "input": "{{sample.output_text}}",
                                                   "reference": "1", "operation": "eq"}}


def test_config_carries_tool_costs_and_rejects_a_negative_one():
    config = PipelineConfig.model_validate({**MINIMAL, "penalties": {"per_tool_call": 0.02,
                                                                     "tool_call_costs": {"calculator": 0}}})
    settings = RolloutSettings.from_config(config.rollout, config.penalties)
    assert settings.tool_call_costs == {"calculator": 0.0}
    with pytest.raises(Exception, match="tool_call_costs"):
        PipelineConfig.model_validate({**MINIMAL, "penalties": {"tool_call_costs": {"search": -1}}})


@pytest.mark.parametrize("correct_only", [False, True])
@pytest.mark.parametrize("costs", [{}, {"calculator": 0.0}, {"search": 0.2}])
def test_a_broken_call_never_pays_better_than_a_real_one(correct_only, costs):
    """The reward hack of a free malformed call, closed: "broken call + right answer" is
    never above "real call + right answer", whatever the prices and correct_only."""
    settings = RolloutSettings(per_tool_call_penalty=0.05, tool_call_costs=costs, penalties_correct_only=correct_only)
    for tool in ("search", "calculator"):
        real = record(1.0, [tool])
        broken = record(1.0, [])
        broken.malformed_tool_calls = 1
        compute_reward(real, settings)
        compute_reward(broken, settings)
        assert broken.reward <= real.reward, (tool, broken.penalties, real.penalties)


def test_per_turn_and_overlong_penalties():
    settings = RolloutSettings(per_turn_penalty=0.1, overlong_penalty=0.5, max_new_tokens_per_turn=100,
                               overlong_buffer_tokens=20)
    sequential = record(1.0, ["search", "cat"])
    sequential.finish_reasons = ["tool_calls", "tool_calls", "stop"]
    sequential.turn_tokens = [30, 85, 10]  # 5 tokens into the 20-token overlong zone
    compute_reward(sequential, settings)
    assert sequential.penalties == {"turns": pytest.approx(0.2), "overlong": pytest.approx(0.5 * 5 / 20)}
    parallel = record(1.0, ["search", "cat"])
    parallel.finish_reasons = ["tool_calls", "stop"]
    parallel.turn_tokens = [40, 10]
    compute_reward(parallel, settings)
    assert parallel.penalties == {"turns": pytest.approx(0.1)} and parallel.reward > sequential.reward


def test_a_priced_tool_the_items_do_not_offer_is_a_clear_error():
    from trainer.errors import ConfigError
    from trainer.rollout.record import check_tool_call_costs

    items = [{"tools": [{"type": "function", "function": {"name": n}} for n in ("search", "calculator")]}]
    check_tool_call_costs({"calculator": 0.0}, items, "data/train.jsonl")
    with pytest.raises(ConfigError, match=r"'calcualtor'.*data/train\.jsonl.*calculator, search"):
        check_tool_call_costs({"calcualtor": 0.0}, items, "data/train.jsonl")


def test_a_repeated_call_pays_its_price_and_the_repeat_price():
    settings = RolloutSettings(per_tool_call_penalty=0.05, repeated_call_penalty=0.1)
    rollout = record(1.0, [])
    rollout.tool_calls = [
        ToolCallRecord("calculator", '{"expression": "2*3"}', "6", 0.0, None, "c0"),
        ToolCallRecord("calculator", '{ "expression":"2*3" }', "6", 0.0, None, "c1"),  # same call, other spacing
        ToolCallRecord("calculator", '{"expression": "2*4"}', "8", 0.0, None, "c2"),  # other arguments
        ToolCallRecord("search", '{"expression": "2*3"}', "", 0.0, None, "c3"),  # other tool
        ToolCallRecord("calculator", '{"expression": "2*3"}', "6", 0.0, None, "c4"),  # a second repeat
    ]
    assert rollout.repeated_tool_calls == 2
    compute_reward(rollout, settings)
    assert rollout.penalties == {"tool_calls": pytest.approx(5 * 0.05), "repeated_calls": pytest.approx(0.2)}
    assert rollout.reward == pytest.approx(1.0 - 0.25 - 0.2)

    wrong = record(0.0, ["list", "list"])
    compute_reward(wrong, RolloutSettings(repeated_call_penalty=0.1, penalties_correct_only=True))
    assert wrong.penalties == {} and wrong.reward == 0.0  # correct_only: a wrong answer is never cheaper


def test_repeated_calls_are_counted_in_the_evaluation_summary():
    from trainer.rollout.evaluate import summarize

    once, twice = record(1.0, ["search", "cat"]), record(1.0, ["cat", "cat", "cat"])
    summary = summarize([once, twice], prefix="eval")
    assert summary.metrics["eval/repeated_calls"] == pytest.approx((0 + 2) / 2)
    config = PipelineConfig.model_validate({**MINIMAL, "penalties": {"repeated_call": 0.1}})
    assert RolloutSettings.from_config(config.rollout, config.penalties).repeated_call_penalty == 0.1
