"""GRPO for tool-using agents, run by Accelerate.

One step of the algorithm:

1. Take the next `batch_size` training items. Every epoch is a permutation of the items
   drawn from the training seed (a remainder smaller than a batch is left out of that
   epoch, so a batch never holds an item twice); the order and the position are part of
   every checkpoint.
2. Run a group of `group_size` rollouts per item through the generation backend and the
   user's tools (trainer/rollout/loop.py) at the rollout temperature. The sampling seed is
   derived from (training seed, step) and each sequence draws from its own generator,
   so a resumed run samples exactly what the uninterrupted one would have. A rollout's
   reward is its grader score minus the configured penalties. With `dynamic_sampling`,
   groups whose rewards are all equal are dropped and fresh items are rolled out until
   the batch is full again, at most `max_resample_batches` more rounds (DAPO).
3. Advantages within each group (trainer/rl/loss.py): only trainable rollouts enter; an
   `infra_error`, a grader error or, with `mask_truncated`, a rollout whose turn was cut
   is left out and counted.
4. `ppo_epochs` passes over those rollouts in micro-batches of similar length. The old
   policy is the trainer itself: `new.detach()` when the step makes one optimizer update,
   one no-grad forward before the first update when it makes several. The sampler's log-probabilities only feed truncated
   importance sampling (`tis_cap`) and the logged sampler-trainer mismatch
   (`train/sampler_kl`, `train/sampler_diff_max`): an inference engine or bf16 kernels do
   not sample with exactly the trainer's numbers. Log-probabilities are computed at the
   generated tokens only, `logprob_chunk_tokens` at a time (trainer/rl/update.py).
   The loss (`loss_type`, `epsilon`, `epsilon_high`, `kl_coef`) is in trainer/rl/loss.py;
   its token weights make an update's gradient the same whatever its micro-batches and
   processes.
5. AdamW, linear warmup reaching the full rate at `warmup_steps`, then a constant, linear
   or cosine schedule; gradient clipping; `mini_batches` optimizer updates per pass.

One step off-policy (`max_staleness: 1`): step t+1's rollouts are sampled in a thread
while step t updates the weights, with the weights of step t - 1 (vLLM servers keep them
until both are done; the embedded engine samples with a frozen copy that the sync after
each step refreshes, in a child process on CPU by default: `rollout.overlap_sampler`,
trainer/rollout/generators.py). Each step checks that its rollouts lag the trainer by at most
`max_staleness` versions (`train/policy_lag_max`), and TIS weighs every token by
min(exp(old - sampler), tis_cap) for the lag. A resumed run's first step samples on-policy.

Evaluation runs before the first step, every `eval_interval` steps and after the last:
one sample per validation item (`eval_samples` items) at the rollout temperature, with the
same seed every time, so two evaluations differ by the model and not by the dice. The
`keep_best_checkpoints` best models by validation reward (`metric_for_best_model`: the grader's
score less the penalties, or the score alone) are saved as model directories
(`best/step_N/`); the last one as `final/`. The test split is never read here.

Distribution (`training.distributed`, trainer/rl/sharding.py): `Accelerator` owns the devices,
mixed precision (bf16 on a GPU by default, over float32 master weights) and DDP; under
`fsdp` the model is sharded with FSDP2 and every process samples with an unsharded copy
refreshed after each step. DeepSpeed is refused (its engine would override the trainer's
per-update accumulation and clipping). With several processes, dynamic sampling draws
its fresh items once for all processes and gives each a distinct share, and
`scale_rewards: batch` divides by the std of every process's rewards. Each process runs the rollouts of its share of the batch's items, so whole groups live on
one process; records are gathered for the metrics; every process runs the same number of
micro-batches (short ones are padded with empty ones) so no collective waits forever. Only
the main process logs and writes.

Outputs under `output_dir`: `metrics.jsonl` (one row per step, step 0 being the evaluation
before training; also sent to MLflow), `rollouts/step_N.jsonl` (the best and the worst
rollout of the step's first groups, whole; also MLflow traces), `rollouts/eval_step_N.jsonl`,
`checkpoints/`, `best/`, `final/`, `figures/` and `train_result.json`.

    agentrft train --config job.yaml
    accelerate launch --num_processes 2 -m flows.cli train --config job.yaml
"""

