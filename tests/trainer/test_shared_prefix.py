"""The update's prefix sharing against the plain forward, on real models.

Each family's tiny model (its real architecture, tokenizer and published template) and the
shipped demo model: groups of rollouts encoded by the chat format as a rollout builds them
(prompt, a tool call, the tool's answer read but not trained on, a final answer), two groups
with different prompts in one micro-batch. The packed forward's per-token log-probabilities
must equal the plain forward's within 1e-5 (relative past a magnitude of 1) and its gradients
within 1e-5 relative (float32; the demo model, see TOLERANCE), in full fine-tuning and with LoRA; `training.shared_prefix` on and off must train the same weights
from fewer forwarded tokens; FSDP2 on two gloo processes likewise; a model the packed forward
does not hold for is trained without it, and the log says why.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests import model_families
from tests.taught_model import SYSTEM, TOOLS
from trainer.config.rollout import RolloutConfig
from trainer.config.training import TrainingConfig
from trainer.generation.policy import load_policy
from trainer.rl.shared_prefix import common_prefix, pack, unsupported
from trainer.rl.update import PolicyUpdate
from trainer.rollout.record import RolloutRecord

REPO = Path(__file__).resolve().parents[2]
DEMO_MODEL = REPO / "envs" / "finqa" / "model"
FAMILIES = ["qwen3", "qwen2.5", "llama3", "mistral", "gpt-oss"]
THINKING = {"qwen3", "gpt-oss"}
QUESTIONS = ("What was the revenue in 2019?", "How many staff were there in 2021?")


def model_dir(name: str) -> Path:
    return DEMO_MODEL if name == "demo" else model_families.tiny_model(name)


def conversations(chat, name: str, question: str, n: int) -> list[tuple[list[int], list[int]]]:
    """`n` rollouts of one prompt: a call, its answer, a final answer, each its own."""
    prompt = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    out = []
    for j in range(n):
        thought = {"reasoning_content": f"Read the {2019 - j} report."} if name in THINKING else {}
        call = {"id": chat.probe_call_id(j), "type": "function",
                "function": {"name": "cat", "arguments": json.dumps({"path": f"reports/{2019 - j}.md"})}}
        messages = [*prompt, {"role": "assistant", "content": "", "tool_calls": [call], **thought},
                    {"role": "tool", "tool_call_id": call["id"], "content": f"revenue {100 + 7 * j} million"},
                    {"role": "assistant", "content": str(100 + 7 * j) * (j + 1)}]
        out.append(chat.encode_conversation(messages, TOOLS))
    return out


def records_of(chat, name: str, sizes: tuple[int, ...] = (3, 2)) -> list[RolloutRecord]:
    records = []
    for question, n in zip(QUESTIONS, sizes, strict=False):
        for j, (ids, mask) in enumerate(conversations(chat, name, question, n)):
            records.append(RolloutRecord(
                trace_id=f"trace_{len(records)}", item_id=question, sample_index=j, messages=[], tool_calls=[],
                final_answer="", status="ok", score=0.0, reward=0.0, token_ids=ids, gen_mask=mask,
                logprobs=[0.0] * len(ids)))
    return records


def updater(model, tokenizer, *, shared: bool, lr: float = 0.0, **training) -> PolicyUpdate:
    from accelerate import Accelerator

    acc = Accelerator(cpu=True)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=lr)
    model, optimizer = acc.prepare(model, optimizer)
    config = SimpleNamespace(
        training=TrainingConfig(shared_prefix=shared, **training),
        rollout=RolloutConfig(max_turns=4, max_new_tokens_per_turn=64, max_total_tokens=4096),
    )
    return PolicyUpdate(acc, model, optimizer, config=config, tokenizer=tokenizer, reference=None,
                        temperature=0.9, kl_coef_of=lambda record: training.get("kl_coef", 0.0))


def loaded(name: str, *, lora: bool, dtype: str = "float32"):
    policy = load_policy(str(model_dir(name)), device="cpu", dtype=dtype)
    model = policy.model
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                                 target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
        with torch.no_grad():  # adapters that move the output, so their gradients are not trivially alike
            for pname, p in model.named_parameters():
                if "lora_B" in pname:
                    p.normal_(0, 0.05, generator=torch.Generator().manual_seed(len(pname)))
    return model.train(), policy


def gradients(up: PolicyUpdate, batch) -> dict[str, torch.Tensor]:
    up.model.zero_grad(set_to_none=True)
    tokens = float(sum(sum(record.gen_mask) for _, (record, _) in batch))
    loss, _ = up._micro_batch_loss(batch, {}, update_tokens=tokens, update_rollouts=float(len(batch)))
    loss.backward()
    return {n: p.grad.clone() for n, p in up.model.named_parameters() if p.grad is not None}


# float32 within 1e-5; the demo model's larger logits take float32 rounding to 1.6e-5 of a
# log-probability and 1.9e-5 of a parameter's gradient (the plain forward itself moves a
# log-probability by 1.3e-5 when its rollout is forwarded alone rather than in the padded
# micro-batch), so the demo is held to 5e-5 in float32, and to 1e-6 in float64, where only the
# output projection rounds (it computes in float32 whatever the model's dtype).
TOLERANCE = {("demo", "float32"): 5e-5, ("demo", "float64"): 1e-6}


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize(("name", "dtype"), [("demo", "float32"), ("demo", "float64"),
                                             *((family, "float32") for family in FAMILIES)])
def test_packed_log_probabilities_and_gradients_are_the_plain_ones(name, dtype, lora):
    tolerance = TOLERANCE.get((name, dtype), 1e-5)
    model, policy = loaded(name, lora=lora, dtype=dtype)
    up = updater(model, policy.tokenizer, shared=True, kl_coef=0.05 if lora else 0.0)
    records = records_of(policy.chat, name)
    advantages = [1.0, -0.5, -0.5, 0.7, -0.7]
    batch = list(enumerate(zip(records, advantages, strict=True)))
    up.shared = True
    assert [sorted(b) for b in up._micro_batches(batch)] == [batch]  # both groups in one micro-batch: two rows
    with torch.no_grad():
        shared, tensors = up._logprobs(batch, entropy=True)
    shared_grads = gradients(up, batch)
    up.shared = False
    with torch.no_grad():
        plain, plain_tensors = up._logprobs(batch, entropy=True)
    plain_grads = gradients(up, batch)

    mask = tensors["mask"]
    assert torch.equal(mask, plain_tensors["mask"]) and mask.sum() > 10
    # the tool's answer is in context, not in the loss
    assert any(0 in r.gen_mask[r.gen_mask.index(1):] for r in records)
    # relative past a magnitude of 1: float32 holds a log-probability of -17.5 to 1.9e-6
    assert ((shared - plain).abs() / plain.abs().clamp(min=1.0))[mask].max() <= tolerance
    assert float(tensors["entropy"]) == pytest.approx(float(plain_tensors["entropy"]), rel=tolerance)
    assert shared_grads.keys() == plain_grads.keys() and shared_grads
    if lora:
        assert all("lora_" in n for n in shared_grads)
    for key, want in plain_grads.items():  # each parameter's gradient, relative to its norm
        assert float(want.norm()) > 0, key
        assert float((shared_grads[key] - want).norm() / want.norm()) <= tolerance, key


def test_shared_prefix_on_and_off_train_the_same_weights_from_fewer_tokens():
    """Through `update` itself (micro-batches by group, the first use's check, SGD steps):
    the same weights and metrics, from about P + G*R forwarded tokens instead of G*(P+R)."""
    ends, forwarded, metrics = {}, {}, {}
    for shared in (True, False):
        model, policy = loaded("demo", lora=False)
        records = records_of(policy.chat, "demo", sizes=(4, 3))
        up = updater(model, policy.tokenizer, shared=shared, lr=0.5, micro_batch_size=4, ppo_epochs=2)
        counted: list[int] = []
        hook = model.get_input_embeddings().register_forward_hook(
            lambda module, args, out, counted=counted: counted.append(int(args[0].numel())))
        metrics[shared] = up.update(records, [1.0, -1.0, 0.5, -0.5, 0.8, -0.4, -0.4], 1)
        hook.remove()
        assert up.shared is shared
        ends[shared] = {n: p.detach().clone() for n, p in model.named_parameters()}
        forwarded[shared] = sum(counted)
        prompt = common_prefix([r.token_ids for r in records[:4]])
        assert prompt >= records[0].gen_mask.index(1)
    for key, want in ends[False].items():
        assert float((ends[True][key] - want).abs().max()) <= 1e-5 * max(float(want.abs().max()), 1.0), key
    for key in ("train/loss", "train/entropy", "train/clip_fraction"):
        assert metrics[True][key] == pytest.approx(metrics[False][key], rel=1e-4, abs=1e-7), key
    # the KL estimate is a sum of exp(d) - d - 1 over small log-prob differences d after a
    # step at lr 0.5: it cancels, and float noise reached 1.3e-4 relative on 2 cores
    assert metrics[True]["train/kl"] == pytest.approx(metrics[False]["train/kl"], rel=1e-3), "train/kl"
    # the first use's check forwards the first micro-batch both ways, once
    assert forwarded[True] < 0.75 * forwarded[False], forwarded


def test_micro_batches_hold_whole_groups_and_cut_a_bigger_one():
    policy = load_policy(str(DEMO_MODEL), device="cpu", dtype="float32")
    records = records_of(policy.chat, "demo", sizes=(5, 2))
    up = updater(policy.model, policy.tokenizer, shared=True, micro_batch_size=4)
    up.shared = True
    rows = list(enumerate(zip(records, [0.0] * 7, strict=True)))
    batches = [[index for index, _ in b] for b in up._micro_batches(rows)]
    assert sorted(map(sorted, batches)) == [[0, 1, 2, 3], [4, 5, 6]]  # the group of 5 cut, its 5th joins the 2
    up.shared = False
    assert sorted(len(b) for b in up._micro_batches(rows)) == [3, 4]


def test_pack_lays_each_rest_after_the_prefix_with_its_own_positions():
    packed = pack([[5, 6, 7, 8], [5, 6, 9], [1, 2]], [[0, 1], [2]], pad=0)
    assert packed.input_ids.tolist() == [[5, 6, 7, 8, 9], [1, 2, 0, 0, 0]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 3, 2], [0, 1, 0, 0, 0]]
    assert packed.segment.tolist() == [[0, 0, 1, 1, 2], [0, 0, -1, -1, -1]]
    assert packed.source.tolist() == [[0, 1, 2, 3], [0, 1, 4, -1], [5, 6, -1, -1]]
    assert packed.tokens == 7


class IgnoresPositions(torch.nn.Module):
    """A causal LM whose forward drops the position ids it is given (as a model with
    positions of its own would): the packed forward cannot hold for it."""

    def __init__(self, model):
        super().__init__()
        self.inner, self.config = model, model.config

    def get_output_embeddings(self):
        return self.inner.get_output_embeddings()

    def forward(self, position_ids=None, **kwargs):
        return self.inner(**kwargs)


def test_a_model_the_packed_forward_does_not_hold_for_trains_without_it_and_says_why(caplog):
    policy = load_policy(str(DEMO_MODEL), device="cpu", dtype="float32")
    records = records_of(policy.chat, "demo")
    up = updater(IgnoresPositions(policy.model), policy.tokenizer, shared=True, lr=0.1)
    with caplog.at_level(logging.WARNING, logger="trainer.rl.update"):
        up.update(records, [1.0, -0.5, -0.5, 0.7, -0.7], 1)
    assert up.shared is False
    assert "differ from the plain forward's" in up.shared_off_reason
    assert "each rollout is forwarded whole" in caplog.text

    config = SimpleNamespace(_attn_implementation="flash_attention_2", layer_types=None)
    assert "does not take a 4D mask" in unsupported(SimpleNamespace(config=config, forward=lambda **kw: None))
    config = SimpleNamespace(_attn_implementation="sdpa", layer_types=["linear_attention", "full_attention"])
    assert "linear_attention" in unsupported(SimpleNamespace(config=config, forward=lambda **kw: None))
    off = updater(policy.model, policy.tokenizer, shared=False)
    assert off.shared is False and off.shared_off_reason == "training.shared_prefix is off"


FSDP_SCRIPT = REPO / "tests" / "trainer" / "shared_prefix_fsdp.py"


@pytest.mark.slow
def test_fsdp2_on_two_processes_trains_the_same_weights_shared_and_plain(tmp_path):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "ACCELERATE_USE_CPU": "true"}
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(port),
         str(FSDP_SCRIPT), str(tmp_path / "out.json")],
        env=env, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads((tmp_path / "out.json").read_text())
    assert out["shared"] == [True, True]
    # the reduced gradients, each parameter's and the whole model's, relative to their norms
    # (8.7e-6 and at most 1.1e-5 here); the demo model's float32 tolerance
    assert out["relative_difference"] <= TOLERANCE[("demo", "float32")], out
    assert out["worst_relative_difference"] <= TOLERANCE[("demo", "float32")], out
    assert out["loss"]["shared"] == pytest.approx(out["loss"]["plain"], rel=1e-5)
    assert out["gradient_norm"] > 0
