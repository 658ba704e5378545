"""The BFCL v4 environment (envs/bfcl/): its rows, its tool server, its grader, and parity.

The parity test holds the project's grade to BFCL's own verdict. The same recorded outputs,
right ones (a possible answer's first accepted values) and wrong ones made from them (another
function, another value, a required argument left out, an extra call, text instead of a call,
arguments that are not JSON, a call where none should be), are graded twice, for every
category the environment uses:
- by the project: `sample.output_tools` with the tool names the model is offered, through the
  endpoint grader (trainer/graders) to the real grader server on loopback;
- by bfcl_eval alone: the outputs with BFCL's own names written as its result files and scored
  by its evaluation runner (envs/bfcl/bfcl_evaluate.py, in BFCL's environment).
"""

from __future__ import annotations

import asyncio
import copy
import json
import os
import subprocess
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from jsonschema.exceptions import best_match

from envs.bfcl.calls import answer_calls, output_tools, tool_name, tool_names
from envs.bfcl.environment import (
    BFCL_VENV,
    DATA_DIR,
    bfcl_env,
    bfcl_python,
    ensure_data,
    grader_server,
)
from envs.bfcl.export import CATEGORIES, EVAL_CATEGORIES, SPLIT_CATEGORIES
from trainer.config.tools import ToolEndpoint, tool_validators
from trainer.graders import grade

pytestmark = [
    pytest.mark.integration,
    # CI builds BFCL's environment in `make test`; a checkout without it skips, saying how to build it.
    pytest.mark.skipif(not (BFCL_VENV / "bin" / "python").exists() and not os.environ.get("CI"),
                       reason="no BFCL environment: build .venv-bfcl with `make bfcl` (scripts/bfcl_env.sh)"),
]
ITEMS_PER_KIND = 2
KINDS = ("right", "wrong_function", "wrong_value", "missing_required", "extra_call", "text", "invalid_json",
         "right_then_turn_two", "no_call", "call", "unparsable_call", "call_in_turn_two")
SCHEMA_SAMPLE = 7  # every 7th row's schemas compiled (jsonschema's schema check is ~5 ms a tool)


@pytest.fixture(scope="session")
def bfcl_rows() -> dict[str, list[dict[str, Any]]]:
    ensure_data(log=lambda line: None)
    rows = {name: [json.loads(line) for line in (DATA_DIR / f"{name}.jsonl").open()]
            for name in ("all", "train", "validation", "test", "demonstrations")}
    return rows


@pytest.fixture(scope="session")
def bfcl_grader() -> str:
    with grader_server(log=lambda line: None) as base_url:
        yield f"{base_url}/grade"


def _source_functions() -> dict[str, list[dict[str, Any]]]:
    """BFCL's function docs as the package ships them, by entry id."""
    data = Path(subprocess.run([str(bfcl_python()), "-c", "import bfcl_eval, os; print(os.path.dirname("
                                "bfcl_eval.__file__))"], env=bfcl_env(), capture_output=True, text=True,
                               check=True).stdout.strip()) / "data"
    return {entry["id"]: entry["function"] for category in CATEGORIES
            for entry in map(json.loads, (data / f"BFCL_v4_{category}.json").open())}


# --- the rows -------------------------------------------------------------------------------

def test_rows_cover_every_category_and_keep_evaluation_categories_out_of_training(bfcl_rows):
    counts = Counter(row["category"] for row in bfcl_rows["all"])
    assert set(counts) == set(CATEGORIES)
    assert counts["simple_python"] == 400 and counts["irrelevance"] == 240 and sum(counts.values()) == 3491
    train = Counter(row["category"] for row in bfcl_rows["train"])
    assert set(train) == set(SPLIT_CATEGORIES) and train["simple_python"] == 280
    ids = {name: {row["id"] for row in bfcl_rows[name]} for name in ("train", "validation", "test")}
    assert not ids["train"] & ids["validation"] and not ids["train"] & ids["test"]
    assert not ids["validation"] & ids["test"]
    assert ids["train"] | ids["validation"] | ids["test"] == {row["id"] for row in bfcl_rows["all"]}
    assert not {row["category"] for row in bfcl_rows["train"]} & set(EVAL_CATEGORIES)
    # round-robin: the first items of a file cover every category in it
    assert {row["category"] for row in bfcl_rows["validation"][:len(CATEGORIES)]} == set(CATEGORIES)


