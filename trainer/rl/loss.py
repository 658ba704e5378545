"""The math of a GRPO step, each piece a pure function that tests can check by hand.

Advantages: A = r - mean(group), divided by the group's standard deviation (`group`, GRPO),
by the whole batch's (`batch`) or not at all (`none`, Dr. GRPO's choice, so that a 0.05
price per call weighs what it says instead of becoming a unit advantage in a group whose
rollouts are all right). Only trainable rollouts enter: an infrastructure failure, a
grader error or (with `mask_truncated`) a cut rollout is no evidence about the policy. A
group whose rewards are all equal, or that has fewer than two, carries no signal.

The clipped objective per generated token, with r = exp(new - old):

    l = -min(r * A, clip(r, 1 - epsilon, 1 + epsilon_high) * A) * w + kl_coef * k3(ref, new)

w is truncated importance sampling: min(exp(old - sampler), tis_cap), the correction for a
sampler (vLLM, bf16 kernels) whose log-probabilities differ from the trainer's. The loss
types differ in how tokens are summed (`token_weights`):

- `grpo`: each rollout's mean over its tokens, then the mean over rollouts;
- `dapo`: the mean over every token of the update (a long rollout is not down-weighted);
- `dr_grpo`: the sum over tokens divided by a constant, the generation budget x rollouts
  (Dr. GRPO's and TRL's constant is the most tokens a completion may have; an agent's
  rollout generates at most max_turns x max_new_tokens_per_turn, and never more than the
  context, `generation_budget`);
- `gspo`: one importance ratio per rollout, exp(mean over its tokens of new - old), used
  as a detached factor on a token-level gradient (GSPO-token), summed as `grpo`.

Names follow TRL's GRPOConfig (`loss_type`, `epsilon`, `epsilon_high`, `scale_rewards`).
"""

from __future__ import annotations

import hashlib
import math
import statistics
from collections.abc import Sequence
from typing import Any

import torch

ADVANTAGE_EPS = 1e-4  # as TRL: a group std of 1e-5 should not blow a reward difference up 1e5 times
LOG_RATIO_CLAMP = 20.0


def derived_seed(seed: int, purpose: str, step: int = 0) -> int:
    """A seed for one purpose at one step, a pure function of its arguments."""
    digest = hashlib.sha256(f"{seed}:{purpose}:{step}".encode()).digest()
    return int.from_bytes(digest[:4], "little")


def group_advantages(rewards: Sequence[float | None], *, divisor: float | None) -> list[float | None] | None:
    """Advantages of one group (None where a rollout has no reward), or None for a group
    without signal. `divisor`: None divides by the group's sample std (+ ADVANTAGE_EPS, as
    TRL), a number divides by that number."""
    present = [r for r in rewards if r is not None]
    if len(present) < 2 or max(present) - min(present) < 1e-9:
        return None
    mean = sum(present) / len(present)
    denominator = statistics.stdev(present) + ADVANTAGE_EPS if divisor is None else divisor
    return [None if r is None else (r - mean) / denominator for r in rewards]


def batch_advantages(
    rewards: Sequence[float | None], group_size: int, *, scale_rewards: str,
    batch_rewards: Sequence[float] | None = None,
) -> tuple[list[float | None], int]:
    """Advantages of consecutive groups of `group_size` rewards (None: not in the loss) and
    the number of groups without signal. `batch_rewards`: every reward of the step's batch
    when `rewards` is one process's share (the std of `scale_rewards: batch` is the batch's)."""
    present = [r for r in rewards if r is not None] if batch_rewards is None else list(batch_rewards)
    divisor = {
        "group": None,
        "batch": (statistics.stdev(present) if len(present) > 1 else 0.0) + ADVANTAGE_EPS,
        "none": 1.0,
    }[scale_rewards]
    advantages: list[float | None] = []
    silent = 0
    for start in range(0, len(rewards), group_size):
        group = list(rewards[start : start + group_size])
        group_adv = group_advantages(group, divisor=divisor)
        if group_adv is None:
            silent += 1
            group_adv = [None] * len(group)
        advantages.extend(group_adv)
    return advantages, silent


def lr_factor(step: int, *, total_steps: int, warmup_steps: int, schedule: str) -> float:
    """Multiplier of the learning rate at the 1-based `step`: linear warmup that reaches
    1.0 at step `warmup_steps`, then constant, or a linear or cosine decay towards 0."""
    if step <= warmup_steps:
        return step / warmup_steps
    if schedule == "constant":
        return 1.0
    progress = (step - warmup_steps - 1) / max(1, total_steps - warmup_steps)
    if schedule == "linear":
        return 1.0 - progress
    return 0.5 * (1.0 + math.cos(math.pi * progress))


