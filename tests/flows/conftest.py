"""Fixtures of the pipeline tests: a micro world (four items, their corpus pages, a DVC pin),
the real tool server on loopback, a tiny taught model, and Prefect's test harness (a real
API server) with results stored in the world. Session-scoped: built once for all of them.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from envs.finqa.dvc_pin import dir_md5
from envs.finqa.local import local_tool_endpoints
from tests.taught_model import GRADER, OUTPUT_CHARS, SYSTEM, TOOLS, copy_items, teach_model
from trainer.bootstrap import read_items
from trainer.config import config_from_dict, merge_overrides


def pin(data_dir: Path, dvc_file: Path) -> None:
    """What `dvc add` writes, for a data directory made by the test."""
    dvc_file.write_text(yaml.safe_dump({"outs": [{"md5": dir_md5(data_dir) + ".dir", "path": data_dir.name}]}))


@pytest.fixture(scope="session")
def world(demo_data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("pipeline")
    data = root / "data"
    data.mkdir()
    items = read_items(demo_data_dir / "train.jsonl", 4)
    copy_items(demo_data_dir, items[:2], data, "train.jsonl")
    copy_items(demo_data_dir, items[2:], data, "eval.jsonl")
    pin(data, root / "data.dvc")
    return root


@pytest.fixture(scope="session")
def endpoints(world: Path):
    with local_tool_endpoints(world / "data" / "corpus", max_output_chars=OUTPUT_CHARS) as served:
        yield served


@pytest.fixture(scope="session")
def taught_model(world: Path, endpoints) -> Path:
    data = world / "data"
    return teach_model([data / "train.jsonl", data / "eval.jsonl"], data / "corpus", endpoints, world / "model")


@pytest.fixture(scope="session")
def harness(world: Path):
    from prefect.settings import PREFECT_LOCAL_STORAGE_PATH, temporary_settings
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        with temporary_settings({PREFECT_LOCAL_STORAGE_PATH: world / "prefect-results"}):
            yield


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


