"""The real `PolicyUpdate` on a tabular policy whose optimum is known.

The model is a lookup table behind the interface the trainer uses (an HF causal LM's
`forward(..., logits_to_keep)` and `get_output_embeddings()`): position t's logits are
column t of the output projection, whatever came before. A rollout is one prompt token and
six sampled tokens; its reward is the share of token 0. So the update's arithmetic can be
checked by hand, and learning can be checked against the known optimum, through the same
code that trains real models (micro-batches, mini-batches, the old policy, clipping).
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from trainer.config.rollout import RolloutConfig
from trainer.config.training import TrainingConfig
from trainer.rl.loss import batch_advantages
from trainer.rl.update import PolicyUpdate
from trainer.rollout.record import RolloutRecord

POSITIONS, VOCAB = 7, 4  # the prompt token and six generated ones; four tokens
LOSS_TYPES = ("grpo", "dapo", "dr_grpo", "gspo")


class TabularLM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.head = torch.nn.Linear(POSITIONS, VOCAB, bias=False)
        torch.nn.init.zeros_(self.head.weight)  # uniform at the start

    def get_output_embeddings(self) -> torch.nn.Module:
        return self.head

    def forward(self, input_ids, attention_mask=None, use_cache=False, logits_to_keep=0):
        hidden = torch.eye(POSITIONS)[: input_ids.size(1)].expand(input_ids.size(0), -1, -1)
        return SimpleNamespace(logits=self.head(hidden[:, -logits_to_keep:] if logits_to_keep else hidden))


def updater(*, optimizer: str, lr: float, **training) -> tuple[PolicyUpdate, TabularLM]:
    from accelerate import Accelerator

    acc = Accelerator(cpu=True)
    model = TabularLM()
    opt = (torch.optim.SGD if optimizer == "sgd" else torch.optim.Adam)(model.parameters(), lr=lr)
    model, opt = acc.prepare(model, opt)
    config = SimpleNamespace(
        training=TrainingConfig(micro_batch_size=4, **training),
        rollout=RolloutConfig(max_turns=1, max_new_tokens_per_turn=POSITIONS - 1, max_total_tokens=64),
    )
    update = PolicyUpdate(acc, model, opt, config=config, tokenizer=SimpleNamespace(pad_token_id=0), reference=None,
                          temperature=1.0, kl_coef_of=lambda record: 0.0)
    return update, model


def record(tokens: list[int], logprobs: list[float], reward: float = 0.0) -> RolloutRecord:
    return RolloutRecord(trace_id="t", item_id="i", sample_index=0, messages=[], tool_calls=[], final_answer="",
                         status="ok", score=reward, reward=reward, token_ids=[0, *tokens],
                         gen_mask=[0] + [1] * len(tokens), logprobs=[0.0, *logprobs])


def test_a_second_mini_batch_sees_the_first_updates_ratio_and_is_clipped():
    """Two identical rollouts, advantage +1 each, two optimizer updates of one rollout
    (`mini_batches: 2`, `ppo_epochs: 1`), plain SGD at lr 12, dapo. By hand: the first
    update's gradient on column t is -(1/6)(onehot(token) - 1/4), so the step moves it to
    2 (onehot - 1/4); the token's probability becomes e^1.5 / (e^1.5 + 3 e^-0.5), a ratio
    of 2.845 over the old 1/4, far above 1.2: all six tokens of the second update clip,
    its loss is -1.2 and its gradient zero."""
    tokens = [0, 1, 0, 2, 0, 3]
    uniform = [math.log(0.25)] * 6
    update, model = updater(optimizer="sgd", lr=12.0, loss_type="dapo", mini_batches=2, ppo_epochs=1,
                            max_grad_norm=1e9, seed=1)
    metrics = update.update([record(tokens, uniform), record(tokens, uniform)], [1.0, 1.0], step=1)
    p = math.exp(1.5) / (math.exp(1.5) + 3 * math.exp(-0.5))
    assert p / 0.25 == pytest.approx(2.845, abs=1e-3)
    assert metrics["train/updates"] == 2
    assert metrics["train/clip_fraction"] == pytest.approx(0.5)  # 6 of the 12 tokens: the second update's
    assert metrics["train/loss"] == pytest.approx((-1.0 + -1.2) / 2, rel=1e-6)
    weight = model.head.weight.detach()
    for t, token in enumerate(tokens):  # only the first update moved the table
        expected = 2.0 * (torch.nn.functional.one_hot(torch.tensor(token), VOCAB).float() - 0.25)
        assert torch.allclose(weight[:, t], expected, atol=1e-6)


def learn(loss_type: str, *, mini_batches: int, steps: int = 30, seed: int = 0) -> tuple[float, float]:
    """The bandit of test_loss.py through `PolicyUpdate`: 4 groups of 8 rollouts a step,
    Adam at 0.05. Returns the mean reward of the first and the last step."""
    update, model = updater(optimizer="adam", lr=0.05, loss_type=loss_type, mini_batches=mini_batches, seed=seed)
    generator = torch.Generator().manual_seed(seed)
    first = last = 0.0
    for step in range(1, steps + 1):
        logprobs = torch.log_softmax(model.head.weight.detach().T[: POSITIONS - 1], -1)  # [6, V]
        tokens = torch.multinomial(logprobs.exp(), 32, replacement=True, generator=generator).T  # [32, 6]
        sampled = logprobs.gather(-1, tokens.T).T  # [32, 6]
        rewards = (tokens == 0).float().mean(-1).tolist()
        advantages, _ = batch_advantages(rewards, 8, scale_rewards="group")
        records = [record(t.tolist(), s.tolist(), r) for t, s, r in zip(tokens, sampled, rewards, strict=True)]
        update.update(records, advantages, step)
        first = first if step > 1 else sum(rewards) / len(rewards)
        last = sum(rewards) / len(rewards)
    return first, last


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_every_loss_type_learns_through_the_update_with_two_mini_batches(loss_type):
    start, end = learn(loss_type, mini_batches=2)
    assert start == pytest.approx(0.25, abs=0.1)
    assert end >= start + 0.4, (start, end)
