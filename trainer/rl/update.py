"""One step's policy update: clipped policy-gradient passes over the rollouts in the loss.

`PolicyUpdate.update` runs `ppo_epochs` passes over the rollouts that have an advantage,
each split into `mini_batches` optimizer updates of micro-batches of similar length (less
padding; an update's gradient is a weighted sum over its tokens, so the grouping does not
change it). The old policy is the trainer: `new.detach()` when the step makes one
optimizer update, one no-grad forward before the first update when it makes several
(`ppo_epochs > 1` or `mini_batches > 1`), so that every later update's ratio measures how
far the earlier ones moved the policy and the clip holds it in its trust region. Log-probabilities are computed only at the
generated tokens (not the prompt, not the tool outputs between turns): the model's output
projection is replaced, for the forward, by one that projects `logprob_chunk_tokens` of
those positions at a time and recomputes each chunk in backward (trainer/rl/loss.py
`fused_logprobs`), so neither pass holds more than a chunk's [tokens, vocabulary] logits.
With `training.shared_prefix` a micro-batch holds whole groups (as many rollouts as
`micro_batch_size` allows; a bigger group is cut), and each group's shared prompt is
forwarded once, its rollouts packed after it under a shared-prefix mask
(trainer/rl/shared_prefix.py): the same log-probabilities and gradients, in P + G*R tokens
instead of G*(P+R). The first update checks the packed forward against the plain one on its
first micro-batch, and a model it does not hold for is trained without it, the log says why.
Under DDP (and FSDP) the gradients add up locally (`no_sync`; FSDP's
`set_requires_gradient_sync`) and are averaged once per update; every process runs
the same number of updates and micro-batches (short ones are padded with empty ones).
"""

from __future__ import annotations

import logging
import math
import random
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import torch

from trainer.rl.loss import (
    chunked_logprobs,
    derived_seed,
    fused_logprobs,
    generation_budget,
    policy_loss,
    token_weights,
)
from trainer.rl.sharding import clip_grad_norm, resolved_mixed_precision
from trainer.rl.shared_prefix import Packed, attention_masks, pack, prompt_key, unsupported
from trainer.rollout.record import RolloutRecord

logger = logging.getLogger(__name__)

# Names of the stats summed over micro-batches (and processes) in one step.
_STATS = ("loss", "kl", "clipped", "entropy", "tokens", "sampler_kl", "tis_capped")


