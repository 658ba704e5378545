"""configs/gpu.yaml and configs/job.yaml as a user runs them, on this CPU: `agentrft config
validate` says which chat format the model gets, and `agentrft train` runs one GRPO step.

Both configs name Qwen/Qwen3-0.6B, which no machine here can download; a tiny random-weight
Qwen3 with Qwen3's real vocabulary and published chat template (tests/model_families.py)
stands in for it. Everything else is the file as shipped, but for the overrides listed
below, each with the reason a CPU (or a test) needs it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flows.cli import main
from tests import model_families
from tests.order_env.world import TOOLS as ORDER_TOOLS
from tests.order_env.world import order_server, write_world

REPO = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def cpu_overrides(model: Path, data: dict[str, Path | None], endpoints: list[dict], out: Path) -> list[str]:
    """What a CPU needs changed in a GPU recipe, and what a test needs: each one named."""
    return [
        f"model.base_model={model}",  # the hub id cannot be downloaded here: Qwen3's tiny stand-in
        "model.device=cpu",  # the configs say cuda (gpu.yaml) or auto
        "model.dtype=float32",  # bf16 weights are for GPUs
        "training.mixed_precision='no'",  # bf16 autocast is for GPUs (quoted: YAML reads no as false)
        "rollout.backend=transformers",  # gpu.yaml launches vLLM on the GPU; the embedded engine here
        f"tools.endpoints={json.dumps(endpoints)}",  # the test's tool server on loopback
        "data.dvc_file=null",  # the test's data files, versioned by their md5
        *(f"data.{key}={'null' if path is None else path}" for key, path in data.items()),
        # Size: one step of one item, two rollouts of short turns (a random model writes to the limit).
        "training.max_steps=1",
        "training.batch_size=1",
        "training.compute_multiplier=0.25",
        "rollout.max_new_tokens_per_turn=24",
        f"training.output_dir={out / 'run'}",
        f"mlflow.tracking_uri=sqlite:///{out / 'mlflow.db'}",
    ]


def validate(config: Path, overrides: list[str], capsys) -> dict:
    assert main(["config", "validate", str(config), *[f"--set={o}" for o in overrides]]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_config_validate_says_when_the_model_cannot_be_read_here(capsys):
    report = validate(REPO / "configs" / "gpu.yaml", [], capsys)
    assert report["valid"] and report["chat_format"] == "auto" and report["chat_format_detected"] is None
    assert "decided when the model loads" in report["chat_format_note"] and "Qwen/Qwen3-0.6B" in report["chat_format_note"]


def test_gpu_recipe_detects_qwen3_and_trains_one_step(world: Path, endpoints, tmp_path: Path, capsys):
    data = world / "data"
    overrides = cpu_overrides(
        model_families.tiny_model("qwen3"),
        {"train_file": data / "train.jsonl", "validation_file": data / "validation.jsonl", "test_file": None},
        [{"name": e.name, "server_url": e.server_url} for e in endpoints], tmp_path)
    report = validate(REPO / "configs" / "gpu.yaml", overrides, capsys)
    assert report["chat_format"] == "qwen3" and report["enable_thinking"] is True
    assert report["stop_tokens"] == ["<|endoftext|>", "<|im_end|>"]
    assert main(["train", "-c", str(REPO / "configs" / "gpu.yaml"), *[f"--set={o}" for o in overrides]]) == 0
    result = json.loads((tmp_path / "run" / "train_result.json").read_text())
    assert result["steps"] == 1 and "train/loss" in result["metrics"]
    assert "train/reasoning_tokens_mean" in result["metrics"]
    assert result["chat_format"]["chat_format"] == "qwen3"


def test_job_template_detects_qwen3_and_trains_one_step(tmp_path: Path, capsys, monkeypatch):
    paths = write_world(tmp_path / "orders")
    monkeypatch.setenv("TOOLS_TOKEN", "t0ken")  # the job's header secret
    with order_server(paths["orders"]) as base_url:
        endpoints = [{"name": t["function"]["name"], "server_url": f"{base_url}/tools/{t['function']['name']}",
                      "headers": {"Authorization": "Bearer ${TOOLS_TOKEN}"}} for t in ORDER_TOOLS]
        data = paths["data"]
        overrides = cpu_overrides(
            model_families.tiny_model("qwen3"),
            {"train_file": data / "train.jsonl", "validation_file": data / "validation.jsonl",
             "test_file": data / "test.jsonl", "production_traffic_file": data / "traffic.jsonl"},
            endpoints, tmp_path)
        report = validate(REPO / "configs" / "job.yaml", overrides, capsys)
        assert report["chat_format"] == "qwen3"
        assert main(["train", "-c", str(REPO / "configs" / "job.yaml"), *[f"--set={o}" for o in overrides]]) == 0
    result = json.loads((tmp_path / "run" / "train_result.json").read_text())
    assert result["steps"] == 1 and "train/loss" in result["metrics"]
