"""The numeric and f1 graders, including the answers a reward-hacking policy would try."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trainer.graders import GraderError, grade, numeric_score, parse_number, validate_grader_file
from trainer.graders.numeric import distinct_numbers

REPO_ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("42", 42.0),
        ("$1,234.5", 1234.5),
        ("(12.5)", -12.5),
        ("($1,000)", -1000.0),
        ("-$3", -3.0),
        ("−7.25", -7.25),  # Unicode minus
        ("12.5%", 12.5),
        ("12.5 percent", 12.5),
        ("1.2 million", 1_200_000.0),
        ("$3.4bn", 3_400_000_000.0),
        ("1.5e3", 1500.0),
        ("revenue was $1,000 or 1000 dollars", 1000.0),  # one distinct number
        ("FY2019", None),  # glued to letters: not a number
        ("no numbers here", None),
        ("10-12", None),  # a range is two numbers
        ("12,5", None),  # a decimal comma reads as two numbers
    ],
)
def test_parse_number(text: str, value: float | None) -> None:
    assert parse_number(text) == value


@pytest.mark.parametrize(
    ("answer", "reference", "score"),
    [
        ("Answer: 12.5%", "12.5%", 1.0),
        ("Answer: 12.53%", "12.5%", 1.0),  # 0.24% relative error, within rel_tol 1%
        ("Answer: 0.125", "12.5%", 1.0),  # the fraction of a percentage reference
        ("Answer: 12.5", "12.5%", 1.0),
        ("Answer: 12.5%", "0.125", 1.0),
        ("The answer is 13%", "12.5%", (0.1 - 0.04) / (0.1 - 0.01)),  # 4% error: partial credit
        ("Answer: 11.25", "12.5", 0.0),  # 10% error: zero_at_rel_error
        ("Answer: $1,234.5 million", "1234.5", 1.0),  # the reference's unit is unknown
        ("Answer: 1.2 billion", "1200", 1.0),  # 1.2 billion = 1200 million
        ("Answer: 1200", "1.2 billion", 1.0),
        ("Answer: $12.5 million", "12.5%", 0.0),  # an amount is not a percentage
        ("Answer: 12.5%", "12.5 million", 0.0),
        ("Answer: (12.5)", "-12.5", 1.0),
        ("Answer: 12.5", "-12.5", 0.0),  # the sign matters
        ("growth = (120 - 100) / 100 = 0.2", "0.2", 1.0),  # the last "=" ends the working
        ("so the result is \\boxed{42}", "42", 1.0),
        ("Final answer:\n  42", "42", 1.0),
        ("Answer: 0", "0", 1.0),
        ("Answer: 0.001", "0", 0.0),  # no relative error against 0; abs_tol is 0
    ],
)
def test_numeric_score(answer: str, reference: str, score: float) -> None:
    assert numeric_score(answer, reference) == pytest.approx(score)


@pytest.mark.parametrize(
    "answer",
    [
        "Answer: 12.5, 13.0 or 14.2",  # several numbers at once
        "Answer: somewhere between 12 and 14",  # a range
        "Answer: 12-14",  # a range, hyphenated
        "Answer: 12.5 ± 1",
        "Revenue 2019: 1,234; 2018: 1,100; growth 12.5%; margin 8%; employees 5,000",  # every number from the page
        "In 2019 the growth was 12.5%",  # no final-answer marker, so the whole text, which has a year
        "I cannot find the answer.",  # no number at all
        "Answer: \\boxed{}",
    ],
)
def test_hedged_or_dumped_answers_earn_nothing(answer: str) -> None:
    assert numeric_score(answer, "12.5%") <= 0.1
    assert numeric_score(answer, "12.5%") == 0.0


def test_a_dump_of_thousands_of_numbers_earns_nothing_and_repeats_of_one_number_are_one() -> None:
    dump = "Answer: " + ", ".join(str(n) for n in range(20_000)) + ", 12.5%"
    assert numeric_score(dump, "12.5%") == 0.0
    assert numeric_score("Answer: 12.5%, i.e. 12.50%, so 12.5%", "12.5%") == 1.0
    assert [n.value for n in distinct_numbers("1, 1.0, 2, 2, 3", limit=2)] == [1.0, 2.0]
    assert len(distinct_numbers("1, 2, 3, 4")) == 4


def test_partial_credit_can_be_switched_off_and_tolerances_tuned() -> None:
    assert numeric_score("Answer: 13", "12.5", partial_credit=False) == 0.0
    assert numeric_score("Answer: 13", "12.5", rel_tol=0.05) == 1.0
    assert numeric_score("Answer: 13", "12.5", abs_tol=0.5) == 1.0
    assert numeric_score("Answer: 13.5", "12.5", zero_at_rel_error=0.2) == pytest.approx(
        (0.2 - 0.08) / (0.2 - 0.01)
    )


def test_a_reference_without_one_number_is_a_reference_parse_error() -> None:
    with pytest.raises(GraderError) as caught:
        numeric_score("Answer: 3", "n/a")
    assert caught.value.kind == "reference_parse_error"
    result = grade(
        {"type": "numeric"}, {"output_text": "Answer: 3"}, {"reference_answer": "2019: 3.5"}
    )
    assert result.reward is None
    assert "exactly one number, found 2 different numbers" in result.errors["reference_parse_error"]


def test_numeric_grader_defaults_read_output_text_and_reference_answer() -> None:
    result = grade(
        {"type": "numeric", "pass_threshold": 0.99},
        {"output_text": "Answer: 12.7%"},
        {"reference_answer": "12.5%"},
    )
    # 1.6% relative error: (0.1 - 0.016) / 0.09
    assert result.reward == pytest.approx(0.084 / 0.09)
    assert result.passed is False


def test_finqa_demo_grader_config() -> None:
    config = validate_grader_file(REPO_ROOT / "envs" / "finqa" / "grader.json")
    item = {"reference_answer": "-3.2%", "exe_ans": -0.032}
    assert grade(config, {"output_text": "The margin fell.\nAnswer: -3.2%"}, item).reward == 1.0
    assert grade(config, {"output_text": "Answer: -0.032"}, item).reward == 1.0
    assert grade(config, {"output_text": "Answer: -3.2% or -3.0%"}, item).reward == 0.0


# ---- f1 ------------------------------------------------------------------------------------


def f1(output: str, gold: list[str], **extra: object) -> float | None:
    grader = {
        "type": "f1",
        "input": "{{sample.output_text}}",
        "reference": "{{item.gold_pages}}",
        **extra,
    }
    return grade(grader, {"output_text": output}, {"gold_pages": gold}).reward


@pytest.mark.parametrize(
    ("output", "gold", "score"),
    [
        (
            '["reports/ACME/2019/page_3.txt", "reports/ACME/2019/page_4.txt"]',
            ["reports/ACME/2019/page_3.txt", "reports/ACME/2019/page_4.txt"],
            1.0,
        ),
        (
            "reports/ACME/2019/page_3.txt",
            ["reports/ACME/2019/page_3.txt", "reports/ACME/2019/page_4.txt"],
            2 * 1 * 0.5 / 1.5,
        ),
        (
            "a.py, b.py, c.py, d.py",
            ["a.py", "b.py"],
            2 * 0.5 * 1 / 1.5,
        ),  # listing more costs precision
        ("A.py\n b.py \n\n", ["a.py", "B.PY"], 1.0),  # newlines, spaces and case are normalised
        ("'a.py', 'a.py'", ["a.py"], 1.0),  # duplicates count once
        ("x.py", ["a.py"], 0.0),
        ("", ["a.py"], 0.0),
        ("[]", [], 1.0),
    ],
)
def test_f1(output: str, gold: list[str], score: float) -> None:
    assert f1(output, gold) == pytest.approx(score)


def test_f1_case_sensitive_and_from_output_json() -> None:
    assert f1("A.py", ["a.py"], case_sensitive=True) == 0.0
    grader = {"type": "f1", "input": "{{sample.output_json.files}}", "reference": "{{item.files}}"}
    sample = {"output_text": json.dumps({"files": ["src/a.py", "src/b.py", "src/c.py"]})}
    # 2 of 3 chosen are right (P = 2/3), 2 of 2 gold found (R = 1): F1 = 0.8
    assert grade(grader, sample, {"files": ["src/a.py", "src/b.py"]}).reward == pytest.approx(0.8)
