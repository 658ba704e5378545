"""The test-split ledger (tasks/ledger.py): every reading appended, counted per split."""

from __future__ import annotations

import json
from pathlib import Path

from tasks.ledger import readings, record_reading, rename_config, split_digest, split_readings
from tasks.tracking import commit_of, git_commit
from trainer.config.data import DataConfig
from trainer.data import read_items, read_jsonl


def _data(tmp_path: Path, demo_data_dir: Path, test_items: int) -> DataConfig:
    for split, count in (("train", 4), ("validation", 4), ("test", test_items)):
        rows = read_items(demo_data_dir / f"{split}.jsonl", count)
        (tmp_path / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return DataConfig(train_file=str(tmp_path / "train.jsonl"), validation_file=str(tmp_path / "validation.jsonl"),
                      test_file=str(tmp_path / "test.jsonl"), production_traffic_file=None, expectations_suite=None,
                      test_ledger=str(tmp_path / "ledger" / "test_readings.jsonl"))


def test_each_reading_is_appended_and_counted_per_split(tmp_path, demo_data_dir):
    data = _data(tmp_path, demo_data_dir, 6)
    first = record_reading(data, command="regression_eval", config="job", config_hash="a" * 16, model="m1")
    again = record_reading(data, command="agentrft eval --split test", config="job", config_hash="b" * 16, model="m2")
    assert (first.count, again.count) == (1, 2)
    assert again.configs == ["job (aaaaaaaa)", "job (bbbbbbbb)"]
    assert "read 2 times, by 2 configs" in again.sentence()
    rows = read_jsonl(Path(data.test_ledger))
    assert [r["command"] for r in rows] == ["regression_eval", "agentrft eval --split test"]
    assert all(r["items"] == 6 and r["split_sha256"] == split_digest(data)[0] for r in rows)

    # another split (one item more) starts at zero in the same ledger
    other = _data(tmp_path, demo_data_dir, 7)
    assert readings(Path(data.test_ledger), split_digest(other)[0]).count == 0
    assert record_reading(other, command="regression_eval", config="job", config_hash="a" * 16,
                          model="m1").count == 1


def test_no_ledger_records_nothing(tmp_path, demo_data_dir):
    data = _data(tmp_path, demo_data_dir, 3).model_copy(update={"test_ledger": None})
    assert record_reading(data, command="regression_eval", config="job", config_hash="a" * 16, model="m") is None
    assert not (tmp_path / "ledger").exists()


def test_auto_puts_the_ledger_beside_the_test_file(tmp_path, demo_data_dir):
    data = _data(tmp_path, demo_data_dir, 3).model_copy(update={"test_ledger": "auto"})
    assert record_reading(data, command="regression_eval", config="job", config_hash="a" * 16, model="m").count == 1
    assert (tmp_path / "test_readings.jsonl").is_file()


def test_auto_keeps_a_dvc_pinned_ledger_outside_the_pin(tmp_path, demo_data_dir):
    """A reading must not change the data version: beside data.dvc, never inside data/."""
    import pytest

    from tasks.data_version import add, check_pinned, init
    from trainer.errors import DataError

    data_dir = tmp_path / "data"
    data_dir.mkdir()
    data = _data(data_dir, demo_data_dir, 3)
    init(tmp_path)
    dvc_file = add(data_dir)
    pinned = check_pinned(dvc_file)
    data = data.model_copy(update={"dvc_file": str(dvc_file), "test_ledger": "auto"})
    assert record_reading(data, command="regression_eval", config="job", config_hash="a" * 16, model="m").count == 1
    assert (tmp_path / "test_readings.jsonl").is_file()
    assert check_pinned(dvc_file) == pinned  # the data version is unchanged
    # a job that does not name data.dvc (an OpenAI job file) still keeps out of the pin
    unnamed = data.model_copy(update={"dvc_file": None})
    assert record_reading(unnamed, command="regression_eval", config="job", config_hash="b" * 16, model="m").count == 2
    assert check_pinned(dvc_file) == pinned and not (data_dir / "test_readings.jsonl").exists()

    inside = data.model_copy(update={"test_ledger": str(data_dir / "test_readings.jsonl")})
    with pytest.raises(DataError, match=r"data.test_ledger: .* is inside .*which .*data.dvc pins"):
        record_reading(inside, command="regression_eval", config="job", config_hash="a" * 16, model="m")
    assert not (data_dir / "test_readings.jsonl").exists()


def test_a_config_is_the_same_config_when_only_a_default_was_added(tmp_path, demo_data_dir):
    """The frozen demo config read at a later commit: a section added to the defaults moves the
    resolved hash but not what the config sets, so it is one config read twice, and the
    sentence says the resolved hash moved; a config that sets something else is another."""
    from trainer.config.loading import load_config

    data = _data(tmp_path, demo_data_dir, 5)
    frozen = load_config(Path(__file__).resolve().parents[2] / "envs" / "finqa" / "demo.yaml")
    # What it sets leaves out every default, so a section added later does not enter it.
    assert "api" not in frozen.model_dump(exclude_defaults=True) and "api" in frozen.model_dump()
    first = record_reading(data, command="regression_eval", config="demo", config_hash="1ea92f2a" + "0" * 8,
                           config_written_hash=frozen.written_hash(), model="m")
    again = record_reading(data, command="regression_eval", config="demo", config_hash="a777e81c" + "0" * 8,
                           config_written_hash=frozen.written_hash(), model="m")
    assert (first.count, again.count) == (1, 2) and len(again.configs) == 1
    assert "resolved 1ea92f2a -> a777e81c: a default changed under it" in again.configs[0]
    changed = frozen.model_copy(deep=True)
    changed.training.kl_coef = 0.5
    assert changed.written_hash() != frozen.written_hash()
    third = record_reading(data, command="regression_eval", config="demo", config_hash="c" * 16,
                           config_written_hash=changed.written_hash(), model="m")
    assert len(third.configs) == 2 and "by 2 configs" in third.sentence()


def test_a_reading_records_the_checkout_and_a_dirty_tree_as_dirty(tmp_path, demo_data_dir):
    import subprocess

    data = _data(tmp_path, demo_data_dir, 3)
    record_reading(data, command="agentrft eval --split test", config="job", config_hash="a" * 16, model="m")
    assert read_jsonl(Path(data.test_ledger))[0]["git_commit"] == git_commit() != ""  # never left empty
    repo = tmp_path / "repo"
    repo.mkdir()
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    (repo / "f.txt").write_text("a")
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "f.txt"], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "c"], check=True)
    head = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    assert commit_of(repo) == head
    (repo / "f.txt").write_text("b")
    assert commit_of(repo) == head + "-dirty"