def chunked_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float, *, chunk: int, with_entropy: bool = False,
    mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log softmax(logits / T) at `targets`, [B, K] from [B, K, V] logits, computed `chunk`
    positions at a time so that no float32 [B, K, V] copy exists at once; with
    `with_entropy`, also the summed entropy over the positions where `mask` is True (no
    gradient)."""
    pieces, entropy = [], logits.new_zeros((), dtype=torch.float32) if with_entropy else None
    for start in range(0, logits.size(1), chunk):
        scaled = logits[:, start : start + chunk].float() / temperature
        norm = torch.logsumexp(scaled, dim=-1)
        pieces.append(scaled.gather(-1, targets[:, start : start + chunk].unsqueeze(-1)).squeeze(-1) - norm)
        if with_entropy:
            with torch.no_grad():
                probs = (scaled - norm.unsqueeze(-1)).exp()
                ent = norm - (probs * scaled).sum(-1)
                if mask is not None:
                    ent = torch.where(mask[:, start : start + chunk], ent, 0.0)
                entropy = entropy + ent.sum()
    return torch.cat(pieces, dim=1), entropy


class _LinearLogprobs(torch.autograd.Function):
    """log softmax(h W^T + b) / T) at the targets, `chunk` rows at a time, with a backward
    that recomputes each chunk's logits and turns them into their own gradient in place
    ((onehot - softmax) * g / T): at most two [chunk, V] float32 tensors at a time in
    forward (logsumexp's own, the entropy's), one in backward."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                targets: torch.Tensor, temperature: float, chunk: int, with_entropy: bool
                ) -> tuple[torch.Tensor, torch.Tensor]:
        logprobs = hidden.new_empty(hidden.size(0), dtype=torch.float32)
        norms = torch.empty_like(logprobs)
        entropy = logprobs.new_zeros(())
        for start in range(0, hidden.size(0), chunk):
            rows = slice(start, start + chunk)
            x = torch.nn.functional.linear(hidden[rows], weight, bias).float()
            if temperature != 1.0:
                x.div_(temperature)
            norm = torch.logsumexp(x, dim=-1)
            norms[rows] = norm
            x.sub_(norm.unsqueeze(-1))  # log-probabilities, in place
            logprobs[rows] = x.gather(-1, targets[rows].unsqueeze(-1)).squeeze(-1)
            if with_entropy:  # H = -sum p log p, as a batched dot product: two [chunk, V] tensors at most
                entropy -= (x.exp().unsqueeze(-2) @ x.unsqueeze(-1)).sum()
        ctx.save_for_backward(hidden, weight, bias, targets, norms)
        ctx.temperature, ctx.chunk = temperature, chunk
        ctx.mark_non_differentiable(entropy)
        return logprobs, entropy

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, _: torch.Tensor) -> tuple[Any, ...]:
        hidden, weight, bias, targets, norms = ctx.saved_tensors
        want_h, want_w, want_b = ctx.needs_input_grad[:3]
        grad_h = torch.zeros_like(hidden) if want_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if want_w else None
        grad_b = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if want_b else None
        for start in range(0, hidden.size(0), ctx.chunk):
            rows = slice(start, start + ctx.chunk)
            x = torch.nn.functional.linear(hidden[rows], weight, bias).float()
            if ctx.temperature != 1.0:
                x.div_(ctx.temperature)
            x.sub_(norms[rows].unsqueeze(-1)).exp_().neg_()  # -softmax
            x.scatter_add_(-1, targets[rows].unsqueeze(-1), torch.ones_like(x[:, :1]))  # onehot - softmax
            x.mul_((grad[rows] / ctx.temperature).unsqueeze(-1))
            if want_h:
                grad_h[rows] = (x.to(weight.dtype) @ weight).to(hidden.dtype)
            if want_w:
                grad_w += x.T @ hidden[rows].float()
            if want_b:
                grad_b += x.sum(0)
        return (grad_h, grad_w.to(weight.dtype) if want_w else None, grad_b.to(bias.dtype) if want_b else None,
                None, None, None, None)


