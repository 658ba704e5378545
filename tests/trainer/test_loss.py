"""The loss math by hand, and a learning test that a broken loss cannot pass.

Hand-computed cases: each `loss_type` on a 2-rollout example, clip-higher, truncated
importance sampling, advantages per scaling, warmup. The learning test trains a tabular
policy on a task whose optimal policy is known (a seeded bandit of token sequences: the
reward is the share of `good` tokens) with the real `batch_advantages`, `token_weights` and
`policy_loss`: every loss type must raise the mean reward by a stated margin, and the same
loop with the sign of the loss flipped must not. (Taking the max instead of the min of the
clipped objective changes nothing on-policy, where the ratio is 1; the clipping tests
catch it: their hand-computed values differ under that mutation.)
"""

from __future__ import annotations

import math

import pytest
import torch

from trainer.rl.loss import (
    ADVANTAGE_EPS,
    batch_advantages,
    chunked_logprobs,
    fused_logprobs,
    generation_budget,
    group_advantages,
    lr_factor,
    policy_loss,
    token_weights,
)

LOSS_TYPES = ("grpo", "dapo", "dr_grpo", "gspo")


def two_rollouts():
    """Rollout A: 2 generated tokens, advantage +1; rollout B: 3 tokens, advantage -1."""
    mask = torch.tensor([[True, True, False], [True, True, True]])
    old = torch.zeros(2, 3)
    new = torch.tensor([[0.1, -0.1, 0.0], [0.05, 0.3, -0.2]], requires_grad=True)
    return new, old, torch.tensor([1.0, -1.0]), mask


def per_token_clipped(log_ratio: float, advantage: float, low: float = 0.2, high: float = 0.2) -> float:
    ratio = math.exp(log_ratio)
    return -min(ratio * advantage, min(max(ratio, 1 - low), 1 + high) * advantage)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_each_loss_type_matches_a_hand_computed_loss(loss_type):
    new, old, advantages, mask = two_rollouts()
    weights = token_weights(mask, loss_type=loss_type, update_tokens=5, update_rollouts=2, generation_budget=10)
    loss, stats = policy_loss(new, old, advantages, mask, weights, epsilon=0.2, loss_type=loss_type)
    a = [per_token_clipped(0.1, 1), per_token_clipped(-0.1, 1)]
    b = [per_token_clipped(0.05, -1), per_token_clipped(0.3, -1), per_token_clipped(-0.2, -1)]
    expected = {
        "dapo": (sum(a) + sum(b)) / 5,  # every token of the update alike
        "grpo": (sum(a) / 2 + sum(b) / 3) / 2,  # each rollout's mean, then the mean
        "dr_grpo": (sum(a) + sum(b)) / (10 * 2),  # a constant: the generation budget x rollouts
    }
    if loss_type == "gspo":
        seq_a, seq_b = (0.1 - 0.1) / 2, (0.05 + 0.3 - 0.2) / 3  # one ratio per rollout
        expected["gspo"] = (2 * per_token_clipped(seq_a, 1) / 2 + 3 * per_token_clipped(seq_b, -1) / 3) / 2
    assert loss.item() == pytest.approx(expected[loss_type], rel=1e-5)
    assert stats["tokens"].item() == 5
    loss.backward()
    assert new.grad[0, 2] == 0  # masked positions get no gradient


def test_gspo_gradient_is_the_sequence_ratio_times_each_token_gradient():
    new, old, advantages, mask = two_rollouts()
    weights = token_weights(mask, loss_type="gspo", update_tokens=5, update_rollouts=2, generation_budget=10)
    loss, _ = policy_loss(new, old, advantages, mask, weights, epsilon=10.0, loss_type="gspo")  # no clipping
    loss.backward()
    # d/dnew_t of -s * A * w_t with s = exp(mean log-ratio) detached, times the token's own ratio (1)
    s_a = math.exp(0.0)
    assert new.grad[0, 0].item() == pytest.approx(-s_a * 1.0 / 2 / 2, rel=1e-5)
    s_b = math.exp((0.05 + 0.3 - 0.2) / 3)
    assert new.grad[1, 1].item() == pytest.approx(s_b * 1.0 / 3 / 2, rel=1e-5)


