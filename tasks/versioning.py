"""Stage versions: what a stage's cached result depends on.

A stage's cache key is a hash of its name, the data version (the md5 in `data.dvc`), the
hash of the config sections it reads, the code version (a hash of the source it runs, so
a changed reward or loss re-runs the stage while a README edit does not), the MLflow
store it records into, and the ids of the upstream results it consumes. Prefect's task
cache looks the key up in the persisted results: an unchanged stage is skipped, a changed
section re-runs its stage and, because the new stage's run id changes, everything after it.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
from functools import cache, lru_cache
from pathlib import Path
from typing import Any

from trainer.config import PipelineConfig

ROOT = Path(__file__).resolve().parents[1]

# The config sections each stage reads (its part of the cache key).
STAGE_SECTIONS: dict[str, tuple[str, ...]] = {
    "validate_data": ("data", "grader"),
    "baseline": ("model", "data", "tools", "grader", "rollout", "penalties", "baseline"),
    "prompt_optimization": (
        "model", "data", "tools", "grader", "rollout", "penalties", "baseline", "prompt_optimization",
    ),
    "rft_training": ("model", "data", "tools", "grader", "rollout", "penalties", "training"),
    "regression_eval": ("data", "tools", "grader", "rollout", "penalties", "baseline", "promotion"),
    "promotion": ("promotion",),
}
STAGES = tuple(STAGE_SECTIONS)

# Source each stage runs, beyond `trainer/` which they all use.
_STAGE_SOURCES: dict[str, tuple[str, ...]] = {
    "validate_data": ("tasks/validate.py", "expectations"),
    "baseline": ("tasks/baseline.py", "tasks/rollout_eval.py", "envs"),
    "prompt_optimization": ("tasks/optimize.py", "tasks/rollout_eval.py", "envs"),
    "rft_training": ("tasks/train.py", "envs"),
    "regression_eval": ("tasks/evaluate.py", "tasks/rollout_eval.py", "envs"),
    "promotion": ("tasks/promote.py",),
}


@cache
def code_version(stage: str) -> str:
    """Hash of the Python source (and suites) the stage runs."""
    digest = hashlib.sha256()
    roots = [ROOT / "trainer", ROOT / "tasks/tracking.py", ROOT / "tasks/versioning.py"]
    roots += [ROOT / part for part in _STAGE_SOURCES[stage]]
    for root in roots:
        files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.suffix in (".py", ".json"))
        for path in files:
            digest.update(str(path.relative_to(ROOT)).encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


@lru_cache(maxsize=1)
def git_commit() -> str:
    """The checkout's commit, with `-dirty` when tracked files differ from it."""
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True, text=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return commit + ("-dirty" if dirty else "")


def data_version(config: PipelineConfig) -> str:
    """The md5 pinned in the DVC file, or (no DVC file) the md5 of the train and eval files."""
    from envs.finqa.dvc_pin import pinned_md5

    if config.data.dvc_file:
        return pinned_md5(Path(config.data.dvc_file))
    digest = hashlib.md5(usedforsecurity=False)
    for path in (config.data.train_file, config.data.eval_file):
        digest.update(Path(path).read_bytes())
    return digest.hexdigest()


def stage_key(
    stage: str, config: PipelineConfig, *, data_md5: str, tracking_uri: str, upstream: dict[str, Any] | None = None
) -> str:
    """The cache key of `stage` for this config, data and upstream results."""
    parts = {
        "stage": stage,
        "data_md5": data_md5,
        "config": config.section_hash(*STAGE_SECTIONS[stage]),
        "code": code_version(stage),
        "mlflow": tracking_uri,
        "upstream": upstream or {},
    }
    text = json.dumps(parts, sort_keys=True, default=str)
    return f"{stage}-{hashlib.sha256(text.encode()).hexdigest()[:20]}"
