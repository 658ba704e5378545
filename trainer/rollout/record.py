"""The rollout record (one per rollout: messages, tool calls, score, reward, penalties,
tokens, latency, status) and how a score becomes a reward."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from trainer.errors import ConfigError

STATUSES = ("ok", "over_budget", "max_turns", "malformed_call", "truncated", "infra_error")


@dataclass
class ToolCallRecord:
    name: str
    arguments: str
    output: str
    latency_s: float
    error: str | None
    call_id: str
    turn: int = 0  # the assistant turn (1-based) that made the call


@dataclass
class RolloutRecord:
    trace_id: str
    item_id: str
    sample_index: int
    messages: list[dict[str, Any]]
    tool_calls: list[ToolCallRecord]
    final_answer: str
    status: str
    score: float | None = None
    reward: float | None = None
    penalties: dict[str, float] = field(default_factory=dict)
    grader_errors: dict[str, str] = field(default_factory=dict)
    sub_rewards: dict[str, float] = field(default_factory=dict)
    tokens_generated: int = 0
    reasoning_tokens: int = 0  # of tokens_generated, those inside the model's reasoning
    turns: int = 0
    latency_s: float = 0.0
    malformed_tool_calls: int = 0
    finish_reasons: list[str] = field(default_factory=list)
    turn_tokens: list[int] = field(default_factory=list)
    turn_seconds: list[float] = field(default_factory=list)  # generation time of each turn
    started_at: float = 0.0  # wall clock (epoch seconds) when the rollout started
    infra_error: str | None = None
    policy_version: int = 0  # optimizer steps applied to the weights that sampled it
    # For training: every token of the conversation, 1 where the model sampled it.
    token_ids: list[int] = field(default_factory=list, repr=False)
    gen_mask: list[int] = field(default_factory=list, repr=False)
    logprobs: list[float] = field(default_factory=list, repr=False)

    @property
    def trainable(self) -> bool:
        """Usable in the loss: no infrastructure failure and a grader score."""
        return self.status != "infra_error" and self.reward is not None

    @property
    def truncated(self) -> bool:
        """A turn was cut by the token limit."""
        return "length" in self.finish_reasons

    @property
    def repeated_tool_calls(self) -> int:
        """Calls with the same tool and arguments (compared as parsed JSON) as an earlier call."""
        seen: set[tuple[str, str]] = set()
        repeats = 0
        for call in self.tool_calls:
            try:
                arguments = json.dumps(json.loads(call.arguments), sort_keys=True)
            except ValueError:
                arguments = call.arguments
            repeats += (call.name, arguments) in seen
            seen.add((call.name, arguments))
        return repeats

    @property
    def tool_turns(self) -> int:
        """Assistant turns that called tools."""
        return self.finish_reasons.count("tool_calls")

    def to_json(self, *, with_tokens: bool = False) -> dict[str, Any]:
        record = asdict(self)
        if not with_tokens:
            for key in ("token_ids", "gen_mask", "logprobs"):
                record.pop(key)
        return record


@dataclass
class RolloutSettings:
    """What the agent loop needs from the config's `rollout` and `penalties` sections."""

    system_prompt: str | None = None
    max_episode_steps: int = 10
    max_turns: int = 12
    max_new_tokens_per_turn: int = 256
    max_total_tokens: int = 2048
    temperature: float = 1.0
    top_p: float = 1.0
    on_malformed_call: str = "end"
    over_budget_penalty: float = 1.0
    per_tool_call_penalty: float = 0.0
    tool_call_costs: dict[str, float] = field(default_factory=dict)
    malformed_call_penalty: float = 0.0
    repeated_call_penalty: float = 0.0
    per_turn_penalty: float = 0.0
    per_token_penalty: float = 0.0
    overlong_penalty: float = 0.0
    overlong_buffer_tokens: int = 64
    penalties_correct_only: bool = False

    @classmethod
    def from_config(cls, rollout: Any, penalties: Any) -> RolloutSettings:
        return cls(
            system_prompt=rollout.system_prompt,
            max_episode_steps=rollout.max_episode_steps,
            max_turns=rollout.max_turns,
            max_new_tokens_per_turn=rollout.max_new_tokens_per_turn,
            max_total_tokens=rollout.max_total_tokens,
            temperature=rollout.temperature,
            top_p=rollout.top_p,
            on_malformed_call=rollout.on_malformed_call,
            over_budget_penalty=penalties.over_budget,
            per_tool_call_penalty=penalties.per_tool_call,
            tool_call_costs=dict(penalties.tool_call_costs),
            malformed_call_penalty=penalties.malformed_call,
            repeated_call_penalty=penalties.repeated_call,
            per_turn_penalty=penalties.per_turn,
            per_token_penalty=penalties.per_token,
            overlong_penalty=penalties.overlong,
            overlong_buffer_tokens=penalties.overlong_buffer_tokens,
            penalties_correct_only=penalties.correct_only,
        )

    @property
    def malformed_call_price(self) -> float:
        """A malformed call costs at least as much as the dearest real call, plus its own
        penalty: a broken call must never be the cheap way to a right answer."""
        return max([self.per_tool_call_penalty, *self.tool_call_costs.values()]) + self.malformed_call_penalty


