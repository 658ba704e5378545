"""The multi grader and its calculate_output formula language."""

from __future__ import annotations

import math

import pytest

from trainer.graders import GraderError, grade
from trainer.graders.expression import parse_formula

VALUES = {"a": 0.5, "b": 0.25, "c": 2.0}


@pytest.mark.parametrize(
    ("formula", "value"),
    [
        ("a + b", 0.75),
        ("a - b * c", 0.0),  # * before -
        ("(a - b) * c", 0.5),
        ("a / b", 2.0),
        ("c ^ 3", 8.0),
        ("2 ^ 3 ^ 2", 512.0),  # right-associative
        ("-2 ^ 2", -4.0),  # power binds tighter than unary minus
        ("-a + +b", -0.25),
        ("min(a, b, c)", 0.25),
        ("max(a, b) + min(c)", 2.5),
        ("abs(b - a)", 0.25),
        ("floor(c * 1.7) + ceil(a)", 4.0),
        ("exp(0) + sqrt(16) + log(1)", 5.0),
        ("log(exp(2))", 2.0),
        ("0.5 * a + 0.5 * b", 0.375),
        ("1e-1 * c", 0.2),
    ],
)
def test_formula_values(formula: str, value: float) -> None:
    assert parse_formula(formula).evaluate(VALUES) == pytest.approx(value)


@pytest.mark.parametrize(
    ("formula", "reason"),
    [
        ("a.b", "attribute access (a.b) is not allowed"),
        ("a[0]", "subscripts (a[b]) are not allowed"),
        ("__import__('os')", "__import__() is not a known function"),
        ("pow(a, 2)", "pow() is not a known function"),
        ("a.__class__()", "only the functions min, max"),
        ("a ** 2", "write powers with ^, not **"),
        ("a if b else c", "IfExp is not allowed"),
        ("a > b", "Compare is not allowed"),
        ("lambda: 1", "Lambda is not allowed"),
        ("'text'", "only numbers are allowed as constants"),
        ("abs(a, b)", "abs() takes exactly one argument, got 2"),
        ("max()", "max() needs at least one argument"),
        ("min(a, key=b)", "keyword arguments are not allowed"),
        ("a +", "syntax error"),
        ("", "the formula is empty"),
        ("a" + " + a" * 1000, "longer than 2000 characters"),
    ],
)
def test_formula_rejections_are_formula_parse_errors(formula: str, reason: str) -> None:
    with pytest.raises(GraderError) as caught:
        parse_formula(formula)
    assert caught.value.kind == "formula_parse_error"
    assert reason in str(caught.value)


def test_formula_names_are_the_graders_it_reads() -> None:
    assert parse_formula("max(a, b) * 0.5 + log(c)").names == {"a", "b", "c"}


@pytest.mark.parametrize(
    ("formula", "reason"),
    [
        ("a / (b - b)", "division by zero"),
        ("log(b - b)", "math domain error"),
        ("(0 - a) ^ 0.5", "negative number to a fractional power"),
        ("exp(1000)", "range"),
    ],
)
def test_math_errors_at_evaluation(formula: str, reason: str) -> None:
    with pytest.raises(GraderError) as caught:
        parse_formula(formula).evaluate(VALUES)
    assert caught.value.kind == "formula_parse_error"
    assert reason in str(caught.value)


def test_huge_powers_overflow_instead_of_hanging() -> None:
    with pytest.raises(GraderError):
        parse_formula("10 ^ 10 ^ 10").evaluate({})


# ---- the multi grader ----------------------------------------------------------------------

CHECKS = {
    "exact": {
        "type": "string_check",
        "operation": "eq",
        "input": "{{sample.output_text}}",
        "reference": "{{item.reference_answer}}",
    },
    "loose": {
        "type": "string_check",
        "operation": "ilike",
        "input": "{{sample.output_text}}",
        "reference": "{{item.reference_answer}}",
    },
    "number": {"type": "numeric"},
}


def test_multi_combines_sub_rewards() -> None:
    grader = {
        "type": "multi",
        "graders": CHECKS,
        "calculate_output": "0.2 * exact + 0.3 * loose + 0.5 * number",
        "pass_threshold": 0.5,
    }
    result = grade(grader, {"output_text": "Answer: 42 USD"}, {"reference_answer": "answer: 42"})
    # exact 0, loose 1 ("answer: 42" inside, ignoring case), number 1
    assert result.to_json() == {
        "reward": 0.8,
        "errors": {},
        "sub_rewards": {"exact": 0.0, "loose": 1.0, "number": 1.0},
    }
    assert result.passed is True


def test_multi_with_a_failing_sub_grader_has_no_reward() -> None:
    grader = {
        "type": "multi",
        "graders": {
            **CHECKS,
            "json": {
                "type": "string_check",
                "operation": "eq",
                "input": "{{sample.output_json.answer}}",
                "reference": "42",
            },
        },
        "calculate_output": "exact + loose + number + json",
    }
    result = grade(grader, {"output_text": "Answer: 42"}, {"reference_answer": "Answer: 42"})
    assert result.reward is None
    assert list(result.errors) == ["sample_parse_error"]
    assert result.errors["sample_parse_error"].startswith(
        "json: the grader reads sample.output_json"
    )
    assert result.sub_rewards == {"exact": 1.0, "loose": 1.0, "number": 1.0}


def test_multi_merges_errors_of_the_same_kind() -> None:
    grader = {
        "type": "multi",
        "graders": {
            "x": {
                "type": "string_check",
                "operation": "eq",
                "input": "{{item.x}}",
                "reference": "1",
            },
            "y": {
                "type": "string_check",
                "operation": "eq",
                "input": "{{item.y}}",
                "reference": "1",
            },
        },
        "calculate_output": "x + y",
    }
    result = grade(grader, {"output_text": ""}, {})
    message = result.errors["invalid_variable_error"]
    assert (
        message.startswith("x: template variable {{ item.x }}")
        and "; y: template variable {{ item.y }}" in message
    )


def test_multi_formula_error_at_evaluation() -> None:
    grader = {"type": "multi", "graders": CHECKS, "calculate_output": "number / exact"}
    result = grade(grader, {"output_text": "Answer: 42"}, {"reference_answer": "42"})
    assert result.reward is None
    assert result.errors == {
        "formula_parse_error": "calculate_output 'number / exact': float division by zero"
    }
    assert result.sub_rewards == {"exact": 0.0, "loose": 1.0, "number": 1.0}
    assert math.isclose(result.sub_rewards["number"], 1.0)