def test_epsilon_high_clips_asymmetrically():
    mask = torch.tensor([[True, True]])
    old = torch.zeros(1, 2)
    new = torch.tensor([[math.log(1.25), math.log(0.75)]], requires_grad=True)
    weights = torch.ones(1, 2)
    up, up_stats = policy_loss(new, old, torch.tensor([1.0]), mask, weights, epsilon=0.2, epsilon_high=0.28)
    # positive advantage: ratio 1.25 < 1 + 0.28 is not clipped (it would be at 0.2); 0.75 < 0.8 is
    # below the range, where min() keeps the unclipped ratio * A
    assert up.item() == pytest.approx(-(1.25 + 0.75), rel=1e-6)
    assert up_stats["clipped"].item() == 0
    symmetric, stats = policy_loss(new, old, torch.tensor([1.0]), mask, weights, epsilon=0.2)
    assert symmetric.item() == pytest.approx(-(1.2 + 0.75), rel=1e-6) and stats["clipped"].item() == 1
    down, down_stats = policy_loss(new, old, torch.tensor([-1.0]), mask, weights, epsilon=0.2, epsilon_high=0.28)
    # negative advantage: the low side clips at 1 - 0.2 whatever epsilon_high says
    assert down.item() == pytest.approx(1.25 + 0.8, rel=1e-6) and down_stats["clipped"].item() == 1


def test_truncated_importance_sampling_weights_are_capped():
    mask = torch.tensor([[True, True, True]])
    new = torch.zeros(1, 3, requires_grad=True)
    old = torch.zeros(1, 3)
    sampler = torch.tensor([[0.0, -math.log(1.5), -math.log(4.0)]])  # weights 1, 1.5, 4 -> capped at 2
    loss, stats = policy_loss(new, old, torch.tensor([1.0]), mask, torch.ones(1, 3), epsilon=0.2,
                              sampler=sampler, tis_cap=2.0)
    assert loss.item() == pytest.approx(-(1.0 + 1.5 + 2.0), rel=1e-6)
    assert stats["tis_capped"].item() == 1
    assert stats["sampler_diff_max"].item() == pytest.approx(math.log(4.0), rel=1e-6)
    assert stats["sampler_kl"].item() > 0


def test_a_kl_coefficient_per_rollout_weighs_each_rollouts_k3_term():
    new, old, advantages, mask = two_rollouts()
    ref = torch.tensor([[0.3, 0.0, 0.0], [-0.2, 0.1, 0.4]])
    weights = token_weights(mask, loss_type="dapo", update_tokens=5, update_rollouts=2, generation_budget=10)
    loss, _ = policy_loss(new, old, advantages, mask, weights, epsilon=0.2, kl_coef=torch.tensor([0.0, 0.5]),
                          ref=ref)

    def k3(r: float, n: float) -> float:
        return math.exp(r - n) - (r - n) - 1

    a = [per_token_clipped(0.1, 1), per_token_clipped(-0.1, 1)]  # coefficient 0: no KL term
    b = [per_token_clipped(n, -1) + 0.5 * k3(r, n) for n, r in ((0.05, -0.2), (0.3, 0.1), (-0.2, 0.4))]
    assert loss.item() == pytest.approx((sum(a) + sum(b)) / 5, rel=1e-5)
    loss.backward()
    assert new.grad[0, 0].item() == pytest.approx(-math.exp(0.1) / 5, rel=1e-5)  # rollout A: no KL gradient


def test_advantages_per_scaling_and_without_signal():
    assert group_advantages([1.0, None, 0.0, 0.0], divisor=1.0) == pytest.approx([2 / 3, None, -1 / 3, -1 / 3])
    scaled = group_advantages([1.0, None, 0.0], divisor=None)
    assert scaled[1] is None and scaled[0] == pytest.approx(0.5 / (0.5**0.5 + ADVANTAGE_EPS))
    assert group_advantages([0.5, 0.5, None], divisor=None) is None  # no variance: no signal
    assert group_advantages([1.0, None, None], divisor=None) is None  # one reward: no signal
    rewards = [1.0, 0.0, 0.5, 0.5, 0.9, 0.1]
    none, silent = batch_advantages(rewards, 2, scale_rewards="none")
    assert none == pytest.approx([0.5, -0.5, None, None, 0.4, -0.4]) and silent == 1
    batch, _ = batch_advantages(rewards, 2, scale_rewards="batch")
    std = torch.tensor(rewards).std().item()
    assert batch[0] == pytest.approx(0.5 / (std + ADVANTAGE_EPS)) and batch[2] is None
    group, _ = batch_advantages(rewards, 2, scale_rewards="group")
    assert group[0] == pytest.approx(group[4], rel=1e-3)  # each group by its own std (+ eps)


