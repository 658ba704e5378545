"""validate_grader: OpenAI's grader objects load unchanged; mistakes name their key path."""

from __future__ import annotations

import json

import pytest

from trainer.errors import ConfigError
from trainer.graders import GRADER_TYPES, GraderConfigError, grade, validate_grader

# The loadable grader objects of OpenAI's graders guide, verbatim.
DOCS_TOOL_CALL_MULTI = """
{
  "type": "multi",
  "graders": {
    "function_name": {
      "name": "function_name",
      "type": "string_check",
      "input": "get_acceptors",
      "reference": "{{sample.output_tools[0].function.name}}",
      "operation": "eq"
    },
    "arguments": {
      "name": "arguments",
      "type": "string_check",
      "input": "{\\"smiles\\": \\"{{item.smiles}}\\"}",
      "reference": "{{sample.output_tools[0].function.arguments}}",
      "operation": "eq"
    }
  },
  "calculate_output": "0.5 * function_name + 0.5 * arguments"
}
"""
DOCS_NAME_EMAIL_MULTI = """
{
  "type": "multi",
  "graders": {
    "name": {
      "name": "name_grader",
      "type": "text_similarity",
      "input": "{{sample.output_json.name}}",
      "reference": "{{item.name}}",
      "evaluation_metric": "fuzzy_match",
      "pass_threshold": 0.9
    },
    "email": {
      "name": "email_grader",
      "type": "string_check",
      "input": "{{sample.output_json.email}}",
      "reference": "{{item.email}}",
      "operation": "eq"
    }
  },
  "calculate_output": "(name + email) / 2"
}
"""
DOCS_PYTHON = """
{
  "type": "python",
  "source": "def grade(sample, item):\\n    return 1.0",
  "image_tag": "2025-05-08"
}
"""
# The RFT guide's multigrader ("similarity_score" and "label_checker" averaged).
DOCS_RFT_MULTI = """
{
  "type": "multi",
  "name": "Example multigrader",
  "graders": {
    "similarity_score": {
      "type": "text_similarity",
      "name": "similarity grader",
      "input": "{{ sample.output_text }}",
      "reference": "{{ item.summary }}",
      "evaluation_metric": "bleu"
    },
    "label_checker": {
      "type": "string_check",
      "name": "label grader",
      "input": "{{ sample.output_text }}",
      "reference": "{{ item.label }}",
      "operation": "eq"
    }
  },
  "calculate_output": "(similarity_score + label_checker) / 2"
}
"""


@pytest.mark.parametrize(
    "text", [DOCS_TOOL_CALL_MULTI, DOCS_NAME_EMAIL_MULTI, DOCS_PYTHON, DOCS_RFT_MULTI]
)
def test_openai_docs_examples_validate(text: str) -> None:
    validate_grader(json.loads(text))


def test_docs_tool_call_grader_scores_as_documented() -> None:
    grader = json.loads(DOCS_TOOL_CALL_MULTI)
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_acceptors", "arguments": '{"smiles": "CCO"}'},
    }
    right = grade(grader, {"output_text": "", "output_tools": [call]}, {"smiles": "CCO"})
    assert right.to_json() == {
        "reward": 1.0,
        "errors": {},
        "sub_rewards": {"function_name": 1.0, "arguments": 1.0},
    }
    wrong_args = {**call, "function": {"name": "get_acceptors", "arguments": '{"smiles": "C"}'}}
    half = grade(grader, {"output_text": "", "output_tools": [wrong_args]}, {"smiles": "CCO"})
    assert half.reward == 0.5 and half.sub_rewards == {"function_name": 1.0, "arguments": 0.0}
    no_call = grade(grader, {"output_text": "I will not call a tool"}, {"smiles": "CCO"})
    assert (
        no_call.reward is None
        and "index 0 is out of range" in no_call.errors["invalid_variable_error"]
    )


