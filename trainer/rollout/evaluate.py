"""Evaluation of a model on held-out items: k samples per item, summarised.

RL needs two things from the base model, and this is where they are measured: a
non-zero baseline (some items solved at least once in k tries) and headroom (best-of-k
above the mean, i.e. variation inside a group that GRPO's advantages can use). Per item:
mean, best-of-k and spread of the score. Overall: mean score, mean best-of-k, the share of
items whose best is above zero, tool calls mean/p95/max, generated tokens, latency
mean/p95, turns and calls per turn, malformed and repeated calls, truncated rollouts, status counts and
grader errors, and the mean score of each group of items when a grouping field is named
(`promotion.group_by`). Figures: the per-item spread plot and a tool-calls histogram.

Nothing here knows Prefect or MLflow: the pipeline's tasks log what this returns.
"""

from __future__ import annotations

import json
import re
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from trainer.data import write_jsonl
from trainer.plots import plot_item_spread, plot_tool_calls
from trainer.rollout.record import RolloutRecord


@dataclass
class ItemSummary:
    item_id: str
    group: str | None
    n: int
    scored: int
    mean: float
    best: float
    worst: float
    std: float
    tool_calls_mean: float


@dataclass
class EvalSummary:
    metrics: dict[str, float]
    items: list[ItemSummary]
    status_counts: dict[str, int]
    grader_errors: dict[str, int]
    group_means: dict[str, float] = field(default_factory=dict)

    def item_table(self) -> list[dict[str, Any]]:
        return [item.__dict__.copy() for item in self.items]


def _percentile(values: Sequence[float], q: float) -> float:
    return float(np.percentile(values, q)) if len(values) else 0.0


def sub_reward_key(name: str) -> str:
    """The metric (after its prefix) of a multi grader's sub-grader `name`: its mean reward."""
    return "sub_reward/" + re.sub(r"[^\w.-]", "_", name) + "_mean"


def summarize(
    records: Sequence[RolloutRecord], *, prefix: str = "eval", groups: dict[str, str] | None = None
) -> EvalSummary:
    """Summary metrics (named `<prefix>/...`) and the per-item table of `records`;
    `groups` maps item ids to their group (see `item_groups`).

    Rollouts without a score (infrastructure failure or grader error) are counted but do
    not enter score means: they are no evidence about the model.
    """
    groups = groups or {}
    by_item: dict[str, list[RolloutRecord]] = defaultdict(list)
    for record in records:
        by_item[record.item_id].append(record)

    items = []
    for item_id, group in by_item.items():
        scores = [r.score for r in group if r.score is not None]
        items.append(
            ItemSummary(
                item_id=item_id,
                group=groups.get(item_id),
                n=len(group),
                scored=len(scores),
                mean=float(np.mean(scores)) if scores else 0.0,
                best=max(scores) if scores else 0.0,
                worst=min(scores) if scores else 0.0,
                std=float(np.std(scores)) if scores else 0.0,
                tool_calls_mean=float(np.mean([len(r.tool_calls) for r in group])),
            )
        )
    scored_items = [item for item in items if item.scored]
    scored = [r for r in records if r.score is not None]
    tool_calls = [len(r.tool_calls) for r in records if r.status != "infra_error"]
    tokens = [r.tokens_generated for r in records if r.status != "infra_error"]
    reasoning = [r.reasoning_tokens for r in records if r.status != "infra_error"]
    latency = [r.latency_s for r in records if r.status != "infra_error"]
    status_counts = dict(Counter(r.status for r in records))
    grader_errors = dict(Counter(kind for r in records for kind in r.grader_errors))

    n = max(len(records), 1)
    metrics = {
        "score_mean": float(np.mean([r.score for r in scored])) if scored else 0.0,
        "reward_mean": float(np.mean([r.reward for r in scored if r.reward is not None])) if scored else 0.0,
        "best_of_k_mean": float(np.mean([i.best for i in scored_items])) if scored_items else 0.0,
        "nonzero_best_share": (
            sum(1 for i in scored_items if i.best > 0) / len(scored_items) if scored_items else 0.0
        ),
        "score_std_within_item_mean": float(np.mean([i.std for i in scored_items])) if scored_items else 0.0,
        "tool_calls_mean": float(np.mean(tool_calls)) if tool_calls else 0.0,
        "tool_calls_p95": _percentile(tool_calls, 95),
        "tool_calls_max": float(max(tool_calls)) if tool_calls else 0.0,
        "tokens_mean": float(np.mean(tokens)) if tokens else 0.0,
        "reasoning_tokens_mean": float(np.mean(reasoning)) if reasoning else 0.0,
        "latency_s_mean": float(np.mean(latency)) if latency else 0.0,
        "latency_s_p50": _percentile(latency, 50),
        "latency_s_p95": _percentile(latency, 95),
        "infra_error_rate": status_counts.get("infra_error", 0) / n,
        "grader_error_rate": sum(1 for r in records if r.grader_errors) / n,
        "over_budget_rate": status_counts.get("over_budget", 0) / n,
        "malformed_calls": float(np.mean([r.malformed_tool_calls for r in records])) if records else 0.0,
        "repeated_calls": float(np.mean([r.repeated_tool_calls for r in records])) if records else 0.0,
        "turns_mean": float(np.mean([r.turns for r in records])) if records else 0.0,
        "tool_turns_mean": float(np.mean([r.tool_turns for r in records])) if records else 0.0,
        "calls_per_turn": (
            sum(len(r.tool_calls) for r in records) / max(1, sum(r.tool_turns for r in records))
        ),
        "truncated_share": sum(1 for r in records if r.truncated) / n,
        "rollouts": float(len(records)),
        "items": float(len(items)),
    }
    metrics["headroom"] = metrics["best_of_k_mean"] - metrics["score_mean"]
    # A multi grader's sub-graders, each on its own (OpenAI's per-grader scores), and the
    # grader errors by kind (OpenAI's per-flag error counts).
    for name in sorted({name for r in records for name in r.sub_rewards}):
        values = [r.sub_rewards[name] for r in records if name in r.sub_rewards]
        metrics[sub_reward_key(name)] = float(np.mean(values))
    for kind, count in sorted(grader_errors.items()):
        metrics[f"grader_error/{kind}"] = float(count)
    by_group: dict[str, list[float]] = defaultdict(list)
    for record in scored:
        if record.item_id in groups:
            by_group[groups[record.item_id]].append(record.score)
    group_means = {name: float(np.mean(values)) for name, values in sorted(by_group.items())}
    return EvalSummary(
        metrics={f"{prefix}/{name}": value for name, value in metrics.items()},
        items=sorted(items, key=lambda i: i.mean),
        status_counts=status_counts,
        grader_errors=grader_errors,
        group_means=group_means,
    )


