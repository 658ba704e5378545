"""Evaluation of a model on held-out items: k samples per item, summarised.

RL needs two things from the base model, and this is where they are measured: a
non-zero baseline (some items solved at least once in k tries) and headroom (best-of-k
above the mean, i.e. variation inside a group that GRPO's advantages can use). Per item:
mean, best-of-k and spread of the score. Overall: mean score, mean best-of-k, the share of
items whose best is above zero, tool calls mean/p95/max, generated tokens, latency
mean/p95, status counts and grader errors. Figures: the per-item spread plot (items sorted
by mean, with min and max, as in the FinQA baseline of OpenAI's talk) and a tool-calls
histogram.

Nothing here knows Prefect or MLflow: the pipeline's tasks log what this returns.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from trainer.rollout import RolloutRecord


@dataclass
class ItemSummary:
    item_id: str
    category: str | None
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
    category_means: dict[str, float] = field(default_factory=dict)

    def item_table(self) -> list[dict[str, Any]]:
        return [item.__dict__.copy() for item in self.items]


def _percentile(values: Sequence[float], q: float) -> float:
    return float(np.percentile(values, q)) if len(values) else 0.0


def summarize(records: Sequence[RolloutRecord], *, prefix: str = "eval") -> EvalSummary:
    """Summary metrics (named `<prefix>/...`) and the per-item table of `records`.

    Rollouts without a score (infrastructure failure or grader error) are counted but do
    not enter score means: they are no evidence about the model.
    """
    by_item: dict[str, list[RolloutRecord]] = defaultdict(list)
    for record in records:
        by_item[record.item_id].append(record)

    items = []
    for item_id, group in by_item.items():
        scores = [r.score for r in group if r.score is not None]
        items.append(
            ItemSummary(
                item_id=item_id,
                category=group[0].category,
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
        "latency_s_mean": float(np.mean(latency)) if latency else 0.0,
        "latency_s_p50": _percentile(latency, 50),
        "latency_s_p95": _percentile(latency, 95),
        "infra_error_rate": status_counts.get("infra_error", 0) / n,
        "grader_error_rate": sum(1 for r in records if r.grader_errors) / n,
        "over_budget_rate": status_counts.get("over_budget", 0) / n,
        "malformed_tool_calls_mean": float(np.mean([r.malformed_tool_calls for r in records])) if records else 0.0,
        "rollouts": float(len(records)),
        "items": float(len(items)),
    }
    metrics["headroom"] = metrics["best_of_k_mean"] - metrics["score_mean"]
    categories: dict[str, list[float]] = defaultdict(list)
    for record in scored:
        categories[record.category or "none"].append(record.score)
    category_means = {name: float(np.mean(values)) for name, values in sorted(categories.items())}
    return EvalSummary(
        metrics={f"{prefix}/{name}": value for name, value in metrics.items()},
        items=sorted(items, key=lambda i: i.mean),
        status_counts=status_counts,
        grader_errors=grader_errors,
        category_means=category_means,
    )


def write_outputs(summary: EvalSummary, records: Sequence[RolloutRecord], out_dir: Path) -> dict[str, Path]:
    """Write the per-item table, the rollouts (JSONL), the summary and the figures."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {
        "summary": out_dir / "summary.json",
        "items": out_dir / "items.jsonl",
        "rollouts": out_dir / "rollouts.jsonl",
        "spread_plot": out_dir / "per_item_spread.png",
        "tool_calls_hist": out_dir / "tool_calls_hist.png",
    }
    paths["summary"].write_text(
        json.dumps(
            {
                "metrics": summary.metrics,
                "status_counts": summary.status_counts,
                "grader_errors": summary.grader_errors,
                "category_means": summary.category_means,
            },
            indent=2,
        )
    )
    with paths["items"].open("w") as handle:
        for row in summary.item_table():
            handle.write(json.dumps(row) + "\n")
    with paths["rollouts"].open("w") as handle:
        for record in records:
            handle.write(json.dumps(record.to_json()) + "\n")
    plot_item_spread(summary, paths["spread_plot"])
    plot_tool_calls(records, paths["tool_calls_hist"])
    return paths


def plot_item_spread(summary: EvalSummary, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    items = summary.items
    x = np.arange(len(items))
    fig, ax = plt.subplots(figsize=(8, 3.5))
    ax.vlines(x, [i.worst for i in items], [i.best for i in items], color="0.7", linewidth=1, label="min-max")
    ax.plot(x, [i.mean for i in items], ".", color="C0", label="mean")
    ax.set_xlabel("items, sorted by mean score")
    ax.set_ylabel("score")
    ax.set_ylim(-0.05, 1.05)
    ax.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_tool_calls(records: Sequence[RolloutRecord], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    counts = [len(r.tool_calls) for r in records if r.status != "infra_error"]
    fig, ax = plt.subplots(figsize=(5, 3))
    top = max(counts, default=0)
    ax.hist(counts, bins=np.arange(top + 2) - 0.5, color="C1")
    ax.set_xlabel("tool calls per rollout")
    ax.set_ylabel("rollouts")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_evaluation(
    backend: Any,
    tokenizer: Any,
    items: Sequence[dict[str, Any]],
    *,
    k: int,
    endpoints: Sequence[Any],
    grader: dict[str, Any],
    settings: Any,
    tools: list[dict[str, Any]] | None = None,
    tool_options: dict[str, Any] | None = None,
    max_concurrent: int = 64,
    prefix: str = "eval",
) -> tuple[EvalSummary, list[RolloutRecord]]:
    """k rollouts per item through the real tools, graded and summarised."""
    import asyncio

    from trainer.rollout import run_rollouts_async
    from trainer.tools import ToolClient

    async def go() -> list[RolloutRecord]:
        async with ToolClient(list(endpoints), tools, **(tool_options or {})) as client:
            return await run_rollouts_async(
                backend, tokenizer, items, n_per_item=k, tool_client=client, grader=grader,
                settings=settings, tools=tools, max_concurrent=max_concurrent,
            )

    records = asyncio.run(go())
    return summarize(records, prefix=prefix), records
