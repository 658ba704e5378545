"""The FinQA-style demo data: the DVC pin (checked by DVC itself), determinism, drift,
programs, gold pages, the three fact-disjoint splits, the two shift evaluations (the splits
read once before, byte for byte), and the loader for the real FinQA JSON format."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from collections import Counter
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from envs.finqa.demo import DEMO_CONFIG, ensure_data
from envs.finqa.finqa_format import infer_category, load_finqa_json
from envs.finqa.generate import (
    LINE_ITEMS,
    NEW_COMPANY_TICKERS,
    REPORT_YEARS,
    TEST_YEARS,
    TICKERS,
    TOPIC_OF,
    TOPICS,
    TRAFFIC_DAYS,
    TRAFFIC_START,
    assign_fact_units,
    execute_program,
    generate_dataset,
    normalize_question,
    retired_first_test_split,
)
from envs.finqa.tool_schemas import TOOL_SCHEMAS
from tasks.data_version import add, check_pinned, data_version, files_md5, init, pinned_md5
from trainer.config.loading import load_config
from trainer.data import read_jsonl
from trainer.errors import DataError

REPO_ROOT = Path(__file__).resolve().parents[2]
SPLITS = ("train", "validation", "test", "production_traffic")
SHIFTS = ("later_years", "new_companies")
ITEM_KEYS = [
    "id", "messages", "tools", "question", "reference_answer", "exe_ans", "program",
    "category", "ticker", "year", "gold_pages",
]  # fmt: skip
PIN = "4d0784860fd559894f4258726013e7d3"  # data.dvc's md5, as DVC computed it
# train.jsonl and validation.jsonl as they were before the first test split was retired
SPLIT_MD5 = {"train": "bce14e0250565025fb96a6e9840bfa18", "validation": "e1ac8fdccc18499169b28f43cfc991dc"}
# The shift evaluations are the test splits read once before (test_readings.jsonl), item for item:
# the later reports (read at 80e5430) and the 20 companies of their own (read at d5725ce).
SHIFT_SHA256 = {"later_years": "0b7ac4036b720711baf8c714fe9d3897a1c82da7f38e1ff89908bcb670d09486",
                "new_companies": "4e8391276390909952d827e5580fd5806e1edfe6281c9112495ca6c6edb76d88"}


@pytest.fixture(scope="module")
def generated(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("finqa") / "data"
    counts = generate_dataset(out, seed=0)
    assert counts == {"pages": 4800, "train": 2000, "validation": 250, "test": 250, "shift/new_companies": 250,
                      "shift/later_years": 250, "production_traffic": 4000}
    return out


@pytest.fixture(scope="module")
def items(generated) -> dict[str, list[dict]]:
    return {**{split: read_jsonl(generated / f"{split}.jsonl") for split in SPLITS},
            **{shift: read_jsonl(generated / "shift" / shift / "items.jsonl") for shift in SHIFTS}}


def corpus_of(generated: Path, split: str) -> Path:
    return generated / "shift" / "new_companies" / "corpus" if split == "new_companies" else generated / "corpus"


def project_with_pin(root: Path) -> Path:
    """A DVC project (no git) at `root` holding the repository's data.dvc, data/ absent."""
    root.mkdir(parents=True, exist_ok=True)
    init(root)
    shutil.copy(REPO_ROOT / "data.dvc", root / "data.dvc")
    return root / "data.dvc"