def item_groups(items: Sequence[dict[str, Any]], group_by: str | None) -> dict[str, str]:
    """Each item's group: the string value of its `group_by` field ({} when None)."""
    if not group_by:
        return {}
    return {str(item["id"]): str(item.get(group_by)) for item in items}


def write_outputs(summary: EvalSummary, records: Sequence[RolloutRecord], out_dir: Path) -> dict[str, Path]:
    """Write the per-item table, the rollouts (JSONL), the summary and the figures."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {
        "summary": out_dir / "summary.json",
        "items": write_jsonl(out_dir / "items.jsonl", summary.item_table()),
        "rollouts": write_jsonl(out_dir / "rollouts.jsonl", (r.to_json() for r in records)),
        "spread_plot": plot_item_spread(summary.items, out_dir / "per_item_spread.png"),
        "tool_calls_hist": plot_tool_calls({"rollouts": records}, out_dir / "tool_calls_hist.png"),
    }
    paths["summary"].write_text(
        json.dumps(
            {
                "metrics": summary.metrics,
                "status_counts": summary.status_counts,
                "grader_errors": summary.grader_errors,
                "group_means": summary.group_means,
            },
            indent=2,
        )
    )
    return paths


def run_evaluation(
    backend: Any,
    chat: Any,
    items: Sequence[dict[str, Any]],
    *,
    k: int,
    tool_client: Any,
    grader: dict[str, Any],
    settings: Any,
    tools: list[dict[str, Any]] | None = None,
    max_concurrent: int = 64,
    prefix: str = "eval",
    group_by: str | None = None,
    log: Any = None,
) -> tuple[EvalSummary, list[RolloutRecord]]:
    """k rollouts per item through the real tools, graded and summarised; progress (done,
    rate, ETA) goes to `log` (or a bar in a terminal)."""
    import asyncio

    from trainer.progress import Progress
    from trainer.rollout.loop import run_rollouts_async

    with Progress(len(items) * k, f"{prefix} rollouts", log=log) as progress:

        async def go() -> list[RolloutRecord]:
            async with tool_client:
                return await run_rollouts_async(
                    backend, chat, items, n_per_item=k, tool_client=tool_client, grader=grader,
                    settings=settings, tools=tools, max_concurrent=max_concurrent,
                    progress=lambda done, _total: progress.set_done(done),
                )

        records = asyncio.run(go())
    return summarize(records, prefix=prefix, groups=item_groups(items, group_by)), records
