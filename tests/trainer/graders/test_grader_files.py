"""The file helpers behind `agentrft grader validate` and `agentrft grader run`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trainer.errors import ConfigError, DataError
from trainer.graders import (
    ERROR_KINDS,
    GraderConfigError,
    GraderResult,
    run_grader_cli,
    validate_grader_file,
)

GRADER = {
    "type": "numeric",
    "name": "answer",
    "input": "{{sample.output_text}}",
    "reference": "{{item.reference_answer}}",
}


def write(path: Path, content: str | bytes) -> Path:
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content, encoding="utf-8")
    return path


def test_validate_grader_file_returns_the_config(tmp_path: Path) -> None:
    path = write(tmp_path / "grader.json", json.dumps(GRADER))
    assert validate_grader_file(path) == GRADER


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ('{"type": "numeric",\n  "rel_tol": 0.01,,\n}', "invalid JSON at line 2, column 19"),
        (b'{"type": "string_check", "input": "\xff"}', "not valid UTF-8 (byte 35)"),
        (
            '{"type": "string_check", "operation": "has", "input": "a", "reference": "b"}',
            "grader.operation: expected one of eq, ne, like, ilike, got 'has'",
        ),
    ],
)
def test_bad_grader_files_name_the_file_and_place(
    tmp_path: Path, content: str | bytes, message: str
) -> None:
    path = write(tmp_path / "grader.json", content)
    with pytest.raises(ConfigError) as caught:
        validate_grader_file(path)
    assert str(caught.value).startswith(f"{path}: ")
    assert message in str(caught.value)


def test_missing_grader_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"missing\.json: grader file not found"):
        validate_grader_file(tmp_path / "missing.json")
    with pytest.raises(GraderConfigError):
        validate_grader_file(write(tmp_path / "list.json", "[1, 2]"))


def test_run_grader_cli(tmp_path: Path) -> None:
    grader = write(tmp_path / "grader.json", json.dumps(GRADER))
    item = write(tmp_path / "item.json", json.dumps({"id": "q1", "reference_answer": "12.5%"}))
    assert run_grader_cli(grader, item, "Answer: 12.5%") == {
        "reward": 1.0,
        "errors": {},
        "sub_rewards": {},
    }
    # output_json is filled when the sample text is JSON, as in OpenAI's graders/run
    json_grader = write(
        tmp_path / "json.json",
        json.dumps(
            {
                "type": "string_check",
                "operation": "eq",
                "input": "{{sample.output_json.a}}",
                "reference": "1",
            }
        ),
    )
    assert run_grader_cli(json_grader, item, '{"a": "1"}')["reward"] == 1.0
    assert list(run_grader_cli(json_grader, item, "not json")["errors"]) == ["sample_parse_error"]


def test_run_grader_cli_item_errors_are_data_errors(tmp_path: Path) -> None:
    grader = write(tmp_path / "grader.json", json.dumps(GRADER))
    with pytest.raises(DataError, match=r"item\.json: item file not found"):
        run_grader_cli(grader, tmp_path / "item.json", "1")
    rows = write(tmp_path / "rows.json", "[{}]")
    with pytest.raises(DataError, match="an item must be one JSON object"):
        run_grader_cli(grader, rows, "1")
    broken = write(tmp_path / "broken.json", '{"reference_answer": ')
    with pytest.raises(DataError, match="invalid JSON at line 1, column 22"):
        run_grader_cli(grader, broken, "1")


def test_result_json_shape() -> None:
    failed = GraderResult.failed("model_grader_server_error", "down")
    assert failed.to_json() == {
        "reward": None,
        "errors": {"model_grader_server_error": "down"},
        "sub_rewards": {},
    }
    assert "reference_parse_error" in ERROR_KINDS and len(set(ERROR_KINDS)) == len(ERROR_KINDS)
