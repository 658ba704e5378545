"""The micro pipeline world shared by the pipeline and reliability tests: two train, two
validation and six test items with their corpus pages under a DVC pin, and the micro config
around a tiny taught model (tests/taught_model.py). The config keeps the default promotion
gates: ten GRPO steps at 0.4 a tool call make a candidate clearly better than the base,
which the gates promote on the test items when each is sampled 16 times. Only the test of
that decision needs them (`LEARNS`); the other tests keep the preset's three steps and 4
samples per test item. Rollouts run 8 at a time; a test that compares two runs' numbers
exactly, or needs one run's outcome, runs them one at a time. The fixtures that build the world live in
`tests/conftest.py`.
"""

from __future__ import annotations

import json
from pathlib import Path

from tests.taught_model import GRADER, OUTPUT_CHARS, SYSTEM, TOOLS
from trainer.config.loading import config_from_dict, merge_overrides

# What the test of the promotion decision adds to the preset (see the module docstring).
# Its rollouts run one at a time: with 8, which sequences share an engine batch depends on when
# tool answers arrive (the machine's load), the logits move in the last bits with the batch,
# and ten steps at this learning rate can end anywhere (a loaded CI run trained to 0.5).
LEARNS = {"training": {"max_steps": 10, "eval_interval": 5, "checkpoint_interval": 5}, "promotion": {"k": 16},
          "rollout": {"max_concurrent_rollouts": 1}}


def micro(world: Path, endpoints, model: Path, **overrides):
    data = world / "data"
    raw = {
        "name": "micro",
        "work_dir": str(world / "runs"),
        "model": {"base_model": str(model)},
        "data": {"dvc_file": str(world / "data.dvc"), "train_file": str(data / "train.jsonl"),
                 "validation_file": str(data / "validation.jsonl"), "test_file": str(data / "test.jsonl"),
                 "production_traffic_file": None, "expectations_suite": None,
                 "test_ledger": str(world / "test_readings.jsonl")},
        "tools": {"endpoints": [e.model_dump() for e in endpoints], "schemas": TOOLS,
                  "max_output_chars": OUTPUT_CHARS, "max_retries": 2},
        "grader": GRADER,
        "rollout": {"system_prompt": SYSTEM, "max_turns": 3, "max_new_tokens_per_turn": 48,
                    "max_total_tokens": 768, "max_concurrent_rollouts": 8},
        "penalties": {"per_tool_call": 0.4, "correct_only": True},
        "baseline": {"k": 2, "min_nonzero_share": 0.0, "min_headroom": 0.0},
        "prompt_optimization": {"k": 1, "target_score": 1.0,
                                "variants": [{"name": "terse", "system_prompt": "Reply with one number."}]},
        "training": {"batch_size": 2, "n_epochs": 10, "compute_multiplier": 0.5, "max_steps": 3, "learning_rate": 5e-3,
                     "eval_interval": 3, "eval_samples": 2, "checkpoint_interval": 3},
        "promotion": {"registered_model": "micro-agent", "k": 4, "group_by": "category"},
        "mlflow": {"tracking_uri": f"sqlite:///{world / 'mlflow.db'}", "experiment": "micro"},
    }
    return config_from_dict(merge_overrides(raw, overrides))


def job_rows(world: Path) -> Path:
    """The world's splits as an OpenAI RFT job brings them: each row with its own `tools`, the
    schemas the taught model knows (a job's tools replace the server config's, schemas
    included), in a folder of their own."""
    out = world / "job-data"
    out.mkdir(exist_ok=True)
    for split in ("train", "validation", "test"):
        rows = [json.loads(line) for line in (world / "data" / f"{split}.jsonl").read_text().splitlines() if line]
        (out / f"{split}.jsonl").write_text("".join(json.dumps({**row, "tools": TOOLS}) + "\n" for row in rows))
    return out


JOB_TOOLS = tuple(tool["function"]["name"] for tool in TOOLS)  # the endpoints a job names: the taught model's
