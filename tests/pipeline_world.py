"""The micro pipeline world shared by the pipeline and reliability tests: four items (two
train, two eval) with their corpus pages and a DVC pin, and the micro config around a tiny
taught model. The fixtures that build it live in `tests/conftest.py`.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from envs.finqa.dvc_pin import dir_md5
from tests.taught_model import GRADER, OUTPUT_CHARS, SYSTEM, TOOLS
from trainer.config import config_from_dict, merge_overrides


def pin(data_dir: Path, dvc_file: Path) -> None:
    """What `dvc add` writes, for a data directory made by the test."""
    dvc_file.write_text(yaml.safe_dump({"outs": [{"md5": dir_md5(data_dir) + ".dir", "path": data_dir.name}]}))


def micro(world: Path, endpoints, model: Path, **overrides):
    data = world / "data"
    raw = {
        "name": "micro",
        "work_dir": str(world / "runs"),
        "model": {"base_model": str(model)},
        "data": {"data_dir": str(data), "dvc_file": str(world / "data.dvc"), "train_file": str(data / "train.jsonl"),
                 "eval_file": str(data / "eval.jsonl"), "corpus_dir": str(data / "corpus")},
        "tools": {"endpoints": [e.model_dump() for e in endpoints], "schemas": TOOLS, "demo_server": False,
                  "max_output_chars": OUTPUT_CHARS, "max_retries": 2},
        "grader": GRADER,
        "rollout": {"system_prompt": SYSTEM, "max_turns": 3, "max_new_tokens_per_turn": 48,
                    "max_total_tokens": 768, "max_concurrent_rollouts": 1},
        "baseline": {"k": 2, "min_nonzero_share": 0.0, "min_headroom": 0.0},
        "prompt_optimization": {"k": 1, "variants": [{"name": "terse", "system_prompt": "Reply with one number."}]},
        "training": {"batch_size": 2, "n_epochs": 2, "compute_multiplier": 0.5, "max_steps": 2, "learning_rate": 1e-12,
                     "eval_interval": 2, "eval_samples": 2, "checkpoint_interval": 1},
        "promotion": {"registered_model": "micro-agent", "k": 2, "min_gain_lower_bound": -0.01,
                      "max_tool_calls_increase": 0.5, "max_tokens_increase": 0.5, "max_latency_increase": 10.0,
                      "max_category_drop": 0.5, "bootstrap_samples": 200},
        "mlflow": {"tracking_uri": f"sqlite:///{world / 'mlflow.db'}", "experiment": "micro"},
    }
    return config_from_dict(merge_overrides(raw, overrides))


