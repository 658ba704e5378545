"""The warm start: supervised fine-tuning on demonstrations, run by Accelerate.

A base model that never calls the tools gives GRPO nothing to learn from (every reward in
a group is the same). Practitioners first fine-tune on demonstrations of the behaviour,
then run RL from there (DeepSeek-R1's "cold start"). This is that fine-tune:

1. Every demonstration (OpenAI's supervised format, checked by
   `trainer.data.read_demonstrations`) becomes token ids and a mask through the model's
   chat format, `ChatFormat.encode_conversation`: the prompt and the tool results are
   read (mask 0), the assistant's turns are written (mask 1), exactly as a rollout builds
   the conversation and marks its completion tokens. A conversation with a user turn after
   an assistant turn, or with a `weight: 0` assistant turn, becomes one example per trained
   stretch, the earlier turns rendered as its prompt by the template.
2. The loss is next-token cross-entropy at the masked tokens only, averaged over every
   assistant token of the optimizer step (all micro-batches and processes), so the grouping
   does not change the gradient. Token accuracy is the share of those tokens whose argmax
   is the demonstrated token.
3. Each epoch is a permutation of the examples drawn from the seed; a step takes
   `batch_size` of them (the last step of an epoch takes what is left). AdamW, warmup,
   then a constant, linear or cosine schedule; gradient clipping at `training.max_grad_norm`.
4. Validation demonstrations, when given, are scored (loss, token accuracy) before the first
   step, every `eval_interval` steps and after the last.

The model is built, sharded and saved as GRPO's is (trainer/rl/setup.py `build_model`:
LoRA or full weights, gradient checkpointing, DDP, FSDP2 over `training.distributed`), and
checkpoints are GRPO's (trainer/rl/checkpoint.py: `checkpoints/step_N/` with Accelerate's
state and the data order; `--resume` continues a stopped run exactly). The final model is
`final/`, a plain model directory (adapters merged), where RFT starts.

Metrics (MLflow and `metrics.jsonl`), named so that OpenAI's supervised job metrics map
one to one: `warm_start/train_loss`, `warm_start/train_mean_token_accuracy`,
`warm_start/valid_loss`, `warm_start/valid_mean_token_accuracy`, plus `warm_start/lr`,
`warm_start/grad_norm`, `warm_start/tokens`, `timing/step_s` and `progress/total_steps` (the
planned steps, which `agentrft api` reports as a supervised job's `total_steps`).

Why not TRL's `SFTTrainer` (it is not a dependency; judged on its documented design):
its assistant-only loss comes from the tokenizer's chat template (`{% generation %}`
markers, which the published Qwen, Llama and Mistral templates do not carry), not from the
chat formats that mark what a rollout samples, so its mask could differ from the tokens RL
later trains on; and it runs transformers' `Trainer` loop, whose FSDP is Accelerate's
plugin (the trainer here shards with FSDP2 itself and refuses that plugin) and whose
checkpoints are not the ones `--resume` and the pipeline read. The loop below is a few
dozen lines over the parts GRPO already uses.

    agentrft warm-start --config job.yaml
"""

from __future__ import annotations

import datetime
import json
import math
import os
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from trainer.config.pipeline import PipelineConfig
from trainer.config.warm_start import resolved_warm_start
from trainer.data import read_demonstrations
from trainer.errors import ConfigError, DataError
from trainer.rl.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint, save_model
from trainer.rl.loss import derived_seed, lr_factor
from trainer.rl.metrics import MetricsSink
from trainer.rl.setup import build_model, check_processes, refuse_sharded_launch
from trainer.rl.sharding import clip_grad_norm, resolved_distributed, resolved_mixed_precision

PREFIX = "warm_start"


@dataclass
class Example:
    ids: list[int]
    mask: list[int]  # 1 where the model writes the token (the loss), 0 where it reads it
    source: str  # file:line of its demonstration


def trained_stretches(messages: list[dict[str, Any]]) -> list[tuple[int, int]]:
    """(first, end) of each stretch of trained assistant turns joined only by tool results,
    the shape `encode_conversation` builds: `messages[:first]` is its prompt."""
    stretches: list[tuple[int, int]] = []
    first = last = None
    for index, message in enumerate(messages):
        if message["role"] == "assistant" and message.get("weight", 1) == 1:
            first = index if first is None else first
            last = index
        elif message["role"] == "tool":
            continue
        elif first is not None:  # a user turn, or an assistant turn not trained, ends the stretch
            stretches.append((first, last + 1))
            first = last = None
    if first is not None:
        stretches.append((first, last + 1))
    return stretches


