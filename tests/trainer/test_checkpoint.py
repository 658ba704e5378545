"""Checkpoints: RNG state as JSON, save/restore through Accelerate, the best-3 bookkeeping
and merged LoRA model directories, on a tiny real model."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from envs.finqa.tiny_model import build_model, tiny_config
from trainer.rl.checkpoint import (
    STATE_FILE,
    BestCheckpoints,
    latest_checkpoint,
    load_checkpoint,
    rng_state,
    save_checkpoint,
    save_model,
    set_rng_state,
)


def _draws() -> tuple[float, float, list[float]]:
    return random.random(), float(np.random.rand()), torch.rand(3).tolist()


def _tiny_model():
    return build_model(tiny_config(64, hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1,
                                   intermediate_size=32, pad_token_id=0, eos_token_id=2), seed=0)


def _train_step(model, optimizer) -> None:
    ids = torch.randint(0, 64, (2, 8))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def test_rng_state_round_trips_through_json():
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    _draws()
    saved = json.loads(json.dumps(rng_state()))
    expected = _draws()
    _draws()  # move every stream on
    set_rng_state(saved)
    assert _draws() == expected


def test_checkpoint_restores_weights_optimizer_rng_and_state(tmp_path: Path):
    from accelerate import Accelerator

    accelerator = Accelerator()
    model = _tiny_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = accelerator.prepare(model, optimizer)
    root = tmp_path / "checkpoints"
    _train_step(model, optimizer)
    save_checkpoint(accelerator, root, 1, {"history": [{"step": 1}]})
    _train_step(model, optimizer)
    state = {"history": [{"step": 1}, {"step": 2, "train/loss": 0.5}], "epoch": 0, "position": 4}
    save_checkpoint(accelerator, root, 2, state)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    moments = {k: v.clone() for k, v in optimizer.state_dict()["state"][0].items()}
    after_save = _draws()

    # only the newest checkpoint stays; unfinished ones never count as the latest
    assert sorted(p.name for p in root.iterdir()) == ["step_2"]
    (root / "step_9.partial").mkdir()
    (root / "step_7").mkdir()
    assert latest_checkpoint(root) == root / "step_2"
    assert latest_checkpoint(tmp_path / "nothing") is None

    for _ in range(3):
        _train_step(model, optimizer)
    assert not torch.equal(model.state_dict()["model.embed_tokens.weight"], weights["model.embed_tokens.weight"])
    restored = load_checkpoint(accelerator, root / "step_2")
    assert restored["step"] == 2 and restored["history"] == state["history"] and restored["position"] == 4
    assert all(torch.equal(v, weights[k]) for k, v in model.state_dict().items())
    assert all(torch.equal(v, moments[k]) for k, v in optimizer.state_dict()["state"][0].items())
    assert _draws() == after_save
    assert json.loads((root / "step_2" / STATE_FILE).read_text())["rng"][0].keys() >= {"python", "numpy", "torch"}


def test_best_checkpoints_keep_the_three_best_scores(tmp_path: Path):
    best = BestCheckpoints(tmp_path / "best", keep=3)
    deleted = []
    for step, score in [(1, 0.2), (2, 0.5), (3, 0.3), (4, 0.4), (5, 0.3), (6, 0.1)]:
        if best.admits(score):
            path, evicted = best.add(step, score)
            assert path == tmp_path / "best" / f"step_{step}"
            path.mkdir(parents=True)
            deleted += [p.name for p in evicted]
    assert [(e.step, e.score) for e in best.ranked()] == [(2, 0.5), (4, 0.4), (3, 0.3)]  # tie: earlier kept
    assert deleted == ["step_1"]
    # a resumed run reloads the list and removes what was saved after its checkpoint
    reloaded = BestCheckpoints(tmp_path / "best", keep=3, entries=best.to_json()[:2])
    assert sorted(p.name for p in reloaded.stale_dirs()) == ["step_1", "step_3"]


def test_save_model_merges_lora_adapters_into_a_plain_model(tmp_path: Path):
    from accelerate import Accelerator
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from envs.finqa.tokenizer import build_tokenizer

    accelerator = Accelerator()
    tokenizer = build_tokenizer(["revenue grew 12% in 2021", "Answer: 3.5"] * 20, vocab_size=300)
    base = build_model(tiny_config(len(tokenizer), hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1,
                                   intermediate_size=32, pad_token_id=tokenizer.pad_token_id,
                                   eos_token_id=tokenizer.eos_token_id), seed=0)
    model = get_peft_model(base, LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.5)  # a trained adapter: B is no longer zero
    model = accelerator.prepare(model)
    ids = torch.tensor([tokenizer.encode("revenue grew 12%")])
    with torch.no_grad():
        expected = model(input_ids=ids).logits

    save_model(accelerator, model, tokenizer, tmp_path / "merged")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    assert not any("lora" in name for name in loaded.state_dict())
    with torch.no_grad():
        assert torch.allclose(loaded(input_ids=ids).logits, expected, atol=1e-5)
    assert (tmp_path / "merged" / "tokenizer.json").is_file()
    # the training model keeps its separate adapters
    assert any("lora_A" in name for name, _ in accelerator.unwrap_model(model).named_parameters())


@pytest.mark.parametrize("keep", [1, 3])
def test_best_checkpoints_admit_until_full(tmp_path: Path, keep: int):
    best = BestCheckpoints(tmp_path, keep=keep)
    for step in range(keep):
        assert best.admits(0.0)
        best.add(step + 1, 0.0)
    assert not best.admits(0.0) and best.admits(0.01)