def test_tools_are_json_schema_with_bfcl_types_mapped_and_names_reversible(bfcl_rows):
    functions = _source_functions()
    mapped: Counter = Counter()
    for index, row in enumerate(bfcl_rows["all"]):
        if index % SCHEMA_SAMPLE == 0:  # a valid JSON schema, as the tool client compiles it
            tool_validators(row["tools"], where=row["id"])
        assert [tool_name(f["name"]) for f in functions[row["id"]]] == [t["function"]["name"] for t in row["tools"]]
        assert row["tool_names"] == tool_names(functions[row["id"]])
        for source, tool in zip(functions[row["id"]], row["tools"], strict=True):
            name = tool["function"]["name"]
            assert row["tool_names"][name] == source["name"] and "." not in name
            assert tool["function"]["parameters"]["type"] == "object"
            for param, spec in source["parameters"]["properties"].items():
                converted = tool["function"]["parameters"]["properties"][param]["type"]
                mapped[spec["type"], converted] += 1
    assert mapped["dict", "object"] and mapped["float", "number"] and mapped["tuple", "array"]
    assert mapped["any", "string"]
    assert {converted for (_, converted) in mapped} <= {"string", "integer", "number", "boolean", "array", "object"}
    assert not [kind for kind in mapped if kind[0] in ("dict", "float", "tuple", "any") and
                kind[1] != {"dict": "object", "float": "number", "tuple": "array", "any": "string"}[kind[0]]]
    dotted = next(row for row in bfcl_rows["all"] if row["id"] == "simple_python_1")
    assert dotted["tool_names"] == {"math_factorial": "math.factorial"}


def test_tool_names_refuse_an_item_whose_names_would_collide():
    with pytest.raises(ValueError, match="would both be offered as 'a_b'"):
        tool_names([{"name": "a.b"}, {"name": "a_b"}], where="x")
    with pytest.raises(ValueError, match="no valid tool name"):
        tool_names([{"name": "a b"}])
    assert tool_names([{"name": "math.factorial"}, {"name": "x"}]) == {"math_factorial": "math.factorial", "x": "x"}


def test_right_answers_pass_the_tool_schemas_but_for_the_data_own_quirks(bfcl_rows):
    refused, answers = [], 0
    for row in bfcl_rows["all"][::SCHEMA_SAMPLE]:
        answers += "ground_truth" in row
        validators = tool_validators(row["tools"], where=row["id"])
        for name, arguments in answer_calls(row.get("ground_truth", [])):
            if best_match(validators[tool_name(name)].iter_errors(arguments)) is not None:
                refused.append(row["id"])
    # a few possible answers break their own schema (an enum, a "required" argument marked optional);
    # the loop still grades such a call by BFCL's checker (it counts as malformed too)
    assert answers > 200 and len(refused) < 0.03 * answers


def test_demonstrations_are_supervised_rows_of_the_train_split(bfcl_rows):
    train = {row["id"]: row for row in bfcl_rows["train"]}
    assert 0.99 * len(train) <= len(bfcl_rows["demonstrations"]) <= len(train)
    demo = bfcl_rows["demonstrations"][0]
    row = train[demo["id"]]
    assert demo["messages"][:-1] == row["messages"] and demo["tools"] == row["tools"]
    calls = demo["messages"][-1]["tool_calls"]
    assert [(row["tool_names"][c["function"]["name"]], json.loads(c["function"]["arguments"])) for c in calls] \
        == answer_calls(row["ground_truth"])


