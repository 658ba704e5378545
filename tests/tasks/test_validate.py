"""The validate_data stage: a GX suite derived from production traffic, run on real files.

The real demo splits pass; a drifted dataset from the generator fails on the KL and
quantile expectations; small modified copies show leakage, unparseable references,
duplicate ids, missing columns and wrong types, each named with its rows.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from envs.finqa.generate import generate_dataset, write_jsonl
from tasks.validate import (
    derive_suite,
    derive_suite_cli,
    load_suite,
    read_rows,
    validate_dataset,
    validate_splits,
    write_suite,
)
from trainer.errors import DataError

NUMERIC = {
    "type": "numeric",
    "name": "answer",
    "input": "{{sample.output_text}}",
    "reference": "{{item.reference_answer}}",
}
COMMITTED_SUITE = Path("expectations/production_traffic.json")


@pytest.fixture(scope="module")
def suite(demo_data_dir: Path) -> dict:
    return derive_suite(demo_data_dir / "production_traffic.jsonl")


@pytest.fixture(scope="module")
def train_rows(demo_data_dir: Path) -> list[dict]:
    return [row for _, row in read_rows(demo_data_dir / "train.jsonl")]


@pytest.fixture(scope="module")
def drifted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("drifted")
    generate_dataset(out, seed=0, drift=True, n_train=400, n_eval=200, n_traffic=10)
    return out


def failures_of(failures: list[dict], expectation: str, column: str) -> list[dict]:
    return [f for f in failures if f["expectation"] == expectation and f["column"] == column]


def test_committed_suite_is_derived_from_the_pinned_traffic(repo_root, demo_data_dir, monkeypatch):
    monkeypatch.chdir(repo_root)  # the suite records the traffic path as given: relative
    derived = derive_suite(Path("data/production_traffic.jsonl"))
    assert derived == load_suite(COMMITTED_SUITE)
    assert derived["meta"]["derived_from"]["rows"] == 4000
    assert derived["meta"]["thresholds"]["kl_max_category"] == 0.1
    in_set = [
        e for e in derived["expectations"] if e["type"] == "expect_column_values_to_be_in_set"
    ]
    assert in_set[0]["kwargs"]["value_set"] == [
        "change", "multi_year", "percent_change", "ratio", "single_lookup"
    ]  # fmt: skip
    kinds = {(e["type"], e["kwargs"]["column"]) for e in derived["expectations"]}
    assert ("expect_column_values_to_be_unique", "id") in kinds
    assert ("expect_column_values_to_not_be_null", "reference_answer") in kinds
    assert ("expect_column_values_to_be_of_type", "year") in kinds
    assert ("expect_column_kl_divergence_to_be_less_than", "question_length") in kinds
    assert ("expect_column_to_exist", "timestamp") not in kinds  # production-only field


def test_derive_is_deterministic(demo_data_dir, tmp_path):
    traffic = demo_data_dir / "production_traffic.jsonl"
    first = write_suite(derive_suite(traffic), tmp_path / "a.json").read_text()
    second = derive_suite_cli(traffic, tmp_path / "production_traffic.json").read_text()
    assert first == second
    assert json.loads(first)["name"] == "production_traffic"


def test_real_splits_pass(suite, demo_data_dir):
    report = validate_splits(
        suite, demo_data_dir / "train.jsonl", demo_data_dir / "eval.jsonl", NUMERIC
    )
    assert report.ok, report.to_markdown()
    assert [d.rows for d in report.datasets] == [2000, 250]
    assert all(d.evaluated == len(suite["expectations"]) and not d.skipped for d in report.datasets)
    metrics = report.metrics()
    assert metrics["validate/failures"] == 0
    assert metrics["validate/train_kl_category"] < 0.01
    assert 0.0 < metrics["validate/eval_kl_question_length"] < 0.1
    assert "# Data validation: passed" in report.to_markdown()


def test_drifted_dataset_fails_on_distributions(suite, drifted):
    report = validate_splits(suite, drifted / "train.jsonl", drifted / "eval.jsonl", NUMERIC)
    assert not report.ok
    for dataset in ("train", "eval"):
        failures = [f for f in report.failures if f["dataset"].endswith(f"{dataset}.jsonl")]
        (kl_category,) = failures_of(
            failures, "expect_column_kl_divergence_to_be_less_than", "category"
        )
        assert kl_category["observed"]["kl_divergence"] > 0.4
        assert kl_category["expected"]["kl_divergence_at_most"] == 0.1
        # multi_year is the category the drift over-represents (45% against 15%)
        assert {s["value"] for s in kl_category["samples"]} == {"multi_year"}
        (quantiles,) = failures_of(
            failures, "expect_column_quantile_values_to_be_between", "question_length"
        )
        assert quantiles["observed"]["0.5"] > quantiles["expected"]["0.5"][1]
        assert all(s["id"].startswith(dataset) and s["value"] > 134 for s in quantiles["samples"])
        (kl_length,) = failures_of(
            failures, "expect_column_kl_divergence_to_be_less_than", "question_length"
        )
        assert kl_length["observed"]["weights"]["> 121"] == 1.0
    # schema, ids and references are still fine: only the distributions drifted
    assert {f["expectation"] for f in report.failures} == {
        "expect_column_kl_divergence_to_be_less_than",
        "expect_column_quantile_values_to_be_between",
    }
    markdown = report.to_markdown()
    assert "FAILED (6 failures)" in markdown
    assert "`expect_column_kl_divergence_to_be_less_than` | `question_length`" in markdown
    json.dumps(report.to_json())  # plain JSON for the artifact


def test_leakage_between_train_and_eval(suite, train_rows, tmp_path):
    train = train_rows[:30]
    eval_rows = [dict(row, id=f"eval-{i}") for i, row in enumerate(train_rows[100:130])]
    # same question, other case and punctuation: still the same item
    eval_rows[5]["question"] = train[3]["question"].upper().replace("?", " ?!")
    eval_rows[7]["id"] = train[1]["id"]
    write_jsonl(tmp_path / "train.jsonl", train)
    write_jsonl(tmp_path / "eval.jsonl", eval_rows)
    report = validate_splits(suite, tmp_path / "train.jsonl", tmp_path / "eval.jsonl", NUMERIC)
    (by_id,) = failures_of(report.failures, "train_eval_disjoint", "id")
    (by_question,) = failures_of(report.failures, "train_eval_disjoint", "question")
    assert by_id["samples"] == [
        {"id": train[1]["id"], "line": 8, "train_id": train[1]["id"], "value": train[1]["id"]}
    ]
    assert by_question["unexpected_count"] == 1
    assert by_question["samples"][0]["id"] == "eval-5"
    assert by_question["samples"][0]["train_id"] == train[3]["id"]
    assert len(report.failures) == 2
    # 30 rows are too few for distribution checks: skipped and said so, not failed
    assert {s["expectation"] for s in report.datasets[0].skipped} == {
        "expect_column_kl_divergence_to_be_less_than",
        "expect_column_quantile_values_to_be_between",
    }
    assert "## Skipped" in report.to_markdown()


def test_unparseable_reference_is_reported_with_its_row(suite, train_rows, tmp_path):
    rows = [dict(row) for row in train_rows[:40]]
    rows[4]["reference_answer"] = "about 12 or 13"
    rows[9]["reference_answer"] = "n/a"
    write_jsonl(tmp_path / "train.jsonl", rows)
    write_jsonl(tmp_path / "eval.jsonl", train_rows[1000:1010])
    report = validate_splits(suite, tmp_path / "train.jsonl", tmp_path / "eval.jsonl", NUMERIC)
    (failure,) = report.failures
    assert failure["expectation"] == "reference_answer_gradable"
    assert failure["dataset"].endswith("train.jsonl")
    assert [(s["id"], s["line"], s["value"]) for s in failure["samples"]] == [
        (rows[4]["id"], 5, "about 12 or 13"),
        (rows[9]["id"], 10, "n/a"),
    ]
    assert "reference_parse_error" in failure["samples"][0]["error"]

    # Any grader type: a multi grader whose string_check reads an item field rows lack.
    multi = {
        "type": "multi",
        "graders": {
            "answer": NUMERIC,
            "unit": {
                "type": "string_check",
                "operation": "eq",
                "input": "{{sample.output_text}}",
                "reference": "{{item.unit}}",
            },
        },
        "calculate_output": "answer * unit",
    }
    report = validate_splits(suite, tmp_path / "eval.jsonl", tmp_path / "eval.jsonl", multi)
    gradable = failures_of(report.failures, "reference_answer_gradable", "reference_answer")
    assert [f["unexpected_count"] for f in gradable] == [10, 10]
    assert "grader.graders.unit" in gradable[0]["samples"][0]["error"]
    assert "no key 'unit'" in gradable[0]["samples"][0]["error"]


def test_duplicate_ids_and_wrong_types_are_named(suite, train_rows, tmp_path):
    rows = [dict(row) for row in train_rows[:300]]
    rows[20]["id"] = rows[10]["id"]
    rows[30]["year"] = "2019"
    rows[40]["messages"] = None
    write_jsonl(tmp_path / "rows.jsonl", rows)
    report = validate_dataset(suite, tmp_path / "rows.jsonl")
    (unique,) = failures_of(report.failures, "expect_column_values_to_be_unique", "id")
    assert unique["unexpected_count"] == 2
    assert [(s["id"], s["line"]) for s in unique["samples"]] == [
        (rows[10]["id"], 11),
        (rows[10]["id"], 21),
    ]
    (year,) = failures_of(report.failures, "expect_column_values_to_be_of_type", "year")
    assert year["expected"] == "type int"
    assert year["samples"] == [{"id": rows[30]["id"], "line": 31, "value": "2019"}]
    (null,) = failures_of(report.failures, "expect_column_values_to_not_be_null", "messages")
    assert null["samples"] == [{"id": rows[40]["id"], "line": 41, "value": None}]
    assert len(report.failures) == 3  # distributions of 300 real rows still pass


def test_missing_column_is_one_clear_failure(suite, train_rows, tmp_path):
    rows = [{k: v for k, v in row.items() if k != "category"} for row in train_rows[:250]]
    write_jsonl(tmp_path / "rows.jsonl", rows)
    report = validate_dataset(suite, tmp_path / "rows.jsonl")
    assert [(f["expectation"], f["column"], f["observed"]) for f in report.failures] == [
        ("expect_column_to_exist", "category", "missing")
    ]
    assert {s["reason"] for s in report.skipped} == {"column 'category' is missing"}
    assert len(report.skipped) == 4  # not null, type, value set, KL


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b'{"id": "a"}\n{"id": "b"}\n{"id": "c",\n', ":3: invalid JSON"),
        (b'{"id": "a"}\n{"id": "\xff"}\n', ":2: invalid UTF-8"),
        (b'{"id": "a"}\n[1, 2]\n', ":2: expected a JSON object"),
        (b"\n\n", "has no rows"),
    ],
)
def test_unreadable_input_names_file_and_line(suite, tmp_path, content, message):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(content)
    with pytest.raises(DataError, match=message) as caught:
        validate_dataset(suite, path)
    assert str(path) in str(caught.value)


def test_missing_files_raise_data_error(suite, tmp_path):
    with pytest.raises(DataError, match="cannot read the file"):
        validate_splits(suite, tmp_path / "train.jsonl", tmp_path / "eval.jsonl", NUMERIC)
    with pytest.raises(DataError, match="agentrft expectations derive"):
        load_suite(tmp_path / "none.json")


def test_invalid_suite_is_a_data_error_not_a_silent_drop(suite, demo_data_dir):
    # GX's ExpectationSuite would only log an unknown expectation and drop it.
    broken = {
        **suite,
        "expectations": [*suite["expectations"], {"type": "expect_magic", "kwargs": {}}],
    }
    with pytest.raises(DataError, match=r"expectation 39 \(expect_magic\): expect_magic not found"):
        validate_dataset(broken, demo_data_dir / "eval.jsonl")