from __future__ import annotations

import datetime
import math
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from trainer.config.pipeline import PipelineConfig
from trainer.config.tools import ToolEndpoint
from trainer.config.training import resolved_hyperparameters
from trainer.errors import ConfigError, InfraError
from trainer.generation.policy import load_config_policy, local_model_path
from trainer.memory import StepRelease, peak_rss_gib
from trainer.progress import Progress
from trainer.rl.batches import (
    Sample,
    fill_batch,
    in_loss,
    plan_batches,
    resample_share,
    without_tokens,
)
from trainer.rl.checkpoint import BestCheckpoints, latest_checkpoint
from trainer.rl.loss import batch_advantages, derived_seed, lr_factor
from trainer.rl.metrics import MetricsSink, step_metrics
from trainer.rl.nodes import NodeWatch, is_collective_failure
from trainer.rl.run_files import checkpoint, evaluate, finish, keep_rollouts, restore
from trainer.rl.setup import build_model, check_processes, refuse_sharded_launch
from trainer.rl.sharding import resolved_distributed
from trainer.rl.update import PolicyUpdate
from trainer.rollout.record import RolloutRecord, RolloutSettings


@dataclass
class TrainResult:
    model_dir: Path | None  # the final model (None when the run stopped before its end)
    best_checkpoints: list[tuple[int, float, Path]]  # (step, validation metric_for_best_model, model dir), best first
    metrics: dict[str, float]  # the last step's metrics
    steps: int  # steps done, in this and earlier sessions