# --- the tool server ------------------------------------------------------------------------

def test_tool_server_answers_each_row_own_functions_through_the_client(bfcl_rows):
    from envs.bfcl.server import create_app
    from envs.tool_server import serve_in_thread
    from trainer.rollout.tool_client import ToolClient

    row = next(r for r in bfcl_rows["all"] if r["id"] == "simple_python_1")
    other = next(r for r in bfcl_rows["all"] if r["id"] == "simple_python_0")

    async def calls(base_url: str) -> list:
        async with ToolClient([ToolEndpoint(name="*", server_url=f"{base_url}/call")], None) as client:
            return [await client.call("math_factorial", '{"number": 5}', item=row, trace_id="trace_a"),
                    await client.call("math_factorial", '{"number": "five"}', item=row, trace_id="trace_a"),
                    await client.call("math_factorial", '{"number": 5}', item=other, trace_id="trace_b"),
                    await client.call("calculate_triangle_area", '{"base": 3, "height": 4}', item=other,
                                      trace_id="trace_b")]

    with serve_in_thread(create_app()) as base_url:
        ok, bad_type, not_offered, second = asyncio.run(calls(base_url))
        import httpx

        direct = httpx.post(f"{base_url}/call", json={
            "type": "function_call", "name": "math_factorial", "arguments": '{"number": "five"}', "item": row,
            "trace_id": "trace_c", "call_id": "c1"})
        trace = httpx.get(f"{base_url}/traces/trace_a").json()
    assert ok.error is None and json.loads(ok.output) == {
        "function": "math.factorial", "arguments": {"number": 5}, "status": "received",
        "note": "the call was received; this function returns no data"}
    assert bad_type.error == "invalid_arguments" and "is not of type 'integer'" in bad_type.output
    assert not_offered.error == "unknown_tool"  # the other row offers another function
    assert second.error is None and json.loads(second.output)["function"] == "calculate_triangle_area"
    assert direct.status_code == 422 and "arguments.number" in direct.json()["detail"]  # the server checks too
    assert [c["name"] for c in trace["calls"]] == ["math_factorial"]  # the client sent only the valid call


def test_a_wildcard_endpoint_serves_only_tools_without_their_own():
    from trainer.config.tools import ToolsConfig
    from trainer.errors import ConfigError

    schema = {"type": "function", "function": {"name": "search", "parameters": {"type": "object"}}}
    ToolsConfig(endpoints=[{"name": "*", "server_url": "http://127.0.0.1:1/call"}], schemas=[schema])
    with pytest.raises(ConfigError, match="no endpoint for it"):
        ToolsConfig(endpoints=[{"name": "other", "server_url": "http://127.0.0.1:1/call"}], schemas=[schema])


# --- the grader and parity --------------------------------------------------------------------