def check_tool_call_costs(
    costs: dict[str, float], items: Sequence[dict[str, Any]], source: str, tools: list[dict[str, Any]] | None = None
) -> None:
    """A priced tool must be one the items offer: a misspelt name would leave that tool at
    the default price without a word."""
    offered = {tool["function"]["name"] for tool in tools} if tools is not None else {
        tool["function"]["name"] for item in items for tool in item.get("tools", [])
    }
    unknown = sorted(set(costs) - offered)
    if unknown:
        raise ConfigError(
            f"penalties.tool_call_costs names {', '.join(map(repr, unknown))}, which no item of {source} "
            f"offers (its tools: {', '.join(sorted(offered)) or 'none'}); fix the name or remove it"
        )


def compute_reward(record: RolloutRecord, settings: RolloutSettings) -> None:
    """reward = score - penalties: over the budget, per tool call (malformed ones at their
    own price, repeated ones at an extra price), per tool-calling turn, per token, and the soft
    overlong penalty."""
    if record.score is None:
        return
    penalties = {}
    if record.status == "over_budget" and settings.over_budget_penalty:
        penalties["over_budget"] = settings.over_budget_penalty
    shaped = record.score > 0 or not settings.penalties_correct_only
    calls_cost = sum(
        settings.tool_call_costs.get(call.name, settings.per_tool_call_penalty) for call in record.tool_calls
    )
    if shaped and calls_cost:
        penalties["tool_calls"] = calls_cost
    if shaped and settings.repeated_call_penalty and (repeats := record.repeated_tool_calls):
        penalties["repeated_calls"] = settings.repeated_call_penalty * repeats
    if record.malformed_tool_calls and settings.malformed_call_price:
        # charged whatever the score: correct_only must not make a broken call free
        penalties["malformed_calls"] = record.malformed_tool_calls * settings.malformed_call_price
    if shaped and settings.per_turn_penalty and record.tool_turns:
        penalties["turns"] = settings.per_turn_penalty * record.tool_turns
    if shaped and settings.per_token_penalty:
        penalties["tokens"] = settings.per_token_penalty * record.tokens_generated
    if settings.overlong_penalty and record.turn_tokens:
        # DAPO's soft overlong punishment, per turn: linear over the last `buffer` tokens.
        start = settings.max_new_tokens_per_turn - settings.overlong_buffer_tokens
        excess = max(record.turn_tokens) - start
        if excess > 0:
            penalties["overlong"] = settings.overlong_penalty * min(1.0, excess / settings.overlong_buffer_tokens)
    record.penalties = penalties
    record.reward = record.score - sum(penalties.values())
