"""The `warm_start` section and demonstrations files: OpenAI's supervised format, checked
with errors that name the file, the line and the key."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trainer.config.loading import config_from_dict, merge_overrides
from trainer.config.warm_start import resolved_warm_start
from trainer.data import read_demonstrations
from trainer.errors import ConfigError, DataError

MINIMAL = {"model": {"base_model": "Qwen/Qwen3-0.6B"},
           "grader": {"type": "string_check", "name": "exact", "input": "{{sample.output_text}}",
                      "reference": "{{item.answer}}", "operation": "eq"}}
TOOL = {"type": "function", "function": {"name": "lookup", "description": "Look a page up.",
                                         "parameters": {"type": "object", "properties": {"page": {"type": "string"}}}}}
CALL = {"id": "call_0", "type": "function", "function": {"name": "lookup", "arguments": '{"page": "a.txt"}'}}
GOOD = {"messages": [{"role": "system", "content": "Answer with a number."},
                     {"role": "user", "content": "Revenue in 2020?"},
                     {"role": "assistant", "content": None, "tool_calls": [CALL]},
                     {"role": "tool", "tool_call_id": "call_0", "content": "revenue: 12"},
                     {"role": "assistant", "content": "Answer: 12"}],
        "tools": [TOOL]}


def write(path: Path, *rows: object) -> Path:
    path.write_text("".join((row if isinstance(row, str) else json.dumps(row)) + "\n" for row in rows))
    return path


def test_defaults_resolve_to_openai_supervised_values() -> None:
    config = config_from_dict(merge_overrides(MINIMAL, {"warm_start": {"demonstrations_file": "d.jsonl"}}))
    assert config.warm_start.enabled and config.warm_start.when == "no_signal"
    assert resolved_warm_start(config.warm_start) == {"n_epochs": 3, "batch_size": 8, "learning_rate_multiplier": 1.0,
                                                      "learning_rate": 1e-4, "seed": 42}
    config = config_from_dict(merge_overrides(MINIMAL, {"warm_start": {"learning_rate_multiplier": 2, "n_epochs": 1}}))
    assert not config.warm_start.enabled
    assert resolved_warm_start(config.warm_start)["learning_rate"] == pytest.approx(2e-4)


def test_config_errors_name_the_key() -> None:
    with pytest.raises(ConfigError, match=r"warm_start\.epochs: unknown key"):
        config_from_dict(merge_overrides(MINIMAL, {"warm_start": {"epochs": 2}}))
    with pytest.raises(ConfigError, match=r"warm_start\.when"):
        config_from_dict(merge_overrides(MINIMAL, {"warm_start": {"when": "sometimes"}}))
    with pytest.raises(ConfigError, match="validation_file is set but warm_start.demonstrations_file is not"):
        config_from_dict(merge_overrides(MINIMAL, {"warm_start": {"validation_file": "v.jsonl"}}))


def test_a_good_file_reads_with_lines_and_ids(tmp_path: Path) -> None:
    path = write(tmp_path / "demos.jsonl", GOOD, "", {**GOOD, "id": "mine"})
    rows = read_demonstrations(path)
    assert [(row["id"], row["line"]) for row in rows] == [("demos:1", 1), ("mine", 3)]
    assert rows[0]["messages"] == GOOD["messages"]


def bad(**changes: object) -> dict:
    row = json.loads(json.dumps(GOOD))
    for key, value in changes.items():
        if key[0] == "m" and key[1:].isdigit():
            row["messages"][int(key[1:])] = value
        else:
            row[key] = value
    return row


@pytest.mark.parametrize(("row", "error"), [
    ("[1, 2]", r":2: expected a JSON object"),
    ("{oops", r":2: invalid JSON"),
    (bad(messages=[]), r":2: messages must be a non-empty list"),
    (bad(m1={"role": "customer", "content": "hi"}), r":2: messages\[1\]\.role: 'customer' is not one of"),
    (bad(m2={"role": "assistant", "tool_calls": [{**CALL, "function": {"name": "lookup", "arguments": "{page"}}]}),
     r":2: messages\[2\]\.tool_calls\[0\]\.function\.arguments: not valid JSON"),
    (bad(m2={"role": "assistant", "tool_calls": [{**CALL, "function": {"name": "search", "arguments": "{}"}}]}),
     r":2: messages\[2\]\.tool_calls\[0\]\.function\.name: 'search' is not among the row's tools \(lookup\)"),
    (bad(m3={"role": "tool", "tool_call_id": "call_9", "content": "x"}),
     r":2: messages\[3\]\.tool_call_id: 'call_9' answers no call"),
    (bad(m4={"role": "assistant", "content": ""}), r":2: messages\[4\]: an assistant turn with neither content"),
    (bad(m4={"role": "assistant", "content": "12", "weight": 0.5}), r":2: messages\[4\]\.weight"),
    (bad(tools={"lookup": {}}), r":2: tools must be a list"),
    ({"messages": [{"role": "user", "content": "hi"}]}, r":2: no assistant turn to learn from"),
    (bad(m1={"role": "user", "content": {"text": "x"}}), r":2: messages\[1\]\.content must be text"),
])
def test_bad_rows_name_file_line_and_key(tmp_path: Path, row: object, error: str) -> None:
    path = write(tmp_path / "demos.jsonl", GOOD, row)
    with pytest.raises(DataError, match=r"demos\.jsonl" + error):
        read_demonstrations(path)


def test_a_missing_or_empty_file_says_so(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="file not found"):
        read_demonstrations(tmp_path / "none.jsonl")
    with pytest.raises(DataError, match="has no rows"):
        read_demonstrations(write(tmp_path / "empty.jsonl", ""))
