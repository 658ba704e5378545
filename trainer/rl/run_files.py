"""A training run's records: evaluations on validation items and the best models they keep,
checkpoints to resume from, the step's kept rollouts and the final model with its figures
and summary. trainer/rl/grpo.py's `GRPOTrainer` holds the state these read and write."""

from __future__ import annotations

import json
import math
import shutil
import time
from pathlib import Path
from typing import Any

from trainer.chat_formats import describe as describe_chat_format
from trainer.errors import ConfigError
from trainer.plots import plot_training
from trainer.rl.batches import without_tokens
from trainer.rl.checkpoint import BestCheckpoints, load_checkpoint, save_checkpoint, save_model
from trainer.rl.loss import derived_seed
from trainer.rollout.evaluate import summarize
from trainer.rollout.record import RolloutRecord

KEPT_GROUPS = 4  # groups per step whose best and worst rollouts are written out whole


def evaluate(trainer: Any, step: int) -> dict[str, float]:
    """Score the current weights on the evaluation items (one sample each, the same seed every
    time) and keep the model among the best ones when its validation metric earns it."""
    from accelerate.utils import gather_object

    acc = trainer.accelerator
    started = time.perf_counter()
    share = math.ceil(len(trainer.eval_items) / acc.num_processes)
    mine = trainer.eval_items[acc.process_index * share : (acc.process_index + 1) * share]
    # The same seed at every evaluation: the differences are the model's.
    records = trainer.rollouts(mine, 1, derived_seed(trainer.config.training.seed, "eval"), step)
    everything = gather_object([without_tokens(r) for r in records])
    metrics = summarize(everything, prefix="eval").metrics
    if trainer.is_main:
        path = trainer.rollouts_dir / f"eval_step_{step}.jsonl"
        path.write_text("".join(json.dumps(r.to_json()) + "\n" for r in everything))
        trainer.sink.log_traces(everything[: trainer.config.mlflow.traces_per_evaluation], step=step, kind="eval")
    score = metrics["eval/score_mean"]
    rank_by = metrics[f"eval/{trainer.config.training.metric_for_best_model}_mean"]
    if step > 0 and trainer.best.admits(rank_by):
        best = BestCheckpoints(trainer.best.root, trainer.best.keep, trainer.best.to_json())
        path, evicted = best.add(step, rank_by)
        save_model(acc, trainer.saved_model(), trainer.tokenizer, path)
        trainer.best = best  # recorded only once its model is on disk (a full disk raises before)
        if trainer.is_main:
            for old in evicted:
                shutil.rmtree(old, ignore_errors=True)
    metrics["timing/eval_s"] = time.perf_counter() - started
    if trainer.is_main:
        print(f"step {step}: validation score {score:.3f}, reward {metrics['eval/reward_mean']:.3f}, "
              f"tool calls {metrics['eval/tool_calls_mean']:.2f}, tokens {metrics['eval/tokens_mean']:.0f}",
              flush=True)
    return metrics


def fingerprint(trainer: Any) -> dict[str, Any]:
    """What must not change between a checkpoint and its resumption."""
    return {
        "seed": trainer.config.training.seed,
        "batch_size": trainer.hp["batch_size"],
        "group_size": trainer.hp["group_size"],
        "train_items": len(trainer.train_items),
    }


def restore(trainer: Any, path: Path) -> None:
    """Continue from the checkpoint at `path`, refusing one written with other settings."""
    state = load_checkpoint(trainer.accelerator, path, sharded=trainer.sharded_state())
    changed = {
        key: (value, state["fingerprint"].get(key))
        for key, value in fingerprint(trainer).items()
        if state["fingerprint"].get(key) != value
    }
    if changed:
        described = ", ".join(f"{k}: now {now}, checkpoint {then}" for k, (now, then) in changed.items())
        raise ConfigError(
            f"{path}: the checkpoint was written with another config ({described}); resume with "
            "the same training settings or choose another output directory"
        )
    trainer.step = state["step"]
    trainer.history = state["history"]
    trainer.data_state = (state["epoch"], state["position"])
    trainer.data.restore(state["epoch"], state["order"])
    trainer.best = BestCheckpoints(trainer.best.root, trainer.best.keep, state["best"])
    if trainer.is_main:
        trainer.sink.rewrite(trainer.history)
        for stale in trainer.best.stale_dirs():
            shutil.rmtree(stale)
        print(f"resumed from {path} at step {trainer.step}")
    trainer.refresh_whole()
    trainer.generator.sync(trainer.step)


def checkpoint(trainer: Any) -> None:
    """Write the trainer's state at its current step: weights, optimizer, data order, history, best models."""
    epoch, position = trainer.data_state
    state = {
        "epoch": epoch,
        "position": position,
        "order": trainer.data.order(epoch),
        "history": trainer.history,
        "best": trainer.best.to_json(),
        "fingerprint": fingerprint(trainer),
    }
    save_checkpoint(trainer.accelerator, trainer.checkpoints_dir, trainer.step, state, sharded=trainer.sharded_state())


def keep_rollouts(trainer: Any, step: int, gathered: list[tuple[RolloutRecord, float | None]]) -> None:
    """Write the best and the worst rollout of the step's first groups, whole, and
    log them as MLflow traces."""
    group_size = trainer.hp["group_size"]
    rows, kept = [], []
    for start in range(0, min(len(gathered), KEPT_GROUPS * group_size), group_size):
        group = gathered[start : start + group_size]
        scored = [pair for pair in group if pair[0].reward is not None] or group
        ranked = sorted(scored, key=lambda pair: pair[0].reward if pair[0].reward is not None else -math.inf)
        for kind, (record, advantage) in [("best", ranked[-1])] + ([("worst", ranked[0])] if len(ranked) > 1 else []):
            rows.append({"step": step, "kept_as": kind, "advantage": advantage, **record.to_json()})
            kept.append(record)
    (trainer.rollouts_dir / f"step_{step}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    trainer.sink.log_traces(kept[: trainer.config.mlflow.traces_per_evaluation], step=step, kind="train")


def finish(trainer: Any) -> Path:
    """Save the final model, draw the figures and hand the artifacts to MLflow."""
    from trainer.data import read_jsonl

    final = trainer.output_dir / "final"
    save_model(trainer.accelerator, trainer.saved_model(), trainer.tokenizer, final)
    if trainer.is_main:
        figures = trainer.output_dir / "figures"
        plot_training(
            trainer.history,
            read_jsonl(trainer.rollouts_dir / "eval_step_0.jsonl", missing_ok=True),
            read_jsonl(trainer.rollouts_dir / f"eval_step_{trainer.step}.jsonl", missing_ok=True),
            figures,
        )
        summary = {
            "model_dir": str(final),
            "steps": trainer.step,
            "chat_format": describe_chat_format(trainer.chat),
            "best_checkpoints": trainer.best.to_json(),
            "metrics": trainer.history[-1],
        }
        (trainer.output_dir / "train_result.json").write_text(json.dumps(summary, indent=2))
        trainer.sink.log_artifacts(figures, "figures")
        trainer.sink.log_artifacts(trainer.rollouts_dir, "rollouts")
        trainer.sink.flush_traces()
    return final