def test_docs_name_email_grader_scores_as_documented() -> None:
    """The guide: a wrong email scores in [0, 0.5], a right one in [0.5, 1]."""
    grader = json.loads(DOCS_NAME_EMAIL_MULTI)
    item = {"name": "John Doe", "email": "john.doe@gmail.com"}
    exact = grade(grader, {"output_text": json.dumps(item)}, item)
    assert exact.reward == 1.0
    # "jon doe" vs "john doe": Indel similarity 2 * 7 / 15
    misspelt = grade(
        grader, {"output_text": '{"name": "Jon Doe", "email": "john.doe@gmail.com"}'}, item
    )
    assert misspelt.reward == pytest.approx((14 / 15 + 1) / 2)
    assert misspelt.sub_rewards == {"name": pytest.approx(14 / 15), "email": 1.0}
    wrong_email = grade(
        grader, {"output_text": '{"name": "John Doe", "email": "jd@gmail.com"}'}, item
    )
    assert wrong_email.reward == 0.5


def test_docs_rft_multigrader_scores() -> None:
    grader = json.loads(DOCS_RFT_MULTI)
    assert (
        grade(
            grader, {"output_text": "positive"}, {"summary": "positive", "label": "positive"}
        ).reward
        == 1.0
    )
    # BLEU of "the cat sat on the mat" against "the cat sat on a mat": 1- to 4-gram
    # precisions 5/6, 3/5, 2/4, 1/3, same length, so (1/12) ** (1/4); the label is wrong.
    item = {"summary": "the cat sat on a mat", "label": "positive"}
    result = grade(grader, {"output_text": "the cat sat on the mat"}, item)
    assert result.reward == pytest.approx((1 / 12) ** 0.25 / 2)
    assert result.sub_rewards == {
        "similarity_score": pytest.approx((1 / 12) ** 0.25),
        "label_checker": 0.0,
    }


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (
            {
                "type": "multi",
                "graders": {
                    "accuracy": {
                        "type": "string_check",
                        "operation": "equals",
                        "input": "a",
                        "reference": "b",
                    }
                },
                "calculate_output": "accuracy",
            },
            "grader.graders.accuracy.operation: expected one of eq, ne, like, ilike, got 'equals'",
        ),
        (
            {"type": "regex"},
            "grader.type: expected one of " + ", ".join(GRADER_TYPES) + ", got 'regex'",
        ),
        ({"operation": "eq"}, "grader.type: expected one of string_check, text_similarity"),
        (
            {"type": "string_check", "operation": "eq", "input": "a"},
            "grader.reference: required field missing",
        ),
        (
            {
                "type": "text_similarity",
                "input": "a",
                "reference": "b",
                "evaluation_metric": "fuzzy_match",
                "pass_treshold": 0.5,
            },
            "grader.pass_treshold: unknown field",
        ),
        (
            {
                "type": "text_similarity",
                "input": "a",
                "reference": "b",
                "evaluation_metric": "rouge_9",
            },
            "grader.evaluation_metric: expected one of fuzzy_match, bleu, gleu, meteor, cosine, rouge_1",
        ),
        (
            {"type": "string_check", "operation": "eq", "input": "{{ row.x }}", "reference": "b"},
            "grader.input: template variable {{ row.x }}: the namespace must be one of item, sample",
        ),
        (
            {"type": "python", "source": "def grade(sample):\n    return 1"},
            "grader.source: grade must take two arguments (sample, item)",
        ),
        (
            {"type": "python", "source": "def score(sample, item):\n    return 1"},
            "grader.source: no top-level function grade(sample, item) is defined",
        ),
        (
            {"type": "python", "source": "def grade(sample, item)\n    return 1"},
            "grader.source: syntax error at line 1",
        ),
        (
            {"type": "python", "source": "#" * (256 * 1024 + 1)},
            "grader.source: the source is over 256 kB",
        ),
        (
            {
                "type": "score_model",
                "model": "m",
                "input": [{"role": "user", "content": "x"}],
                "range": [1, 0],
            },
            "grader.range: the low end must be below the high end",
        ),
        (
            {"type": "score_model", "model": "m", "input": [{"role": "judge", "content": "x"}]},
            "grader.input[0].role: expected one of system, developer, user, assistant, got 'judge'",
        ),
        (
            {
                "type": "score_model",
                "model": "m",
                "input": [{"role": "user", "content": "{{ answer }}"}],
            },
            "grader.input[0].content: template variable {{ answer }}",
        ),
        (
            {
                "type": "label_model",
                "model": "m",
                "input": [{"role": "user", "content": "x"}],
                "labels": ["a", "b"],
                "passing_labels": ["c"],
            },
            "grader.passing_labels: ['c'] are not among labels ['a', 'b']",
        ),
        (
            {"type": "multi", "graders": {"a": {"type": "numeric"}}, "calculate_output": "a + b"},
            "grader.calculate_output: unknown name(s) b; the formula may use the graders a",
        ),
        (
            {"type": "multi", "graders": {"a": {"type": "numeric"}}, "calculate_output": "a.real"},
            "grader.calculate_output 'a.real': attribute access (a.b) is not allowed",
        ),
        (
            {
                "type": "multi",
                "graders": {
                    "inner": {
                        "type": "multi",
                        "graders": {"a": {"type": "numeric"}},
                        "calculate_output": "a",
                    }
                },
                "calculate_output": "inner",
            },
            "grader.graders.inner: a multi grader cannot contain another multi grader",
        ),
        (
            {"type": "numeric", "rel_tol": 0.2, "zero_at_rel_error": 0.1},
            "grader.zero_at_rel_error: must be above rel_tol",
        ),
        (
            {"type": "numeric", "rel_tol": -1},
            "grader.rel_tol: Input should be greater than or equal to 0",
        ),
        ({"type": "endpoint"}, "grader.url: required field missing"),
        ("not an object", "grader: a grader must be a JSON object, got str"),
    ],
)
def test_invalid_graders_name_the_key_path(config: object, message: str) -> None:
    with pytest.raises(GraderConfigError) as caught:
        validate_grader(config)  # type: ignore[arg-type]
    assert message in str(caught.value)
    assert isinstance(caught.value, ConfigError)


