"""The warm start's trainer on the shipped demo model: its loss covers the assistant's tokens
as the chat format marks them, a run stopped mid-way resumes to the numbers of an
uninterrupted one, and two FSDP2 processes train as one."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from tests.pipeline_world import micro
from tests.taught_model import scripts, write_demonstrations
from trainer.data import read_items, read_jsonl
from trainer.generation.policy import load_config_policy
from trainer.rl.warm_start import (
    WarmStartTrainer,
    assistant_loss,
    encode_demonstration,
    trained_stretches,
)

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]
DEMO_MODEL = REPO / "envs" / "finqa" / "model"


@pytest.fixture(scope="module")
def taught_model() -> Path:
    """The shipped demo model (a tiny Qwen2.5-format model that calls tools): no fit needed."""
    return DEMO_MODEL


@pytest.fixture(scope="module")
def demonstrations(world: Path, endpoints) -> tuple[Path, Path]:
    data = world / "data"
    out = world / "demonstrations"
    out.mkdir(exist_ok=True)
    return (write_demonstrations(read_items(data / "train.jsonl"), endpoints, out / "train.jsonl"),
            write_demonstrations(read_items(data / "validation.jsonl"), endpoints, out / "valid.jsonl",
                                 ways=lambda item: scripts(item)[:2]))


def test_the_loss_covers_only_the_assistant_tokens(world, endpoints, taught_model, demonstrations):
    config = micro(world, endpoints, taught_model)
    chat = load_config_policy(config.model, str(taught_model), device="cpu", dtype="float32").chat
    row = json.loads(demonstrations[0].read_text().splitlines()[0])  # list, read, answer
    [example] = encode_demonstration(chat, row, max_tokens=4096, where="x")
    # The mask is the chat format's, the one a rollout's completion mask is.
    assert (example.ids, example.mask) == tuple(chat.encode_conversation(row["messages"], row["tools"]))
    written = [chat.encode(chat.assistant_text(row["messages"][:k], m, row["tools"]))
               for k, m in enumerate(row["messages"]) if m["role"] == "assistant"]
    assert sum(example.mask) == sum(len(ids) for ids in written) and len(written) == 2
    assert [t for t, m in zip(example.ids, example.mask, strict=True) if m] == [t for ids in written for t in ids]

    # The gradient reaches the logits only where the next token is the assistant's.
    ids = torch.tensor([example.ids])
    logits = torch.randn(1, len(example.ids), max(example.ids) + 1, requires_grad=True)
    loss, right = assistant_loss(logits, ids, torch.tensor([example.mask]))
    loss.backward()
    touched = logits.grad[0].abs().sum(-1) > 0
    assert touched[:-1].tolist() == [bool(m) for m in example.mask[1:]]
    assert not touched[-1]

    # A user turn after the assistant's, or a turn of weight 0, starts another example whose
    # prompt is the conversation so far: only the later turn is trained there.
    follow_up = [*row["messages"], {"role": "user", "content": "And in 2019?"}, {"role": "assistant", "content": "Answer: 3"}]
    assert trained_stretches(follow_up) == [(2, 5), (6, 7)]
    first, second = encode_demonstration(chat, {**row, "messages": follow_up}, max_tokens=4096, where="x")
    assert (first.ids, first.mask) == (example.ids, example.mask)
    last = chat.encode(chat.assistant_text(follow_up[:6], follow_up[6], row["tools"]))
    assert [t for t, m in zip(second.ids, second.mask, strict=True) if m] == last
    assert second.ids[: -len(last)] == chat.prompt_ids(follow_up[:6], row["tools"])
    unweighted = [*row["messages"][:4], {**row["messages"][4], "weight": 0}]
    assert trained_stretches(unweighted) == [(2, 3)]


def _comparable(row: dict) -> dict:
    return {k: v for k, v in row.items() if not k.startswith("timing/")}


def test_a_stopped_run_resumes_to_the_same_numbers(world, endpoints, taught_model, demonstrations, tmp_path):
    train_file, valid_file = demonstrations
    config = micro(world, endpoints, taught_model, warm_start={
        "demonstrations_file": str(train_file), "validation_file": str(valid_file), "batch_size": 5, "n_epochs": 2,
        "learning_rate": 3e-3, "checkpoint_interval": 1, "eval_interval": 2, "micro_batch_size": 3})

    def trainer(out: Path, resume: bool = False) -> WarmStartTrainer:
        t = WarmStartTrainer(config, model_path=str(taught_model), output_dir=out, resume=resume)
        t.setup()
        return t

    whole = trainer(tmp_path / "whole")
    assert whole.total_steps == 4  # 10 conversations, 5 a step, 2 epochs
    result = whole.train()
    whole.cleanup()
    assert result.steps == 4 and (result.model_dir / "config.json").is_file()

    stopped = trainer(tmp_path / "stopped")
    assert stopped.train(stop_after=3).model_dir is None
    stopped.cleanup()
    resumed = trainer(tmp_path / "stopped", resume=True)
    assert resumed.step == 3
    resumed.train()
    resumed.cleanup()

    want = [_comparable(r) for r in read_jsonl(tmp_path / "whole" / "metrics.jsonl")]
    got = [_comparable(r) for r in read_jsonl(tmp_path / "stopped" / "metrics.jsonl")]
    assert [r["step"] for r in got] == [0, 1, 2, 3, 4]
    for a, b in zip(want, got, strict=True):
        assert a.keys() == b.keys()
        for key in a:
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-7), key
    # It learns: the validation loss falls and the demonstrated tokens are predicted more often.
    assert got[-1]["warm_start/valid_loss"] < got[0]["warm_start/valid_loss"]
    assert got[-1]["warm_start/valid_mean_token_accuracy"] > got[0]["warm_start/valid_mean_token_accuracy"]


@pytest.mark.slow
def test_two_fsdp_processes_warm_start_as_one_process_does(world, endpoints, taught_model, demonstrations, tmp_path):
    """FSDP2 over two gloo processes, each with its share of every step's conversations, under
    `accelerate launch` running `agentrft warm-start`: the model saved whole is the one
    process's (the loss is a sum over every assistant token of the step, whatever the split)."""
    from transformers import AutoModelForCausalLM

    from trainer.rl.warm_start import warm_start

    fit = {"demonstrations_file": str(demonstrations[0]), "batch_size": 5, "n_epochs": 1, "learning_rate": 3e-3,
           "micro_batch_size": 2}
    one = warm_start(micro(world, endpoints, taught_model, warm_start=fit), model_path=str(taught_model),
                     output_dir=tmp_path / "one")
    sharded = micro(world, endpoints, taught_model, warm_start=fit, training={"num_processes": 2, "distributed": "fsdp"})
    config_file = tmp_path / "two.yaml"
    config_file.write_text(yaml.safe_dump(sharded.model_dump(mode="json")))
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "ACCELERATE_USE_CPU": "true",
           "AGENTRFT_LAUNCHED": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
         "--main_process_port", str(port), "-m", "flows.cli", "warm-start", "--config", str(config_file),
         "--model", str(taught_model), "--output-dir", str(tmp_path / "two")],
        env=env, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "warm start: 2 steps" in done.stdout
    a = AutoModelForCausalLM.from_pretrained(one.model_dir).state_dict()
    b = AutoModelForCausalLM.from_pretrained(tmp_path / "two" / "final").state_dict()
    base = AutoModelForCausalLM.from_pretrained(taught_model).state_dict()
    moved = max((a[k] - base[k]).abs().max().item() for k in a)
    assert moved > 1e-3  # it trained
    # Adam divides by the root of the squared gradients, so a gradient near 0 amplifies the
    # float noise of a sum split across processes (1.2e-4 seen on 2 cores): 5% of how far the
    # weights moved, where a wrong split (half the tokens, a process's sum unreduced) moves
    # them by about as much as the training itself.
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 0.05 * moved