def files_of(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_regenerated_data_is_what_data_dvc_pins_by_dvc_status(generated, tmp_path):
    assert pinned_md5(REPO_ROOT / "data.dvc") == PIN
    dvc_file = project_with_pin(tmp_path / "project")
    shutil.copytree(generated, tmp_path / "project" / "data")
    # DVC's own status compares the regenerated workspace with the committed pin.
    assert check_pinned(dvc_file) == PIN
    # And `dvc add` of the regenerated data writes the committed pin again.
    (tmp_path / "project" / "data.dvc").unlink()
    assert add(tmp_path / "project" / "data") == dvc_file.resolve()
    assert pinned_md5(dvc_file) == PIN
    assert dvc_file.read_text() == (REPO_ROOT / "data.dvc").read_text()


def test_a_changed_file_is_caught_by_dvc_with_the_commands_to_run(generated, tmp_path):
    dvc_file = project_with_pin(tmp_path / "project")
    data = tmp_path / "project" / "data"
    shutil.copytree(generated, data)
    page = data / "corpus/reports/ACME/2019/page_3.txt"
    page.write_text(page.read_text(encoding="utf-8") + "edited\n", encoding="utf-8")
    with pytest.raises(DataError) as error:
        check_pinned(dvc_file)
    message = str(error.value)
    assert message.startswith(f"{data}: differs from the version {dvc_file} pins (modified: data/)")
    assert f"`dvc checkout {dvc_file}`" in message and "`dvc add data`" in message
    shutil.rmtree(data)
    with pytest.raises(DataError, match=rf"{re.escape(str(data))}: the data .* pins is missing; run `dvc checkout"):
        check_pinned(dvc_file)


def demo_config_in(root: Path):
    """The demo config with its data paths moved under `root` (a DVC project)."""
    data = root / "data"
    return load_config(DEMO_CONFIG, {"data": {
        "dvc_file": str(root / "data.dvc"), "train_file": str(data / "train.jsonl"),
        "validation_file": str(data / "validation.jsonl"), "test_file": str(data / "test.jsonl"),
        "production_traffic_file": str(data / "production_traffic.jsonl")}})


def test_demo_regenerates_missing_data_to_the_pin(tmp_path):
    project_with_pin(tmp_path)
    logged: list[str] = []
    assert ensure_data(demo_config_in(tmp_path), seed=0, log=logged.append) == PIN
    assert len(logged) == 1 and logged[0].startswith(f"regenerating {tmp_path / 'data'} from seed 0")
    assert (tmp_path / "data" / "test.jsonl").is_file()
    logged.clear()
    assert ensure_data(demo_config_in(tmp_path), seed=0, log=logged.append) == PIN
    assert logged == []  # in place and pinned: nothing regenerated


def test_a_generator_that_no_longer_reproduces_the_pin_is_reported(tmp_path):
    # Another seed stands in for a changed generator.
    project_with_pin(tmp_path)
    with pytest.raises(DataError, match=r"the regenerated data does not match .*data\.dvc: .*differs from the "
                       r"version .*no longer reproduces the pinned data") as error:
        ensure_data(demo_config_in(tmp_path), seed=1, log=lambda _: None)
    assert f"`dvc add {tmp_path / 'data'}` and commit {tmp_path / 'data.dvc'}" in str(error.value)


def test_data_version_round_trip_through_dvc(tmp_path):
    tracked = tmp_path / "d"
    (tracked / "sub" / "deeper").mkdir(parents=True)
    (tracked / "a.txt").write_text("alpha\n", encoding="utf-8")
    (tracked / "sub" / "b.jsonl").write_text('{"x": 1}\r\n', encoding="utf-8", newline="")
    (tracked / "sub" / "deeper" / "café.txt").write_bytes(b"\x00\x01binary")
    init(tmp_path)
    dvc_file = add(tracked)
    md5 = pinned_md5(dvc_file)
    assert re.fullmatch(r"[0-9a-f]{32}", md5) and check_pinned(dvc_file) == md5

    class Data:  # a config's data section, as data_version reads it
        dvc_file = str(tmp_path / "d.dvc")
        train_file, validation_file, test_file = (str(tracked / "a.txt"), str(tracked / "sub" / "b.jsonl"), None)

    assert data_version(Data) == md5
    Data.dvc_file = None  # not under DVC: the md5 of the dataset files
    assert data_version(Data) == files_md5([tracked / "a.txt", tracked / "sub" / "b.jsonl"]) != md5
    (tracked / "a.txt").write_text("beta\n", encoding="utf-8")
    with pytest.raises(DataError, match=r"differs from the version .*d\.dvc pins \(modified: d/\)"):
        check_pinned(dvc_file)
    # The command the error names restores the pinned data.
    subprocess.run([sys.executable, "-m", "dvc", "checkout", "--force", "-q", str(dvc_file)], cwd=tmp_path, check=True,
                   env={**os.environ, "DVC_NO_ANALYTICS": "1"})
    assert (tracked / "a.txt").read_text(encoding="utf-8") == "alpha\n" and check_pinned(dvc_file) == md5


def test_broken_or_missing_dvc_files_are_data_errors(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "data.dvc").write_text("outs: []\n", encoding="utf-8")
    with pytest.raises(DataError, match=r"not inside a DVC repository; run `dvc init`"):
        pinned_md5(outside / "data.dvc")
    project = tmp_path / "project"
    project.mkdir()
    init(project)
    (project / "data.dvc").write_text("outs: []\n", encoding="utf-8")
    with pytest.raises(DataError, match=r"data\.dvc: expected one pinned output with an md5; recreate it with `dvc add`"):
        pinned_md5(project / "data.dvc")
    (project / "data.dvc").write_text("outs: {md5: 1}\n", encoding="utf-8")
    with pytest.raises(DataError, match=r"data\.dvc: not a valid DVC file"):
        pinned_md5(project / "data.dvc")
    with pytest.raises(DataError, match="DVC file not found; pin the data with `dvc add"):
        pinned_md5(project / "missing.dvc")


def test_same_seed_gives_the_same_bytes(generated, tmp_path):
    again = tmp_path / "again"
    generate_dataset(again, seed=0)
    assert files_of(again) == files_of(generated)
    assert b"\r" not in (again / "train.jsonl").read_bytes()


def test_drift_changes_the_category_mix_and_lengthens_questions(items, generated, tmp_path):
    generate_dataset(tmp_path, seed=0, drift=True, n_train=400, n_validation=50, n_test=50, n_traffic=50)
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
            assert row["ticker"] in (NEW_COMPANY_TICKERS if split == "new_companies" else TICKERS)
            assert row["year"] in (TEST_YEARS if split == "later_years" else REPORT_YEARS + TEST_YEARS
                                   if split == "production_traffic" else REPORT_YEARS)
            assert row["ticker"] in row["question"] and str(row["year"]) in row["question"]
    assert items["train"][0]["id"] == "train-00000"
    assert items["validation"][-1]["id"] == "validation-00249"
    assert items["test"][-1]["id"] == "heldout-00249" and items["later_years"][-1]["id"] == "test-00249"


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
    for split, rows in items.items():
        corpus = corpus_of(generated, split)
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
    assert len(pages) == len(TICKERS) * len(REPORT_YEARS + TEST_YEARS) * 10 == 4800
    assert sorted(p.name for p in reports.iterdir()) == sorted(TICKERS)
    for report in [reports / "ACME" / "2016", reports / TICKERS[-1] / "2022", reports / "ACME" / "2023",
                   reports / TICKERS[-1] / "2027"]:
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
    ids = [row["id"] for split in SPLITS for row in items[split]]
    assert len(ids) == len(set(ids)) == 6500
    for shift in SHIFTS:  # each read alone, under the ids it had as the test split
        assert len({row["id"] for row in items[shift]}) == 250
    questions = {
        split: {normalize_question(r["question"]) for r in rows} for split, rows in items.items()
    }
    assert [len(questions[s]) for s in (*SPLITS[:3], *SHIFTS)] == [2000, 250, 250, 250, 250]
    names = [*SPLITS[:3], *SHIFTS]
    for index, a in enumerate(names):
        for b in names[index + 1:]:
            assert not questions[a] & questions[b], (a, b)
    assert not questions["production_traffic"] & (questions["train"] | questions["validation"] | questions["test"])


def facts_read(row: dict, corpus: Path) -> set[tuple[str, int, str]]:
    """The (ticker, year, line item) facts of the tables on an item's gold pages."""
    facts = set()
    for page in row["gold_pages"]:
        _, ticker, report, _ = page.split("/")
        for line in (corpus / page).read_text(encoding="utf-8").splitlines():
            if " | " in line and not line.startswith("(in $ millions)"):
                facts |= {(ticker, int(report), line.split(" | ")[0]), (ticker, int(report) - 1, line.split(" | ")[0])}
    return facts


def needed_facts(row: dict, corpus: Path) -> set[tuple[str, int, str]]:
    """The facts an item's program reads: the figures on its gold pages whose printed value
    is one of the program's operands. A test item's gold page of 2023 also shows 2022 (the
    prior-year column), which it does not need. Where a line prints the same value for both
    years, the year the question names is the one read (both when it names neither)."""
    operands = set(re.findall(r"(?<![#\w])\d+(?:\.\d+)?", row["program"]))
    named = {int(year) for year in re.findall(r"\b(?:19|20)\d\d\b", row["question"])}
    facts = set()
    for page in row["gold_pages"]:
        _, ticker, report, _ = page.split("/")
        for line in (corpus / page).read_text(encoding="utf-8").splitlines():
            if " | " in line and not line.startswith("(in $ millions)"):
                item, now, prior = line.split(" | ")
                if item not in row["question"]:
                    continue
                years = [year for year, value in ((int(report), now), (int(report) - 1, prior)) if value in operands]
                if now == prior and len(years) == 2 and named & set(years):
                    years = [year for year in years if year in named]
                facts |= {(ticker, year, item) for year in years}
    return facts


def test_splits_are_disjoint_by_underlying_fact(items, generated):
    """Train and validation own whole (company, topic) units; the test split asks about the
    same companies and report years, but every fact its programs read (company, year, line
    item, checked from each program's operands) is read by no other split: not train, not
    validation, not the retired first test split, not a shift evaluation."""
    owner = assign_fact_units(0)
    per_ticker = Counter((ticker, split) for (ticker, _), split in owner.items())
    assert len(owner) == len(TICKERS) * len(TOPICS)
    for ticker in TICKERS:
        assert (per_ticker[ticker, "retired"], per_ticker[ticker, "validation"], per_ticker[ticker, "train"]) == (1, 1, 8)
    corpus = generated / "corpus"
    units = {split: set() for split in ("train", "validation")}
    for split in units:
        for row in items[split]:
            read = facts_read(row, corpus)
            assert {owner[ticker, TOPIC_OF[item]] for ticker, _, item in read} == {split}, row["id"]
            assert {year for _, year, _ in read} <= {REPORT_YEARS[0] - 1, *REPORT_YEARS}, row["id"]
            units[split] |= read
    assert not units["train"] & units["validation"]
    operands = {split: set() for split in ("train", "validation", "test", "later_years", "new_companies", "retired")}
    rows = {**items, "retired": retired_first_test_split(0)}
    for split, facts in operands.items():
        for row in rows[split]:
            read = needed_facts(row, corpus_of(generated, split))
            assert read, (split, row["id"])
            facts |= read
    assert {year for _, year, _ in operands["test"]} <= {REPORT_YEARS[0] - 1, *REPORT_YEARS}
    assert {year for _, year, _ in operands["later_years"]} == set(TEST_YEARS)
    for other in ("train", "validation", "retired", "later_years", "new_companies"):
        assert not operands["test"] & operands[other], other
    # Every split asks about each of its companies.
    for split in ("train", "validation", "test", "later_years"):
        assert {row["ticker"] for row in items[split]} == set(TICKERS), split
    assert {row["ticker"] for row in items["new_companies"]} == set(NEW_COMPANY_TICKERS)
    assert assign_fact_units(1) != owner  # the assignment follows the seed


def test_the_shift_evaluations_are_the_splits_read_before_and_train_and_validation_kept_their_bytes(
        items, generated, tmp_path):
    """The later-years split (read once at 80e5430) and the new-companies split (read once
    at d5725ce) are the same items as then, byte for byte as the ledger names them; the new
    companies' corpus holds their reports beside the 40 companies' of the same years, as it
    was served then."""
    import hashlib

    from envs.finqa.demo_model import model_corpus

    for split, md5 in SPLIT_MD5.items():
        assert hashlib.md5((generated / f"{split}.jsonl").read_bytes()).hexdigest() == md5, split
    for shift, sha in SHIFT_SHA256.items():
        text = "".join(json.dumps(row, sort_keys=True) + "\n" for row in items[shift])
        assert hashlib.sha256(text.encode()).hexdigest() == sha, shift
    shifted = generated / "shift" / "new_companies" / "corpus"
    assert sorted(p.name for p in (shifted / "reports").iterdir()) == sorted(TICKERS + NEW_COMPANY_TICKERS)
    assert len(list(shifted.rglob("*.txt"))) == (len(TICKERS) + len(NEW_COMPANY_TICKERS)) * len(REPORT_YEARS) * 10
    assert files_of(shifted / "reports" / "ACME") == {
        path: text for path, text in files_of(generated / "corpus" / "reports" / "ACME").items()
        if int(path.split("/")[0]) in REPORT_YEARS}
    assert not (shifted / "periods.json").exists()
    # Production asks about every report year, the test split's too.
    assert {row["year"] for row in items["production_traffic"]} == set(REPORT_YEARS + TEST_YEARS)
    built_from = model_corpus(generated, tmp_path / "corpus")
    assert sorted(p.name for p in (built_from / "reports" / "ACME").iterdir()) == [str(y) for y in REPORT_YEARS]
    assert files_of(built_from / "reports" / "ACME" / "2022") == files_of(
        generated / "corpus" / "reports" / "ACME" / "2022")


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


def test_the_retired_first_split_is_drawn_again_byte_for_byte():
    """The micro world's test items come from the retired first split: drawn again, its
    items hash to what the ledger recorded for every reading of it."""
    from envs.finqa.generate import retired_first_test_split

    rows = retired_first_test_split()
    digest = hashlib.sha256("".join(json.dumps(row, sort_keys=True) + "\n" for row in rows).encode()).hexdigest()
    first = json.loads((REPO_ROOT / "test_readings.jsonl").read_text().splitlines()[0])
    assert (digest, len(rows)) == (first["split_sha256"], first["items"])
