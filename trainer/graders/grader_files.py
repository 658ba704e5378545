"""Grader and item JSON files for the `agentrft grader validate / run` commands.

Both commands take files a user wrote by hand, so every failure names the file and the
place: a missing file, bytes that are not UTF-8, JSON syntax (line and column), and then
the grader's own key paths. Grader files are config (ConfigError); item files are data
(DataError).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from trainer.errors import AgentRFTError, ConfigError, DataError
from trainer.graders.config import GraderConfigError, validate_grader
from trainer.graders.dispatch import grade, sample_from_text


def validate_grader_file(path: Path) -> dict[str, Any]:
    """Load and validate a grader object from a JSON file; return it."""
    config = _load_json(Path(path), ConfigError, what="grader")
    try:
        validate_grader(config, where="grader")
    except GraderConfigError as exc:
        raise GraderConfigError(f"{path}: {exc}") from None
    return config


def run_grader_cli(grader_path: Path, item_path: Path, sample_text: str) -> dict[str, Any]:
    """Grade `sample_text` against the item in `item_path`: graders/run's answer shape."""
    config = validate_grader_file(grader_path)
    item = _load_json(Path(item_path), DataError, what="item")
    if not isinstance(item, dict):
        raise DataError(
            f"{item_path}: an item must be one JSON object (one data row), got {type(item).__name__}"
        )
    return grade(config, sample_from_text(sample_text), item).to_json()


def _load_json(path: Path, error: type[AgentRFTError], *, what: str) -> Any:
    if not path.is_file():
        raise error(f"{path}: {what} file not found")
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise error(
            f"{path}: not valid UTF-8 (byte {exc.start}); save the {what} file as UTF-8"
        ) from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise error(
            f"{path}: invalid JSON at line {exc.lineno}, column {exc.colno}: {exc.msg}"
        ) from None
