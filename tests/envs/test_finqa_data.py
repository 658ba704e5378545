"""The FinQA-style demo data: the DVC pin, determinism, drift, programs, gold pages, splits,
and the loader for the real FinQA JSON format."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections import Counter
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from envs.finqa.dvc_pin import dir_manifest, dir_md5, pinned_md5, verify_data

from envs.finqa.finqa_format import infer_category, load_finqa_json
from envs.finqa.generate import (
    LINE_ITEMS,
    REPORT_YEARS,
    TICKERS,
    TRAFFIC_DAYS,
    TRAFFIC_START,
    execute_program,
    generate_dataset,
    normalize_question,
)
from envs.finqa.tool_schemas import TOOL_SCHEMAS
from trainer.errors import DataError

REPO_ROOT = Path(__file__).resolve().parents[2]
SPLITS = ("train", "eval", "production_traffic")
ITEM_KEYS = [
    "id", "messages", "tools", "question", "reference_answer", "exe_ans", "program",
    "category", "ticker", "year", "gold_pages",
]  # fmt: skip


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


@pytest.fixture(scope="module")
def generated(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("finqa") / "data"
    counts = generate_dataset(out, seed=0)
    assert counts == {"pages": 2800, "train": 2000, "eval": 250, "production_traffic": 4000}
    return out


@pytest.fixture(scope="module")
def items(generated) -> dict[str, list[dict]]:
    return {split: read_jsonl(generated / f"{split}.jsonl") for split in SPLITS}


def test_regenerated_data_matches_the_dvc_pin(generated):
    pin = pinned_md5(REPO_ROOT / "data.dvc")
    assert re.fullmatch(r"[0-9a-f]{32}", pin)
    assert dir_md5(generated) == pin
    result = verify_data(generated, REPO_ROOT / "data.dvc", seed=0)
    assert result.ok, result.message
    assert result.regenerated_md5 == result.data_md5 == pin


def test_verify_names_both_md5s_and_the_first_differing_file(tmp_path):
    changed = tmp_path / "data"
    generate_dataset(changed, seed=0)
    page = changed / "corpus/reports/ACME/2019/page_3.txt"
    page.write_text(page.read_text(encoding="utf-8") + "edited\n", encoding="utf-8")

    result = verify_data(changed, REPO_ROOT / "data.dvc", seed=0)
    assert not result.ok
    assert result.data_md5 != result.pinned_md5 == result.regenerated_md5
    assert result.first_difference == "corpus/reports/ACME/2019/page_3.txt (differs)"
    for text in (result.pinned_md5, result.data_md5, "corpus/reports/ACME/2019/page_3.txt"):
        assert text in result.message
    with pytest.raises(DataError, match="data mismatch"):
        result.raise_if_mismatch()


def test_verify_reports_a_generator_that_no_longer_reproduces_the_pin(generated):
    # Another seed stands in for a changed generator.
    result = verify_data(generated, REPO_ROOT / "data.dvc", seed=1)
    assert not result.ok
    assert result.regenerated_md5 != result.pinned_md5 == result.data_md5
    assert result.first_difference == "corpus/reports/ACME/2016/page_1.txt (differs)"
    assert result.regenerated_md5 in result.message and result.pinned_md5 in result.message


def test_dir_md5_equals_what_dvc_add_records(tmp_path):
    tracked = tmp_path / "d"
    (tracked / "sub" / "deeper").mkdir(parents=True)
    (tracked / "a.txt").write_text("alpha\n", encoding="utf-8")
    (tracked / "sub" / "b.jsonl").write_text('{"x": 1}\r\n', encoding="utf-8", newline="")
    (tracked / "sub" / "deeper" / "café.txt").write_bytes(b"\x00\x01binary")
    (tracked / "Z.txt").write_text("upper case sorts first\n", encoding="utf-8")
    env = {**os.environ, "DVC_NO_ANALYTICS": "1"}
    for args in (["init", "--no-scm", "-q"], ["add", "d", "-q"]):
        subprocess.run([sys.executable, "-m", "dvc", *args], cwd=tmp_path, env=env, check=True)
    assert pinned_md5(tmp_path / "d.dvc") == dir_md5(tracked)


def test_pinned_md5_rejects_a_broken_dvc_file(tmp_path):
    bad = tmp_path / "data.dvc"
    bad.write_text("outs: []\n", encoding="utf-8")
    with pytest.raises(DataError, match=r"data\.dvc: no 'outs\[0\]\.md5'"):
        pinned_md5(bad)
    with pytest.raises(DataError, match="not found"):
        pinned_md5(tmp_path / "missing.dvc")


def test_same_seed_gives_the_same_bytes(generated, tmp_path):
    again = tmp_path / "again"
    generate_dataset(again, seed=0)
    assert dir_manifest(again) == dir_manifest(generated)
    for split in SPLITS:
        assert (again / f"{split}.jsonl").read_bytes() == (
            generated / f"{split}.jsonl"
        ).read_bytes()
    assert b"\r" not in (again / "train.jsonl").read_bytes()


def test_drift_changes_the_category_mix_and_lengthens_questions(items, generated, tmp_path):
    generate_dataset(tmp_path, seed=0, drift=True, n_train=400, n_eval=50, n_traffic=50)
    drifted = read_jsonl(tmp_path / "train.jsonl")

    def share(rows: list[dict], categories: tuple[str, ...]) -> float:
        return sum(row["category"] in categories for row in rows) / len(rows)

    def mean_length(rows: list[dict]) -> float:
        return sum(len(row["question"]) for row in rows) / len(rows)

    normal = items["train"]
    assert share(normal, ("multi_year", "ratio")) == pytest.approx(0.30)
    assert share(drifted, ("multi_year", "ratio")) == pytest.approx(0.80)
    assert share(normal, ("single_lookup",)) == pytest.approx(0.30)
    assert share(drifted, ("single_lookup",)) == pytest.approx(0.05)
    assert mean_length(drifted) > 2.5 * mean_length(normal)
    # The corpus does not drift: the same pages serve both datasets.
    same_page = "corpus/reports/ACME/2019/page_3.txt"
    assert (tmp_path / same_page).read_bytes() == (generated / same_page).read_bytes()


def test_item_shape_and_category_mix(items):
    mix = {
        "single_lookup": 0.30,
        "change": 0.20,
        "percent_change": 0.20,
        "ratio": 0.15,
        "multi_year": 0.15,
    }
    for split, rows in items.items():
        counts = Counter(row["category"] for row in rows)
        for category, share in mix.items():
            assert counts[category] / len(rows) == pytest.approx(share, abs=0.003), (
                split,
                category,
            )
        for row in rows:
            assert list(row)[: len(ITEM_KEYS)] == ITEM_KEYS
            assert row["messages"] == [{"role": "user", "content": row["question"]}]
            assert row["tools"] == TOOL_SCHEMAS
            assert row["ticker"] in TICKERS and row["year"] in REPORT_YEARS
            assert row["ticker"] in row["question"] and str(row["year"]) in row["question"]
    assert items["train"][0]["id"] == "train-00000"
    assert items["eval"][-1]["id"] == "eval-00249"


def test_every_exe_ans_is_its_program_executed(items):
    for rows in items.values():
        for row in rows:
            assert round(execute_program(row["program"]), 4) == row["exe_ans"], row["id"]
            reference = row["reference_answer"]
            if reference.endswith("%"):
                assert float(reference[:-1]) == pytest.approx(row["exe_ans"] * 100, abs=0.005)
            else:
                assert float(reference) == pytest.approx(row["exe_ans"], abs=5e-5)


def test_example_programs():
    assert execute_program("subtract(540, 480), divide(#0, 480)") == pytest.approx(0.125)
    assert execute_program("add(1.5, 2.5), add(#0, 5), divide(#1, const_3)") == pytest.approx(3.0)
    assert execute_program("multiply(2, const_m1)") == -2.0
    assert execute_program("exp(2, 10)") == 1024.0
    assert execute_program("greater(5, 3)") == 1.0
    assert execute_program("divide(5%, 2)") == pytest.approx(0.025)
    assert execute_program("54.3") == 54.3
    with pytest.raises(DataError, match="#2 refers to no earlier step"):
        execute_program("add(1, 2), add(#2, 1)")
    with pytest.raises(DataError, match="unknown op 'table_sum'"):
        execute_program("table_sum(revenue, none)")
    with pytest.raises(DataError, match="division by zero"):
        execute_program("divide(1, 0)")


def test_gold_pages_exist_and_hold_the_program_numbers(items, generated):
    corpus = generated / "corpus"
    for rows in items.values():
        for row in rows:
            cells = set()
            for page in row["gold_pages"]:
                assert page.startswith(f"reports/{row['ticker']}/")
                text = (corpus / page).read_text(encoding="utf-8")
                cells.update(cell for line in text.splitlines() for cell in line.split(" | "))
            numbers = re.findall(r"(?<![#_\w])\d+(?:\.\d+)?", row["program"])
            assert numbers and set(numbers) <= cells, row["id"]
            # The report year is stated on the page's first line, so search finds the topic.
            assert (
                (corpus / row["gold_pages"][0])
                .read_text(encoding="utf-8")
                .startswith(
                    f"{row['ticker']} {row['gold_pages'][0].split('/')[2]} annual report - "
                )
            )


def test_corpus_has_each_line_item_on_exactly_one_page_per_report(generated):
    reports = generated / "corpus" / "reports"
    pages = sorted(reports.rglob("*.txt"))
    assert len(pages) == len(TICKERS) * len(REPORT_YEARS) * 10 == 2800
    assert sorted(p.name for p in reports.iterdir()) == sorted(TICKERS)
    for report in [reports / "ACME" / "2016", reports / TICKERS[-1] / "2022"]:
        seen = Counter()
        for page in report.iterdir():
            text = page.read_text(encoding="utf-8")
            assert 300 < len(text) < 800
            seen.update(line.split(" | ")[0] for line in text.splitlines() if " | " in line)
        assert seen.pop("(in $ millions)") == 10
        assert seen == Counter({item: 1 for item in LINE_ITEMS})


def test_tables_add_up(generated):
    page = next(
        p
        for p in (generated / "corpus/reports/ACME/2020").iterdir()
        if "statements of operations" in p.read_text(encoding="utf-8")
    )
    rows = {
        line.split(" | ")[0]: [float(v) for v in line.split(" | ")[1:]]
        for line in page.read_text(encoding="utf-8").splitlines()
        if " | " in line and not line.startswith("(in $ millions)")
    }
    assert list(rows) == ["net revenue", "cost of revenue", "gross profit", "operating income"]
    for year in range(2):
        assert rows["gross profit"][year] == pytest.approx(
            rows["net revenue"][year] - rows["cost of revenue"][year]
        )


def test_splits_are_disjoint_by_id_and_question(items):
    ids = [row["id"] for rows in items.values() for row in rows]
    assert len(ids) == len(set(ids)) == 6250
    questions = {
        split: {normalize_question(r["question"]) for r in rows} for split, rows in items.items()
    }
    assert len(questions["train"]) == 2000 and len(questions["eval"]) == 250
    assert not questions["train"] & questions["eval"]
    assert not questions["production_traffic"] & (questions["train"] | questions["eval"])


def test_traffic_is_timestamped_in_order_over_90_days(items):
    stamps = [row["timestamp"] for row in items["production_traffic"]]
    assert stamps == sorted(stamps)
    times = [datetime.strptime(s, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC) for s in stamps]
    assert TRAFFIC_START <= times[0] and times[-1] < TRAFFIC_START + timedelta(days=TRAFFIC_DAYS)
    assert times[-1] - times[0] > timedelta(days=TRAFFIC_DAYS - 2)
    assert [row["id"] for row in items["production_traffic"][:2]] == [
        "traffic-00000",
        "traffic-00001",
    ]


FINQA_RECORDS = [
    {
        "pre_text": ["interest rate to a variable interest rate based on libor .", "the company 's revenue grew ."],
        "post_text": ["fair value of the swap was immaterial ."],
        "filename": "ADI/2009/page_49.pdf",
        "table_ori": [["", "2009", "2008"]],
        "table": [["", "2009", "2008"], ["net revenue", "$ 2,603", "$ 2,583"]],
        "id": "ADI/2009/page_49.pdf-1",
        "qa": {
            "question": "what is the percentage change in net revenue from 2008 to 2009?",
            "program": "subtract(2603, 2583), divide(#0, 2583)",
            "exe_ans": 0.00774,
            "answer": "0.8%",
        },
    },
    {
        "pre_text": ["interest rate to a variable interest rate based on libor .", "the company 's revenue grew ."],
        "post_text": ["fair value of the swap was immaterial ."],
        "filename": "ADI/2009/page_49.pdf",
        "table": [["", "2009", "2008"], ["net revenue", "$ 2,603", "$ 2,583"]],
        "id": "ADI/2009/page_49.pdf-2",
        "qa": {"question": "was net revenue higher in 2009?", "program": "greater(2603, 2583)", "exe_ans": "yes"},
    },
    {
        "pre_text": [],
        "post_text": [],
        "filename": "BRK/B/2015/page_7.pdf",
        "table": [["cash", "120"], ["debt", "60"]],
        "id": "BRK/B/2015/page_7.pdf-3",
        "qa": {"question": "what is the ratio of cash to debt?", "program": "divide(120, 60)", "exe_ans": 2.0},
    },
]  # fmt: skip


def test_finqa_loader_builds_the_corpus_and_items(tmp_path):
    source = tmp_path / "train.json"
    source.write_text(json.dumps(FINQA_RECORDS), encoding="utf-8")
    out = tmp_path / "finqa"
    assert load_finqa_json(source, out, split_name="train") == 3

    assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()) == [
        "corpus/reports/ADI/2009/page_49.txt",
        "corpus/reports/BRK.B/2015/page_7.txt",
        "train.jsonl",
    ]
    assert (out / "corpus/reports/ADI/2009/page_49.txt").read_text(encoding="utf-8") == (
        "interest rate to a variable interest rate based on libor .\n"
        "the company 's revenue grew .\n\n"
        " | 2009 | 2008\n"
        "net revenue | $ 2,603 | $ 2,583\n\n"
        "fair value of the swap was immaterial .\n"
    )
    assert (out / "corpus/reports/BRK.B/2015/page_7.txt").read_text(
        encoding="utf-8"
    ) == "cash | 120\ndebt | 60\n"

    rows = read_jsonl(out / "train.jsonl")
    assert [list(row) for row in rows] == [ITEM_KEYS] * 3
    first = rows[0]
    assert first["id"] == "ADI/2009/page_49.pdf-1"
    assert first["messages"] == [{"role": "user", "content": FINQA_RECORDS[0]["qa"]["question"]}]
    assert first["tools"] == TOOL_SCHEMAS
    assert (first["reference_answer"], first["exe_ans"], first["category"]) == (
        "0.8%",
        0.00774,
        "percent_change",
    )
    assert (first["ticker"], first["year"], first["gold_pages"]) == (
        "ADI",
        2009,
        ["reports/ADI/2009/page_49.txt"],
    )
    assert (rows[1]["exe_ans"], rows[1]["reference_answer"], rows[1]["category"]) == (
        1.0,
        "yes",
        "multi_year",
    )
    assert (rows[2]["ticker"], rows[2]["reference_answer"], rows[2]["category"]) == (
        "BRK.B",
        "2",
        "ratio",
    )


def test_infer_category_from_program_ops():
    assert infer_category("2603") == "single_lookup"
    assert infer_category("subtract(2603, 2583)") == "change"
    assert infer_category("subtract(2603, 2583), divide(#0, 2583)") == "percent_change"
    assert infer_category("divide(120, 60)") == "ratio"
    assert infer_category("add(1, 2), add(#0, 3), divide(#1, const_3)") == "multi_year"


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        (
            lambda r: r.pop("table"),
            r"record 1 \(id 'ADI/2009/page_49.pdf-2'\): missing key 'table'",
        ),
        (
            lambda r: r["qa"].pop("exe_ans"),
            r"record 1 \(id 'ADI/2009/page_49.pdf-2'\): 'qa': missing key 'exe_ans'",
        ),
        (lambda r: r.pop("id"), r"record 1: missing key 'id'"),
        (
            lambda r: r.update(pre_text="one string"),
            r"record 1 .*'pre_text' must be a list of strings",
        ),
        (
            lambda r: r.update(filename="../../etc/page_1.pdf"),
            r"record 1 .*'filename' must look like",
        ),
        (lambda r: r["qa"].update(exe_ans="n/a"), r"record 1 .*'qa.exe_ans' must be a number"),
    ],
)
def test_finqa_loader_names_the_bad_record(tmp_path, change, expected):
    records = json.loads(json.dumps(FINQA_RECORDS))
    change(records[1])
    source = tmp_path / "dev.json"
    source.write_text(json.dumps(records), encoding="utf-8")
    with pytest.raises(DataError, match=expected) as error:
        load_finqa_json(source, tmp_path / "out", split_name="dev")
    assert str(source) in str(error.value)
    assert not (tmp_path / "out").exists()