def test_warmup_reaches_the_full_rate():
    factors = [lr_factor(s, total_steps=10, warmup_steps=4, schedule="cosine") for s in range(1, 11)]
    assert factors[:4] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    assert factors[4] == pytest.approx(1.0) and factors[-1] < factors[4]
    assert lr_factor(1, total_steps=10, warmup_steps=0, schedule="constant") == 1.0


def test_chunked_logprobs_equal_the_full_log_softmax():
    torch.manual_seed(0)
    logits = torch.randn(2, 7, 11)
    targets = torch.randint(0, 11, (2, 7))
    full = torch.log_softmax(logits / 0.7, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    chunked, entropy = chunked_logprobs(logits, targets, 0.7, chunk=3, with_entropy=True,
                                        mask=torch.ones(2, 7, dtype=torch.bool))
    assert torch.allclose(chunked, full, atol=1e-6)
    probs = torch.softmax(logits / 0.7, -1)
    assert entropy.item() == pytest.approx(-(probs * probs.log()).sum().item(), rel=1e-5)


def test_fused_logprobs_equal_the_logits_path_in_value_and_gradient():
    torch.manual_seed(0)
    hidden = torch.randn(2, 9, 8)
    weight = torch.randn(13, 8)
    targets = torch.randint(0, 13, (2, 9))
    mask = torch.rand(2, 9) > 0.4  # generated tokens between tool outputs
    h1, w1 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    reference, ref_entropy = chunked_logprobs(h1 @ w1.T, targets, 0.7, chunk=4, with_entropy=True, mask=mask)
    (reference[mask] * torch.arange(1.0, mask.sum() + 1)).sum().backward()
    h2, w2 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    fused, entropy = fused_logprobs(h2[mask], w2, None, targets[mask], 0.7, chunk=3, with_entropy=True)
    (fused * torch.arange(1.0, mask.sum() + 1)).sum().backward()
    assert torch.allclose(fused, reference[mask], atol=1e-6)
    assert entropy.item() == pytest.approx(ref_entropy.item(), rel=1e-5)
    assert torch.allclose(h2.grad, h1.grad, atol=1e-6) and torch.allclose(w2.grad, w1.grad, atol=1e-5)
    # with a bias, through the same backward
    b1, b2 = torch.randn(13, requires_grad=True), None
    reference, _ = chunked_logprobs(hidden @ weight.T + b1, targets, 1.3, chunk=4)
    reference[mask].sum().backward()
    b2 = b1.detach().clone().requires_grad_()
    fused, _ = fused_logprobs(hidden[mask], weight, b2, targets[mask], 1.3, chunk=2)
    fused.sum().backward()
    assert torch.allclose(fused, reference[mask], atol=1e-6) and torch.allclose(b2.grad, b1.grad, atol=1e-6)
    # no position at all still puts the head in the graph (DDP, FSDP)
    empty, _ = fused_logprobs(hidden[:0, 0], w2, None, targets[:0, 0], 1.0, chunk=4)
    assert empty.shape == (0,) and empty.grad_fn is not None


def test_dr_grpo_divides_by_the_generation_budget():
    # 3 turns of at most 64 new tokens in a 1024-token context: 192; the context caps it
    assert generation_budget(3, 64, 1024) == 192 and generation_budget(12, 256, 2048) == 2048
    new, old, advantages, mask = two_rollouts()
    weights = token_weights(mask, loss_type="dr_grpo", update_tokens=5, update_rollouts=2,
                            generation_budget=generation_budget(3, 64, 1024))
    loss, _ = policy_loss(new, old, advantages, mask, weights, epsilon=0.2, loss_type="dr_grpo")
    a = [per_token_clipped(0.1, 1), per_token_clipped(-0.1, 1)]
    b = [per_token_clipped(0.05, -1), per_token_clipped(0.3, -1), per_token_clipped(-0.2, -1)]
    assert loss.item() == pytest.approx((sum(a) + sum(b)) / (192 * 2), rel=1e-6)


def test_sampler_kl_is_kl_of_the_sampler_from_the_trainer_in_closed_form():
    """Under the sampler's own distribution the per-token statistic averages to KL(sampler ||
    trainer) exactly: weight each token of a vocabulary by its sampler probability."""
    sampler = torch.log_softmax(torch.tensor([1.0, 0.2, -0.5, 2.0]), -1)
    trainer = torch.log_softmax(torch.tensor([0.4, 0.9, -1.0, 1.5]), -1)
    expected = (sampler.exp() * (sampler - trainer)).sum().item()
    estimate = 0.0
    for token in range(4):
        mask = torch.tensor([[True]])
        _, stats = policy_loss(trainer[token].view(1, 1), trainer[token].view(1, 1), torch.tensor([1.0]), mask,
                               torch.ones(1, 1), epsilon=0.2, sampler=sampler[token].view(1, 1), tis_cap=1e9)
        estimate += sampler[token].exp().item() * stats["sampler_kl"].item()
    assert estimate == pytest.approx(expected, rel=1e-5)
    reverse = (trainer.exp() * (trainer - sampler)).sum().item()
    assert abs(estimate - reverse) > 1e-3  # the two directions differ here, so the test tells them apart


def test_gspo_defaults_to_its_papers_clip_range():
    from trainer.config.training import TrainingConfig

    assert TrainingConfig(loss_type="gspo").clip_range() == (3e-4, 4e-4)
    assert TrainingConfig(loss_type="dapo").clip_range() == (0.2, 0.2)
    assert TrainingConfig(loss_type="gspo", epsilon=0.1).clip_range() == (0.1, 0.1)
    assert TrainingConfig(loss_type="dapo", epsilon_high=0.28).clip_range() == (0.2, 0.28)


# --- learning: a task whose optimal policy is known ------------------------------------


def learn(loss_type: str, *, steps: int = 40, mutation: str | None = None, seed: int = 0) -> tuple[float, float]:
    """A tabular policy over 4 tokens at each of 6 positions; a rollout samples one token
    per position and earns the share of token 0 (the optimum is always token 0). Groups of
    8 rollouts, 4 groups a step, one Adam update a step through the real loss functions.
    Returns the mean reward of the first and the last step."""
    generator = torch.Generator().manual_seed(seed)
    logits = torch.zeros(6, 4, requires_grad=True)
    optimizer = torch.optim.Adam([logits], lr=0.05)
    first = last = 0.0
    for step in range(steps):
        probs = torch.softmax(logits.detach(), -1)
        tokens = torch.stack([torch.multinomial(probs, 1, generator=generator).squeeze(-1) for _ in range(32)])
        rewards = (tokens == 0).float().mean(-1).tolist()
        advantages, _ = batch_advantages(rewards, 8, scale_rewards="group")
        chosen = [i for i, a in enumerate(advantages) if a is not None]
        table = torch.log_softmax(logits, -1).expand(len(chosen), 6, 4)
        new = table.gather(-1, tokens[chosen].unsqueeze(-1)).squeeze(-1)  # [R, 6]
        mask = torch.ones_like(new, dtype=torch.bool)
        weights = token_weights(mask, loss_type=loss_type, update_tokens=float(mask.sum()),
                                update_rollouts=float(len(chosen)), generation_budget=6)
        loss, _ = policy_loss(new, new.detach(), torch.tensor([advantages[i] for i in chosen]), mask, weights,
                              epsilon=0.2, loss_type=loss_type)
        if mutation == "flip_sign":
            loss = -loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        first = first if step else sum(rewards) / len(rewards)
        last = sum(rewards) / len(rewards)
    return first, last


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_every_loss_type_learns_the_known_optimum(loss_type):
    start, end = learn(loss_type)
    assert start == pytest.approx(0.25, abs=0.1)  # a uniform policy: one token in four
    assert end >= start + 0.4, (start, end)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_the_learning_test_fails_with_the_sign_of_the_loss_flipped(loss_type):
    """The mutation check: the learning test above must catch a flipped loss."""
    start, end = learn(loss_type, mutation="flip_sign")
    assert end < start + 0.4 and end < 0.2, (start, end)
