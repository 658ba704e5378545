"""`promotion`: the gates a candidate passes before the `champion` alias moves."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from trainer.config.section import Section


class PromotionConfig(Section):
    registered_model: str | None = Field(None, description="MLflow registered model name (None: the job's name).")
    k: int = Field(4, ge=1, description="Samples per test item in the regression evaluation.")
    max_items: int | None = Field(None, ge=1, description="Test items in the regression evaluation.")
    min_gain_lower_bound: float = Field(
        0.0, description="Gate: lower bound of the 95% paired-bootstrap interval of the score gain."
    )
    max_tool_calls_increase: float = Field(
        0.10, description="Gate: allowed relative increase of tool calls per rollout (from a base below "
        "tool_calls_floor: of that floor, as an absolute rise).")
    max_tokens_increase: float = Field(
        0.10, description="Gate: allowed relative increase of generated tokens per rollout (from a base below "
        "tokens_floor: of that floor).")
    max_latency_increase: float = Field(
        0.25, description="Gate: allowed relative increase of latency p50 (from a base below latency_floor_s: of "
        "that floor).")
    tool_calls_floor: float = Field(
        1.0, gt=0, description="Tool calls per rollout below which the base model's figure is too small for a "
        "relative change (24 calls in 240 rollouts: +900% for one call a question): the candidate's rise is judged "
        "in calls, against max_tool_calls_increase x this floor, and reported so.")
    tokens_floor: float = Field(
        16.0, gt=0, description="Generated tokens per rollout below which a relative change is judged in tokens, "
        "against max_tokens_increase x this floor.")
    latency_floor_s: float = Field(
        0.05, gt=0, description="Latency p50 (seconds) below which a relative change is judged in seconds, against "
        "max_latency_increase x this floor.")
    max_tool_calls_mean: float | None = Field(
        None, ge=0, description="Gate: the candidate's tool calls per rollout at most this, whatever the base "
        "model's (None: no absolute gate).")
    max_tokens_mean: float | None = Field(
        None, ge=0, description="Gate: the candidate's generated tokens per rollout at most this (None: no absolute "
        "gate).")
    max_latency_s_p50: float | None = Field(
        None, ge=0, description="Gate: the candidate's latency p50 in seconds at most this (None: no absolute "
        "gate).")
    group_by: str | None = Field(
        None, description="Item field that groups the test items (e.g. category) for the per-group gate; None "
        "skips that gate."
    )
    max_group_drop: float = Field(0.05, ge=0, description="Gate: no group may fall more than this.")
    check_hack_patterns: bool = Field(
        True, description="Gate: among paid rollouts, the candidate's share whose answer has a hack's shape (several "
        "numbers, text addressed to the grader, the question echoed) against the base model's on the same items.")
    max_hack_share_increase: float = Field(
        0.05, ge=0, le=1, description="Gate: how far the candidate's hack-shaped share of paid rollouts may exceed "
        "the base model's.")
    bootstrap_samples: int = Field(
        20000, ge=100, description="Paired bootstrap resamples (20,000: a bound's sd from one seed to another is "
        "~0.05 point of score on 250 items; at 2,000 ~0.15, enough to decide a gate sitting near a bound).")
    concurrent_runs: Literal["wait", "stop"] = Field(
        "wait", description="Another run training or promoting the same registered model: wait for it, or stop."
    )
    lock_timeout_s: float = Field(6 * 3600.0, gt=0, description="How long `wait` waits before stopping.")
