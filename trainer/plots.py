"""Every figure the project draws, in one place.

- `plot_item_spread`: per-item score spread of an evaluation (items sorted by mean, with
  min and max, as in the FinQA baseline of OpenAI's talk);
- `plot_tool_calls`: tool calls per rollout, for one evaluation or several side by side
  (the regression stage's before/after histogram);
- `plot_reward_vs_tool_calls`: reward against tool calls for several evaluations (the
  policy-shift plot of OpenAI's Agent RFT talk);
- `plot_training`: the reward curve, tool calls and tokens over the steps, and the
  policy-shift plot of the evaluations before and after training.

Inputs are rollout rows (`RolloutRecord.to_json()`) or records, so figures can be redrawn
from the JSONL files of any run.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _row(record: Any) -> dict[str, Any]:
    return record if isinstance(record, dict) else record.to_json()


def plot_item_spread(items: Sequence[Any], path: Path) -> Path:
    """`items`: ItemSummary objects (mean, best, worst)."""
    plt = _pyplot()
    ordered = sorted(items, key=lambda i: i.mean)
    x = np.arange(len(ordered))
    fig, ax = plt.subplots(figsize=(8, 3.5))
    ax.vlines(x, [i.worst for i in ordered], [i.best for i in ordered], color="0.7", linewidth=1, label="min-max")
    ax.plot(x, [i.mean for i in ordered], ".", color="C0", label="mean")
    ax.set_xlabel("items, sorted by mean score")
    ax.set_ylabel("score")
    ax.set_ylim(-0.05, 1.05)
    ax.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_tool_calls(runs: Mapping[str, Sequence[Any]], path: Path) -> Path:
    """Histogram of tool calls per rollout, one series per named run."""
    plt = _pyplot()
    rows = {name: [_row(r) for r in records] for name, records in runs.items()}
    counts = {name: [len(r["tool_calls"]) for r in rs if r["status"] != "infra_error"] for name, rs in rows.items()}
    top = max((max(c, default=0) for c in counts.values()), default=0)
    bins = np.arange(top + 2) - 0.5
    fig, ax = plt.subplots(figsize=(6, 3.2))
    for name, values in counts.items():
        ax.hist(values, bins=bins, alpha=0.5 if len(counts) > 1 else 1.0, label=name)
    ax.set_xlabel("tool calls per rollout")
    ax.set_ylabel("rollouts")
    if len(counts) > 1:
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_reward_vs_tool_calls(runs: Mapping[str, Sequence[Any]], path: Path) -> Path:
    """Reward against tool calls, one colour per named run. Tool calls are integers: a
    little seeded jitter sideways keeps overlapping rollouts visible."""
    plt = _pyplot()
    rng = np.random.default_rng(0)
    fig, ax = plt.subplots(figsize=(5.5, 4))
    for name, records in runs.items():
        scored = [r for r in map(_row, records) if r.get("reward") is not None]
        if not scored:
            continue
        calls = np.array([len(r["tool_calls"]) for r in scored], dtype=float)
        rewards = np.array([r["reward"] for r in scored], dtype=float)
        ax.scatter(calls + rng.uniform(-0.15, 0.15, len(calls)), rewards, s=14, alpha=0.5,
                   label=f"{name} (mean {rewards.mean():.2f}, {calls.mean():.1f} calls)")
    ax.set_xlabel("tool calls per rollout")
    ax.set_ylabel("reward")
    ax.legend(loc="best", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _series(history: Sequence[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    points = [(row["step"], row[key]) for row in history if row.get(key) is not None]
    return [s for s, _ in points], [v for _, v in points]


def plot_training(
    history: Sequence[dict[str, Any]],
    before: Sequence[dict[str, Any]],
    after: Sequence[dict[str, Any]],
    out_dir: Path,
) -> list[Path]:
    """Draw the training figures into `out_dir`. `before`/`after` are rollout rows
    (`RolloutRecord.to_json()`) of the evaluations before and after training."""
    from matplotlib.ticker import MaxNLocator

    plt = _pyplot()
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for key, label in (("train/reward_mean", "train reward"), ("eval/reward_mean", "eval reward"),
                       ("eval/score_mean", "eval score")):
        steps, values = _series(history, key)
        if steps:
            ax.plot(steps, values, marker="." if key.startswith("train") else "o", label=label)
    ax.set_xlabel("step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel("mean per rollout")
    ax.legend(loc="best")
    fig.tight_layout()
    paths.append(out_dir / "reward_curve.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.2))
    for ax, what, title in ((axes[0], "tool_calls_mean", "tool calls per rollout"),
                            (axes[1], "tokens_mean", "generated tokens per rollout")):
        for prefix in ("train", "eval"):
            steps, values = _series(history, f"{prefix}/{what}")
            if steps:
                ax.plot(steps, values, marker="." if prefix == "train" else "o", label=prefix)
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_title(title)
        ax.legend(loc="best")
    fig.tight_layout()
    paths.append(out_dir / "tool_calls_tokens.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    paths.append(plot_reward_vs_tool_calls({"before training": before, "after training": after},
                                           out_dir / "policy_shift.png"))
    return paths