def fused_logprobs(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor,
    temperature: float, *, chunk: int, with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log softmax((hidden W^T + b) / T) at `targets` for [N, H] hidden states (the
    positions whose next token was generated), [N]: the output projection and the
    log-softmax of `chunk` positions at a time, in forward and again in backward, so no
    [N, V] logits exist at once in either pass; only the hidden states are kept. With
    `with_entropy`, also the summed entropy (no gradient). An empty `hidden` still puts
    the projection in the graph (DDP and FSDP expect every parameter in every backward)."""
    logprobs, entropy = _LinearLogprobs.apply(hidden, weight, bias, targets, temperature, chunk, with_entropy)
    return logprobs, (entropy if with_entropy else None)


def generation_budget(max_turns: int, max_new_tokens_per_turn: int, max_total_tokens: int) -> int:
    """The most tokens one rollout can generate: `dr_grpo`'s constant."""
    return min(max_turns * max_new_tokens_per_turn, max_total_tokens)


def token_weights(
    mask: torch.Tensor, *, loss_type: str, update_tokens: float, update_rollouts: float, generation_budget: int
) -> torch.Tensor:
    """Each token's weight in the update's loss (see the module docstring): the update's
    loss is the weighted sum of per-token losses, whatever its micro-batches."""
    mask = mask.float()
    match loss_type:
        case "dapo":
            return mask / max(update_tokens, 1.0)
        case "dr_grpo":
            return mask / (generation_budget * max(update_rollouts, 1.0))
        case "grpo" | "gspo":
            per_rollout = mask.sum(-1, keepdim=True).clamp(min=1.0)
            return mask / per_rollout / max(update_rollouts, 1.0)
    raise ValueError(f"unknown loss_type {loss_type!r}")


def policy_loss(
    new: torch.Tensor,
    old: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    weights: torch.Tensor,
    *,
    epsilon: float,
    epsilon_high: float | None = None,
    loss_type: str = "dapo",
    sampler: torch.Tensor | None = None,
    tis_cap: float | None = None,
    kl_coef: float | torch.Tensor = 0.0,
    ref: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The update's loss share of one micro-batch, `sum(weights * per-token loss)`, and the
    sums of its statistics. `new`, `old`, `sampler`, `ref`, `mask` and `weights` are
    [batch, positions]; `advantages` is [batch], and so is `kl_coef` when it is a tensor (a
    coefficient per rollout). Masked-out positions take no part, not even as a 0 * NaN."""
    log_ratio = torch.where(mask, (new - old).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP), 0.0)
    if loss_type == "gspo":
        # The rollout's ratio, exp(mean log-ratio), as a detached value times the token's own
        # ratio of 1 (new / new.detach()): the gradient of GSPO's sequence-level objective.
        count = mask.sum(-1, keepdim=True).clamp(min=1)
        seq = (log_ratio.sum(-1, keepdim=True) / count).detach()
        log_ratio = torch.where(mask, seq + new - new.detach(), 0.0)
    ratio = log_ratio.exp()
    high = epsilon if epsilon_high is None else epsilon_high
    unclipped = ratio * advantages[:, None]
    clipped = ratio.clamp(1 - epsilon, 1 + high) * advantages[:, None]
    per_token = -torch.minimum(unclipped, clipped)
    zero = torch.zeros((), device=new.device)
    stats: dict[str, torch.Tensor] = {}
    if sampler is not None and tis_cap is not None:
        sampler_log_ratio = torch.where(mask, (old - sampler).detach().clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP), 0.0)
        tis = sampler_log_ratio.exp().clamp(max=tis_cap)
        per_token = per_token * tis
        # KL(sampler || trainer) from the sampler's own tokens: k3 with r = trainer / sampler,
        # r - 1 - log r, whose mean under the sampler is that KL exactly.
        stats["sampler_kl"] = torch.where(mask, sampler_log_ratio.exp() - 1 - sampler_log_ratio, zero).sum()
        stats["sampler_diff_max"] = torch.where(mask, sampler_log_ratio.abs(), zero).max() if mask.any() else zero
        stats["tis_capped"] = (mask & (sampler_log_ratio.exp() > tis_cap)).sum().float()
    if ref is not None:
        ref_log_ratio = torch.where(mask, (ref - new).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP), 0.0)
        kl = ref_log_ratio.exp() - ref_log_ratio - 1
        coef = kl_coef[:, None] if isinstance(kl_coef, torch.Tensor) else kl_coef
        per_token = per_token + coef * kl
    else:
        kl = ratio.detach() - 1 - log_ratio.detach()
    loss = torch.where(mask, per_token * weights, 0.0).sum()
    stats.update({
        "loss": loss.detach(),
        "kl": torch.where(mask, kl.detach(), zero).sum(),
        "clipped": (mask & (clipped < unclipped)).sum().float(),
        "tokens": mask.sum().float(),
    })
    return loss, stats
