"""Reading and writing JSONL: datasets, traffic logs, metrics and rollouts.

One reader for every JSONL file the project touches, so every caller gets the same rules
and the same errors: a missing file, invalid UTF-8, invalid JSON or a line that is not an
object is a `DataError` that names the file and the line; blank lines are skipped.

Datasets follow OpenAI's RFT format: `{"messages": [...], "tools": [...], ...reference
fields}`. OpenAI's rows carry no id, ours do (`id` is the rollout record's `item_id`):
`read_items` gives a row without one the id `<file stem>:<line>`, stable for the file.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from trainer.errors import DataError


def read_jsonl(path: str | Path, limit: int | None = None, *, missing_ok: bool = False) -> list[dict[str, Any]]:
    """The objects of a JSONL file, in order (the first `limit`); `missing_ok` gives [] for
    a file that does not exist (metrics of a run that has not started)."""
    return [row for _, row in read_numbered(path, limit, missing_ok=missing_ok)]


def read_numbered(
    path: str | Path, limit: int | None = None, *, missing_ok: bool = False
) -> list[tuple[int, dict[str, Any]]]:
    """The objects of a JSONL file with their 1-based line numbers."""
    path = Path(path)
    try:
        handle = path.open("rb")
    except FileNotFoundError:
        if missing_ok:
            return []
        raise DataError(f"{path}: file not found; check the path in the config") from None
    except OSError as exc:
        raise DataError(f"{path}: cannot read the file ({exc.strerror}); check the path") from None
    rows: list[tuple[int, dict[str, Any]]] = []
    with handle:
        for number, raw in enumerate(handle, start=1):
            if limit is not None and len(rows) >= limit:
                break
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise DataError(
                    f"{path}:{number}: invalid UTF-8 at byte {exc.start} of the line; re-encode the file as UTF-8"
                ) from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(
                    f"{path}:{number}: invalid JSON ({exc.msg} at column {exc.colno}); each line must be one JSON object"
                ) from None
            if not isinstance(row, dict):
                raise DataError(f"{path}:{number}: expected a JSON object, got {type(row).__name__}")
            rows.append((number, row))
    return rows


def read_items(path: str | Path, limit: int | None = None, *, what: str = "dataset") -> list[dict[str, Any]]:
    """The rows of a dataset, each with an `id` (`<stem>:<line>` where the row has none);
    a file with no rows is a DataError."""
    path = Path(path)
    numbered = read_numbered(path, limit)
    if not numbered:
        raise DataError(f"{path}: the {what} has no rows")
    return [row if "id" in row else {"id": f"{path.stem}:{number}", **row} for number, row in numbered]


def write_jsonl(path: str | Path, rows: Iterable[dict[str, Any]]) -> Path:
    """One JSON object a line, UTF-8, '\\n' endings; the parent folder is created."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8", newline="\n") as handle:
        for row in rows:
            handle.write(json.dumps(row, ensure_ascii=False, default=str) + "\n")
    return path


def user_text(row: dict[str, Any]) -> str:
    """The user content of a row's messages, joined: what a rollout is asked (a list of
    content parts contributes its text parts)."""
    parts = []
    for message in row.get("messages") or []:
        if not isinstance(message, dict) or message.get("role") != "user":
            continue
        content = message.get("content")
        if isinstance(content, str):
            parts.append(content)
        elif isinstance(content, list):
            parts += [p.get("text", "") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str)]
    return "\n".join(parts)


def normalize_text(text: str) -> str:
    """Lowercase, punctuation dropped, whitespace collapsed: the key for leakage checks."""
    return " ".join(re.sub(r"[^\w]+", " ", text.lower()).split())


def split_validation(items: list[dict[str, Any]], part: str) -> list[dict[str, Any]]:
    """A job without a test file sets aside half of its validation items as the test split:
    an item is in `test` when the md5 of its normalised user request (its id when it has
    none) is odd. Seeded by content, so the halves are the same on every machine and do
    not move when items are added."""
    def is_test(item: dict[str, Any]) -> bool:
        key = normalize_text(user_text(item)) or str(item.get("id"))
        return int(hashlib.md5(key.encode(), usedforsecurity=False).hexdigest(), 16) % 2 == 1

    if part not in ("validation", "test"):
        raise ValueError(f"part must be validation or test, got {part!r}")
    return [item for item in items if is_test(item) == (part == "test")]


def split_items(data: Any, split: str, limit: int | None = None) -> list[dict[str, Any]]:
    """The items of a config's split (`data` is its `data` section): train, validation or
    test, where a job without `test_file` splits its validation file (`split_validation`).
    Only the regression evaluation asks for `test`."""
    if split == "train":
        return read_items(data.train_file, min(filter(None, [limit, data.max_train_items]), default=None),
                          what="training file")
    if split == "validation":
        limit = min(filter(None, [limit, data.max_validation_items]), default=None)
        if data.test_file:
            return read_items(data.validation_file, limit, what="validation file")
        return split_validation(read_items(data.validation_file, what="validation file"), "validation")[:limit]
    if split == "test":
        limit = min(filter(None, [limit, data.max_test_items]), default=None)
        if data.test_file:
            return read_items(data.test_file, limit, what="test file")
        return split_validation(read_items(data.validation_file, what="validation file"), "test")[:limit]
    raise ValueError(f"unknown split {split!r}")


