"""OpenAI's grader templates: `{{ namespace.path }}` replaced by a value.

The namespaces are `item` (the data row) and `sample` (the model's output:
`output_text`, `output_json`, `output_tools`). A path walks dicts by `.key` and lists by
`[index]` (or `.index`), e.g. `{{ sample.output_tools[0].function.arguments }}`; spaces
inside the braces are ignored. Strings are inserted as they are, anything else as JSON
(so a list in the item renders as a JSON list that an f1 grader can read back).

`sample.output_json` is the output parsed as JSON: when the sample carries none, the
output text is parsed on demand, and text that is not JSON is a `sample_parse_error`
(the model's fault, reported as a grader error). A variable that does not exist is an
`invalid_variable_error` naming it.
"""

from __future__ import annotations

import json
import re
from typing import Any

from trainer.graders.result import GraderError

_VARIABLE = re.compile(r"\{\{(.*?)\}\}", re.DOTALL)
# One step of a path: `.key` (any characters but dots, brackets and spaces) or `[3]`.
_STEP = re.compile(r"\.([^.\[\]\s]+)|\[\s*(\d+)\s*\]")
NAMESPACES = ("item", "sample")


def template_variables(template: str) -> list[str]:
    """The variable expressions of a template, stripped: `["item.answer", ...]`."""
    return [match.group(1).strip() for match in _VARIABLE.finditer(template)]


def check_template(template: str) -> str | None:
    """A config-time check: the first problem with a template's variables, or None."""
    for variable in template_variables(template):
        try:
            _split_variable(variable)
        except GraderError as exc:
            return str(exc)
    if "{{" in _VARIABLE.sub("", template):  # else it would be graded as literal text
        return "a `{{` is never closed by `}}`; write variables as {{ item.name }}"
    return None


def render_template(template: str, sample: dict[str, Any], item: dict[str, Any]) -> str:
    """Replace every `{{ item.* }}` / `{{ sample.* }}` in `template` with its value."""

    def replace(match: re.Match[str]) -> str:
        value = lookup_variable(match.group(1).strip(), sample, item)
        return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)

    return _VARIABLE.sub(replace, template)


def lookup_variable(variable: str, sample: dict[str, Any], item: dict[str, Any]) -> Any:
    """The value a variable such as `sample.output_json.total` names."""
    namespace, steps = _split_variable(variable)
    if namespace == "item":
        value: Any = item
    else:
        value = sample
        if steps and steps[0] == "output_json":
            value = {"output_json": sample_output_json(sample)}
    for step in steps:
        if isinstance(value, dict) and isinstance(step, str) and step in value:
            value = value[step]
        elif (
            isinstance(value, list) and _as_index(step) is not None and _as_index(step) < len(value)
        ):
            value = value[_as_index(step)]
        else:
            raise GraderError(
                "invalid_variable_error",
                f"template variable {{{{ {variable} }}}}: {_describe_missing(value, step)}",
            )
    return value


def sample_output_json(sample: dict[str, Any]) -> Any:
    """The sample's output as JSON: its `output_json`, else its output text parsed."""
    if sample.get("output_json") is not None:
        return sample["output_json"]
    text = sample.get("output_text") or ""
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise GraderError(
            "sample_parse_error",
            f"the grader reads sample.output_json but the output is not valid JSON "
            f"({exc.msg} at line {exc.lineno}, column {exc.colno}): {text[:120]!r}",
        ) from None


def _split_variable(variable: str) -> tuple[str, list[str | int]]:
    namespace, _, rest = variable.partition(".")
    if namespace not in NAMESPACES:
        raise GraderError(
            "invalid_variable_error",
            f"template variable {{{{ {variable} }}}}: the namespace must be one of "
            f"{', '.join(NAMESPACES)}, got {namespace!r}",
        )
    path = "." + rest if rest else ""
    steps: list[str | int] = []
    position = 0
    while position < len(path):
        match = _STEP.match(path, position)
        if match is None:
            raise GraderError(
                "invalid_variable_error",
                f"template variable {{{{ {variable} }}}}: cannot read the path at {path[position:]!r} "
                "(use .key and [index])",
            )
        steps.append(match.group(1) if match.group(1) is not None else int(match.group(2)))
        position = match.end()
    return namespace, steps


def _as_index(step: str | int) -> int | None:
    if isinstance(step, int):
        return step
    return int(step) if step.isdigit() else None


def _describe_missing(value: Any, step: str | int) -> str:
    if isinstance(value, dict):
        keys = ", ".join(sorted(map(str, value))[:20]) or "none"
        return f"no key {step!r} (available: {keys})"
    if isinstance(value, list):
        return f"index {step!r} is out of range for a list of {len(value)}"
    return f"cannot look up {step!r} in a {type(value).__name__} value"
