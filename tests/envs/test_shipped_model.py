"""The demo's base model ships with the project: it loads, matches its pin, and reaches its
band on a small evaluation through the real tools. The band is the seed spread of that
evaluation (benchmarks/shipped_model_band.py), and the test samples at a seed the spread
did not measure."""

from __future__ import annotations

import json

import pytest

from benchmarks.shipped_model_band import small_evaluation
from envs.finqa.demo_model import MODEL_DIR, verify_model_pin

pytestmark = pytest.mark.integration


def test_the_shipped_model_matches_its_pin_and_reaches_its_band(demo_data_dir):
    from trainer.config.loading import load_config
    from trainer.generation.policy import load_policy

    pin = verify_model_pin()  # every shipped file's md5 against the pin: a changed weight fails here
    band = pin["evaluation"].get("band")
    assert band and "spread" in band, (
        "envs/finqa/model.pin.json has no measured band: run `python -m benchmarks.shipped_model_band --write`")
    seed = load_config("envs/finqa/demo.yaml").baseline.seed
    first, last = (int(end) for end in band["spread"]["seeds"].split("-"))
    assert not first <= seed <= last  # a draw the band was not measured on
    parameters = json.loads((MODEL_DIR / "bootstrap.json").read_text())["parameters"]
    assert sum(p.numel() for p in load_policy(str(MODEL_DIR), device="cpu").model.parameters()) == parameters

    metrics = small_evaluation(demo_data_dir, seed)
    low, high = band["score_mean"]
    assert low <= metrics["eval/score_mean"] <= high, (metrics["eval/score_mean"], band["score_mean"])
    low, high = band["tool_calls_mean"]
    assert low <= metrics["eval/tool_calls_mean"] <= high, (metrics["eval/tool_calls_mean"], band["tool_calls_mean"])
    assert metrics["eval/infra_error_rate"] == 0
