"""Templates: {{ item.* }} and {{ sample.* }} variables, and their error kinds."""

from __future__ import annotations

import pytest

from trainer.graders import GraderError, grade, render_template

ITEM = {"id": "q1", "reference_answer": "12.5%", "meta": {"year": 2019, "pages": ["p3", "p4"]}}
SAMPLE = {
    "output_text": '{"answer": {"value": 12.5, "unit": "%"}}',
    "output_json": None,
    "output_tools": [
        {
            "id": "call_1",
            "type": "function",
            "function": {"name": "read_page", "arguments": '{"page": 3}'},
        }
    ],
}


@pytest.mark.parametrize(
    ("template", "rendered"),
    [
        ("{{item.reference_answer}}", "12.5%"),
        ("{{ item.reference_answer }}", "12.5%"),
        ("{{   item.meta.year\t}}", "2019"),  # numbers render as JSON
        ("{{item.meta.pages}}", '["p3", "p4"]'),  # lists too, so f1 can read them back
        ("{{item.meta.pages[1]}}", "p4"),
        ("{{item.meta.pages.0}}", "p3"),
        ("{{sample.output_json.answer.value}}{{ sample.output_json.answer.unit }}", "12.5%"),
        ("{{sample.output_tools[0].function.arguments}}", '{"page": 3}'),
        ("{{ sample.output_tools[0].function.name }}!", "read_page!"),
        ("no variables", "no variables"),
        ("Q {{item.id}}: {{item.reference_answer}}", "Q q1: 12.5%"),
    ],
)
def test_render_template(template: str, rendered: str) -> None:
    assert render_template(template, SAMPLE, ITEM) == rendered


@pytest.mark.parametrize(
    ("template", "message"),
    [
        (
            "{{item.answer}}",
            "{{ item.answer }}: no key 'answer' (available: id, meta, reference_answer)",
        ),
        ("{{item.meta.pages[5]}}", "index 5 is out of range for a list of 2"),
        ("{{sample.output_tools[1].function.name}}", "index 1 is out of range for a list of 1"),
        ("{{sample.choices}}", "no key 'choices'"),
        ("{{ row.answer }}", "the namespace must be one of item, sample, got 'row'"),
        ("{{item.id.x}}", "cannot look up 'x' in a str value"),
    ],
)
def test_unknown_variables_are_invalid_variable_errors(template: str, message: str) -> None:
    with pytest.raises(GraderError) as caught:
        render_template(template, SAMPLE, ITEM)
    assert caught.value.kind == "invalid_variable_error"
    assert message in str(caught.value)


def test_output_json_of_non_json_text_is_a_sample_parse_error() -> None:
    with pytest.raises(GraderError) as caught:
        render_template(
            "{{sample.output_json.answer}}", {"output_text": "The answer is 12.5%"}, ITEM
        )
    assert caught.value.kind == "sample_parse_error"
    assert "not valid JSON" in str(caught.value)


def test_template_errors_become_grader_errors_with_no_reward() -> None:
    grader = {
        "type": "string_check",
        "operation": "eq",
        "input": "{{sample.output_json.answer}}",
        "reference": "{{item.reference_answer}}",
    }
    not_json = grade(grader, {"output_text": "12.5%"}, ITEM)
    assert not_json.reward is None and list(not_json.errors) == ["sample_parse_error"]
    missing = grade(
        {**grader, "reference": "{{item.gold}}"}, {"output_text": '{"answer": "12.5%"}'}, ITEM
    )
    assert missing.reward is None and list(missing.errors) == ["invalid_variable_error"]
    assert grade(grader, {"output_text": '{"answer": "12.5%"}'}, ITEM).reward == 1.0
