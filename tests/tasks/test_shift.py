"""A shift evaluation run for real on the micro world: both models on the split, paired,
the reading counted in the ledger; the prompt the pipeline chose named as it names it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tasks.shift import shift_evaluation
from tasks.tracking import git_commit
from tests.pipeline_world import micro
from trainer.errors import ConfigError


def test_a_shift_reading_is_paired_and_counted_and_current_is_the_configs_prompt(world, endpoints, taught_model,
                                                                                 tmp_path: Path) -> None:
    ledger = tmp_path / "readings.jsonl"
    config = micro(world, endpoints, taught_model, data={
        "test_ledger": str(ledger),
        "shift_evaluations": {"later": {"file": str(world / "data" / "test.jsonl"), "measures": "a later period"}}},
        promotion={"k": 1, "max_items": 2})
    with pytest.raises(ConfigError, match="'nope' is not among prompt_optimization.variants .* nor `current`"):
        shift_evaluation(config, "later", str(taught_model), variant="nope", log=lambda _: None)
    with pytest.raises(ConfigError, match="has no 'earlier'; declared: later"):
        shift_evaluation(config, "earlier", str(taught_model), log=lambda _: None)
    assert not ledger.exists()  # refused before any reading
    result = shift_evaluation(config, "later", str(taught_model), variant="current", log=lambda _: None)
    readings = [json.loads(line) for line in ledger.read_text().splitlines()]
    assert len(readings) == 1 and readings[0]["test_file"].endswith("test.jsonl")
    assert readings[0]["command"] == "agentrft shift later" and readings[0]["mlflow_run_id"] == result["mlflow_run_id"]
    assert readings[0]["config"] == config.name and readings[0]["git_commit"] == git_commit()  # as regression_eval's
    assert result["name"] == "later" and result["measures"] == "a later period" and "read once" in result["readings"]
    assert result["comparison"]  # the paired comparison of the two models
