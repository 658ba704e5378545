"""The `agentrft` command line as a user runs it: real subprocesses, exit codes, and
clear one-line errors instead of tracebacks."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def agentrft(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "flows.cli", *args], cwd=cwd, capture_output=True, text=True, timeout=300
    )


def test_grader_validate_and_run(tmp_path: Path, demo_data_dir: Path) -> None:
    grader = REPO / "configs/graders/finqa_numeric.json"
    result = agentrft("grader", "validate", "--grader", str(grader))
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["valid"] is True

    item = json.loads((demo_data_dir / "validation.jsonl").read_text().splitlines()[0])
    item_file = tmp_path / "item.json"
    item_file.write_text(json.dumps(item))
    result = agentrft(
        "grader", "run", "--grader", str(grader), "--item", str(item_file),
        "--sample", f"Answer: {item['reference_answer']}",
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["reward"] == 1.0
    result = agentrft("grader", "run", "--grader", str(grader), "--item", str(item_file), "--sample", "no idea")
    assert json.loads(result.stdout)["reward"] == 0.0


@pytest.mark.parametrize(
    ("args", "content", "expected"),
    [
        (["grader", "validate", "--grader"], b'{"type": "string_check", "operation": "equals"}', "operation"),
        (["grader", "validate", "--grader"], b"{not json", "line 1"),
        (["grader", "validate", "--grader"], b"\xff\xfe", "UTF-8"),
        (["config", "validate"], b"training:\n  n_epochs: [\n", "invalid YAML"),
        (["config", "validate"], b"trainig: {}\n", "trainig: unknown key"),
    ],
)
def test_bad_input_is_a_clear_error_without_traceback(
    tmp_path: Path, args: list[str], content: bytes, expected: str
) -> None:
    path = tmp_path / "input.file"
    path.write_bytes(content)
    result = agentrft(*args, str(path))
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert expected in result.stderr
    assert str(path) in result.stderr


def test_missing_header_secret_is_named(tmp_path: Path) -> None:
    config = tmp_path / "job.yaml"
    config.write_text(
        "tools:\n  endpoints:\n    - name: search\n      server_url: http://127.0.0.1:1/s\n"
        "      headers: {Authorization: 'Bearer ${AGENTRFT_TEST_TOKEN}'}\n"
    )
    result = agentrft("config", "validate", str(config))
    assert result.returncode == 2
    assert "AGENTRFT_TEST_TOKEN" in result.stderr and "Traceback" not in result.stderr


def test_data_verify_reports_mismatch(tmp_path: Path) -> None:
    dvc_file = tmp_path / "data.dvc"
    dvc_file.write_text("outs:\n- md5: 00000000000000000000000000000000.dir\n  path: data\n")
    result = agentrft("data", "verify", "--data-dir", str(tmp_path / "absent"), "--dvc-file", str(dvc_file))
    assert result.returncode == 1
    assert "00000000000000000000000000000000" in result.stdout + result.stderr
