"""BFCL v4 as a yardstick: a model's accuracy by category, as BFCL's own checker scores it.

`agentrft eval --benchmark bfcl --model M` (flows/cli/run.py) evaluates with the function every
stage evaluates with (`tasks.rollout_eval.evaluate_model`: the embedded engine or vLLM, as
`rollout.backend` says) on `benchmark.yaml`, with BFCL's grader and tool server up
(envs/bfcl/environment.py), and prints `accuracy_table`. `--split all` reads every entry of
every category (the leaderboard's set); validation and test are the recipe's splits.

Accuracy is the mean of BFCL's verdicts (1 or 0) over a category's rollouts: with `k` 1 and
greedy decoding, BFCL's own figure for that category. A rollout BFCL could not grade (an
infrastructure failure, a grader error) is counted apart, never as wrong.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from envs.bfcl.environment import DATA_DIR, HERE

BENCHMARK_CONFIG = HERE / "benchmark.yaml"
ALL_FILE = DATA_DIR / "all.jsonl"


def accuracy_by_category(items: list[dict[str, Any]], records: list[Any]) -> dict[str, dict[str, Any]]:
    """category -> entries, graded rollouts, accuracy, malformed calls a rollout, ungraded rollouts."""
    category = {str(item["id"]): item["category"] for item in items}
    rows: dict[str, dict[str, Any]] = defaultdict(lambda: {"entries": set(), "graded": 0, "right": 0.0,
                                                          "malformed": 0, "ungraded": 0})
    for record in records:
        row = rows[category[record.item_id]]
        row["entries"].add(record.item_id)
        row["malformed"] += record.malformed_tool_calls
        if record.score is None:
            row["ungraded"] += 1
        else:
            row["graded"] += 1
            row["right"] += record.score
    order = {name: i for i, name in enumerate(dict.fromkeys(item["category"] for item in items))}
    return {name: {"entries": len(row["entries"]), "rollouts": row["graded"] + row["ungraded"],
                   "accuracy": row["right"] / row["graded"] if row["graded"] else None,
                   "malformed_per_rollout": row["malformed"] / (row["graded"] + row["ungraded"]),
                   "ungraded": row["ungraded"]}
            for name, row in sorted(rows.items(), key=lambda kv: order[kv[0]])}


def accuracy_table(by_category: dict[str, dict[str, Any]], *, title: str) -> Any:
    """A rich table of `accuracy_by_category`."""
    from rich.table import Table

    table = Table(title=title)
    for column in ("category", "entries", "accuracy", "malformed/rollout", "ungraded"):
        table.add_column(column, justify="left" if column == "category" else "right", no_wrap=True)
    for name, row in by_category.items():
        accuracy = "-" if row["accuracy"] is None else f"{100 * row['accuracy']:.1f}%"
        table.add_row(name, str(row["entries"]), accuracy, f"{row['malformed_per_rollout']:.2f}", str(row["ungraded"]))
    return table


def all_items(limit: int | None = None) -> list[dict[str, Any]]:
    """Every entry of every category (the first `limit`: the file is a round-robin of categories)."""
    from trainer.data import read_items

    return read_items(ALL_FILE, limit, what="BFCL's whole set")
