"""The numeric grader (ours): is the final answer the reference number, within tolerance?

FinQA-style answers are one number written many ways: `$1,234.5`, `(12.5)` for -12.5,
`12.5%`, `1.2 billion`. The grader reads the number from the answer's *final answer*
and compares it with the reference's number:

- full credit when the error is within `abs_tol` or the relative error within `rel_tol`;
- with `partial_credit`, a linear falloff from 1.0 at `rel_tol` to 0.0 at
  `zero_at_rel_error` (0.05 relative error with the defaults scores (0.1-0.05)/0.09);
- otherwise 0.

Reward hacking is the main design force: a policy that lists several numbers, a range,
or every number on the page must not be paid for the one that happens to be right. So:

1. The final answer is what follows the last `\\boxed{...}`, else the rest of the line
   after the last "answer:" / "answer is" / "final answer:", else the rest of the line
   after the last "=", else the whole text.
2. It must state exactly one distinct number (after normalisation: `$1,000` and `1000`
   are one number, `12.5` and `12.5%` are two). None or several score 0, with no error:
   it is the model's answer that is wrong, not the grader.

Normalisation: `$ € £ ¥` are ignored, thousands separators are dropped (`1,234`), a
number in parentheses is negative (accounting), `%` / `percent` marks a percentage,
`thousand million billion trillion bn` multiply. A number glued to letters (`Q4`,
`FY2019`) is not a number. A decimal comma (`12,5`) reads as two numbers.

Units: when exactly one side carries a multiplier word and the other is a plain number
(not a percentage), the plain side's unit is unknown (FinQA tables say "in millions"
once, in a header), so the multiplied side is also tried in thousands, millions,
billions and trillions (`1.2 billion` matches `1200` and `1.2`). Percentages: when one side is a percentage and the other is not, both the
percentage's number and its fraction are tried (`12.5%` matches `12.5` and `0.125`).
Each extra reading can only match a reference off by an exact power of 1000 or 100,
which gives a hacking policy nothing.

A reference without exactly one number is a data problem, reported as the error kind
`reference_parse_error` (reward None, never a 0 the policy would learn from).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace
from typing import Any

from trainer.graders.config import NumericGrader
from trainer.graders.result import GraderError
from trainer.graders.templates import render_template

_MULTIPLIERS = {"thousand": 1e3, "million": 1e6, "billion": 1e9, "bn": 1e9, "trillion": 1e12}
_UNITS = (1.0, 1e3, 1e6, 1e9, 1e12)
_NUMBER = re.compile(
    r"""
    (?<![\w.])                                  # not glued to a word or another number
    (?P<open>\(\s*)?                            # (12.5): an accounting negative
    (?P<sign>[-−–+±])?\s*
    [$€£¥]?\s*
    (?P<sign2>[-−])?
    (?P<digits>\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?|\.\d+)
    (?:[eE](?P<exponent>[-+]?\d+)(?![\w.]))?
    (?P<percent>\s*(?:%|percent\b|per\s+cent\b))?
    (?:\s*(?P<multiplier>thousand|million|billion|trillion|bn)s?\b)?
    (?P<close>\s*\))?
    """,
    re.VERBOSE | re.IGNORECASE,
)
_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")
_ANSWER_MARKER = re.compile(r"\b(?:final\s+answer|answer)\s*(?:is\b\s*:?|:|=)", re.IGNORECASE)
# Comparisons of nearly equal floats (0.1 + 0.2 vs 0.3) must not cost credit.
_EPSILON = 1e-9


@dataclass(frozen=True)
class ParsedNumber:
    """A number as written: its signed value, whether it is a percentage, and its
    multiplier word's factor (1.0 when none)."""

    value: float
    percent: bool
    multiplier: float

    @property
    def scaled(self) -> float:
        return self.value * self.multiplier


def numeric_score_grader(
    grader: NumericGrader, sample: dict[str, Any], item: dict[str, Any]
) -> float:
    return numeric_score(
        render_template(grader.input, sample, item),
        render_template(grader.reference, sample, item),
        rel_tol=grader.rel_tol,
        abs_tol=grader.abs_tol,
        partial_credit=grader.partial_credit,
        zero_at_rel_error=grader.zero_at_rel_error,
    )