def test_renaming_gives_one_config_one_name_and_rewrites_nothing_else(tmp_path, demo_data_dir):
    """The regression stage used to record the MLflow experiment's name and shift readings the
    config's: config 7c0907bc counted as two. The migration renames the rows recorded under the
    old name and changes nothing else, byte for byte."""
    data = _data(tmp_path, demo_data_dir, 3)
    ledger = Path(data.test_ledger)
    for name in ("agent-rft-demo", "finqa-demo"):
        record_reading(data, command="regression_eval", config=name, config_hash="c" * 16,
                       config_written_hash="7c0907bc" + "0" * 8, model="m", git_commit="abc")
    # a row written by hand, in another layout, and one of another config: left exactly as they are
    with ledger.open("a") as handle:
        handle.write('{"split_sha256":"x", "config": "other-job",  "config_hash": ""}\n')
        handle.write('{"split_sha256":"x","config":"agent-rft-demo","note":"kept"}\n')
    before = ledger.read_text().splitlines(keepends=True)
    split = split_digest(data)[0]
    assert readings(ledger, split).configs == ["agent-rft-demo (7c0907bc)", "finqa-demo (7c0907bc)"]
    assert rename_config(ledger, "finqa-demo", {"agent-rft-demo"}) == 2
    after = ledger.read_text().splitlines(keepends=True)
    assert len(after) == len(before) and [after[1], after[2]] == [before[1], before[2]]
    for old, new in ((before[0], after[0]), (before[3], after[3])):
        old_row, new_row = json.loads(old), json.loads(new)
        assert new_row["config"] == "finqa-demo" and new_row["recorded_as"] == "agent-rft-demo"
        assert {k: v for k, v in new_row.items() if k not in ("config", "recorded_as")} == \
            {k: v for k, v in old_row.items() if k != "config"}
        assert list(new_row)[: len(old_row)] == list(old_row)  # the fields in their order, recorded_as last
    assert readings(ledger, split).configs == ["finqa-demo (7c0907bc)"]  # one config is one config
    assert rename_config(ledger, "finqa-demo", {"agent-rft-demo"}) == 0  # run again: nothing to do
    assert ledger.read_text().splitlines(keepends=True) == after


def test_each_split_is_counted_by_name_and_the_retired_ones_too(tmp_path, demo_data_dir):
    data = _data(tmp_path, demo_data_dir, 3)
    shift = tmp_path / "shift.jsonl"
    shift.write_text("".join(json.dumps(r) + "\n" for r in read_items(demo_data_dir / "test.jsonl", 2)))
    (tmp_path / "old").mkdir()
    retired = _data(tmp_path / "old", demo_data_dir, 5)  # a test split this config no longer reads
    for _ in range(2):
        record_reading(data, command="regression_eval", config="job", config_hash="a" * 16, model="m",
                       split_file=str(shift))
    record_reading(retired.model_copy(update={"test_ledger": data.test_ledger}), command="regression_eval",
                   config="job", config_hash="a" * 16, model="m")
    splits = split_readings(data, Path(data.test_ledger), {"later": str(shift), "unwritten": str(tmp_path / "no")})
    by_name = {s["split"]: s for s in splits}
    assert by_name["test"]["readings"] == 0 and by_name["later"]["readings"] == 2
    assert by_name["unwritten"]["readings"] is None and "not found" in by_name["unwritten"]["unread_because"]
    assert by_name["(no longer this config's)"]["readings"] == 1 and by_name["(no longer this config's)"]["items"] == 5