def _perturbations(row: dict[str, Any], functions: list[dict[str, Any]]) -> dict[str, tuple[list, str]]:
    """Recorded outputs for one row: name -> (calls `(tool name, arguments, turn)`, text)."""
    names = {f["name"]: tool_name(f["name"]) for f in functions}
    if "ground_truth" not in row:  # the relevance categories: a call, or none
        first = functions[0]
        some = {p: 1 for p in first["parameters"].get("required", [])}
        return {"no_call": ([], "I cannot do that with these functions."),
                "call": ([(names[first["name"]], some, 1)], ""),
                "unparsable_call": ([(names[first["name"]], "{not json", 1)], ""),
                "call_in_turn_two": ([(names[first["name"]], some, 2)], "")}
    right = [(names[name], arguments, 1) for name, arguments in answer_calls(row["ground_truth"])]
    outputs = {"right": (right, ""), "text": ([], "Here is how you would do it in Python."),
               "extra_call": (right + right[:1], ""), "invalid_json": ([(right[0][0], "{not json", 1)], ""),
               "right_then_turn_two": (right + [(right[0][0], right[0][1], 2)], "")}
    others = [names[f["name"]] for f in functions if names[f["name"]] != right[0][0]]
    outputs["wrong_function"] = ([(others[0] if others else right[0][0] + "_v2", right[0][1], 1)] + right[1:], "")
    arguments = copy.deepcopy(right[0][1])
    for param, value in arguments.items():
        if isinstance(value, bool):
            arguments[param] = not value
        elif isinstance(value, int | float):
            arguments[param] = value + 7
        elif isinstance(value, str):
            arguments[param] = value + " elsewhere"
        else:
            continue
        outputs["wrong_value"] = ([(right[0][0], arguments, 1)] + right[1:], "")
        break
    function = next(f for f in functions if names[f["name"]] == right[0][0])
    required = [p for p in function["parameters"].get("required", []) if p in right[0][1]]
    if required:
        missing = {k: v for k, v in right[0][1].items() if k != required[0]}
        outputs["missing_required"] = ([(right[0][0], missing, 1)] + right[1:], "")
    return outputs


def _bfcl_result(calls: list, text: str, names: dict[str, str]) -> Any:
    """What BFCL's OpenAI handler records for the first response, with BFCL's own names."""
    first = [(names.get(name, name), arguments) for name, arguments, turn in calls if turn == 1]
    if not first:
        return text
    return [{name: arguments if isinstance(arguments, str) else json.dumps(arguments)} for name, arguments in first]


def test_grade_equals_bfcl_own_verdict_on_right_and_wrong_outputs_of_every_category(
        bfcl_rows, bfcl_grader, tmp_path):
    functions = _source_functions()
    grader = {"type": "endpoint", "name": "bfcl", "url": bfcl_grader}
    cases, results = [], []
    # One output an item, the kinds taken in turn, so that BFCL's runner scores them all in one
    # pass (a result file holds an entry once): ITEMS_PER_KIND items of each kind a category has.
    for category in CATEGORIES:
        rows = [r for r in bfcl_rows["all"] if r["category"] == category]
        for index, row in enumerate(rows[:ITEMS_PER_KIND * len(KINDS)]):
            outputs = _perturbations(row, functions[row["id"]])
            kinds = [kind for kind in KINDS if kind in outputs]
            variant = kinds[index % len(kinds)]
            calls, text = outputs[variant]
            tools = [call for turn in sorted({t for *_, t in calls} or {1})
                     for call in output_tools([(n, a) for n, a, t in calls if t == turn], turn=turn)]
            ours = grade(grader, {"output_text": text, "output_tools": tools}, row, trace_id="trace_parity")
            assert ours.errors == {}, (row["id"], variant, ours.errors)
            cases.append((row["id"], variant, ours.reward, category))
            results.append({"id": row["id"], "result": _bfcl_result(calls, text, row["tool_names"])})
    path = tmp_path / "results.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in results))
    from envs.bfcl.environment import run_in_bfcl

    theirs = json.loads(run_in_bfcl("envs.bfcl.bfcl_evaluate", str(path)))
    disagree = [(i, v, s) for i, v, s, _ in cases if s != float(theirs[""]["valid"][i])]
    assert not disagree
    verdicts = Counter((v, s) for _, v, s, _ in cases)
    # the outputs test something: right ones pass, each wrong kind fails, in every category
    assert {c for *_, c in cases} == set(CATEGORIES)
    assert verdicts["right", 1.0] >= 0.9 * (verdicts["right", 1.0] + verdicts["right", 0.0])
    for wrong in ("extra_call", "invalid_json", "wrong_function", "wrong_value", "missing_required", "text"):
        assert verdicts[wrong, 0.0] > 0 and verdicts[wrong, 1.0] == 0, wrong
    assert verdicts["right_then_turn_two", 0.0] == verdicts["right", 0.0]  # later turns are not BFCL's to grade
    assert verdicts["call", 0.0] and verdicts["call", 1.0]  # irrelevance fails a call, live_relevance wants one
    assert verdicts["no_call", 1.0] and verdicts["unparsable_call", 1.0]  # no call: right on irrelevance
    assert verdicts["call_in_turn_two", 1.0]  # only the first response counts


