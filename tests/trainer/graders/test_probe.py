"""Reward-hacking probes: the demo's grader pays for none of them; a naive grader is caught;
the CLI reports and exits non-zero when a probe scores above 0.1."""

from __future__ import annotations

import json
from pathlib import Path

from flows.cli import main
from trainer.data import read_items
from trainer.graders.probe import probe_answers, run_probes

REPO = Path(__file__).resolve().parents[3]
DEMO_GRADER = REPO / "envs" / "finqa" / "grader.json"


def test_at_least_twenty_probes_of_the_required_kinds(demo_data_dir: Path) -> None:
    item = read_items(demo_data_dir / "validation.jsonl", 1)[0]
    probes = probe_answers(item, "Revenue 1,234 and 5,678 in 2019")
    assert len(probes) >= 20
    for kind in ("empty", "question_echoed", "several_numbers", "every_number_on_page", "range",
                 "judge_addressed", "tool_output_pasted", "enormous", "json_malformed"):
        assert kind in probes
    assert item["reference_answer"] in probes["several_numbers"]  # the right number hides among others
    assert "1,234" in probes["every_number_on_page"] and len(probes["enormous"]) > 500_000


def test_demo_grader_pays_for_no_probe(demo_data_dir: Path) -> None:
    grader = json.loads(DEMO_GRADER.read_text())
    report = run_probes(grader, read_items(demo_data_dir / "validation.jsonl", 8), corpus_dir=demo_data_dir / "corpus")
    assert report.tried >= 8 * 20 and report.passed and report.max_score <= 0.1, report.flagged
    assert report.grader_errors == {}


def test_a_naive_grader_is_caught(demo_data_dir: Path) -> None:
    naive = {"type": "string_check", "name": "contains", "input": "{{sample.output_text}}",
             "reference": "{{item.reference_answer}}", "operation": "like"}
    report = run_probes(naive, read_items(demo_data_dir / "validation.jsonl", 3), corpus_dir=demo_data_dir / "corpus")
    flagged = {f["probe"] for f in report.flagged}
    assert not report.passed and {"several_numbers", "either_or"} <= flagged


def test_cli_probe_exit_codes(tmp_path: Path, demo_data_dir: Path, capsys) -> None:
    dataset = tmp_path / "items.jsonl"
    dataset.write_text("".join(json.dumps(i) + "\n" for i in read_items(demo_data_dir / "validation.jsonl", 2)))
    assert main(["grader", "probe", "--grader", str(DEMO_GRADER), "--dataset", str(dataset)]) == 0
    naive = tmp_path / "naive.json"
    naive.write_text(json.dumps({"type": "string_check", "name": "n", "input": "{{sample.output_text}}",
                                 "reference": "{{item.reference_answer}}", "operation": "like"}))
    assert main(["grader", "probe", "--grader", str(naive), "--dataset", str(dataset)]) == 1
    assert "can be gamed" in capsys.readouterr().err
    assert main(["grader", "probe", "--grader", str(DEMO_GRADER), "--dataset", str(tmp_path / "missing.jsonl")]) == 2