def encode_demonstration(chat: Any, row: dict[str, Any], *, max_tokens: int, where: str) -> list[Example]:
    """A demonstration's examples: ids and the chat format's mask of the assistant's tokens."""
    messages, tools = row["messages"], row.get("tools")
    examples = []
    for first, end in trained_stretches(messages):
        ids, mask = chat.encode_conversation(messages[:end], tools, first=first)
        if len(ids) > max_tokens:
            raise DataError(f"{where}: the conversation is {len(ids)} tokens in this model's chat format, over "
                            f"warm_start.max_tokens ({max_tokens}); raise max_tokens or shorten it")
        examples.append(Example(ids, mask, where))
    return examples


def encode_file(chat: Any, path: str, *, max_tokens: int) -> list[Example]:
    return [example for row in read_demonstrations(path)
            for example in encode_demonstration(chat, row, max_tokens=max_tokens, where=f"{path}:{row['line']}")]


def assistant_loss(logits: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed cross-entropy and the count of right argmaxes at the masked next tokens."""
    logits, targets, weights = logits[:, :-1].float(), ids[:, 1:], mask[:, 1:].float()
    token_loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1),
                                                   reduction="none").view_as(targets)
    right = (logits.argmax(-1) == targets).float()
    return (token_loss * weights).sum(), (right * weights).sum().detach()


@dataclass
class WarmStartResult:
    model_dir: Path | None  # the warm-started model (None when the run stopped before its end)
    metrics: dict[str, float]  # the last step's
    steps: int


class WarmStartTrainer:
    """One supervised run: `setup()`, `train()`, `cleanup()`."""

    def __init__(self, config: PipelineConfig, *, model_path: str, output_dir: Path, mlflow_run_id: str | None = None,
                 resume: bool = False):
        if not config.warm_start.enabled:
            raise ConfigError("warm_start.demonstrations_file is not set: name the demonstrations to train on")
        self.config, self.ws = config, config.warm_start
        self.hp = resolved_warm_start(config.warm_start)
        self.model_path, self.output_dir = str(model_path), Path(output_dir)
        self.mlflow_run_id, self.resume = mlflow_run_id, resume

    def setup(self) -> None:
        from accelerate import Accelerator
        from accelerate.utils import InitProcessGroupKwargs, set_seed

        from trainer.generation.policy import load_config_policy, local_model_path

        training = self.config.training
        refuse_sharded_launch(training.accelerate_config)
        self.distributed = resolved_distributed(training)
        mixed_precision = resolved_mixed_precision(training.mixed_precision)
        timeout = InitProcessGroupKwargs(timeout=datetime.timedelta(seconds=training.collective_timeout_s))
        self.accelerator = acc = Accelerator(mixed_precision="no" if self.distributed == "fsdp" else mixed_precision,
                                             kwargs_handlers=[timeout])
        self.is_main = acc.is_main_process
        set_seed(self.ws.seed)
        check_processes(acc, self.distributed)
        tracking_uri = self.config.mlflow.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
        dtype = "float32" if self.config.model.dtype == "auto" else self.config.model.dtype
        local = local_model_path(self.model_path, tracking_uri=tracking_uri)
        policy = load_config_policy(self.config.model, local, device=str(acc.device), dtype=dtype)
        self.tokenizer, self.chat = policy.tokenizer, policy.chat
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self.train_examples = encode_file(self.chat, self.ws.demonstrations_file, max_tokens=self.ws.max_tokens)
        self.valid_examples = (encode_file(self.chat, self.ws.validation_file, max_tokens=self.ws.max_tokens)
                               if self.ws.validation_file else [])
        self.steps_per_epoch = math.ceil(len(self.train_examples) / self.hp["batch_size"])
        self.total_steps = self.steps_per_epoch * self.hp["n_epochs"]
        if self.ws.max_steps is not None:
            self.total_steps = min(self.total_steps, self.ws.max_steps)
        # No KL term in a supervised fit: the reference copy is never built.
        fit = training.model_copy(update={"kl_coef": 0.0, "kl_coef_by_group": {}})
        self.model, self.optimizer, _, self.whole = build_model(
            policy.model, acc, fit, distributed=self.distributed, mixed_precision=mixed_precision,
            learning_rate=self.hp["learning_rate"])
        self.checkpoints_dir = self.output_dir / "checkpoints"
        self.step, self.history = 0, []
        self.sink = None
        if self.is_main:
            self.sink = MetricsSink(self.output_dir / "metrics.jsonl", run_id=self.mlflow_run_id,
                                    tracking_uri=tracking_uri, unavailable_timeout_s=self.config.mlflow.unavailable_timeout_s)
        latest = latest_checkpoint(self.checkpoints_dir)
        if self.resume and latest is not None:
            self._restore(latest)
        elif latest is not None:
            raise ConfigError(f"{self.output_dir} holds checkpoints of an earlier run ({latest.name}); pass --resume "
                              "to continue it or choose another output directory")
        elif self.is_main:
            self.sink.rewrite([])

    # -- data order ----------------------------------------------------------------------

    def batch(self, step: int) -> list[int]:
        """The example indices of the 1-based `step`: a slice of its epoch's permutation."""
        epoch, position = divmod(step - 1, self.steps_per_epoch)
        order = list(range(len(self.train_examples)))
        random.Random(derived_seed(self.ws.seed, "warm_start:epoch", epoch)).shuffle(order)
        size = self.hp["batch_size"]
        return order[position * size : (position + 1) * size]

    # -- the loop ------------------------------------------------------------------------

    def train(self, *, stop_after: int | None = None) -> WarmStartResult:
        """Run to the last step, or only up to step `stop_after` (then checkpoint)."""
        last = self.total_steps if stop_after is None else min(self.total_steps, stop_after)
        if self.step == 0 and self.valid_examples:
            self._log(0, self.validate())
        while self.step < last:
            step = self.step + 1
            started = time.perf_counter()
            metrics = self._learn(step)
            due = self.valid_examples and ((self.ws.eval_interval and step % self.ws.eval_interval == 0)
                                           or step == self.total_steps)
            if due:
                metrics.update(self.validate())
            metrics["timing/step_s"] = time.perf_counter() - started
            metrics["progress/total_steps"] = float(self.total_steps)  # the API's step/total_steps
            self.step = step
            self._log(step, metrics)
            if self.is_main:
                print(f"warm start step {step}/{self.total_steps}: loss {metrics[f'{PREFIX}/train_loss']:.4f}, token "
                      f"accuracy {metrics[f'{PREFIX}/train_mean_token_accuracy']:.3f}", flush=True)
            if step % self.ws.checkpoint_interval == 0 or step == last:
                self._checkpoint()
        model_dir = self._finish() if self.step == self.total_steps else None
        return WarmStartResult(model_dir=model_dir, steps=self.step,
                               metrics={k: v for k, v in self.history[-1].items() if k != "step"} if self.history else {})

    def _micro_batches(self, indices: list[int], examples: list[Example]) -> list[list[Example]]:
        """This process's share of `indices` in micro-batches, padded with empty ones so every
        process runs as many forwards (no collective waits forever)."""
        acc = self.accelerator
        mine = [examples[i] for i in indices[acc.process_index :: acc.num_processes]]
        mine.sort(key=lambda e: len(e.ids))  # similar lengths: less padding
        size = self.ws.micro_batch_size
        micro = [mine[i : i + size] for i in range(0, len(mine), size)]
        most = int(acc.gather(torch.tensor([len(micro)], device=acc.device)).max())
        return micro + [[] for _ in range(most - len(micro))]

    def _forward(self, batch: list[Example]) -> tuple[torch.Tensor, torch.Tensor]:
        """(summed loss, right tokens) of a micro-batch; an empty one runs the first example
        with a zero mask, so its backward still meets the other processes'."""
        rows = batch or [Example(self.train_examples[0].ids[:2], [0, 0], "")]
        longest = max(len(e.ids) for e in rows)
        device = self.accelerator.device
        ids = torch.full((len(rows), longest), self.pad_id, dtype=torch.long, device=device)
        mask = torch.zeros((len(rows), longest), dtype=torch.long, device=device)
        attention = torch.zeros_like(mask)
        for row, example in enumerate(rows):
            ids[row, : len(example.ids)] = torch.tensor(example.ids, device=device)
            mask[row, : len(example.mask)] = torch.tensor(example.mask if batch else [0] * len(example.mask), device=device)
            attention[row, : len(example.ids)] = 1
        with self.accelerator.autocast():
            logits = self.model(input_ids=ids, attention_mask=attention).logits
        return assistant_loss(logits, ids, mask)

    def _learn(self, step: int) -> dict[str, float]:
        acc, training = self.accelerator, self.config.training
        indices = self.batch(step)
        micro = self._micro_batches(indices, self.train_examples)
        # Every assistant token of the step (all processes) weighs the same in the gradient.
        mine = sum(sum(self.train_examples[i].mask[1:]) for i in indices[acc.process_index :: acc.num_processes])
        tokens = float(acc.reduce(torch.tensor(float(mine), device=acc.device), reduction="sum"))
        lr = self.hp["learning_rate"] * lr_factor(step, total_steps=self.total_steps,
                                                  warmup_steps=self.ws.warmup_steps, schedule=self.ws.lr_schedule)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        sums = torch.zeros(2, device=acc.device)
        sharded = self.distributed == "fsdp"
        from contextlib import nullcontext

        for index, batch in enumerate(micro):
            sync = index == len(micro) - 1
            if sharded:
                self.model.set_requires_gradient_sync(sync)
            with nullcontext() if sync or sharded else acc.no_sync(self.model):
                loss, right = self._forward(batch)
                # DDP averages over processes: scaled back to a sum over every token of the step.
                acc.backward(loss * acc.num_processes / max(tokens, 1.0))
            sums += torch.stack([loss.detach(), right])
        norm = (clip_grad_norm(list(self.model.parameters()), training.max_grad_norm) if sharded
                else acc.clip_grad_norm_(self.model.parameters(), training.max_grad_norm))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum, right_sum = acc.reduce(sums, reduction="sum").tolist()
        return {f"{PREFIX}/train_loss": loss_sum / max(tokens, 1.0),
                f"{PREFIX}/train_mean_token_accuracy": right_sum / max(tokens, 1.0),
                f"{PREFIX}/lr": lr, f"{PREFIX}/grad_norm": float(norm) if norm is not None else float("nan"),
                f"{PREFIX}/tokens": tokens, f"{PREFIX}/epoch": (step - 1) // self.steps_per_epoch + 1}

    @torch.no_grad()
    def validate(self) -> dict[str, float]:
        """Loss and token accuracy over every validation example (all processes)."""
        acc = self.accelerator
        started = time.perf_counter()
        self.model.eval()
        sums = torch.zeros(3, device=acc.device)
        indices = list(range(len(self.valid_examples)))
        for batch in self._micro_batches(indices, self.valid_examples):
            loss, right = self._forward(batch)
            sums += torch.stack([loss, right, torch.tensor(float(sum(sum(e.mask[1:]) for e in batch)),
                                                           device=acc.device)])
        self.model.train()
        loss_sum, right_sum, tokens = acc.reduce(sums, reduction="sum").tolist()
        return {f"{PREFIX}/valid_loss": loss_sum / max(tokens, 1.0),
                f"{PREFIX}/valid_mean_token_accuracy": right_sum / max(tokens, 1.0),
                "timing/valid_s": time.perf_counter() - started}

    # -- records, checkpoints ------------------------------------------------------------

    def _log(self, step: int, metrics: dict[str, float]) -> None:
        row = {"step": step, **{k: (float(v) if math.isfinite(v) else None) for k, v in metrics.items()}}
        self.history.append(row)
        if self.is_main:
            self.sink.log(metrics, step)

    def _fingerprint(self) -> dict[str, Any]:
        return {"seed": self.ws.seed, "batch_size": self.hp["batch_size"], "examples": len(self.train_examples)}

    def _sharded_state(self) -> tuple[Any, Any] | None:
        return (self.model, self.optimizer) if self.distributed == "fsdp" else None

    def _checkpoint(self) -> None:
        save_checkpoint(self.accelerator, self.checkpoints_dir, self.step,
                        {"history": self.history, "fingerprint": self._fingerprint()}, sharded=self._sharded_state())

    def _restore(self, path: Path) -> None:
        state = load_checkpoint(self.accelerator, path, sharded=self._sharded_state())
        changed = {k: (v, state["fingerprint"].get(k)) for k, v in self._fingerprint().items()
                   if state["fingerprint"].get(k) != v}
        if changed:
            described = ", ".join(f"{k}: now {now}, checkpoint {then}" for k, (now, then) in changed.items())
            raise ConfigError(f"{path}: the checkpoint was written with another config ({described}); resume with "
                              "the same warm_start settings and demonstrations or choose another output directory")
        self.step, self.history = state["step"], state["history"]
        if self.is_main:
            self.sink.rewrite(self.history)
            print(f"resumed from {path} at step {self.step}", flush=True)

    def _finish(self) -> Path:
        final = self.output_dir / "final"
        if self.whole is not None:
            self.whole.refresh(self.model)
        save_model(self.accelerator, self.whole.model if self.whole is not None else self.model, self.tokenizer, final)
        if self.is_main:
            (self.output_dir / "warm_start_result.json").write_text(json.dumps(
                {"model_dir": str(final), "steps": self.step, "metrics": self.history[-1],
                 "examples": len(self.train_examples), "valid_examples": len(self.valid_examples)}, indent=2))
        return final

    def cleanup(self) -> None:
        if hasattr(self, "accelerator"):
            self.accelerator.end_training()


def warm_start(config: PipelineConfig, *, model_path: str, output_dir: Path, mlflow_run_id: str | None = None,
               resume: bool = False) -> WarmStartResult:
    """Fine-tune `model_path` on the config's demonstrations; see the module docstring."""
    trainer = WarmStartTrainer(config, model_path=model_path, output_dir=output_dir, mlflow_run_id=mlflow_run_id,
                               resume=resume)
    try:
        trainer.setup()
        return trainer.train()
    finally:
        trainer.cleanup()