def test_grader_server_refuses_what_it_cannot_grade_with_an_error_not_a_zero(bfcl_rows, bfcl_grader):
    grader = {"type": "endpoint", "name": "bfcl", "url": bfcl_grader}
    unknown = grade(grader, {"output_text": "", "output_tools": []}, {"id": "x", "bfcl_id": "no_such_1"})
    missing = grade(grader, {"output_text": "", "output_tools": []}, {"id": "x"})
    assert unknown.reward is None and "endpoint_grader_server_error" in unknown.errors
    assert missing.reward is None and "endpoint_grader_server_error" in missing.errors


# --- the yardstick: agentrft eval --benchmark bfcl ---------------------------------------------

def _taught_conversations(rows: dict[str, dict[str, Any]]) -> list[tuple[list[dict], list[dict]]]:
    """simple_python_0 answered right (the call, then a word after the acknowledgement) and
    irrelevance_0 answered without a call."""
    from envs.bfcl.server import BFCLTools

    right = rows["simple_python_0"]
    (name, arguments), = answer_calls(right["ground_truth"])
    call = {"id": "call_0", "type": "function",
            "function": {"name": tool_name(name), "arguments": json.dumps(arguments, separators=(",", ":"))}}
    ack = BFCLTools().run(tool_name(name), json.loads(call["function"]["arguments"]), right)
    return [([*right["messages"], {"role": "assistant", "content": "", "tool_calls": [call]},
              {"role": "tool", "tool_call_id": "call_0", "content": ack}, {"role": "assistant", "content": "Done."}],
             right["tools"]),
            ([*rows["irrelevance_0"]["messages"], {"role": "assistant", "content": "None of these functions can."}],
             rows["irrelevance_0"]["tools"])]


def test_eval_benchmark_bfcl_prints_accuracy_by_category_and_counts_the_reading(bfcl_rows, tmp_path):
    from tests.model_families import taught_model

    by_id = {row["id"]: row for row in bfcl_rows["all"]}
    model = taught_model("qwen2.5", _taught_conversations(by_id))
    ledger, out = tmp_path / "readings.jsonl", tmp_path / "eval"
    root = Path(__file__).resolve().parents[2]
    result = subprocess.run(
        [str(root / ".venv" / "bin" / "python"), "-m", "flows.cli", "eval", "--benchmark", "bfcl", "--split", "all",
         "--max-items", str(len(CATEGORIES)), "--model", str(model), "--out", str(out),
         "--set", f"data.test_ledger={ledger}", "--set", f"mlflow.tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}",
         "--set", "rollout.max_new_tokens_per_turn=48", "--set", "rollout.max_total_tokens=4096"],
        cwd=root, capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONPATH": str(root)})
    assert result.returncode == 0, result.stderr[-3000:]
    accuracy = json.loads((out / "bfcl_accuracy.json").read_text())
    assert list(accuracy) == list(CATEGORIES)  # the first entry of each category, in the file's order
    assert all(row["entries"] == 1 and row["ungraded"] == 0 for row in accuracy.values())
    assert accuracy["simple_python"]["accuracy"] == 1.0  # the taught call, right by BFCL's checker
    assert accuracy["irrelevance"]["accuracy"] == 1.0  # the taught refusal
    assert "BFCL v4 accuracy by its own checker" in result.stdout and "100.0%" in result.stdout
    (reading,) = [json.loads(line) for line in ledger.read_text().splitlines()]
    assert reading["command"] == "agentrft eval --split all" and reading["test_file"].endswith("all.jsonl")
