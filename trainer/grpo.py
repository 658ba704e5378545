"""GRPO for tool-using agents, run by Accelerate.

One step of the algorithm:

1. Take the next `batch_size` training items. Every epoch is a permutation of the items
   drawn from the training seed (a remainder smaller than a batch is left out of that
   epoch, so a batch never holds an item twice); the order and the position are part of
   every checkpoint.
2. Run a group of `group_size` rollouts per item through the generation engine and the
   user's tools (trainer/rollout.py) at the rollout temperature. The sampling seed is
   derived from (training seed, step) and each sequence draws from its own generator,
   so a resumed run samples exactly what the uninterrupted one would have. A rollout's
   reward is its grader score minus the configured penalties.
3. Advantages within each group: A = r - mean(group), divided by the group's standard
   deviation (+1e-6) when `scale_rewards` (GRPO), not divided otherwise (Dr. GRPO). Only
   trainable rollouts enter the mean and the loss: an `infra_error` or a grader error is
   no evidence about the policy, so it is left out and counted (`train/infra_error_rate`,
   `train/grader_errors`). A group whose trainable rewards are all equal (or that has
   fewer than two) carries no signal and is left out too
   (`train/zero_variance_group_share`).
4. `ppo_epochs` passes over those rollouts in shuffled micro-batches. The old policy is
   the sampler: its log-probabilities come with the rollouts, computed at the sampling
   temperature T, so the new ones are recomputed from logits / T. Per generated token
   (prompts, chat markup and tool outputs are context, never targets):
       ratio = exp(new - old)
       loss  = -min(ratio * A, clip(ratio, 1 - clip_eps, 1 + clip_eps) * A) + kl_coef * k3
   averaged over all generated tokens of an optimizer update, on all processes together
   (the token-level mean of DAPO: a long rollout is not down-weighted per token). k3 =
   exp(ref - new) - (ref - new) - 1 estimates KL(new || ref) against a frozen copy of the
   starting model (for LoRA: the base with adapters off). `train/kl` reports it, or, when
   kl_coef is 0, the same estimator of KL(old || new): how far the update moved.
5. AdamW, linear warmup then a constant/linear/cosine schedule over the steps, gradient
   clipping. Each pass makes `mini_batches` optimizer updates (default 1: the whole
   batch, as OpenAI's and TRL's defaults do), each accumulated over micro-batches of
   `micro_batch_size` rollouts; `gradient_accumulation_steps` fixes the micro-batches per
   update instead. (Eight updates a step at the same learning rate moved a tiny policy
   eight times as far and off the rails in the TRL comparison.)

Evaluation runs before the first step, every `eval_interval` steps and after the last:
one sample per held-out item (`eval_samples` items) at the rollout temperature, with the
same seed every time, so two evaluations differ by the model and not by the dice. Sampled
rather than greedy because that is how the policy is trained and how the baseline and
regression stages measure it. The `keep_best_checkpoints` best models by eval score are
saved as model directories (`best/step_N/`); the last one as `final/`.

Distribution: `Accelerator` owns the devices, mixed precision (bf16 on a GPU by default,
over float32 master weights) and DDP or DeepSpeed ZeRO-1/2 (FSDP and ZeRO-3 are refused:
each process samples with the whole model). Each process runs the rollouts of its share of
the batch's items, so whole groups live on one process and their advantages need no
communication; records are gathered for the metrics, DDP averages the gradients, and the
generated-token count of each update is summed over processes so the mean stays
token-level. Every process runs the same number of micro-batches (short ones are padded
with empty ones) so no collective waits forever. Only the main process logs and writes.

Outputs under `output_dir`: `metrics.jsonl` (one row per step, step 0 being the evaluation
before training; also sent to MLflow), `rollouts/step_N.jsonl` (the best and the worst
rollout of the step's first groups, whole), `rollouts/eval_step_N.jsonl`, `checkpoints/`,
`best/`, `final/`, `figures/` and `train_result.json`. Besides DESIGN.md's names the rows
carry `train/rollouts_in_loss`, `train/updates`, `train/clip_fraction`, `train/entropy`
(of the policy at its generated tokens) and `train/best_of_k_mean` (the groups' best
score: it falls when the policy's entropy collapses); `timing/step_s` counts the rollouts,
the update and the evaluation, not the checkpoint writing.

    python -m trainer.train_cli --config configs/demo.yaml
    accelerate launch --num_processes 2 -m trainer.train_cli --config configs/gpu.yaml
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import hashlib
import json
import math
import os
import random
import shutil
import statistics
import time
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from trainer.bootstrap import read_items
from trainer.checkpoint import (
    BestCheckpoints,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
    save_model,
)
from trainer.config import PipelineConfig, resolved_hyperparameters
from trainer.engine import TransformersBackend
from trainer.errors import ConfigError, DataError
from trainer.evaluate import summarize
from trainer.metrics import MetricsSink, plot_training, read_jsonl
from trainer.policy import load_policy
from trainer.rollout import (
    RolloutRecord,
    RolloutSettings,
    check_tool_call_costs,
    run_rollouts_async,
)
from trainer.tools import ToolClient, ToolEndpoint

ADVANTAGE_EPS = 1e-6
KEPT_GROUPS = 4  # groups per step whose best and worst rollouts are written out whole
# Names of the stats summed over micro-batches (and processes) in one step.
_STATS = ("loss", "kl", "clipped", "entropy", "tokens")


# --- the pieces, each testable alone ----------------------------------------------------


def derived_seed(seed: int, purpose: str, step: int = 0) -> int:
    """A seed for one purpose at one step, a pure function of its arguments."""
    digest = hashlib.sha256(f"{seed}:{purpose}:{step}".encode()).digest()
    return int.from_bytes(digest[:4], "little")


class DataOrder:
    """Which items each step trains on: every epoch a seeded permutation, cut in batches."""

    def __init__(self, n_items: int, batch_size: int, seed: int):
        self.n_items = n_items
        self.batch_size = batch_size
        self.seed = seed
        self.steps_per_epoch = n_items // batch_size
        self._orders: dict[int, list[int]] = {}

    def order(self, epoch: int) -> list[int]:
        if epoch not in self._orders:
            order = list(range(self.n_items))
            random.Random(f"{self.seed}:epoch:{epoch}").shuffle(order)
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


def group_advantages(rewards: Sequence[float | None], *, scale: bool) -> list[float | None] | None:
    """Advantages of one group's rollouts, None where a rollout has no reward (it is left
    out of the mean and of the loss). None for the whole group when it carries no signal:
    fewer than two rewards, or all of them equal."""
    present = [r for r in rewards if r is not None]
    if len(present) < 2 or max(present) - min(present) < 1e-9:
        return None
    mean = sum(present) / len(present)
    # The sample standard deviation, as TRL's GRPOTrainer uses.
    denominator = statistics.stdev(present) + ADVANTAGE_EPS if scale else 1.0
    return [None if r is None else (r - mean) / denominator for r in rewards]


def batch_advantages(
    records: Sequence[RolloutRecord], group_size: int, *, scale: bool
) -> tuple[list[float | None], int]:
    """Advantages of consecutive groups of `group_size` records (None: not in the loss)
    and the number of groups that carry no signal."""
    advantages: list[float | None] = []
    silent = 0
    for start in range(0, len(records), group_size):
        group = records[start : start + group_size]
        group_adv = group_advantages([r.reward if r.trainable else None for r in group], scale=scale)
        if group_adv is None:
            silent += 1
            group_adv = [None] * len(group)
        advantages.extend(group_adv)
    return advantages, silent


def lr_factor(step: int, *, total_steps: int, warmup_steps: int, schedule: str) -> float:
    """Multiplier of the learning rate at the 1-based `step`: linear warmup over
    `warmup_steps`, then constant, or a linear or cosine decay towards 0 at the end."""
    if step <= warmup_steps:
        return step / (warmup_steps + 1)
    if schedule == "constant":
        return 1.0
    progress = (step - warmup_steps - 1) / max(1, total_steps - warmup_steps)
    if schedule == "linear":
        return 1.0 - progress
    return 0.5 * (1.0 + math.cos(math.pi * progress))


def token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor, temperature: float) -> torch.Tensor:
    """log p(token t+1 | tokens <= t) under softmax(logits / temperature), shape
    [batch, len - 1]; the full log-softmax over the vocabulary is never materialised."""
    scaled = logits[:, :-1].float() / temperature
    picked = scaled.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(scaled, dim=-1)


def policy_loss(
    new: torch.Tensor,
    old: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_eps: float,
    kl_coef: float = 0.0,
    ref: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The clipped policy-gradient loss (plus kl_coef * k3 against `ref`) summed over the
    tokens where `mask` is True, and the sums of the step's statistics. `new`, `old`,
    `ref` and `mask` are [batch, len - 1] (position t scores token t + 1); `advantages`
    is [batch]. Masked-out positions take no part, not even as a 0 * NaN."""
    log_ratio = torch.where(mask, (new - old).clamp(-20.0, 20.0), 0.0)
    ratio = log_ratio.exp()
    unclipped = ratio * advantages[:, None]
    clipped = ratio.clamp(1 - clip_eps, 1 + clip_eps) * advantages[:, None]
    per_token = -torch.minimum(unclipped, clipped)
    if ref is not None:
        ref_log_ratio = torch.where(mask, (ref - new).clamp(-20.0, 20.0), 0.0)
        kl = ref_log_ratio.exp() - ref_log_ratio - 1
        per_token = per_token + kl_coef * kl
    else:
        kl = ratio - 1 - log_ratio
    loss_sum = torch.where(mask, per_token, 0.0).sum()
    zero = torch.zeros((), device=new.device)
    stats = {
        "loss": loss_sum.detach(),
        "kl": torch.where(mask, kl.detach(), zero).sum(),
        "clipped": (mask & (clipped < unclipped)).sum().float(),
        "tokens": mask.sum().float(),
    }
    return loss_sum, stats


