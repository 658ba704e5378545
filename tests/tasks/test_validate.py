"""The validate_data stage: a GX suite derived from production traffic, run by its
Checkpoint on real files, plus leakage, gradability and shape checks.

The demo's three splits pass; a drifted dataset from the generator fails on the message
length and category distributions; small modified copies show leakage, unparseable
references, duplicate ids, missing fields and wrong types, each named with its rows.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from envs.finqa.generate import generate_dataset, write_jsonl
from tasks.expectations import derive_and_save, derive_suite, gx_context, load_suite
from tasks.validate import validate_datasets
from trainer.config.data import DataConfig
from trainer.data import read_items
from trainer.errors import DataError

NUMERIC = {"type": "numeric", "name": "answer", "input": "{{sample.output_text}}",
           "reference": "{{item.reference_answer}}"}


@pytest.fixture(scope="module")
def context(demo_data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("gx") / "expectations"
    derive_and_save(demo_data_dir / "production_traffic.jsonl", root, name="traffic", required=["reference_answer"],
                    time_fields=["year"])  # the demo's test split asks about later reports
    return root


@pytest.fixture(scope="module")
def drifted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("drifted")
    generate_dataset(out, seed=0, drift=True, n_train=250, n_validation=250, n_test=250, n_traffic=10)
    return out


def data(context: Path | None, train: Path, validation: Path, test: Path | None) -> DataConfig:
    return DataConfig(train_file=str(train), validation_file=str(validation), test_file=str(test) if test else None,
                      expectations_dir=str(context or "expectations"), expectations_suite="traffic" if context else None)


def failures_of(failures: list[dict], expectation: str, column: str | None = None) -> list[dict]:
    return [f for f in failures if f["expectation"] == expectation and (column is None or f["column"] == column)]


def test_committed_suite_is_derived_from_the_pinned_traffic(repo_root, demo_data_dir, monkeypatch):
    from tasks.expectations import required_fields
    from trainer.config.loading import load_config

    monkeypatch.chdir(repo_root)  # the suite records the traffic path as given: relative
    config = load_config("envs/finqa/demo.yaml")
    derived = derive_suite(Path("data/production_traffic.jsonl"), name="production_traffic",
                           required=required_fields(config), time_fields=["year"])
    committed = json.loads(Path("expectations/expectations/production_traffic.json").read_text())
    assert [(e["type"], e["kwargs"]) for e in committed["expectations"]] == \
        [(e["type"], e["kwargs"]) for e in derived["expectations"]]
    assert committed["meta"]["derived_from"]["md5"] == derived["meta"]["derived_from"]["md5"]
    kinds = {(e["type"], e["kwargs"]["column"]) for e in derived["expectations"]}
    assert ("expect_column_values_to_be_unique", "id") in kinds
    assert ("expect_column_values_to_not_be_null", "reference_answer") in kinds  # the grader reads it
    assert ("expect_column_kl_divergence_to_be_less_than", "messages.user_chars") in kinds
    assert ("expect_column_kl_divergence_to_be_less_than", "category") in kinds  # low cardinality
    assert ("expect_column_values_to_be_in_set", "tools.names") in kinds
    assert ("expect_column_to_exist", "timestamp") not in kinds  # production-only: never required
    # the report year moves with time (the test split asks about later reports): its type alone
    assert {kind for kind, column in kinds if column == "year"} == {"expect_column_values_to_be_in_type_list"}
    assert committed["meta"]["time_fields"] == ["year"]
    # the checkpoint the stage runs is stored next to the suite
    assert Path("expectations/checkpoints/production_traffic.json").is_file()


def test_demo_splits_pass_and_data_docs_are_built(context, demo_data_dir):
    report, docs = validate_datasets(data(context, *(demo_data_dir / f"{s}.jsonl" for s in
                                                      ("train", "validation", "test"))), NUMERIC)
    assert report.failures == []
    assert [d.split for d in report.datasets] == ["train", "validation", "test"]
    assert all(d.evaluated > 20 for d in report.datasets)
    assert {s["column"] for d in report.datasets for s in d.skipped} == {"timestamp", "timestamp.length"}
    assert (docs / "index.html").is_file()


def test_drifted_dataset_fails_on_distributions_naming_the_field(context, drifted):
    report, _ = validate_datasets(data(context, *(drifted / f"{s}.jsonl" for s in ("train", "validation", "test"))),
                                  NUMERIC)
    lengths = failures_of(report.failures, "expect_column_quantile_values_to_be_between", "messages.user_chars")
    assert {f["dataset"].split(" ")[0] for f in lengths} == {"train", "validation", "test"}
    categories = failures_of(report.failures, "expect_column_kl_divergence_to_be_less_than", "category")
    assert categories and categories[0]["observed"]["kl_divergence"] > 0.3
    assert "validate/train_kl_category" in report.metrics()


def test_validation_file_overlapping_train_is_caught(demo_data_dir, tmp_path):
    train = read_items(demo_data_dir / "train.jsonl", 30)
    validation = read_items(demo_data_dir / "validation.jsonl", 30)
    leaked = [{**train[3], "id": "validation-leak"}, *validation[:5]]  # the same question, a new id
    write_jsonl(tmp_path / "train.jsonl", train)
    write_jsonl(tmp_path / "validation.jsonl", leaked)
    write_jsonl(tmp_path / "test.jsonl", [validation[0], *read_items(demo_data_dir / "test.jsonl", 5)])
    report, _ = validate_datasets(data(None, tmp_path / "train.jsonl", tmp_path / "validation.jsonl",
                                       tmp_path / "test.jsonl"), NUMERIC)
    (question,) = failures_of(report.failures, "train_validation_disjoint", "messages")
    assert question["samples"][0]["id"] == "validation-leak" and question["samples"][0]["train_id"] == train[3]["id"]
    (by_id,) = failures_of(report.failures, "validation_test_disjoint", "id")
    assert by_id["samples"][0]["id"] == validation[0]["id"]


def test_unparseable_reference_is_reported_with_its_row(demo_data_dir, tmp_path):
    rows = read_items(demo_data_dir / "train.jsonl", 10)
    rows[4] = {**rows[4], "reference_answer": "about twelve"}
    del rows[6]["reference_answer"]
    write_jsonl(tmp_path / "train.jsonl", rows)
    report, _ = validate_datasets(data(None, tmp_path / "train.jsonl", demo_data_dir / "validation.jsonl",
                                       demo_data_dir / "test.jsonl"), NUMERIC)
    (bad,) = failures_of(report.failures, "rows_gradable")
    assert bad["unexpected_count"] == 2
    assert [s["line"] for s in bad["samples"]] == [5, 7]
    assert "reference_parse_error" in bad["samples"][0]["error"]
    assert "reference_answer" in bad["samples"][1]["error"]


def test_duplicate_ids_missing_fields_and_wrong_types_are_named(context, demo_data_dir, tmp_path):
    rows = read_items(demo_data_dir / "validation.jsonl", 20)
    rows[2] = {**rows[2], "id": rows[1]["id"]}
    rows[5] = {**rows[5], "year": "2019"}
    for row in rows:
        row.pop("category")  # not required: its checks are skipped
    write_jsonl(tmp_path / "validation.jsonl", rows)
    test_rows = [{k: v for k, v in row.items() if k != "reference_answer"}
                 for row in read_items(demo_data_dir / "test.jsonl", 20)]
    write_jsonl(tmp_path / "test.jsonl", test_rows)
    report, _ = validate_datasets(data(context, demo_data_dir / "train.jsonl", tmp_path / "validation.jsonl",
                                       tmp_path / "test.jsonl"), NUMERIC)
    (duplicate,) = failures_of(report.failures, "expect_column_values_to_be_unique", "id")
    assert duplicate["dataset"].startswith("validation") and duplicate["unexpected_count"] == 2
    (types,) = failures_of(report.failures, "expect_column_values_to_be_in_type_list", "year")
    assert types["samples"][0]["line"] == 6
    missing = failures_of(report.failures, "expect_column_to_exist", "reference_answer")
    assert [f["dataset"].split(" ")[0] for f in missing] == ["test"]  # the grader needs it: required
    validation = next(d for d in report.datasets if d.split == "validation")
    assert {"category"} <= {s["column"] for s in validation.skipped}


@pytest.mark.parametrize(("content", "message"), [
    (b'{"id": 1}\n{not json\n', ":2: invalid JSON"),
    (b'{"id": 1}\n\xff\xfe\n', ":2: invalid UTF-8"),
    (b'[1, 2]\n', ":1: expected a JSON object"),
])
def test_unreadable_input_names_file_and_line(demo_data_dir, tmp_path, content, message):
    (tmp_path / "train.jsonl").write_bytes(content)
    with pytest.raises(DataError, match=message):
        validate_datasets(data(None, tmp_path / "train.jsonl", demo_data_dir / "validation.jsonl", None), NUMERIC)


def test_missing_suite_is_a_data_error_naming_the_command(tmp_path):
    with pytest.raises(DataError, match="agentrft expectations derive"):
        load_suite(tmp_path / "expectations", "nope")
    gx_context(tmp_path / "expectations")  # an empty context is fine; the missing suite is not


def test_traffic_without_messages_is_a_clear_error(tmp_path):
    write_jsonl(tmp_path / "traffic.jsonl", [{"question": "what?", "answer": "1"}])
    with pytest.raises(DataError, match="no row has a `messages` list"):
        derive_suite(tmp_path / "traffic.jsonl")


def test_a_time_field_keeps_its_type_check_alone_and_must_exist(demo_data_dir, tmp_path):
    traffic = demo_data_dir / "production_traffic.jsonl"
    plain = {(e["type"], e["kwargs"]["column"]) for e in derive_suite(traffic)["expectations"]}
    assert ("expect_column_quantile_values_to_be_between", "year") in plain
    timed = {(e["type"], e["kwargs"]["column"]) for e in derive_suite(traffic, time_fields=["year"])["expectations"]}
    assert plain - timed == {("expect_column_values_to_be_between", "year"),
                             ("expect_column_quantile_values_to_be_between", "year")}
    with pytest.raises(DataError, match=r"time fields \['yeer'\] are in no row"):
        derive_suite(traffic, time_fields=["yeer"])
