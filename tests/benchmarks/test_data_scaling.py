"""bench_data_scaling's kept arms and rows: an arm is reused only for the code that made it."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from benchmarks.bench_data_scaling import CODE, _kept, code_key, rows_of
from benchmarks.run_all import data_scaling_rows

REPO = Path(__file__).resolve().parents[2]


def _arm(arm: str, seed: int, gain: float) -> dict:
    return {"arm": f"items-{arm}-seed-{seed}", "items": int(arm), "seed": seed, "steps": 20,
            "gain": {"gain": gain, "low": gain - 0.03, "high": gain + 0.03},
            "changes": {"tool_calls_mean": {"relative": -0.2}, "tokens_mean": {"relative": -0.1}},
            "validation": {"items": 250, "k": 4, "base_score": 0.58}}


def test_an_arm_is_kept_only_for_its_own_clean_code_key(tmp_path: Path) -> None:
    path = tmp_path / "items-10-seed-42.json"
    assert _kept(path, "abc") is None  # nothing there
    path.write_text(json.dumps({"code": "abc", "gain": 1}))
    assert _kept(path, "abc") == {"code": "abc", "gain": 1}
    assert _kept(path, "def") is None
    path.write_text(json.dumps({"code": "abc-dirty"}))
    assert _kept(path, "abc-dirty") is None  # uncommitted code never makes a kept arm


def test_code_key_covers_the_code_that_makes_an_arm(tmp_path: Path) -> None:
    """In a clone: a committed change to any file an arm runs (each package the benchmark
    imports, the demo config, the data pin) moves the key; one to the docs does not; an
    uncommitted one marks it dirty."""
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "--quiet", "--shared", str(REPO), str(clone)], check=True)

    def commit(path: str, text: str) -> str:
        with (clone / path).open("a") as handle:
            handle.write(text)
        subprocess.run(["git", "-C", str(clone), "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qam",
                        f"touch {path}"], check=True)
        return code_key(clone)

    key = code_key(clone)
    assert len(key) == 16 and all((REPO / path).exists() for path in CODE)
    for path in ("trainer/errors.py", "tasks/ledger.py", "envs/finqa/generate.py", "flows/pipeline.py",
                 "envs/finqa/demo.yaml", "data.dvc", "benchmarks/bench_data_scaling.py"):
        moved = commit(path, "\n# changed\n")
        assert moved != key, f"a change to {path} leaves the key as it was"
        key = moved
    assert commit("README.md", "\nchanged\n") == key  # not code
    (clone / "trainer" / "errors.py").write_text("# uncommitted\n")
    assert code_key(clone) == key + "-dirty"


def test_rows_give_median_and_range_over_seeds_and_a_straddling_verdict() -> None:
    results = [_arm("10", 42, 0.02), _arm("10", 43, -0.01), _arm("10", 44, 0.05), _arm("100", 42, 0.08)]
    epoch = _arm("1000", 42, 0.10) | {"arm": "epoch-1000-seed-42", "steps": 125}
    rows = rows_of(results, ["10", "100", "1000"], epoch)
    assert [r["runs"] for r in rows] == [3, 1, 1]
    ten = rows[0]
    assert (ten["value"], ten["min"], ten["max"], ten["verdict"]) == (2.0, -1.0, 5.0, "straddles")
    assert rows[1]["verdict"] == "met"
    assert rows[2]["figure"].endswith("one epoch (125 steps of 8)") and rows[2]["value"] == pytest.approx(10.0)


def test_run_all_rows_carry_the_seeds_verdict_and_no_verdict_for_the_single_epoch_run() -> None:
    epoch = _arm("1000", 42, 0.10) | {"arm": "epoch-1000-seed-42", "steps": 125}
    rows = data_scaling_rows([{"rows": rows_of([_arm("10", 42, 0.02), _arm("10", 43, 0.04)], ["10"], epoch)}])
    assert [(r["verdict"], r["runs"], r["min"]) for r in rows] == [("met", 2, 2.0), (None, 1, None)]
