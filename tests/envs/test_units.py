"""The units environment: its table, its data and its tool server over real HTTP."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from envs.tool_server import ToolError, serve_in_thread
from envs.units.generate import generate_dataset
from envs.units.server import create_app
from envs.units.tools import UnitTools, calculate, convert, unit_of
from trainer.graders import grade


@pytest.mark.parametrize(("value", "source", "target", "expected"), [
    (1, "mile", "km", 1.609344), (3.7, "miles", "kilometers", 5.9545728), (212, "°F", "celsius", 100.0),
    (0, "celsius", "kelvin", 273.15), (100, "kelvin", "fahrenheit", -279.67), (1, "gallon", "ml", 3785.411784),
    (2, "lbs", "kg", 0.90718474), (12, "inches", "ft", 1.0), (1, "Nautical Miles", "m", 1852.0),
])
def test_conversions_are_exact(value, source, target, expected):
    assert convert(value, source, target) == pytest.approx(expected, rel=1e-12, abs=1e-9)


def test_a_unit_it_lacks_or_of_another_kind_is_the_models_mistake_and_says_what_to_use():
    with pytest.raises(ToolError) as unknown:
        unit_of("furlong")
    assert unknown.value.status_code == 400 and "length: meter" in unknown.value.message
    with pytest.raises(ToolError, match="cannot convert mass .* to length"):
        convert(2, "kg", "meter")
    with pytest.raises(ToolError, match="cannot read 'the price of tea'"):
        UnitTools().run("calculate", {"query": "the price of tea"})
    with pytest.raises(ToolError) as other:
        UnitTools().run("convert", {"query": "3 mi in km"})
    assert other.value.status_code == 404


@pytest.mark.parametrize(("query", "answer"), [
    ("3.7 miles in km", "5.95457 kilometers"), ("How many kilometers is 3.7 miles?", "5.95457 kilometers"),
    ("Convert 250 degrees Fahrenheit to Celsius.", "121.111 celsius"), ("575 kelvin to °F", "575.33 fahrenheit"),
    ("77 fluid ounces is how many milliliters?", "2277.16 milliliters"), ("What is 1413 times 844?", "1192572"),
    ("What is 9537 divided by 166?", "57.4518072289"), ("347*29", "10063"), ("What is 123,456 plus 7,890?", "131346"),
])
def test_calculate_reads_a_question_as_people_type_it(query, answer):
    assert calculate(query) == answer


def test_the_splits_are_disjoint_by_question_and_by_operation(tmp_path: Path):
    counts = generate_dataset(tmp_path, n_train=200, n_validation=50, n_test=50, n_traffic=100)
    assert counts == {"train": 200, "validation": 50, "test": 50, "production_traffic": 100}
    rows = {split: [json.loads(line) for line in (tmp_path / f"{split}.jsonl").read_text().splitlines()]
            for split in ("train", "validation", "test", "production_traffic")}
    operations = {split: {r["operation"] for r in rows[split]} for split in ("train", "validation", "test")}
    assert not operations["train"] & operations["test"] and not operations["validation"] & operations["test"]
    questions = [r["question"] for split in rows.values() for r in split]
    assert len(questions) == len(set(questions))
    for row in rows["test"]:  # the tool answers every question, and its answer is the reference, to the grader
        sample = {"output_text": calculate(row["question"]).split(" ")[0]}
        assert grade({"type": "numeric", "name": "a", "input": "{{sample.output_text}}",
                      "reference": "{{item.reference_answer}}"}, sample, row).reward == pytest.approx(1.0), row
        assert row["messages"][-1] == {"role": "user", "content": row["question"]}
    assert generate_dataset(tmp_path / "again", n_train=200, n_validation=50, n_test=50, n_traffic=100) == counts
    assert (tmp_path / "again" / "test.jsonl").read_bytes() == (tmp_path / "test.jsonl").read_bytes()


def test_the_tool_server_answers_in_the_agent_rft_wire_format():
    with serve_in_thread(create_app()) as url:
        body = {"type": "function_call", "call_id": "call_1", "name": "calculate", "trace_id": "trace_1",
                "arguments": json.dumps({"query": "3.7 mi in km"}), "item": {}}
        answer = httpx.post(f"{url}/tools/calculate", json=body)
        assert answer.status_code == 200 and answer.json() == {
            "type": "function_call_output", "call_id": "call_1", "id": "", "output": "5.95457 kilometers"}
        wrong = httpx.post(f"{url}/tools/calculate", json={**body, "arguments": json.dumps({"query": "3.7 furlongs in km"})})
        assert wrong.status_code == 400 and wrong.json()["output"].startswith("Error: unknown unit 'furlongs'")
        bad = httpx.post(f"{url}/tools/calculate", json={**body, "arguments": json.dumps({"query": 3.7})})
        assert bad.status_code == 422 and "arguments" in bad.json()["detail"]
        trace = httpx.get(f"{url}/traces/trace_1").json()
        assert [call["status_code"] for call in trace["calls"]] == [200, 400, 422]
        graded = httpx.post(f"{url}/grade", json={"sample": {"output_text": "5.95"}, "item": {"reference_answer": "5.95457"}})
        assert graded.json()["score"] == pytest.approx(1.0)
        assert httpx.get(f"{url}/health").json()["tools"] == ["calculate"]