class GRPOTrainer:
    """One training run: `setup()`, `train()`, `cleanup()`."""

    def __init__(
        self,
        config: PipelineConfig,
        *,
        model_path: str,
        output_dir: Path,
        mlflow_run_id: str | None = None,
        resume: bool = False,
        endpoints: list[ToolEndpoint] | None = None,
    ):
        self.config = config
        self.hp = resolved_hyperparameters(config.training)
        self.model_path = str(model_path)
        self.output_dir = Path(output_dir)
        self.mlflow_run_id = mlflow_run_id
        self.resume = resume
        self.endpoints = list(endpoints if endpoints is not None else config.tools.endpoints)
        self.settings = RolloutSettings.from_config(config.rollout, config.penalties)
        # The engine's logprobs are at T = 1 when it decodes greedily.
        self.temperature = config.rollout.temperature or 1.0
        self._exit = ExitStack()
        self.release = StepRelease()  # memory given back after a step that left the process large

    # -- setup -------------------------------------------------------------------------

    def setup(self) -> None:
        from accelerate import Accelerator
        from accelerate.utils import InitProcessGroupKwargs, set_seed

        training = self.config.training
        refuse_sharded_launch(training.accelerate_config)
        from trainer.rl.sharding import resolved_mixed_precision

        self.distributed = resolved_distributed(training)
        mixed_precision = resolved_mixed_precision(training.mixed_precision)
        # Under FSDP its mixed-precision policy casts (bf16 compute over float32 shards), not autocast.
        timeout = InitProcessGroupKwargs(timeout=datetime.timedelta(seconds=training.collective_timeout_s))
        self.accelerator = acc = Accelerator(mixed_precision="no" if self.distributed == "fsdp" else mixed_precision,
                                             kwargs_handlers=[timeout])
        self.is_main = acc.is_main_process  # this process logs, saves and draws
        set_seed(training.seed)
        check_processes(acc, self.distributed)
        self.watch = NodeWatch(acc)
        if not self.endpoints:
            raise ConfigError("tools.endpoints is empty: declare the endpoint of every tool the model may call")
        self.train_items, self.eval_items, self.data, self.total_steps = plan_batches(
            self.config, self.hp, self.settings, processes=acc.num_processes)

        # float32 master weights unless the config names a dtype: mixed precision casts.
        dtype = "float32" if self.config.model.dtype == "auto" else self.config.model.dtype
        # The run and `models:/` URIs live in the config's store (the pipeline writes the
        # resolved URI into the config it hands over); MLFLOW_TRACKING_URI only when it names none.
        tracking_uri = self.config.mlflow.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
        local = local_model_path(self.model_path, tracking_uri=tracking_uri)
        policy = load_config_policy(self.config.model, local, device=str(acc.device), dtype=dtype)
        self.tokenizer = policy.tokenizer
        self.chat = policy.chat
        self.stop_token_ids = policy.stop_token_ids
        parts = build_model(policy.model, acc, training, distributed=self.distributed,
                            mixed_precision=mixed_precision, learning_rate=self.hp["learning_rate"])
        self.model, self.optimizer, self.reference, self.whole = parts
        kl_by_item = {str(item["id"]): training.kl_coef_of(item) for item in self.train_items}
        self.updater = PolicyUpdate(acc, self.model, self.optimizer, config=self.config, tokenizer=self.tokenizer,
                                    reference=self.reference, temperature=self.temperature,
                                    kl_coef_of=lambda record: kl_by_item[record.item_id],
                                    sharded=self.distributed == "fsdp")
        from trainer.rollout.generators import RolloutContext, make_generator

        self.rollout_context = RolloutContext(self.chat, self.config, self.endpoints, self.settings,
                                              list(self.stop_token_ids))
        self.generator = self._exit.enter_context(make_generator(self.config, self, self.output_dir))

        self.checkpoints_dir = self.output_dir / "checkpoints"
        self.rollouts_dir = self.output_dir / "rollouts"
        self.best = BestCheckpoints(self.output_dir / "best", training.keep_best_checkpoints)
        self.step = 0
        self.history: list[dict[str, Any]] = []
        self.data_state = (0, 0)
        self.sink = None
        if self.is_main:
            self.rollouts_dir.mkdir(parents=True, exist_ok=True)
            self.sink = MetricsSink(
                self.output_dir / "metrics.jsonl", run_id=self.mlflow_run_id, tracking_uri=tracking_uri,
                unavailable_timeout_s=self.config.mlflow.unavailable_timeout_s,
            )
        latest = latest_checkpoint(self.checkpoints_dir)
        if self.resume and latest is not None:
            restore(self, latest)
        elif latest is not None:
            raise ConfigError(
                f"{self.output_dir} holds checkpoints of an earlier run ({latest.name}); pass --resume "
                "to continue it or choose another output directory"
            )
        elif self.is_main:
            if self.resume:
                print(f"no checkpoint in {self.checkpoints_dir}: starting from step 0")
            self.sink.rewrite([])

    def sampling_model(self) -> torch.nn.Module:
        """The whole model that rollouts sample with (and vLLM syncs read)."""
        return self.whole.model if self.whole is not None else self.accelerator.unwrap_model(self.model)

    def sharded_state(self) -> tuple[Any, Any] | None:
        return (self.model, self.optimizer) if self.distributed == "fsdp" else None

    def refresh_whole(self) -> None:
        if self.whole is not None:
            self.whole.refresh(self.model)

    def train(self, *, stop_after: int | None = None) -> TrainResult:
        """Run to the last step, or only up to step `stop_after` (then checkpoint)."""
        training = self.config.training
        last = self.total_steps if stop_after is None else min(self.total_steps, stop_after)
        if self.step == 0 and self.eval_items:
            self._log(0, evaluate(self, 0))  # the starting model, at the same settings
        progress = Progress(self.total_steps, "GRPO", unit="steps", log=print if self.is_main else _quiet)
        progress.done = self.step
        # max_staleness 1: step t+1's rollouts are sampled (with version t - 1) while step t
        # trains; the generator gets version t once both are done.
        ahead = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rollouts-ahead") if training.max_staleness else None
        pending: Future[Sample] | None = None
        with progress:  # its heartbeat thread stops however the loop ends
            try:
                while self.step < last:
                    step = self.step + 1
                    started = time.perf_counter()
                    sample = pending.result() if pending is not None else self._sample(step, step - 1)
                    waited = time.perf_counter() - started
                    pending = (ahead.submit(self._sample, step + 1, step - 1)
                               if ahead is not None and step < last else None)
                    learn_started = time.time()  # wall clock, comparable with the rollouts' started_at
                    metrics = self._learn(sample)
                    metrics["timing/learn_start_unix"], metrics["timing/learn_end_unix"] = learn_started, time.time()
                    if pending is not None:
                        pending_started = time.perf_counter()
                        wait([pending])  # the servers keep version step - 1 until its rollouts are in
                        metrics["timing/ahead_wait_s"] = time.perf_counter() - pending_started
                    metrics["timing/rollout_wait_s"] = waited
                    synced = time.perf_counter()
                    self.refresh_whole()
                    self.generator.sync(step)
                    metrics["timing/sync_s"] = time.perf_counter() - synced
                    due = bool(self.eval_items) and (step % self.hp["eval_interval"] == 0 or step == self.total_steps)
                    metrics.update(evaluate(self, step) if due else {"timing/eval_s": 0.0})
                    metrics["timing/step_s"] = time.perf_counter() - started
                    # the step's engine, batches and heap given back once the process holds a third
                    # of the machine: without it the real-model recipe's trainer grew to 23 GB by
                    # step 15 and was OOM-killed (docs/real-model.md); the demo's stays far below it
                    del sample
                    released = time.perf_counter()
                    resident, _ = self.release()
                    metrics["timing/release_s"] = time.perf_counter() - released
                    metrics["memory/rss_gib"], metrics["memory/peak_rss_gib"] = resident, peak_rss_gib()
                    metrics["progress/total_steps"] = float(self.total_steps)  # the API's step/total_steps
                    self.step = step
                    self._log(step, metrics)
                    if step % training.checkpoint_interval == 0 or step == last:
                        checkpoint(self)
                    progress.update(1, f"reward {metrics['train/reward_mean']:.3f}, tool calls "
                                       f"{metrics['train/tool_calls_mean']:.2f}, {metrics['timing/step_s']:.1f} s/step")
            except Exception as exc:
                if self.accelerator.num_processes > 1 and is_collective_failure(exc):  # a node is gone: name it
                    latest = latest_checkpoint(self.checkpoints_dir)
                    raise InfraError(self.watch.explain(exc, step=self.step + 1, checkpoint=latest and str(latest))
                                     ) from exc
                raise
            finally:
                if ahead is not None:
                    ahead.shutdown(wait=True, cancel_futures=True)  # no sampling outlives the generator
        model_dir = finish(self) if self.step == self.total_steps else None
        return TrainResult(
            model_dir=model_dir,
            best_checkpoints=[(e.step, e.score, Path(e.path)) for e in self.best.ranked()],
            metrics={k: v for k, v in self.history[-1].items() if k != "step"} if self.history else {},
            steps=self.step,
        )

    def _sample(self, step: int, version: int) -> Sample:
        """Step `step`'s rollouts, sampled with the weights of policy version `version`
        (dynamic sampling's rounds included). No collective runs here: with
        `max_staleness: 1` this runs in a thread beside the previous step's update."""
        acc, training = self.accelerator, self.config.training
        group_size, mask_truncated = self.hp["group_size"], training.mask_truncated
        epoch, position, indices = self.data.batch(step)
        share = len(indices) // acc.num_processes
        mine = [self.train_items[i] for i in indices[acc.process_index * share : (acc.process_index + 1) * share]]

        started = time.perf_counter()
        records = self.rollouts(mine, group_size, derived_seed(training.seed, "rollout", step), version)
        resampled = dropped = 0
        sampled = list(records)
        if training.dynamic_sampling:

            def sample(round_: int) -> list[RolloutRecord]:
                fresh = resample_share(len(self.train_items), len(mine), acc.num_processes, acc.process_index,
                                       derived_seed(training.seed, f"resample:{round_}", step))
                fresh = [self.train_items[i] for i in fresh]
                new = self.rollouts(fresh, group_size, derived_seed(training.seed, f"resample:{round_}", step),
                                     version)
                sampled.extend(new)
                return new

            records, resampled, dropped = fill_batch(
                sample, records, group_size=group_size, want_groups=len(mine),
                max_rounds=training.max_resample_batches, mask_truncated=mask_truncated,
            )
        return Sample(step, (epoch, position), records, sampled, resampled, dropped,
                      time.perf_counter() - started)

    def _learn(self, sample: Sample) -> dict[str, float]:
        """One optimizer step (policy version step - 1 -> step) on a step's rollouts."""
        from accelerate.utils import gather_object

        acc, training = self.accelerator, self.config.training
        step, records, mask_truncated = sample.step, sample.records, training.mask_truncated
        self.data_state = sample.data_state
        # The trainer holds version step - 1; a rollout may lag it by at most max_staleness
        # versions (TIS weighs each token by min(exp(old - sampler), tis_cap) for the lag).
        lags = [step - 1 - r.policy_version for r in sample.sampled]
        if any(lag < 0 or lag > training.max_staleness for lag in lags):
            raise RuntimeError(
                f"step {step} trains on rollouts of policy versions {sorted({r.policy_version for r in sample.sampled})}"
                f" while the trainer holds version {step - 1}; training.max_staleness is {training.max_staleness}"
            )
        rewards = [r.reward if in_loss(r, mask_truncated=mask_truncated) else None for r in records]
        # `scale_rewards: batch` divides by the std of the whole batch, every process's rewards
        everyone = ([x for part in gather_object([[x for x in rewards if x is not None]]) for x in part]
                    if training.scale_rewards == "batch" and acc.num_processes > 1 else None)
        advantages, silent_groups = batch_advantages(rewards, self.hp["group_size"],
                                                     scale_rewards=training.scale_rewards, batch_rewards=everyone)

        started = time.perf_counter()
        lr = self.hp["learning_rate"] * lr_factor(
            step, total_steps=self.total_steps, warmup_steps=training.warmup_steps, schedule=training.lr_schedule
        )
        for param_group in self.optimizer.param_groups:
            param_group["lr"] = lr
        update = self.updater.update(records, advantages, step)
        training_s = time.perf_counter() - started

        gathered = gather_object([(without_tokens(r), a) for r, a in zip(records, advantages, strict=True)])
        everything = gather_object([without_tokens(r) for r in sample.sampled])
        counts = gather_object([(silent_groups, sample.resampled, sample.dropped, sample.seconds, training_s,
                                 max(lags, default=0))])
        metrics = step_metrics(everything, gathered, counts, group_size=self.hp["group_size"], lr=lr,
                               update=update, infra=self.generator.metrics())  # infra/replicas_alive on vLLM
        if self.is_main:
            keep_rollouts(self, step, gathered)
        return metrics

    def rollouts(self, items: list[dict[str, Any]], n: int, seed: int, version: int) -> list[RolloutRecord]:
        """`n` rollouts of each item with the current weights, through the real tools."""
        if not items:
            return []
        # The embedded engine on the live weights refuses a model in training mode (dropout);
        # vLLM and a frozen copy never touch the training model (which may be updating now).
        model = self.sampling_model() if self.generator.reads_training_model else None
        if model is not None:
            model.eval()
        try:
            return self.generator.sample(items, n, seed, version)
        finally:
            if model is not None:
                model.train()

    # -- evaluation, records, checkpoints ----------------------------------------------

    def _log(self, step: int, metrics: dict[str, float]) -> None:
        row = {"step": step, **{k: (float(v) if math.isfinite(v) else None) for k, v in metrics.items()}}
        self.history.append(row)
        if self.is_main:
            self.sink.log(metrics, step)

    def saved_model(self) -> torch.nn.Module:
        """What a model directory is written from: under FSDP the whole copy (refreshed
        after every step), else the trained model."""
        return self.whole.model if self.whole is not None else self.model

    def cleanup(self) -> None:
        if hasattr(self, "watch"):
            self.watch.close()
        self._exit.close()
        if hasattr(self, "accelerator"):
            self.accelerator.end_training()


def _quiet(_: str) -> None:
    """Log sink of the processes that are not the main one."""


def train(
    config: PipelineConfig,
    *,
    model_path: str,
    output_dir: Path,
    mlflow_run_id: str | None = None,
    resume: bool = False,
    endpoints: list[ToolEndpoint] | None = None,
) -> TrainResult:
    """Train `model_path` with GRPO as `config` says; see the module docstring. The tools
    are the config's endpoints unless `endpoints` are given."""
    trainer = GRPOTrainer(
        config, model_path=model_path, output_dir=output_dir, mlflow_run_id=mlflow_run_id, resume=resume,
        endpoints=endpoints,
    )
    try:
        trainer.setup()
        return trainer.train()
    finally:
        trainer.cleanup()
