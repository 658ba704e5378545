"""GRPO for tool-using agents, run by Accelerate.

One step of the algorithm:

1. Take the next `batch_size` training items. Every epoch is a permutation of the items
   drawn from the training seed (a remainder smaller than a batch is left out of that
   epoch, so a batch never holds an item twice); the order and the position are part of
   every checkpoint.
2. Run a group of `group_size` rollouts per item through the generation backend and the
   user's tools (trainer/rollout.py) at the rollout temperature. The sampling seed is
   derived from (training seed, step) and each sequence draws from its own generator,
   so a resumed run samples exactly what the uninterrupted one would have. A rollout's
   reward is its grader score minus the configured penalties. With `dynamic_sampling`,
   groups whose rewards are all equal are dropped and fresh items are rolled out until
   the batch is full again, at most `max_resample_batches` more rounds (DAPO).
3. Advantages within each group (trainer/loss.py): only trainable rollouts enter; an
   `infra_error`, a grader error or, with `mask_truncated`, a rollout whose turn was cut
   is left out and counted.
4. `ppo_epochs` passes over those rollouts in micro-batches of similar length. The old
   policy is the trainer itself: `new.detach()` when the step makes one optimizer update,
   one no-grad forward before the first update when it makes several. The sampler's log-probabilities only feed truncated
   importance sampling (`tis_cap`) and the logged sampler-trainer mismatch
   (`train/sampler_kl`, `train/sampler_diff_max`): an inference engine or bf16 kernels do
   not sample with exactly the trainer's numbers. Log-probabilities are computed at the
   generated tokens only, `logprob_chunk_tokens` at a time (trainer/update.py).
   The loss (`loss_type`, `epsilon`, `epsilon_high`, `kl_coef`) is in trainer/loss.py;
   its token weights make an update's gradient the same whatever its micro-batches and
   processes.
5. AdamW, linear warmup reaching the full rate at `warmup_steps`, then a constant, linear
   or cosine schedule; gradient clipping; `mini_batches` optimizer updates per pass.

One step off-policy (`max_staleness: 1`): step t+1's rollouts are sampled in a thread
while step t updates the weights, with the weights of step t - 1 (vLLM servers keep them
until both are done; the embedded engine samples with a frozen copy that the sync after
each step refreshes, in a child process on CPU by default: `rollout.overlap_sampler`,
trainer/backends.py). Each step checks that its rollouts lag the trainer by at most
`max_staleness` versions (`train/policy_lag_max`), and TIS weighs every token by
min(exp(old - sampler), tis_cap) for the lag. A resumed run's first step samples on-policy.

Evaluation runs before the first step, every `eval_interval` steps and after the last:
one sample per validation item (`eval_samples` items) at the rollout temperature, with the
same seed every time, so two evaluations differ by the model and not by the dice. The
`keep_best_checkpoints` best models by validation reward (`metric_for_best_model`: the grader's
score less the penalties, or the score alone) are saved as model directories
(`best/step_N/`); the last one as `final/`. The test split is never read here.

Distribution (`training.distributed`, trainer/sharding.py): `Accelerator` owns the devices,
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
    accelerate launch --num_processes 2 -m trainer.train_cli --config job.yaml
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import os
import random
import shutil
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from trainer.chat_formats import describe as describe_chat_format
from trainer.checkpoint import (
    BestCheckpoints,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
    save_model,
)
from trainer.config import PipelineConfig, resolved_hyperparameters
from trainer.data import split_items
from trainer.errors import ConfigError
from trainer.evaluate import summarize
from trainer.loss import batch_advantages, derived_seed, lr_factor
from trainer.metrics import MetricsSink
from trainer.plots import plot_training
from trainer.policy import load_config_policy, local_model_path
from trainer.progress import Progress
from trainer.rollout import (
    RolloutRecord,
    RolloutSettings,
    check_tool_call_costs,
)
from trainer.sharding import WholeCopy, one_process_group, resolved_distributed, shard
from trainer.tools import ToolEndpoint
from trainer.update import PolicyUpdate

KEPT_GROUPS = 4  # groups per step whose best and worst rollouts are written out whole


def refuse_sharded_launch(accelerate_config: str | None) -> None:
    """An accelerate config that asks Accelerate for FSDP or DeepSpeed is refused before
    Accelerate starts them: sharding is `training.distributed` (trainer/sharding.py), one
    way to say it. DeepSpeed is not offered: its engine runs its own gradient accumulation
    and clipping, which would override the trainer's, and it does not run on the CPU
    machines the tests use; FSDP2 shards what ZeRO-3 does."""
    if not accelerate_config:
        return
    import yaml

    path = Path(accelerate_config)
    try:
        settings = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"training.accelerate_config: cannot read {path} ({exc})") from None
    kind = str(settings.get("distributed_type", "")).upper()
    if kind in ("DEEPSPEED", "FSDP") or settings.get("deepspeed_config") or settings.get("fsdp_config"):
        raise sharded_error(f"training.accelerate_config {path}: {kind or 'DeepSpeed/FSDP'}")


def check_groups(training: Any, items: list[dict[str, Any]], file: str) -> None:
    """Every group that `training.kl_coef_by_group` or `training.group_weights` names occurs in
    the training items: a misspelt group would silently train without its KL term or weight."""
    found = {training.group_of(item) for item in items} - {None}
    for key in ("kl_coef_by_group", "group_weights"):
        named = getattr(training, key)
        if not named:
            continue
        if not found:
            raise ConfigError(
                f"{file}: no training item has the field {training.group_by!r} that training.group_by names; "
                f"name a field the items have or drop training.{key}"
            )
        unknown = sorted(set(named) - found)
        if unknown:
            raise ConfigError(
                f"training.{key}: group(s) {unknown} do not occur in {file} (field "
                f"{training.group_by!r} has {sorted(found)}); fix the names"
            )


def sharded_error(what: str) -> ConfigError:
    return ConfigError(f"{what}: the trainer shards the model itself; set training.distributed: fsdp (FSDP2, "
                       "what DeepSpeed ZeRO-3 does) or ddp, and keep the accelerate config to where the processes "
                       "run (machines, GPU ids)")


class DataOrder:
    """Which items each step trains on: every epoch a seeded permutation, cut in batches.

    With `weights` (one per item) the permutation is a weighted shuffle (Efraimidis-Spirakis:
    item i's key is u_i ** (1 / w_i), in descending order), so heavier items tend to come
    earlier in the epoch; every item still comes exactly once an epoch."""

    def __init__(self, n_items: int, batch_size: int, seed: int, weights: list[float] | None = None):
        if weights is not None and len(weights) != n_items:
            raise ValueError(f"DataOrder: {len(weights)} weights for {n_items} items")
        self.n_items = n_items
        self.batch_size = batch_size
        self.seed = seed
        self.weights = weights
        self.steps_per_epoch = n_items // batch_size
        self._orders: dict[int, list[int]] = {}

    def order(self, epoch: int) -> list[int]:
        if epoch not in self._orders:
            rng = random.Random(f"{self.seed}:epoch:{epoch}")
            if self.weights is None:
                order = list(range(self.n_items))
                rng.shuffle(order)
            else:
                keys = [rng.random() ** (1.0 / w) for w in self.weights]
                order = sorted(range(self.n_items), key=lambda i: -keys[i])
            self._orders[epoch] = order
        return self._orders[epoch]

    def restore(self, epoch: int, order: list[int]) -> None:
        """Use a checkpoint's order for `epoch`."""
        self._orders[epoch] = list(order)

    def batch(self, step: int) -> tuple[int, int, list[int]]:
        """(epoch, position after this batch in the epoch's order, item indices) of the
        1-based `step`."""
        epoch, index = divmod(step - 1, self.steps_per_epoch)
        start = index * self.batch_size
        return epoch, start + self.batch_size, self.order(epoch)[start : start + self.batch_size]


def resample_share(n_items: int, per_process: int, processes: int, rank: int, seed: int) -> list[int]:
    """Dynamic sampling's fresh items for one process: one seeded draw without replacement
    for all processes (the same on each), cut in shares, so no two processes roll out the
    same item in a round. With fewer items than processes x share, the shares shrink."""
    order = list(range(n_items))
    random.Random(seed).shuffle(order)  # a prefix of one permutation: the same draw for any process count
    drawn = order[: per_process * processes]
    share = len(drawn) // processes
    return drawn[rank * share : (rank + 1) * share]


def in_loss(record: RolloutRecord, *, mask_truncated: bool) -> bool:
    """Whether a rollout's reward enters its group's advantages and the loss."""
    return record.trainable and not (mask_truncated and record.truncated)


def fill_batch(
    sample: Any, first: list[Any], *, group_size: int, want_groups: int, max_rounds: int, mask_truncated: bool
) -> tuple[list[RolloutRecord], int, int]:
    """Dynamic sampling: keep the groups of `first` (records, `group_size` a group) whose
    rewards vary and call `sample(round)` for fresh groups until `want_groups` are kept or
    `max_rounds` extra rounds ran. Returns the kept records, the extra rounds and the
    groups dropped."""
    kept: list[RolloutRecord] = []
    dropped, rounds, records = 0, 0, first
    while True:
        for start in range(0, len(records), group_size):
            group = records[start : start + group_size]
            rewards = [r.reward for r in group if in_loss(r, mask_truncated=mask_truncated)]
            if len(kept) // group_size < want_groups and len(rewards) > 1 and max(rewards) - min(rewards) > 1e-9:
                kept += group
            else:
                dropped += 1
        if len(kept) // group_size >= want_groups or rounds >= max_rounds:
            return kept, rounds, dropped
        rounds += 1
        records = sample(rounds)


@dataclass
class Sample:
    """A step's rollouts, before the update that learns from them."""

    step: int
    data_state: tuple[int, int]  # (epoch, position) of the data order at this step
    records: list[RolloutRecord]  # the batch (after dynamic sampling)
    sampled: list[RolloutRecord]  # everything sampled for it, the dropped groups too
    resampled: int
    dropped: int
    seconds: float


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

    # -- setup -------------------------------------------------------------------------

    def setup(self) -> None:
        from accelerate import Accelerator
        from accelerate.utils import DistributedType, set_seed

        training, data = self.config.training, self.config.data
        refuse_sharded_launch(training.accelerate_config)
        from trainer.launch import resolved_mixed_precision

        self.distributed = resolved_distributed(training)
        mixed_precision = resolved_mixed_precision(training.mixed_precision)
        # Under FSDP its mixed-precision policy casts (bf16 compute over float32 shards), not autocast.
        self.accelerator = acc = Accelerator(mixed_precision="no" if self.distributed == "fsdp" else mixed_precision)
        self.is_main = acc.is_main_process  # this process logs, saves and draws
        set_seed(training.seed)
        launched = int(os.environ.get("WORLD_SIZE", "1"))
        if launched != acc.num_processes:
            raise ConfigError(
                f"started as one of {launched} processes (WORLD_SIZE) but Accelerate runs this one alone, "
                "so they would overwrite each other's outputs; on a machine without a GPU set "
                "ACCELERATE_USE_CPU=true, or start `agentrft train` and let it launch them"
            )
        if acc.distributed_type in (DistributedType.FSDP, DistributedType.DEEPSPEED):  # set by the environment
            raise sharded_error(f"{acc.distributed_type.value} (from the ACCELERATE_* environment)")
        if self.distributed == "none" and acc.num_processes > 1:
            raise ConfigError(f"training.distributed is none but {acc.num_processes} processes were started: "
                              "set training.distributed to ddp or fsdp")
        if self.distributed == "fsdp":
            one_process_group(acc.device)
        if not self.endpoints:
            raise ConfigError("tools.endpoints is empty: declare the endpoint of every tool the model may call")
        for name in ("n_epochs", "batch_size", "eval_interval"):
            if self.hp[name] < 1:
                raise ConfigError(f"training.{name} must be at least 1 (or 'auto'), got {self.hp[name]}")
        self.train_items = split_items(data, "train")
        validation = split_items(data, "validation")
        self.eval_items = validation[: self.hp["eval_samples"]]
        for items, file in ((self.train_items, data.train_file), (validation, data.validation_file)):
            check_tool_call_costs(self.settings.tool_call_costs, items, file, self.config.tools.schemas)
        check_groups(training, self.train_items, data.train_file)
        batch_size = self.hp["batch_size"]
        if batch_size % acc.num_processes:
            raise ConfigError(
                f"training.batch_size ({batch_size}) must be a multiple of the {acc.num_processes} "
                "processes: each process runs whole groups"
            )
        weights = [training.weight_of(item) for item in self.train_items] if training.group_weights else None
        self.data = DataOrder(len(self.train_items), batch_size, training.seed, weights)
        if self.data.steps_per_epoch == 0:
            raise ConfigError(
                f"training.batch_size ({batch_size}) exceeds the {len(self.train_items)} training items "
                f"of {data.train_file}; lower it or add items"
            )
        self.total_steps = self.hp["n_epochs"] * self.data.steps_per_epoch
        if training.max_steps:
            self.total_steps = min(self.total_steps, training.max_steps)

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
        model = policy.model
        self.reference = None
        if training.uses_reference and training.lora is None:
            self.reference = copy.deepcopy(model).eval().requires_grad_(False)
            if self.distributed == "fsdp":
                shard(self.reference, mixed_precision=mixed_precision)
        if training.lora is not None:
            from peft import LoraConfig as PeftLoraConfig
            from peft import get_peft_model

            model = get_peft_model(
                model,
                PeftLoraConfig(
                    r=training.lora.r,
                    lora_alpha=training.lora.alpha,
                    lora_dropout=training.lora.dropout,
                    target_modules=list(training.lora.target_modules),
                    task_type="CAUSAL_LM",
                ),
            )
        if training.gradient_checkpointing:
            enable = getattr(model, "activation_checkpointing_enable", None)
            if enable is not None:
                enable(activation_checkpointing_kwargs={"use_reentrant": False})
            else:  # transformers before activation_checkpointing_enable (5.17 has only this name)
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
        self.whole = None  # under FSDP: the unsharded copy that samples
        if self.distributed == "fsdp":
            self.whole = WholeCopy(model)
            shard(model, mixed_precision=mixed_precision)
        optimizer = torch.optim.AdamW(  # after sharding: FSDP replaces the parameters
            [p for p in model.parameters() if p.requires_grad],
            lr=self.hp["learning_rate"],
            weight_decay=training.weight_decay,
        )
        if self.distributed == "fsdp":
            self.model, self.optimizer = model, optimizer  # sharded here, not wrapped by Accelerate
        else:
            self.model, self.optimizer = acc.prepare(model, optimizer)
        kl_by_item = {str(item["id"]): training.kl_coef_of(item) for item in self.train_items}
        self.updater = PolicyUpdate(acc, self.model, self.optimizer, config=self.config, tokenizer=self.tokenizer,
                                    reference=self.reference, temperature=self.temperature,
                                    kl_coef_of=lambda record: kl_by_item[record.item_id],
                                    sharded=self.distributed == "fsdp")
        from trainer.backends import RolloutContext, make_generator

        self.rollout_context = RolloutContext(self.chat, self.config, self.endpoints, self.settings,
                                              list(self.stop_token_ids))
        self.generator = self._exit.enter_context(make_generator(self.config, self, self.output_dir))

        self.checkpoints_dir = self.output_dir / "checkpoints"
        self.rollouts_dir = self.output_dir / "rollouts"
        self.best = BestCheckpoints(self.output_dir / "best", training.keep_best_checkpoints)
        self.step = 0
        self.history: list[dict[str, Any]] = []
        self._data_state = (0, 0)
        self.sink = None
        if self.is_main:
            self.rollouts_dir.mkdir(parents=True, exist_ok=True)
            self.sink = MetricsSink(
                self.output_dir / "metrics.jsonl", run_id=self.mlflow_run_id, tracking_uri=tracking_uri,
                unavailable_timeout_s=self.config.mlflow.unavailable_timeout_s,
            )
        latest = latest_checkpoint(self.checkpoints_dir)
        if self.resume and latest is not None:
            self._restore(latest)
        elif latest is not None:
            raise ConfigError(
                f"{self.output_dir} holds checkpoints of an earlier run ({latest.name}); pass --resume "
                "to continue it or choose another output directory"
            )
        elif self.is_main:
            if self.resume:
                print(f"no checkpoint in {self.checkpoints_dir}: starting from step 0")
            self.sink.rewrite([])

    def _fingerprint(self) -> dict[str, Any]:
        """What must not change between a checkpoint and its resumption."""
        return {
            "seed": self.config.training.seed,
            "batch_size": self.hp["batch_size"],
            "group_size": self.hp["group_size"],
            "train_items": len(self.train_items),
        }

    def sampling_model(self) -> torch.nn.Module:
        """The whole model that rollouts sample with (and vLLM syncs read)."""
        return self.whole.model if self.whole is not None else self.accelerator.unwrap_model(self.model)

    def _sharded_state(self) -> tuple[Any, Any] | None:
        return (self.model, self.optimizer) if self.distributed == "fsdp" else None

    def _refresh_whole(self) -> None:
        if self.whole is not None:
            self.whole.refresh(self.model)

    def _restore(self, path: Path) -> None:
        state = load_checkpoint(self.accelerator, path, sharded=self._sharded_state())
        changed = {
            key: (value, state["fingerprint"].get(key))
            for key, value in self._fingerprint().items()
            if state["fingerprint"].get(key) != value
        }
        if changed:
            described = ", ".join(f"{k}: now {now}, checkpoint {then}" for k, (now, then) in changed.items())
            raise ConfigError(
                f"{path}: the checkpoint was written with another config ({described}); resume with "
                "the same training settings or choose another output directory"
            )
        self.step = state["step"]
        self.history = state["history"]
        self._data_state = (state["epoch"], state["position"])
        self.data.restore(state["epoch"], state["order"])
        self.best = BestCheckpoints(self.best.root, self.best.keep, state["best"])
        if self.is_main:
            self.sink.rewrite(self.history)
            for stale in self.best.stale_dirs():
                shutil.rmtree(stale)
            print(f"resumed from {path} at step {self.step}")
        self._refresh_whole()
        self.generator.sync(self.step)

    # -- the loop ----------------------------------------------------------------------

    def train(self, *, stop_after: int | None = None) -> TrainResult:
        """Run to the last step, or only up to step `stop_after` (then checkpoint)."""
        training = self.config.training
        last = self.total_steps if stop_after is None else min(self.total_steps, stop_after)
        if self.step == 0 and self.eval_items:
            self._log(0, self._evaluate(0))  # the starting model, at the same settings
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
                    metrics = self._learn(sample)
                    if pending is not None:
                        pending_started = time.perf_counter()
                        wait([pending])  # the servers keep version step - 1 until its rollouts are in
                        metrics["timing/ahead_wait_s"] = time.perf_counter() - pending_started
                    metrics["timing/rollout_wait_s"] = waited
                    synced = time.perf_counter()
                    self._refresh_whole()
                    self.generator.sync(step)
                    metrics["timing/sync_s"] = time.perf_counter() - synced
                    evaluate = bool(self.eval_items) and (step % self.hp["eval_interval"] == 0
                                                          or step == self.total_steps)
                    metrics.update(self._evaluate(step) if evaluate else {"timing/eval_s": 0.0})
                    metrics["timing/step_s"] = time.perf_counter() - started
                    self.step = step
                    self._log(step, metrics)
                    if step % training.checkpoint_interval == 0 or step == last:
                        self._checkpoint()
                    progress.update(1, f"reward {metrics['train/reward_mean']:.3f}, tool calls "
                                       f"{metrics['train/tool_calls_mean']:.2f}, {metrics['timing/step_s']:.1f} s/step")
            finally:
                if ahead is not None:
                    ahead.shutdown(wait=True, cancel_futures=True)  # no sampling outlives the generator
        model_dir = self._finish() if self.step == self.total_steps else None
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
        records = self._rollouts(mine, group_size, derived_seed(training.seed, "rollout", step), version)
        resampled = dropped = 0
        sampled = list(records)
        if training.dynamic_sampling:

            def sample(round_: int) -> list[RolloutRecord]:
                fresh = resample_share(len(self.train_items), len(mine), acc.num_processes, acc.process_index,
                                       derived_seed(training.seed, f"resample:{round_}", step))
                fresh = [self.train_items[i] for i in fresh]
                new = self._rollouts(fresh, group_size, derived_seed(training.seed, f"resample:{round_}", step),
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
        self._data_state = sample.data_state
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

        gathered = gather_object([(_without_tokens(r), a) for r, a in zip(records, advantages, strict=True)])
        everything = gather_object([_without_tokens(r) for r in sample.sampled])
        counts = gather_object([(silent_groups, sample.resampled, sample.dropped, sample.seconds, training_s,
                                 max(lags, default=0))])
        # The slowest process sets the pace of a step.
        sampling_s = max(c[3] for c in counts)
        training_s = max(c[4] for c in counts)
        metrics = summarize(everything, prefix="train").metrics
        metrics.update(update)
        metrics.update(self.generator.metrics())  # infra/replicas_alive on vLLM
        metrics.update(
            {
                "train/rollouts_per_s": len(everything) / max(sampling_s, 1e-9),
                "train/tokens_per_s": sum(r.tokens_generated for r in everything) / max(sampling_s, 1e-9),
                "train/grader_errors": float(sum(1 for r in everything if r.grader_errors)),
                "train/zero_variance_group_share": sum(c[0] for c in counts) / max(1, len(gathered) // self.hp[
                    "group_size"]),
                "train/resample_rounds": float(max(c[1] for c in counts)),
                "train/dropped_groups": float(sum(c[2] for c in counts)),
                "train/rollouts_in_loss": float(sum(1 for _, a in gathered if a is not None)),
                "train/policy_lag_max": float(max(c[5] for c in counts)),
                "train/lr": lr,
                "timing/sampling_s": sampling_s,
                "timing/training_s": training_s,
            }
        )
        if self.is_main:
            self._keep_rollouts(step, gathered)
        return metrics

    def _rollouts(self, items: list[dict[str, Any]], n: int, seed: int, version: int) -> list[RolloutRecord]:
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

    def _evaluate(self, step: int) -> dict[str, float]:
        from accelerate.utils import gather_object

        acc = self.accelerator
        started = time.perf_counter()
        share = math.ceil(len(self.eval_items) / acc.num_processes)
        mine = self.eval_items[acc.process_index * share : (acc.process_index + 1) * share]
        # The same seed at every evaluation: the differences are the model's.
        records = self._rollouts(mine, 1, derived_seed(self.config.training.seed, "eval"), step)
        everything = gather_object([_without_tokens(r) for r in records])
        metrics = summarize(everything, prefix="eval").metrics
        if self.is_main:
            path = self.rollouts_dir / f"eval_step_{step}.jsonl"
            path.write_text("".join(json.dumps(r.to_json()) + "\n" for r in everything))
            self.sink.log_traces(everything[: self.config.mlflow.traces_per_evaluation], step=step, kind="eval")
        score = metrics["eval/score_mean"]
        rank_by = metrics[f"eval/{self.config.training.metric_for_best_model}_mean"]
        if step > 0 and self.best.admits(rank_by):
            best = BestCheckpoints(self.best.root, self.best.keep, self.best.to_json())
            path, evicted = best.add(step, rank_by)
            save_model(acc, self._saved_model(), self.tokenizer, path)
            self.best = best  # recorded only once its model is on disk (a full disk raises before)
            if self.is_main:
                for old in evicted:
                    shutil.rmtree(old, ignore_errors=True)
        metrics["timing/eval_s"] = time.perf_counter() - started
        if self.is_main:
            print(f"step {step}: validation score {score:.3f}, reward {metrics['eval/reward_mean']:.3f}, "
                  f"tool calls {metrics['eval/tool_calls_mean']:.2f}, tokens {metrics['eval/tokens_mean']:.0f}",
                  flush=True)
        return metrics

    def _keep_rollouts(self, step: int, gathered: list[tuple[RolloutRecord, float | None]]) -> None:
        """Write the best and the worst rollout of the step's first groups, whole, and
        log them as MLflow traces."""
        group_size = self.hp["group_size"]
        rows, kept = [], []
        for start in range(0, min(len(gathered), KEPT_GROUPS * group_size), group_size):
            group = gathered[start : start + group_size]
            scored = [pair for pair in group if pair[0].reward is not None] or group
            ranked = sorted(scored, key=lambda pair: pair[0].reward if pair[0].reward is not None else -math.inf)
            for kind, (record, advantage) in [("best", ranked[-1])] + ([("worst", ranked[0])] if len(ranked) > 1 else []):
                rows.append({"step": step, "kept_as": kind, "advantage": advantage, **record.to_json()})
                kept.append(record)
        (self.rollouts_dir / f"step_{step}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
        self.sink.log_traces(kept[: self.config.mlflow.traces_per_evaluation], step=step, kind="train")

    def _log(self, step: int, metrics: dict[str, float]) -> None:
        row = {"step": step, **{k: (float(v) if math.isfinite(v) else None) for k, v in metrics.items()}}
        self.history.append(row)
        if self.is_main:
            self.sink.log(metrics, step)

    def _checkpoint(self) -> None:
        epoch, position = self._data_state
        state = {
            "epoch": epoch,
            "position": position,
            "order": self.data.order(epoch),
            "history": self.history,
            "best": self.best.to_json(),
            "fingerprint": self._fingerprint(),
        }
        save_checkpoint(self.accelerator, self.checkpoints_dir, self.step, state, sharded=self._sharded_state())

    def _saved_model(self) -> torch.nn.Module:
        """What a model directory is written from: under FSDP the whole copy (refreshed
        after every step), else the trained model."""
        return self.whole.model if self.whole is not None else self.model

    def _finish(self) -> Path:
        """Save the final model, draw the figures and hand the artifacts to MLflow."""
        from trainer.data import read_jsonl

        final = self.output_dir / "final"
        save_model(self.accelerator, self._saved_model(), self.tokenizer, final)
        if self.is_main:
            figures = self.output_dir / "figures"
            plot_training(
                self.history,
                read_jsonl(self.rollouts_dir / "eval_step_0.jsonl", missing_ok=True),
                read_jsonl(self.rollouts_dir / f"eval_step_{self.step}.jsonl", missing_ok=True),
                figures,
            )
            summary = {
                "model_dir": str(final),
                "steps": self.step,
                "chat_format": describe_chat_format(self.chat),
                "best_checkpoints": self.best.to_json(),
                "metrics": self.history[-1],
            }
            (self.output_dir / "train_result.json").write_text(json.dumps(summary, indent=2))
            self.sink.log_artifacts(figures, "figures")
            self.sink.log_artifacts(self.rollouts_dir, "rollouts")
            self.sink.flush_traces()
        return final

    def cleanup(self) -> None:
        self._exit.close()
        if hasattr(self, "accelerator"):
            self.accelerator.end_training()


def _without_tokens(record: RolloutRecord) -> RolloutRecord:
    """The record as gathered across processes: the token arrays stay where they are used."""
    return dataclasses.replace(record, token_ids=[], gen_mask=[], logprobs=[])


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
