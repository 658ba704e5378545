"""BFCL's function names as tool names and back, and its possible answers as calls.

Chat Completions tool names must match `^[a-zA-Z0-9_-]{1,64}$`; BFCL's names have dots
(`math.factorial`). BFCL itself sends OpenAI-style models `math_factorial` (its
`convert_to_tool`), and so do we, so a model here sees what it sees on the leaderboard. That
replacement is not reversible on its own (`a.b` and `a_b` both give `a_b`), but it is within
one item's functions, which is all a call can name: `tool_names` maps each tool name of an item
back to BFCL's name and refuses an item where two of its functions would share one.

`answer_calls` turns a possible answer (`[{"math.factorial": {"number": [5]}}]`: every value a
list of the accepted ones, `""` meaning the optional argument may be left out) into the calls a
right output makes, with the first accepted value of each argument.

Standard library only: the grader server imports it in BFCL's own environment.
"""

from __future__ import annotations

import json
import re
from typing import Any

VALID_TOOL_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")


def tool_name(bfcl_name: str) -> str:
    """The tool name a model is offered for a BFCL function: its dots as underscores."""
    return bfcl_name.replace(".", "_")


def tool_names(functions: list[dict[str, Any]], *, where: str = "item") -> dict[str, str]:
    """tool name -> BFCL name for one item's functions; ValueError when two share a tool name
    or a name is not a valid tool name even after the replacement."""
    names: dict[str, str] = {}
    for function in functions:
        bfcl_name = function["name"]
        name = tool_name(bfcl_name)
        if not VALID_TOOL_NAME.match(name):
            raise ValueError(f"{where}: function {bfcl_name!r} has no valid tool name ({name!r})")
        if name in names and names[name] != bfcl_name:
            raise ValueError(f"{where}: functions {names[name]!r} and {bfcl_name!r} would both be "
                             f"offered as {name!r}")
        names[name] = bfcl_name
    return names


def bfcl_call_name(name: str, names: dict[str, str]) -> str:
    """BFCL's name for a tool name the model called; a name the item does not offer stays as it
    is (BFCL's checker then finds the wrong function, as it would)."""
    return names.get(name, name)


def answer_calls(ground_truth: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    """(BFCL name, arguments) of the calls a right output makes: the first accepted value of
    each argument, arguments whose first accepted value is `""` (may be omitted) left out."""
    calls = []
    for call in ground_truth:
        (name, options), = call.items()
        arguments = {param: _first_options(accepted[0]) for param, accepted in options.items()
                     if accepted and accepted[0] != ""}
        calls.append((name, arguments))
    return calls


def _first_options(value: Any) -> Any:
    """An accepted value, with the dicts inside it (which list accepted values per key, as
    the arguments do) reduced to their first accepted values."""
    if isinstance(value, dict):
        return {key: _first_options(options[0] if isinstance(options, list) and options else options)
                for key, options in value.items()
                if not (isinstance(options, list) and options and options[0] == "")}
    if isinstance(value, list):
        return [_first_options(v) for v in value]
    return value


def output_tools(calls: list[tuple[str, Any]], *, turn: int = 1) -> list[dict[str, Any]]:
    """Calls `(tool name, arguments: dict or raw string)` as a grader sample's `output_tools`."""
    return [{"id": f"call_{i}", "type": "function", "turn": turn,
             "function": {"name": name,
                          "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments)}}
            for i, (name, arguments) in enumerate(calls)]