def numeric_score(
    answer: str,
    reference: str,
    *,
    rel_tol: float = 0.01,
    abs_tol: float = 0.0,
    partial_credit: bool = True,
    zero_at_rel_error: float = 0.1,
) -> float:
    """Credit in [0, 1] for `answer`'s final number against `reference`'s number."""
    references = distinct_numbers(reference)
    if len(references) != 1:
        found = "no number" if not references else f"{len(references)} different numbers"
        raise GraderError(
            "reference_parse_error",
            f"the reference must state exactly one number, found {found} in {reference[:120]!r}",
        )
    answers = distinct_numbers(final_answer(answer), limit=2)
    if len(answers) != 1:
        return 0.0
    ref, ans = references[0], answers[0]
    ref_values = _readings(ref, other=ans)
    ans_values = _readings(ans, other=ref)
    return max(
        _credit(a, r, rel_tol, abs_tol, partial_credit, zero_at_rel_error)
        for a in ans_values
        for r in ref_values
    )


def parse_number(text: str) -> float | None:
    """The one number `text` states (`"$1,234.5"` -> 1234.5, `"(12.5)"` -> -12.5,
    `"12.5%"` -> 12.5, `"1.2 million"` -> 1200000.0), or None when it states none or
    several different ones."""
    numbers = distinct_numbers(text, limit=2)
    return numbers[0].scaled if len(numbers) == 1 else None


def final_answer(text: str) -> str:
    """The part of a model's output that holds its final answer (see module doc)."""
    boxed = _BOXED.findall(text)
    if boxed:
        return boxed[-1]
    markers = list(_ANSWER_MARKER.finditer(text))
    if markers:
        return _rest_of_line(text, markers[-1].end())
    equals = text.rfind("=")
    if equals >= 0:
        return _rest_of_line(text, equals + 1)
    return text


def distinct_numbers(text: str, *, limit: int | None = None) -> list[ParsedNumber]:
    """The numbers in `text`, one per distinct (value, percent) pair, in order; only the
    first `limit` when given (whether an answer states one number needs two at most, and a
    probe that lists thousands of numbers would otherwise cost a quadratic scan)."""
    found: list[ParsedNumber] = []
    for match in _NUMBER.finditer(text):
        if limit is not None and len(found) >= limit:
            break
        first = _parse_match(match)
        # "±5" states two numbers, 5 and -5: an answer hedged that way is not one answer.
        both = [first, replace(first, value=-first.value)] if match["sign"] == "±" and first.value else [first]
        for number in both:
            duplicate = any(
                other.percent == number.percent
                and math.isclose(other.scaled, number.scaled, rel_tol=_EPSILON, abs_tol=_EPSILON)
                for other in found
            )
            if not duplicate:
                found.append(number)
    return found


def _parse_match(match: re.Match[str]) -> ParsedNumber:
    value = float(match["digits"].replace(",", ""))
    if match["exponent"]:
        value *= 10.0 ** int(match["exponent"])
    # "--5" is a double negative; "±5" is handled by `distinct_numbers` (two numbers).
    negative = (match["sign"] in ("-", "−", "–")) != bool(match["sign2"])
    if match["open"] and match["close"]:
        negative = True
    multiplier = _MULTIPLIERS[match["multiplier"].lower()] if match["multiplier"] else 1.0
    return ParsedNumber(
        value=-value if negative else value, percent=bool(match["percent"]), multiplier=multiplier
    )


def _readings(number: ParsedNumber, *, other: ParsedNumber) -> set[float]:
    """The values `number` may mean, given how the number it is compared with is written."""
    values = {number.scaled}
    if number.multiplier != 1.0 and other.multiplier == 1.0 and not other.percent:
        values |= {number.scaled / unit for unit in _UNITS if unit <= number.multiplier}
    if number.percent and not other.percent:
        values |= {value / 100.0 for value in values}
    return values


def _credit(
    answer: float, reference: float, rel_tol: float, abs_tol: float, partial: bool, zero_at: float
) -> float:
    error = abs(answer - reference)
    if error <= abs_tol + _EPSILON * max(1.0, abs(reference)):
        return 1.0
    if reference == 0:
        return 0.0
    relative = error / abs(reference)
    if relative <= rel_tol + _EPSILON:
        return 1.0
    if not partial:
        return 0.0
    return max(0.0, (zero_at - relative) / (zero_at - rel_tol))


def _rest_of_line(text: str, start: int) -> str:
    rest = text[start:].lstrip()
    return rest.split("\n", 1)[0]
