"""Shared test setup: offline libraries, quiet Prefect, and the demo data on disk.

`data/` is owned by DVC and not committed; a fresh clone regenerates it from the
deterministic generator (the data tests check it reproduces the md5 in data.dvc).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO_ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO_ROOT


@pytest.fixture(scope="session")
def demo_data_dir() -> Path:
    """The pinned demo data, generated on first use in a fresh clone."""
    from envs.finqa.generate import generate_dataset

    data_dir = REPO_ROOT / "data"
    if not (data_dir / "train.jsonl").is_file():
        generate_dataset(data_dir, seed=0)
    return data_dir