ROLES = ("system", "developer", "user", "assistant", "tool")


def read_demonstrations(path: str | Path, limit: int | None = None) -> list[dict[str, Any]]:
    """The conversations of a demonstrations file (OpenAI's supervised fine-tuning format:
    `{"messages": [...], "tools": [...]}` a line), each checked: every problem is a
    DataError naming the file, the line and the key. Each row gets `line` (its 1-based
    line number) and an `id` (`<stem>:<line>` where it has none)."""
    path = Path(path)
    numbered = read_numbered(path, limit)
    if not numbered:
        raise DataError(f"{path}: the demonstrations file has no rows; write one conversation a line "
                        '({"messages": [...], "tools": [...]})')
    rows = []
    for number, row in numbered:
        _check_demonstration(row, f"{path}:{number}")
        rows.append({"id": row.get("id", f"{path.stem}:{number}"), **row, "line": number})
    return rows


def _text_content(content: Any) -> bool:
    """Whether `content` is text: a string, or a list of `{"type": "text", "text": ...}` parts."""
    if isinstance(content, str):
        return True
    return isinstance(content, list) and all(
        isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str) for part in content)


def _check_demonstration(row: dict[str, Any], where: str) -> None:
    tools = row.get("tools")
    names: set[str] | None = None
    if tools is not None:
        if not isinstance(tools, list):
            raise DataError(f"{where}: tools must be a list of Chat Completions tools, got {type(tools).__name__}")
        names = set()
        for t, tool in enumerate(tools):
            function = tool.get("function") if isinstance(tool, dict) else None
            if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
                raise DataError(f"{where}: tools[{t}] must be {{\"type\": \"function\", \"function\": {{\"name\": ..., "
                                "\"parameters\": {...}}}}")
            if "parameters" in function and not isinstance(function["parameters"], dict):
                raise DataError(f"{where}: tools[{t}].function.parameters must be a JSON schema object")
            names.add(function["name"])
    messages = row.get("messages")
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{where}: messages must be a non-empty list of chat messages")
    open_calls: set[str] = set()
    trained = False
    for m, message in enumerate(messages):
        key = f"{where}: messages[{m}]"
        if not isinstance(message, dict):
            raise DataError(f"{key} must be an object with a role, got {type(message).__name__}")
        role = message.get("role")
        if role not in ROLES:
            raise DataError(f"{key}.role: {role!r} is not one of {', '.join(ROLES)}")
        content = message.get("content")
        calls = message.get("tool_calls")
        if role == "assistant":
            weight = message.get("weight", 1)
            if weight not in (0, 1):
                raise DataError(f"{key}.weight: {weight!r}; OpenAI's weight is 0 (not trained) or 1 (trained)")
            if calls is not None:
                _check_calls(calls, names, key)
                open_calls = {call["id"] for call in calls if isinstance(call.get("id"), str)}
            if content is not None and not _text_content(content):
                raise DataError(f"{key}.content must be text (a string or a list of text parts)")
            if not calls and not (isinstance(content, str) and content) and not (
                    isinstance(content, list) and content):
                raise DataError(f"{key}: an assistant turn with neither content nor tool_calls teaches nothing; "
                                "remove it or write what the model should say")
            trained = trained or weight == 1
            continue
        if calls is not None:
            raise DataError(f"{key}.tool_calls: only assistant turns call tools (this one is {role})")
        if not _text_content(content):
            raise DataError(f"{key}.content must be text (a string or a list of text parts)")
        if role == "tool":
            call_id = message.get("tool_call_id")
            if m == 0 or messages[m - 1].get("role") not in ("assistant", "tool"):
                raise DataError(f"{key}: a tool result must follow the assistant turn that called the tool")
            if open_calls and call_id not in open_calls:
                raise DataError(f"{key}.tool_call_id: {call_id!r} answers no call of the assistant turn before it "
                                f"(its calls: {', '.join(sorted(open_calls))})")
    if not trained:
        raise DataError(f"{where}: no assistant turn to learn from; a demonstration ends with what the model should "
                        "write (an assistant message with content or tool_calls)")


def _check_calls(calls: Any, names: set[str] | None, key: str) -> None:
    if not isinstance(calls, list) or not calls:
        raise DataError(f"{key}.tool_calls must be a non-empty list (leave the key out for a turn without calls)")
    for c, call in enumerate(calls):
        where = f"{key}.tool_calls[{c}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise DataError(f"{where} must be {{\"id\": ..., \"type\": \"function\", \"function\": {{\"name\": ..., "
                            "\"arguments\": \"<JSON string>\"}}}}")
        if names is not None and function["name"] not in names:
            raise DataError(f"{where}.function.name: {function['name']!r} is not among the row's tools "
                            f"({', '.join(sorted(names)) or 'none'}); add its schema to `tools`")
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError as exc:
                raise DataError(f"{where}.function.arguments: not valid JSON ({exc.msg} at column {exc.colno}); "
                                "write the arguments as a JSON object in a string") from None
        if not isinstance(arguments, dict):
            raise DataError(f"{where}.function.arguments must be a JSON object (as a string), got "
                            f"{type(arguments).__name__}")
