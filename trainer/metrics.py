"""Where training metrics go, and the figures drawn from them at the end.

`MetricsSink` writes every logged step as one JSON line (`{"step": N, "train/...": ...}`)
to a local file, and, when an MLflow run id is given (the argument or `MLFLOW_RUN_ID`),
sends the same values to that run with `MlflowClient().log_batch`. The client call names
the run explicitly, so it works from any thread or process without an active fluent run:
the Prefect task that owns the run can hand its id to an `accelerate launch`ed trainer.
Only the main process builds a sink; the others never log.

The figures are drawn from the metrics history and the evaluation rollouts, so they can
be redrawn after a resumed run: the reward curve (train and eval), tool calls and tokens
per rollout over the steps, and reward against tool calls before and after training (the
policy-shift plot of OpenAI's Agent RFT talk).
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

# MLflow takes at most 1000 metrics per log_batch call.
_MLFLOW_BATCH = 1000


@contextmanager
def fluent_store(uri: str) -> Iterator[None]:
    """Point MLflow's fluent API at `uri` for a block, then restore what was there before
    (`set_tracking_uri` also exports MLFLOW_TRACKING_URI to every later subprocess)."""
    from mlflow.tracking._tracking_service.utils import _use_tracking_uri

    with _use_tracking_uri(uri):
        yield


class MetricsSink:
    """JSONL locally, plus MLflow when a run id is given. `tracking_uri` None uses MLflow's
    own resolution (MLFLOW_TRACKING_URI, else ./mlruns)."""

    def __init__(self, path: Path, *, run_id: str | None = None, tracking_uri: str | None = None):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.run_id = run_id or os.environ.get("MLFLOW_RUN_ID") or None
        self._client = None
        self._already_logged: set[int] = set()
        if self.run_id:
            from mlflow import MlflowClient

            self._client = MlflowClient(tracking_uri=tracking_uri)

    def log(self, metrics: dict[str, float], step: int) -> None:
        """Append one step's metrics; non-finite values are kept locally (as null) but not
        sent to MLflow, which rejects them in some stores."""
        row = {"step": step, **{k: (v if math.isfinite(v) else None) for k, v in metrics.items()}}
        with self.path.open("a", encoding="utf-8") as handle:
            handle.write(json.dumps(row) + "\n")
        if self._client is None or step in self._already_logged:
            return
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(key, float(value), now, step) for key, value in metrics.items() if math.isfinite(value)]
        for start in range(0, len(batch), _MLFLOW_BATCH):
            self._client.log_batch(self.run_id, metrics=batch[start : start + _MLFLOW_BATCH])

    def rewrite(self, history: Sequence[dict[str, Any]]) -> None:
        """Replace the local file by `history` (rows as `log` writes them): a resumed run
        drops the lines of steps that were logged after its checkpoint.

        MLflow cannot forget a logged step, so a run killed between logging a step and
        checkpointing it keeps its first values: steps the MLflow run already holds beyond
        `history` are not sent again (the run keeps one value per step and metric)."""
        with self.path.open("w", encoding="utf-8") as handle:
            for row in history:
                handle.write(json.dumps(row) + "\n")
        if self._client is not None:
            kept = {row["step"] for row in history}
            self._already_logged = {
                m.step
                for key in ("timing/step_s", "eval/score_mean")
                for m in self._client.get_metric_history(self.run_id, key)
            } - kept

    def log_artifacts(self, local_dir: Path, artifact_path: str) -> None:
        """Upload a directory to the MLflow run, when there is one."""
        if self._client is not None:
            self._client.log_artifacts(self.run_id, str(local_dir), artifact_path)


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The rows of a JSONL file (metrics, rollouts), in order; none when it is missing."""
    if not Path(path).is_file():
        return []
    with Path(path).open(encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]


# --- figures ----------------------------------------------------------------------------


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
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

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

    # Tool calls are integers: a little seeded jitter sideways keeps overlapping rollouts visible.
    rng = np.random.default_rng(0)
    fig, ax = plt.subplots(figsize=(5.5, 4))
    for rows, label, color in ((before, "before training", "C0"), (after, "after training", "C3")):
        scored = [r for r in rows if r.get("reward") is not None]
        if not scored:
            continue
        calls = np.array([len(r["tool_calls"]) for r in scored], dtype=float)
        rewards = np.array([r["reward"] for r in scored], dtype=float)
        ax.scatter(calls + rng.uniform(-0.15, 0.15, len(calls)), rewards, s=14, alpha=0.5, color=color,
                   label=f"{label} (mean {rewards.mean():.2f}, {calls.mean():.1f} calls)")
    ax.set_xlabel("tool calls per rollout")
    ax.set_ylabel("reward")
    ax.legend(loc="best", fontsize=8)
    fig.tight_layout()
    paths.append(out_dir / "policy_shift.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    return paths