class PolicyUpdate:
    """The optimisation half of a GRPO step, on an Accelerate-prepared model."""

    def __init__(self, accelerator: Any, model: Any, optimizer: Any, *, config: Any, tokenizer: Any,
                 reference: Any, temperature: float, kl_coef_of: Callable[[RolloutRecord], float],
                 sharded: bool = False):
        self.accelerator, self.model, self.optimizer = accelerator, model, optimizer
        self.sharded = sharded  # an FSDP2 model (trainer/rl/sharding.py), not one Accelerate wraps
        self.config, self.tokenizer, self.reference, self.temperature = config, tokenizer, reference, temperature
        self.kl_coef_of = kl_coef_of  # a rollout's KL coefficient (`training.kl_coef_by_group`)
        # Whether each group's prompt is forwarded once: None until the first update checks it.
        self.shared: bool | None = None if config.training.shared_prefix else False
        self.shared_off_reason: str | None = None if config.training.shared_prefix else "training.shared_prefix is off"

    def update(self, records: list[RolloutRecord], advantages: list[float | None], step: int) -> dict[str, float]:
        """`ppo_epochs` passes of clipped policy-gradient updates over the rollouts that
        have an advantage; returns the step's training metrics."""
        acc, training = self.accelerator, self.config.training
        chosen = [(r, a) for r, a in zip(records, advantages, strict=True) if a is not None]
        sums = torch.zeros(len(_STATS), device=acc.device)
        sampler_diff_max = torch.zeros((), device=acc.device)
        norms: list[float] = []
        old: dict[int, torch.Tensor] = {}  # rollout index -> logprob of each token, by position
        if self.shared is None:
            self._check_shared(list(enumerate(chosen)))
        if training.ppo_epochs > 1 or training.mini_batches > 1:  # the policy before this step's updates, once
            with torch.no_grad():
                for batch in self._micro_batches(list(enumerate(chosen))):
                    logprobs, tensors = self._logprobs(batch)
                    for row, (index, (record, _)) in enumerate(batch):
                        by_position = torch.zeros(len(record.token_ids), device=acc.device)
                        span = len(record.token_ids) - tensors["first"]
                        by_position[tensors["first"]:] = logprobs[row, :span]
                        old[index] = by_position
        for ppo_epoch in range(training.ppo_epochs):
            order = list(enumerate(chosen))
            random.Random(derived_seed(training.seed, f"ppo:{ppo_epoch}", step)).shuffle(order)
            per_update = math.ceil(len(order) / training.mini_batches) if order else 0
            updates = [order[i : i + per_update] for i in range(0, len(order), per_update)] if order else []
            # Every process runs the same number of updates and micro-batches in each.
            n_updates = int(acc.gather(torch.tensor([len(updates)], device=acc.device)).max())
            if n_updates == 0:
                break  # no group varies on any process: nothing to learn from this batch
            updates += [[] for _ in range(n_updates - len(updates))]
            for rows in updates:
                micro = self._micro_batches(rows)
                n_micro = int(acc.gather(torch.tensor([len(micro)], device=acc.device)).max())
                micro += [[] for _ in range(n_micro - len(micro))]
                totals = acc.gather(torch.tensor([
                    float(sum(sum(r.gen_mask) for _, (r, _) in rows)), float(len(rows))], device=acc.device))
                totals = totals.view(acc.num_processes, 2).sum(0).tolist()
                for index, batch in enumerate(micro):
                    # Gradients add up locally; DDP averages them over processes once, at the
                    # update's last micro-batch, so the loss is scaled by the process count.
                    sync = index == len(micro) - 1
                    if self.sharded:  # FSDP2 reduce-scatters the gradients at the last micro-batch only
                        self.model.set_requires_gradient_sync(sync)
                    with nullcontext() if sync or self.sharded else acc.no_sync(self.model):
                        loss, stats = self._micro_batch_loss(batch, old, update_tokens=totals[0],
                                                             update_rollouts=totals[1])
                        acc.backward(loss * acc.num_processes)
                    sums += torch.stack([stats.get(name, torch.zeros((), device=acc.device)) for name in _STATS])
                    sampler_diff_max = torch.maximum(sampler_diff_max, stats.get("sampler_diff_max", sampler_diff_max))
                norm = (clip_grad_norm(list(self.model.parameters()), training.max_grad_norm) if self.sharded
                        else acc.clip_grad_norm_(self.model.parameters(), training.max_grad_norm))
                norms.append(float(norm) if norm is not None else float("nan"))
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=True)
        totals = dict(zip(_STATS, acc.reduce(sums, reduction="sum").tolist(), strict=True))
        tokens = max(totals["tokens"], 1.0)
        return {
            "train/loss": totals["loss"] / max(len(norms), 1),
            "train/kl": totals["kl"] / tokens,
            "train/clip_fraction": totals["clipped"] / tokens,
            "train/entropy": totals["entropy"] / tokens,
            "train/sampler_kl": totals["sampler_kl"] / tokens,
            "train/sampler_diff_max": float(acc.reduce(sampler_diff_max, reduction="max") if acc.num_processes > 1
                                            else sampler_diff_max),
            "train/tis_capped_share": totals["tis_capped"] / tokens,
            "train/grad_norm": sum(norms) / len(norms) if norms else 0.0,
            "train/updates": float(len(norms)),
        }

    def _micro_batches(self, rows: list[tuple[int, tuple[RolloutRecord, float]]]) -> list[list[Any]]:
        """Micro-batches of `micro_batch_size` rollouts of similar length (sorted: less
        padding, and the update's gradient is a sum, so the grouping does not change it).
        Shared: by group, whole groups to a micro-batch while they fit, a bigger one cut."""
        size = self.config.training.micro_batch_size
        if not self.shared:
            ordered = sorted(rows, key=lambda row: len(row[1][0].token_ids))
            return [ordered[i : i + size] for i in range(0, len(ordered), size)]
        groups: dict[tuple[int, ...], list[Any]] = {}
        for row in rows:
            groups.setdefault(prompt_key(row[1][0]), []).append(row)
        pieces = [group[i : i + size] for group in groups.values() for i in range(0, len(group), size)]
        batches: list[list[Any]] = []
        for piece in sorted(pieces, key=len, reverse=True):  # the largest first, then fill the gaps
            fits = next((b for b in batches if len(b) + len(piece) <= size), None)
            if fits is None:
                batches.append(list(piece))
            else:
                fits.extend(piece)
        return batches

    def _check_shared(self, rows: list[tuple[int, tuple[RolloutRecord, float]]]) -> None:
        """Decide `self.shared` once, on every process alike: the model must take the packed
        forward, and its log-probabilities on the first micro-batch must be the plain ones."""
        acc = self.accelerator
        reason = unsupported(acc.unwrap_model(self.model))
        difference = 0.0
        if reason is None:
            self.shared = True
            batch = (self._micro_batches(rows) or [[]])[0]
            with torch.no_grad():
                shared, tensors = self._logprobs(batch)
                self.shared = False
                plain, _ = self._logprobs(batch)
            mask = tensors["mask"]
            if mask.any():
                difference = float((shared - plain).abs()[mask].max())
        tolerance = 1e-3 if self._float32() else 5e-2
        verdicts = acc.gather(torch.tensor([float(reason is not None), difference], device=acc.device))
        verdicts = verdicts.view(acc.num_processes, 2)
        worst = float(verdicts[:, 1].max())
        if reason is None and bool(verdicts[:, 0].any()):
            reason = "another process's model cannot take the packed forward"
        elif reason is None and worst > tolerance:
            reason = (f"its log-probabilities differ from the plain forward's by {worst:.2e} (more than "
                      f"{tolerance:g}) on the first micro-batch")
        self.shared = reason is None
        self.shared_off_reason = reason
        if reason is not None and acc.is_main_process:
            logger.warning("training.shared_prefix: each rollout is forwarded whole: %s", reason)

    def _float32(self) -> bool:
        """Whether the update computes in float32 (no autocast, no FSDP bf16 policy)."""
        if self.accelerator.mixed_precision not in ("no", None):
            return False
        if self.sharded and resolved_mixed_precision(self.config.training.mixed_precision) != "no":
            return False
        parameter = next(self.accelerator.unwrap_model(self.model).parameters(), None)
        return parameter is None or parameter.dtype == torch.float32

    def _padded(self, batch: list[Any]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
        """The micro-batch's rows right-padded on the device: (input ids, attention mask,
        generation mask, `first`: the earliest generated position of any row, at least 1).
        An empty micro-batch is a two-token dummy."""
        device, pad = self.accelerator.device, self.tokenizer.pad_token_id
        rows = [record for _, (record, _) in batch]
        ids_rows = [r.token_ids for r in rows] or [[pad, pad]]
        masks = [r.gen_mask for r in rows] or [[0, 0]]
        width = max(len(ids) for ids in ids_rows)
        input_ids = torch.full((len(ids_rows), width), pad, dtype=torch.long)
        attention = torch.zeros((len(ids_rows), width), dtype=torch.long)
        generated = torch.zeros((len(ids_rows), width), dtype=torch.bool)
        for b, (ids, gen_mask) in enumerate(zip(ids_rows, masks, strict=True)):
            input_ids[b, : len(ids)] = torch.tensor(ids)
            attention[b, : len(ids)] = 1
            generated[b, : len(ids)] = torch.tensor(gen_mask, dtype=torch.bool)
        first = int(generated.float().argmax(-1)[generated.any(-1)].min()) if generated.any() else width - 1
        return input_ids.to(device), attention.to(device), generated.to(device), max(first, 1)

    def _logprobs(self, batch: list[tuple[int, tuple[RolloutRecord, float]]], *, model: Any = None,
                  entropy: bool = False) -> tuple[torch.Tensor, dict[str, Any]]:
        """Log-probabilities under `model` (default the policy) of the micro-batch's tokens
        from position `first` (the earliest generated token of any row) to the end: [B, K],
        with the generation mask over the same span, `first`, and the summed entropy."""
        device = self.accelerator.device
        # Hidden states only from the first generated token's predecessor on: the prompt is
        # context, and the output projection runs only where the next token was generated.
        input_ids, attention, generated, first = self._padded(batch)
        width = input_ids.size(1)
        forward = model or self.model
        mask = generated[:, first:]
        targets = input_ids[:, first:][mask]
        chunk = self.config.training.logprob_chunk_tokens
        inner = self.accelerator.unwrap_model(forward)
        head = inner.get_output_embeddings()
        config = getattr(inner, "config", None)
        inputs: dict[str, Any] = {"input_ids": input_ids, "attention_mask": attention}
        keep = width - first + 1

        def select(hidden: torch.Tensor) -> torch.Tensor:  # [rows, keep, H] -> [generated tokens, H]
            return hidden[:, :-1][mask]

        if self.shared and batch:
            # Packed by group: the hidden state that predicts each generated token sits at its
            # predecessor's place in the packed rows.
            records = [record for _, (record, _) in batch]
            groups: dict[tuple[int, ...], list[int]] = {}
            for index, record in enumerate(records):
                groups.setdefault(prompt_key(record), []).append(index)
            packed: Packed = pack([r.token_ids for r in records], list(groups.values()), self.tokenizer.pad_token_id)
            rows, columns = mask.nonzero(as_tuple=True)
            where = packed.source[rows.cpu(), first + columns.cpu() - 1]
            packed_width = packed.input_ids.size(1)
            start = int(where.remainder(packed_width).min()) if where.numel() else packed_width - 1
            keep = packed_width - start
            where_rows = (where // packed_width).to(device)
            where_columns = (where % packed_width - start).to(device)
            inputs = {"input_ids": packed.input_ids.to(device), "position_ids": packed.position_ids.to(device),
                      "attention_mask": attention_masks(config, packed, device)}

            def select(hidden: torch.Tensor) -> torch.Tensor:
                return hidden[where_rows, where_columns]

        # A model that transforms its logits after the projection (Gemma's soft-capping,
        # Cohere's logit scale) or has no plain projection: log-probabilities from its logits.
        if (not isinstance(getattr(head, "weight", None), torch.Tensor)
                or getattr(config, "final_logit_softcapping", None) or getattr(config, "logit_scale", None)):
            logits = select(forward(**inputs, use_cache=False, logits_to_keep=keep).logits)
            picked, ent = chunked_logprobs(logits[None], targets[None], self.temperature, chunk=chunk,
                                           with_entropy=entropy)
            logprobs = torch.zeros(mask.shape, dtype=picked.dtype, device=device).masked_scatter(mask, picked[0])
            return logprobs, {"mask": mask, "first": first, "entropy": ent}
        found: dict[str, Any] = {}

        def project(hidden: torch.Tensor) -> torch.Tensor:
            # In the head's own forward, where sharded parameters are whole; what it returns
            # is what the model returns as its logits, so the gradient flows through the
            # model's output (FSDP's backward hooks sit there).
            logprobs, found["entropy"] = fused_logprobs(
                select(hidden), head.weight, getattr(head, "bias", None), targets, self.temperature,
                chunk=chunk, with_entropy=entropy)
            return logprobs

        head.forward = project
        try:
            flat = forward(**inputs, use_cache=False, logits_to_keep=keep).logits
        finally:
            del head.forward  # the class's forward again
        logprobs = torch.zeros(mask.shape, dtype=flat.dtype, device=device).masked_scatter(mask, flat)
        ent = found["entropy"]
        return logprobs, {"mask": mask, "first": first, "entropy": ent}

    def _micro_batch_loss(
        self, batch: list[tuple[int, tuple[RolloutRecord, float]]], old: dict[int, torch.Tensor], *,
        update_tokens: float, update_rollouts: float,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The update's loss share of a micro-batch and its stats. An empty batch is a
        two-token dummy that contributes nothing but keeps DDP in step."""
        device, training = self.accelerator.device, self.config.training
        new, tensors = self._logprobs(batch, entropy=True)
        mask, first = tensors["mask"], tensors["first"]
        span = new.size(1)

        def aligned(values: list[float] | torch.Tensor) -> torch.Tensor:
            row = torch.as_tensor(values, dtype=torch.float32, device=device)[first : first + span]
            return torch.nn.functional.pad(row, (0, span - row.numel()))

        old_t = torch.stack([aligned(old[i]) for i, _ in batch]) if old and batch else new.detach()
        sampler = torch.stack([aligned(record.logprobs) for _, (record, _) in batch]) if batch else new.detach()
        advantages = torch.tensor([a for _, (_, a) in batch] or [0.0], device=device)
        coefs = torch.tensor([self.kl_coef_of(record) for _, (record, _) in batch] or [0.0], device=device)
        ref = self._reference_logprobs(batch) if training.uses_reference else None
        rollout = self.config.rollout
        budget = generation_budget(rollout.max_turns, rollout.max_new_tokens_per_turn, rollout.max_total_tokens)
        weights = token_weights(mask, loss_type=training.loss_type, update_tokens=update_tokens,
                                update_rollouts=update_rollouts, generation_budget=budget)
        low, high = training.clip_range()
        loss, stats = policy_loss(
            new, old_t, advantages, mask, weights, epsilon=low, epsilon_high=high,
            loss_type=training.loss_type, sampler=sampler, tis_cap=training.tis_cap, kl_coef=coefs, ref=ref,
        )
        stats["entropy"] = tensors["entropy"]
        return loss, stats

    def _reference_logprobs(self, batch: list[Any]) -> torch.Tensor:
        with torch.no_grad(), self.accelerator.autocast():
            if self.reference is not None:
                return self._logprobs(batch, model=self.reference)[0]
            peft_model = self.accelerator.unwrap_model(self.model)  # LoRA: the base under the adapters
            with peft_model.disable_adapter():
                return self._logprobs(batch, model=peft_model)[0]

