"""The micro pipeline world shared by the pipeline and reliability tests: six items (two
each of train, validation and test) with their corpus pages under a DVC pin, and the micro
config around a tiny taught model. The fixtures that build it live in `tests/conftest.py`.
"""

from __future__ import annotations

from pathlib import Path

from tests.taught_model import GRADER, OUTPUT_CHARS, SYSTEM, TOOLS
from trainer.config import config_from_dict, merge_overrides


def micro(world: Path, endpoints, model: Path, **overrides):
    data = world / "data"
    raw = {
        "name": "micro",
        "work_dir": str(world / "runs"),
        "model": {"base_model": str(model)},
        "data": {"dvc_file": str(world / "data.dvc"), "train_file": str(data / "train.jsonl"),
                 "validation_file": str(data / "validation.jsonl"), "test_file": str(data / "test.jsonl"),
                 "production_traffic_file": None, "expectations_suite": None},
        "tools": {"endpoints": [e.model_dump() for e in endpoints], "schemas": TOOLS,
                  "max_output_chars": OUTPUT_CHARS, "max_retries": 2},
        "grader": GRADER,
        "rollout": {"system_prompt": SYSTEM, "max_turns": 3, "max_new_tokens_per_turn": 48,
                    "max_total_tokens": 768, "max_concurrent_rollouts": 1},
        "baseline": {"k": 2, "min_nonzero_share": 0.0, "min_headroom": 0.0},
        "prompt_optimization": {"k": 1, "target_score": 1.0,
                                "variants": [{"name": "terse", "system_prompt": "Reply with one number."}]},
        "training": {"batch_size": 2, "n_epochs": 2, "compute_multiplier": 0.5, "max_steps": 2, "learning_rate": 1e-12,
                     "eval_interval": 2, "eval_samples": 2, "checkpoint_interval": 1},
        "promotion": {"registered_model": "micro-agent", "k": 2, "min_gain_lower_bound": -0.01,
                      "max_tool_calls_increase": 0.5, "max_tokens_increase": 0.5, "max_latency_increase": 10.0,
                      "bootstrap_samples": 200},
        "mlflow": {"tracking_uri": f"sqlite:///{world / 'mlflow.db'}", "experiment": "micro"},
    }
    return config_from_dict(merge_overrides(raw, overrides))
