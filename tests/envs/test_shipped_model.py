"""The demo's base model ships with the project: it loads, matches its pin, and reaches its
recorded baseline band on a small evaluation through the real tools."""

from __future__ import annotations

import json

import pytest

from envs.finqa.demo_model import MODEL_DIR, PIN_FILE, verify_model_pin

pytestmark = pytest.mark.integration


def test_the_shipped_model_matches_its_pin_and_reaches_its_band(demo_data_dir):
    from envs.finqa.local import local_tool_endpoints
    from trainer.config import load_config
    from trainer.data import read_items
    from trainer.evaluate import run_evaluation
    from trainer.policy import load_policy
    from trainer.rollout import RolloutSettings
    from trainer.tools import ToolClient

    pin = verify_model_pin()
    recorded = json.loads(PIN_FILE.read_text())["evaluation"]
    assert pin["evaluation"] == recorded and recorded["score_mean"] > 0.2
    config = load_config("envs/finqa/demo.yaml")
    policy = load_policy(str(MODEL_DIR), device="cpu")
    assert sum(p.numel() for p in policy.model.parameters()) == json.loads((MODEL_DIR / "bootstrap.json").read_text())[
        "parameters"]
    items = read_items(demo_data_dir / "validation.jsonl", 16)
    with local_tool_endpoints(demo_data_dir / "corpus", max_output_chars=config.tools.max_output_chars) as endpoints:
        summary, _ = run_evaluation(
            policy.backend(max_slots=32, max_len=config.rollout.max_total_tokens, seed=config.baseline.seed),
            policy.chat, items, k=2, tool_client=ToolClient.from_config(config.tools, endpoints), grader=config.grader,
            settings=RolloutSettings.from_config(config.rollout, config.penalties), max_concurrent=32,
        )
    low, high = recorded["band"]["score_mean"]
    assert low <= summary.metrics["eval/score_mean"] <= high, summary.metrics["eval/score_mean"]
    assert summary.metrics["eval/tool_calls_mean"] > 2  # it uses the tools, as its demonstrations did
    assert summary.metrics["eval/infra_error_rate"] == 0