def test_where_prefixes_the_key_path() -> None:
    with pytest.raises(GraderConfigError, match=r"^job\.grader\.operation: expected one of"):
        validate_grader(
            {"type": "string_check", "operation": "contains", "input": "a", "reference": "b"},
            where="job.grader",
        )


def test_grade_raises_on_an_invalid_grader() -> None:
    with pytest.raises(GraderConfigError, match="grader.operation"):
        grade(
            {"type": "string_check", "operation": "is", "input": "a", "reference": "b"},
            {"output_text": "a"},
            {},
        )


def test_every_type_has_a_minimal_valid_config() -> None:
    minimal = {
        "string_check": {"operation": "eq", "input": "a", "reference": "b"},
        "text_similarity": {"input": "a", "reference": "b", "evaluation_metric": "bleu"},
        "score_model": {
            "model": "m",
            "input": [{"role": "user", "content": "x", "type": "message"}],
        },
        "label_model": {
            "model": "m",
            "input": [{"role": "user", "content": "x"}],
            "labels": ["a"],
            "passing_labels": ["a"],
        },
        "python": {"source": "def grade(sample, item, *rest):\n    return 1.0"},
        "multi": {"graders": {"a": {"type": "numeric"}}, "calculate_output": "a"},
        "endpoint": {
            "url": "http://127.0.0.1:9/grade",
            "headers": {"Authorization": "Bearer ${TOKEN}"},
        },
        "numeric": {},
        "f1": {"input": "{{sample.output_text}}", "reference": "{{item.gold_pages}}"},
    }
    assert set(minimal) == set(GRADER_TYPES)
    for grader_type, fields in minimal.items():
        validate_grader({"type": grader_type, **fields})