def _without_tokens(record: RolloutRecord) -> RolloutRecord:
    """The record as gathered across processes: the token arrays stay where they are used."""
    return dataclasses.replace(record, token_ids=[], gen_mask=[], logprobs=[])


def _read(path: str, limit: int | None, key: str) -> list[dict[str, Any]]:
    file = Path(path)
    if not file.is_file():
        raise DataError(f"{key}: {file} does not exist; generate the data (agentrft data generate) or fix the path")
    items = read_items(file, limit)
    if not items:
        raise DataError(f"{key}: {file} holds no items")
    return items


@dataclass
class TrainResult:
    model_dir: Path | None  # the final model (None when the run stopped before its end)
    best_checkpoints: list[tuple[int, float, Path]]  # (step, eval score, model dir), best first
    metrics: dict[str, float]  # the last step's metrics
    steps: int  # steps done, in this and earlier sessions


# --- the recipe -------------------------------------------------------------------------


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
        self.endpoints = list(endpoints) if endpoints is not None else None
        self.settings = RolloutSettings.from_config(config.rollout, config.penalties)
        # The engine's logprobs are at T = 1 when it decodes greedily.
        self.temperature = config.rollout.temperature or 1.0
        self._exit = ExitStack()

    # -- setup -------------------------------------------------------------------------

    def setup(self) -> None:
        from accelerate import Accelerator
        from accelerate.utils import DistributedType, set_seed

        training = self.config.training
        mixed = training.mixed_precision
        if mixed == "auto":
            mixed = "bf16" if torch.cuda.is_available() else "no"
        self.accelerator = acc = Accelerator(
            mixed_precision=mixed, gradient_accumulation_steps=training.gradient_accumulation_steps or 1
        )
        self.is_main = acc.is_main_process  # this process logs, saves and draws
        set_seed(training.seed)
        launched = int(os.environ.get("WORLD_SIZE", "1"))
        if launched != acc.num_processes:
            raise ConfigError(
                f"started as one of {launched} processes (WORLD_SIZE) but Accelerate runs this one alone, "
                "so they would overwrite each other's outputs; on a machine without a GPU set "
                "ACCELERATE_USE_CPU=true, or start `python -m trainer.train_cli` and let it launch them"
            )
        sharded = acc.distributed_type == DistributedType.FSDP or (
            acc.distributed_type == DistributedType.DEEPSPEED and acc.state.deepspeed_plugin.zero_stage == 3
        )
        if sharded:
            raise ConfigError(
                "training.accelerate_config: FSDP and DeepSpeed ZeRO-3 shard the weights, but every process "
                "samples its rollouts with the whole model; use DDP or DeepSpeed ZeRO-1/2 (with LoRA for "
                "models that do not fit otherwise)"
            )

        for name in ("n_epochs", "batch_size", "eval_interval"):
            if self.hp[name] < 1:
                raise ConfigError(f"training.{name} must be at least 1 (or 'auto'), got {self.hp[name]}")
        self.train_items = _read(self.config.data.train_file, self.config.data.max_train_items, "data.train_file")
        eval_items = _read(self.config.data.eval_file, self.config.data.max_eval_items, "data.eval_file")
        self.eval_items = eval_items[: self.hp["eval_samples"]]
        for items, file in ((self.train_items, self.config.data.train_file), (eval_items, self.config.data.eval_file)):
            check_tool_call_costs(self.settings.tool_call_costs, items, file)
        batch_size = self.hp["batch_size"]
        if batch_size % acc.num_processes:
            raise ConfigError(
                f"training.batch_size ({batch_size}) must be a multiple of the {acc.num_processes} "
                "processes: each process runs whole groups"
            )
        self.data = DataOrder(len(self.train_items), batch_size, training.seed)
        if self.data.steps_per_epoch == 0:
            raise ConfigError(
                f"training.batch_size ({batch_size}) exceeds the {len(self.train_items)} training items "
                f"of {self.config.data.train_file}; lower it or add items"
            )
        self.total_steps = self.hp["n_epochs"] * self.data.steps_per_epoch
        if training.max_steps:
            self.total_steps = min(self.total_steps, training.max_steps)

        # float32 master weights unless the config names a dtype: mixed precision casts.
        dtype = "float32" if self.config.model.dtype == "auto" else self.config.model.dtype
        policy = load_policy(self.model_path, device=str(acc.device), dtype=dtype)
        self.tokenizer = policy.tokenizer
        self.stop_token_ids = policy.stop_token_ids
        model = policy.model
        self.reference = None
        if training.kl_coef > 0 and training.lora is None:
            self.reference = copy.deepcopy(model).eval().requires_grad_(False)
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
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
        optimizer = torch.optim.AdamW(
            [p for p in model.parameters() if p.requires_grad],
            lr=self.hp["learning_rate"],
            weight_decay=training.weight_decay,
        )
        self.model, self.optimizer = acc.prepare(model, optimizer)

        if self.endpoints is None:
            self.endpoints = self._start_tools()

        self.checkpoints_dir = self.output_dir / "checkpoints"
        self.rollouts_dir = self.output_dir / "rollouts"
        self.best = BestCheckpoints(self.output_dir / "best", training.keep_best_checkpoints)
        self.step = 0
        self.history: list[dict[str, Any]] = []
        self._data_state = (0, 0)
        self.sink = None
        if self.is_main:
            self.rollouts_dir.mkdir(parents=True, exist_ok=True)
            # The process that made the run may have pointed MLflow elsewhere than the config.
            tracking_uri = os.environ.get("MLFLOW_TRACKING_URI") or self.config.mlflow.tracking_uri
            self.sink = MetricsSink(
                self.output_dir / "metrics.jsonl", run_id=self.mlflow_run_id, tracking_uri=tracking_uri
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

    def _start_tools(self) -> list[ToolEndpoint]:
        tools = self.config.tools
        if tools.endpoints:
            return list(tools.endpoints)
        if not tools.demo_server:
            raise ConfigError("tools.endpoints is empty and tools.demo_server is false: declare the tool endpoints")
        from envs.finqa.local import local_tool_endpoints

        # Each process serves its own copy; a fixed port can only be bound once.
        port = tools.demo_server_port if self.accelerator.num_processes == 1 else 0
        return self._exit.enter_context(
            local_tool_endpoints(
                Path(self.config.data.corpus_dir), port=port, max_output_chars=tools.max_output_chars
            )
        )

    def _fingerprint(self) -> dict[str, Any]:
        """What must not change between a checkpoint and its resumption."""
        return {
            "seed": self.config.training.seed,
            "batch_size": self.hp["batch_size"],
            "group_size": self.hp["group_size"],
            "train_items": len(self.train_items),
        }

    def _restore(self, path: Path) -> None:
        state = load_checkpoint(self.accelerator, path)
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

    # -- the loop ----------------------------------------------------------------------

    def train(self, *, stop_after: int | None = None) -> TrainResult:
        """Run to the last step, or only up to step `stop_after` (then checkpoint)."""
        from tqdm.auto import tqdm

        training = self.config.training
        last = self.total_steps if stop_after is None else min(self.total_steps, stop_after)
        if self.step == 0 and self.eval_items:
            self._log(0, self._evaluate(0))  # the starting model, at the same settings
        bar = tqdm(total=self.total_steps, initial=self.step, desc="GRPO", unit="step", disable=not self.is_main)
        while self.step < last:
            step = self.step + 1
            started = time.perf_counter()
            metrics = self._train_step(step)
            evaluate = bool(self.eval_items) and (step % self.hp["eval_interval"] == 0 or step == self.total_steps)
            metrics.update(self._evaluate(step) if evaluate else {"timing/eval_s": 0.0})
            metrics["timing/step_s"] = time.perf_counter() - started
            self.step = step
            self._log(step, metrics)
            if step % training.checkpoint_interval == 0 or step == last:
                self._checkpoint()
            bar.update(1)
            bar.set_postfix(
                reward=f"{metrics['train/reward_mean']:.3f}",
                tools=f"{metrics['train/tool_calls_mean']:.2f}",
                s_step=f"{metrics['timing/step_s']:.1f}",
            )
        bar.close()
        model_dir = self._finish() if self.step == self.total_steps else None
        return TrainResult(
            model_dir=model_dir,
            best_checkpoints=[(e.step, e.score, Path(e.path)) for e in self.best.ranked()],
            metrics={k: v for k, v in self.history[-1].items() if k != "step"} if self.history else {},
            steps=self.step,
        )

    def _train_step(self, step: int) -> dict[str, float]:
        from accelerate.utils import gather_object

        acc, training = self.accelerator, self.config.training
        group_size = self.hp["group_size"]
        epoch, position, indices = self.data.batch(step)
        self._data_state = (epoch, position)
        share = len(indices) // acc.num_processes
        mine = [self.train_items[i] for i in indices[acc.process_index * share : (acc.process_index + 1) * share]]

        started = time.perf_counter()
        records = self._rollouts(mine, group_size, derived_seed(training.seed, "rollout", step))
        sampling_s = time.perf_counter() - started

        advantages, silent_groups = batch_advantages(records, group_size, scale=training.scale_rewards)

        started = time.perf_counter()
        lr = self.hp["learning_rate"] * lr_factor(
            step, total_steps=self.total_steps, warmup_steps=training.warmup_steps, schedule=training.lr_schedule
        )
        for param_group in self.optimizer.param_groups:
            param_group["lr"] = lr
        update = self._update(records, advantages, step)
        training_s = time.perf_counter() - started

        gathered = gather_object([(_without_tokens(r), a) for r, a in zip(records, advantages, strict=True)])
        silent_total = sum(gather_object([silent_groups]))
        timings = gather_object([(sampling_s, training_s)])
        everything = [r for r, _ in gathered]
        # The slowest process sets the pace of a step.
        sampling_s = max(t[0] for t in timings)
        training_s = max(t[1] for t in timings)
        metrics = summarize(everything, prefix="train").metrics
        metrics.update(update)
        metrics.update(
            {
                "train/rollouts_per_s": len(everything) / max(sampling_s, 1e-9),
                "train/tokens_per_s": sum(r.tokens_generated for r in everything) / max(sampling_s, 1e-9),
                "train/grader_errors": float(sum(1 for r in everything if r.grader_errors)),
                "train/zero_variance_group_share": silent_total / max(1, len(everything) // group_size),
                "train/rollouts_in_loss": float(sum(1 for _, a in gathered if a is not None)),
                "train/lr": lr,
                "timing/sampling_s": sampling_s,
                "timing/training_s": training_s,
            }
        )
        if self.is_main:
            self._keep_rollouts(step, gathered)
        return metrics

    def _rollouts(self, items: list[dict[str, Any]], n: int, seed: int) -> list[RolloutRecord]:
        """`n` rollouts of each item with the current weights, through the real tools."""
        if not items:
            return []
        rollout, tools = self.config.rollout, self.config.tools
        model = self.accelerator.unwrap_model(self.model)
        model.eval()  # no dropout while sampling; the engine refuses a training model
        # A fresh engine each time: a cache filled before an update would be stale after it.
        backend = TransformersBackend(
            model,
            stop_token_ids=self.stop_token_ids,
            max_slots=rollout.max_concurrent_rollouts,
            max_len=rollout.max_total_tokens,
            seed=seed,
        )

        async def run() -> list[RolloutRecord]:
            async with ToolClient(
                self.endpoints,
                tools.schemas,
                timeout_s=tools.timeout_s,
                max_retries=tools.max_retries,
                max_output_chars=tools.max_output_chars,
                max_concurrency_per_endpoint=tools.max_concurrency_per_endpoint,
                allowed_hosts=tools.allowed_hosts,
                seed=seed,
            ) as client:
                return await run_rollouts_async(
                    backend,
                    self.tokenizer,
                    items,
                    n_per_item=n,
                    tool_client=client,
                    grader=self.config.grader,
                    settings=self.settings,
                    tools=tools.schemas,
                    max_concurrent=rollout.max_concurrent_rollouts,
                )

        try:
            return asyncio.run(run())
        finally:
            model.train()

    def _update(self, records: list[RolloutRecord], advantages: list[float | None], step: int) -> dict[str, float]:
        """`ppo_epochs` passes of clipped policy-gradient updates over the rollouts that
        have an advantage; returns the step's training metrics."""
        acc, training = self.accelerator, self.config.training
        chosen = [(r, a) for r, a in zip(records, advantages, strict=True) if a is not None]
        sums = torch.zeros(len(_STATS), device=acc.device)
        norms: list[float] = []
        for ppo_epoch in range(training.ppo_epochs):
            order = list(chosen)
            random.Random(derived_seed(training.seed, f"ppo:{ppo_epoch}", step)).shuffle(order)
            micro = [order[i : i + training.micro_batch_size] for i in range(0, len(order), training.micro_batch_size)]
            # Every process runs the same number of micro-batches, whole updates of them.
            most = int(acc.gather(torch.tensor([len(micro)], device=acc.device)).max())
            if most == 0:
                break  # no group varies on any process: nothing to learn from this batch
            # micro-batches per optimiser update: the pass split into `mini_batches` updates
            accumulation = training.gradient_accumulation_steps or math.ceil(most / training.mini_batches)
            n_micro = math.ceil(most / accumulation) * accumulation
            acc.gradient_accumulation_steps = accumulation
            acc.step = 0  # accumulate() counts micro-batches from here
            micro += [[] for _ in range(n_micro - len(micro))]
            tokens = torch.tensor(
                [float(sum(sum(r.gen_mask[1:]) for r, _ in batch)) for batch in micro], device=acc.device
            )
            # Generated tokens of each update, over all processes: the loss's denominator.
            per_update = acc.gather(tokens).view(acc.num_processes, -1).sum(0).view(-1, accumulation).sum(1).tolist()
            for index, batch in enumerate(micro):
                with acc.accumulate(self.model):
                    loss_sum, stats = self._micro_batch_loss(batch)
                    # DDP averages over processes and accumulate() divides by the number of
                    # micro-batches: undo both, so the update's gradient is sum / tokens.
                    scale = acc.num_processes * accumulation / max(per_update[index // accumulation], 1.0)
                    acc.backward(loss_sum * scale)
                    if acc.sync_gradients:
                        norm = acc.clip_grad_norm_(self.model.parameters(), training.max_grad_norm)
                        norms.append(float(norm) if norm is not None else float("nan"))
                    self.optimizer.step()
                    self.optimizer.zero_grad(set_to_none=True)
                sums += stats
        totals = dict(zip(_STATS, acc.reduce(sums, reduction="sum").tolist(), strict=True))
        tokens = max(totals["tokens"], 1.0)
        return {
            "train/loss": totals["loss"] / tokens,
            "train/kl": totals["kl"] / tokens,
            "train/clip_fraction": totals["clipped"] / tokens,
            "train/entropy": totals["entropy"] / tokens,
            "train/grad_norm": sum(norms) / len(norms) if norms else 0.0,
            "train/updates": float(len(norms)),
        }

    def _micro_batch_loss(self, batch: list[tuple[RolloutRecord, float]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Loss sum of a micro-batch (right-padded) and its stats in `_STATS` order. An
        empty batch is a two-token dummy that contributes nothing but keeps DDP in step."""
        device, training = self.accelerator.device, self.config.training
        pad = self.tokenizer.pad_token_id
        rows = [(r.token_ids, r.gen_mask, r.logprobs, a) for r, a in batch] or [([pad, pad], [0, 0], [0.0, 0.0], 0.0)]
        width = max(len(ids) for ids, *_ in rows)
        input_ids = torch.full((len(rows), width), pad, dtype=torch.long)
        attention = torch.zeros((len(rows), width), dtype=torch.long)
        generated = torch.zeros((len(rows), width), dtype=torch.bool)
        old = torch.zeros((len(rows), width))
        for b, (ids, gen_mask, logprobs, _) in enumerate(rows):
            input_ids[b, : len(ids)] = torch.tensor(ids)
            attention[b, : len(ids)] = 1
            generated[b, : len(ids)] = torch.tensor(gen_mask, dtype=torch.bool)
            old[b, : len(ids)] = torch.tensor(logprobs)
        input_ids, attention = input_ids.to(device), attention.to(device)
        mask, old = generated[:, 1:].to(device), old[:, 1:].to(device)
        advantages = torch.tensor([row[3] for row in rows], device=device)

        logits = self.model(input_ids=input_ids, attention_mask=attention, use_cache=False).logits
        new = token_logprobs(logits, input_ids, self.temperature)
        ref = self._reference_logprobs(input_ids, attention) if training.kl_coef > 0 else None
        loss_sum, stats = policy_loss(
            new, old, advantages, mask, clip_eps=training.clip_eps, kl_coef=training.kl_coef, ref=ref
        )
        with torch.no_grad():
            picked = logits[:, :-1][mask].float() / self.temperature
            entropy = (torch.logsumexp(picked, -1) - (picked.softmax(-1) * picked).sum(-1)).sum()
        stats["entropy"] = entropy
        return loss_sum, torch.stack([stats[name] for name in _STATS])

    def _reference_logprobs(self, input_ids: torch.Tensor, attention: torch.Tensor) -> torch.Tensor:
        with torch.no_grad(), self.accelerator.autocast():
            if self.reference is not None:
                logits = self.reference(input_ids=input_ids, attention_mask=attention, use_cache=False).logits
            else:  # LoRA: the base model under the adapters is the reference
                peft_model = self.accelerator.unwrap_model(self.model)
                with peft_model.disable_adapter():
                    logits = peft_model(input_ids=input_ids, attention_mask=attention, use_cache=False).logits
        return token_logprobs(logits, input_ids, self.temperature)

    # -- evaluation, records, checkpoints ----------------------------------------------

    def _evaluate(self, step: int) -> dict[str, float]:
        from accelerate.utils import gather_object

        acc = self.accelerator
        started = time.perf_counter()
        share = math.ceil(len(self.eval_items) / acc.num_processes)
        mine = self.eval_items[acc.process_index * share : (acc.process_index + 1) * share]
        # The same seed at every evaluation: the differences are the model's.
        records = self._rollouts(mine, 1, derived_seed(self.config.training.seed, "eval"))
        everything = gather_object([_without_tokens(r) for r in records])
        metrics = summarize(everything, prefix="eval").metrics
        if self.is_main:
            with (self.rollouts_dir / f"eval_step_{step}.jsonl").open("w") as handle:
                for record in everything:
                    handle.write(json.dumps(record.to_json()) + "\n")
        score = metrics["eval/score_mean"]
        if step > 0 and self.best.admits(score):
            path, evicted = self.best.add(step, score)
            save_model(acc, self.model, self.tokenizer, path)
            if self.is_main:
                for old in evicted:
                    shutil.rmtree(old, ignore_errors=True)
        metrics["timing/eval_s"] = time.perf_counter() - started
        if self.is_main:
            from tqdm.auto import tqdm

            tqdm.write(
                f"step {step}: eval score {score:.3f}, reward {metrics['eval/reward_mean']:.3f}, "
                f"tool calls {metrics['eval/tool_calls_mean']:.2f}, tokens {metrics['eval/tokens_mean']:.0f}"
            )
        return metrics

    def _keep_rollouts(self, step: int, gathered: list[tuple[RolloutRecord, float | None]]) -> None:
        """Write the best and the worst rollout of the step's first groups, whole."""
        group_size = self.hp["group_size"]
        rows = []
        for start in range(0, min(len(gathered), KEPT_GROUPS * group_size), group_size):
            group = gathered[start : start + group_size]
            scored = [pair for pair in group if pair[0].reward is not None] or group
            ranked = sorted(scored, key=lambda pair: pair[0].reward if pair[0].reward is not None else -math.inf)
            kept = [("best", ranked[-1])] + ([("worst", ranked[0])] if len(ranked) > 1 else [])
            for kind, (record, advantage) in kept:
                rows.append({"step": step, "kept_as": kind, "advantage": advantage, **record.to_json()})
        with (self.rollouts_dir / f"step_{step}.jsonl").open("w") as handle:
            for row in rows:
                handle.write(json.dumps(row) + "\n")

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
        save_checkpoint(self.accelerator, self.checkpoints_dir, self.step, state)

    def _finish(self) -> Path:
        """Save the final model, draw the figures and hand the artifacts to MLflow."""
        final = self.output_dir / "final"
        save_model(self.accelerator, self.model, self.tokenizer, final)
        if self.is_main:
            figures = self.output_dir / "figures"
            plot_training(
                self.history,
                read_jsonl(self.rollouts_dir / "eval_step_0.jsonl"),
                read_jsonl(self.rollouts_dir / f"eval_step_{self.step}.jsonl"),
                figures,
            )
            summary = {
                "model_dir": str(final),
                "steps": self.step,
                "best_checkpoints": self.best.to_json(),
                "metrics": self.history[-1],
            }
            (self.output_dir / "train_result.json").write_text(json.dumps(summary, indent=2))
            self.sink.log_artifacts(figures, "figures")
            self.sink.log_artifacts(self.rollouts_dir, "rollouts")
        return final

    def cleanup(self) -> None:
        self._exit.close()
        if hasattr(self, "accelerator"):
            self.accelerator.end_training()


def train(
    config: PipelineConfig,
    *,
    model_path: str,
    output_dir: Path,
    mlflow_run_id: str | None = None,
    resume: bool = False,
    endpoints: list[ToolEndpoint] | None = None,
) -> TrainResult:
    """Train `model_path` with GRPO as `config` says; see the module docstring. With no
    `endpoints` the config's are used, or the demo tool server is started over
    `config.data.corpus_dir` when `tools.demo_server` is set."""
    trainer = GRPOTrainer(
        config,
        model_path=model_path,
        output_dir=output_dir,
        mlflow_run_id=mlflow_run_id,
        resume=resume,
        endpoints=endpoints,
    )
    try:
        trainer.setup()
        return trainer.train()
    finally:
        trainer.cleanup()
