"""Checks on the datasets that no traffic statistic can make: leakage, gradability, shape.

- Leakage: no id and no normalised user request (the user content of `messages`) may be
  shared by two splits (train, validation, test), or an evaluation measures memory
  instead of skill, and the test split would not be held out.
- Gradability: every `{{item.*}}` field a grader template reads exists in every row, and
  a grader that parses its reference (`numeric`) can parse every row's reference; a row
  the grader cannot use would turn all its rollouts into grader errors.
- Shape: a rollout can start from every row: `messages` is a non-empty list of
  `{"role", "content"}` objects, a row's own `tools` are valid tool schemas, the row
  fits in a tool request (every call carries the whole row as `item`), and its `id`, when
  it has one, can name its rollouts (a null or a list would merge rows in every report;
  a row without one is named `<file stem>:<line>`).

Each failure names the dataset, the check, the column, what was observed and expected,
and sample rows (id, line): the report the pipeline shows when it stops.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from trainer.config.tools import tool_validators
from trainer.data import normalize_text, user_text
from trainer.errors import DataError
from trainer.graders import grade, sample_from_text, validate_grader
from trainer.graders.result import GraderError
from trainer.graders.templates import lookup_variable, render_template, template_variables

SAMPLE_ROWS = 5
# Graders that parse their reference and can reject it (the numeric grader's
# reference_parse_error); other graders get their `{{item.*}}` variables checked per row
# instead of being run: judges and endpoints would cost a request per row.
REFERENCE_PARSING_GRADERS = ("numeric",)
# Every tool request carries the whole row (`item`) and is capped at 1 MB (OpenAI's limit,
# the tool client's max_body_bytes); 64 kB stay free for the call's arguments and envelope.
MAX_ROW_BYTES = 1_000_000 - 64 * 1024

Numbered = list[tuple[int, dict[str, Any]]]


def failure(dataset: Path | str, check: str, column: str | None, observed: Any, expected: Any,
            count: int | None = None, samples: list[Any] | None = None) -> dict[str, Any]:
    return {"dataset": Path(dataset).as_posix() if isinstance(dataset, Path) else dataset, "expectation": check,
            "column": column, "observed": observed, "expected": expected, "unexpected_count": count,
            "samples": samples or []}


def short(value: Any, limit: int = 120) -> Any:
    """A value small enough for a report: long strings and containers are cut."""
    if isinstance(value, str):
        return value if len(value) <= limit else value[: limit - 3] + "..."
    if isinstance(value, list | dict):
        text = json.dumps(value, ensure_ascii=False, default=str)
        return value if len(text) <= limit else text[: limit - 3] + "..."
    return value


def check_leakage(splits: dict[str, tuple[Path, Numbered]]) -> list[dict[str, Any]]:
    """Failures for ids and normalised user requests shared by two splits."""
    failures = []
    names = list(splits)
    for a_index, a in enumerate(names):
        for b in names[a_index + 1 :]:
            (_, rows_a), (path_b, rows_b) = splits[a], splits[b]
            for column, key in (("id", lambda row: row.get("id")),
                                ("messages", lambda row: normalize_text(user_text(row)) or None)):
                seen = {key(row): row.get("id") for _, row in rows_a if key(row) is not None}
                shared = [{"id": row.get("id"), "line": line, f"{a}_id": seen[key(row)],
                           "value": short(user_text(row) if column == "messages" else row.get("id"))}
                          for line, row in rows_b if key(row) is not None and key(row) in seen]
                if shared:
                    what = "id" if column == "id" else "normalised user request"
                    failures.append(failure(
                        path_b, f"{a}_{b}_disjoint", column, f"{len(shared)} {b} rows share a{'n' if column == 'id' else ''} "
                        f"{what} with {a}", "no shared values", len(shared), shared[:SAMPLE_ROWS]))
    return failures


def _leaf_graders(grader: dict[str, Any], where: str):
    if grader["type"] == "multi":
        for name, sub in grader["graders"].items():
            yield from _leaf_graders(sub, f"{where}.graders.{name}")
    else:
        yield where, grader


def _strings(value: Any):
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for sub in value.values():
            yield from _strings(sub)
    elif isinstance(value, list):
        for sub in value:
            yield from _strings(sub)


def _row_problems(leaf: dict[str, Any], where: str, row: dict[str, Any]) -> list[str]:
    empty = sample_from_text("")
    problems = []
    for template in _strings(leaf):
        for variable in template_variables(template):
            if variable.split(".", 1)[0].split("[", 1)[0] != "item":
                continue
            try:
                lookup_variable(variable, empty, row)
            except GraderError as exc:
                problems.append(f"{where}: {exc}")
    if (not problems and leaf["type"] in REFERENCE_PARSING_GRADERS
            and str(leaf.get("input", "")).replace(" ", "") == "{{sample.output_text}}"):
        # The reference graded as the answer: it must parse (and score full marks). Only
        # where the answer is the whole output: a part of it (`sample.output_json.amount`)
        # cannot be made from the reference alone.
        reference = render_template(leaf["reference"], empty, row)
        errors = grade(leaf, sample_from_text(reference), row).errors
        problems += [f"{where}: {kind}: {message}" for kind, message in errors.items()]
    return problems


def check_gradable(grader: dict[str, Any], numbered: Numbered, path: Path) -> list[dict[str, Any]]:
    """Failures for rows the grader cannot use. GraderConfigError for a bad grader."""
    validate_grader(grader)
    leaves = list(_leaf_graders(grader, "grader"))
    bad = []
    for line, row in numbered:
        problems = [p for where, leaf in leaves for p in _row_problems(leaf, where, row)]
        if problems:
            bad.append({"id": row.get("id"), "line": line, "error": "; ".join(problems)})
    if not bad:
        return []
    return [failure(path, "rows_gradable", "(grader fields)", f"{len(bad)} of {len(numbered)} rows the grader "
                    "cannot use", f"grader {grader.get('name') or grader['type']!r} reads every row without error",
                    len(bad), bad[:SAMPLE_ROWS])]


def _messages_ok(messages: Any) -> bool:
    return isinstance(messages, list) and bool(messages) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str | list)
        for m in messages
    )


def _id_ok(value: Any) -> bool:
    return (isinstance(value, str) and bool(value.strip())) or (isinstance(value, int) and not isinstance(value, bool))


def check_row_shapes(numbered: Numbered, path: Path) -> list[dict[str, Any]]:
    """Failures for rows a rollout could not start from, whatever the suite says."""
    checked_tools: dict[str, str | None] = {}  # rows usually share one list: check each once
    bad: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    for line, row in numbered:
        problems = []
        if not _messages_ok(row.get("messages")):
            problems.append(("messages_well_formed", "messages",
                             "a non-empty list of objects with a string `role` and `content`",
                             short(row.get("messages"))))
        if "tools" in row:
            key = json.dumps(row["tools"], sort_keys=True, default=str)
            if key not in checked_tools:
                try:
                    tool_validators(row["tools"], where="tools", error=DataError)
                    checked_tools[key] = None
                except DataError as exc:
                    checked_tools[key] = str(exc)
            if checked_tools[key]:
                problems.append(("tool_schemas_valid", "tools", "Chat Completions tool schemas: a function.name "
                                 "each, once, parameters a JSON schema", checked_tools[key]))
        if "id" in row and not _id_ok(row["id"]):
            problems.append(("id_usable", "id", "a non-empty string or an integer (or no `id`: the row is named "
                             "<file stem>:<line>)", short(row["id"])))
        size = len(json.dumps(row, ensure_ascii=False, default=str).encode())
        if size > MAX_ROW_BYTES:
            problems.append(("row_fits_tool_request", "(row)", f"at most {MAX_ROW_BYTES} bytes", f"{size} bytes"))
        for check, column, expected, error in problems:
            bad.setdefault((check, column, expected), []).append(
                {"id": short(row.get("id")), "line": line, "error": error})
    return [failure(path, check, column, f"{len(rows)} of {len(numbered)} rows", expected, len(rows),
                    rows[:SAMPLE_ROWS])
            for (check, column, expected), rows in bad.items()]
