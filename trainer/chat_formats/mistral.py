"""Mistral and Ministral: `[INST]` turns, calls after a `[TOOL_CALLS]` control token,
results between `[TOOL_RESULTS]` and `[/TOOL_RESULTS]`, no generation prompt (the model
writes right after `[/INST]` or `[/TOOL_RESULTS]`).

Three generations of the format are in use, and the tokenizer's template says which:

    Mistral Nemo (2407):     [TOOL_CALLS][{"name": "search", "arguments": {...}, "id": "a1b2c3d4e"}]</s>
                             [TOOL_RESULTS]{"content": "...", "call_id": "a1b2c3d4e"}[/TOOL_RESULTS]
    Mistral Small 3.2:       [TOOL_CALLS]search[CALL_ID]a1b2c3d4e[ARGS]{...}</s>
                             [TOOL_RESULTS]a1b2c3d4e[TOOL_CONTENT]...[/TOOL_RESULTS]
    Ministral 3 / Magistral: [THINK]...[/THINK][TOOL_CALLS]search[ARGS]{...}</s>
                             [TOOL_RESULTS]...[/TOOL_RESULTS]

Call ids are the model's own where it writes them (Mistral's templates insist on nine
alphanumeric characters); where it does not, they are `call` and five digits.

mistral-common, Mistral's own tokenizer library, is the reference: Nemo's prompts and tool
results here are its encoding token for token (tests/trainer/test_chat_format_references.py).
Where Nemo's published Jinja template differs from it (it writes a tool output as raw text
inside `{"content": ...}`, mistral-common as a JSON value), the bridge follows mistral-common.
"""

from __future__ import annotations

import json
import re
from typing import Any, ClassVar

from trainer.chat_formats.base import (
    ChatFormat,
    ParsedToolCall,
    ParsedTurn,
    call_from_object,
    compact_arguments,
    snippet,
)
from trainer.chat_formats.hermes import _text

TOOL_CALLS, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
THINK_OPEN, THINK_CLOSE = "[THINK]", "[/THINK]"
_NAME = re.compile(r"\s*([A-Za-z0-9_.\-]+)\s*")


class MistralFormat(ChatFormat):
    name = "mistral"
    stop_tokens: ClassVar[tuple[str, ...]] = ("</s>",)
    skip_special_tokens = False  # [TOOL_CALLS], [ARGS], [THINK] are control tokens

    def __init__(self, tokenizer: Any, *, enable_thinking: bool | None = None):
        super().__init__(tokenizer, enable_thinking=enable_thinking)
        template = _template_text(tokenizer)
        self.variant = "nemo" if '"call_id"' in template else "v11" if "[TOOL_CONTENT]" in template else "v13"
        close_ids = self.encode(THINK_CLOSE)
        self._think_close_id = close_ids[0] if len(close_ids) == 1 else None

    @staticmethod
    def call_id(index: int) -> str:
        return f"call{index:05d}"

    def parse(self, token_ids: list[int], *, first_call_index: int = 0,
              tools: list[dict[str, Any]] | None = None) -> ParsedTurn:
        text = self.decode(token_ids).rstrip()
        for marker in self.stop_tokens:
            text = text.removesuffix(marker)
        reasoning, reasoning_tokens = "", 0
        if text.lstrip().startswith(THINK_OPEN):
            head, closed, rest = text.lstrip().removeprefix(THINK_OPEN).partition(THINK_CLOSE)
            if not closed:
                return ParsedTurn(content="", tool_calls=[], errors=[], reasoning=head.strip(),
                                  reasoning_tokens=len(token_ids), reasoning_open=True)
            reasoning, text = head.strip(), rest
            reasoning_tokens = (token_ids.index(self._think_close_id) + 1 if self._think_close_id in token_ids
                                else len(self.encode(THINK_OPEN + head + THINK_CLOSE)))
        content, marker, calls_text = text.partition(TOOL_CALLS)
        calls: list[ParsedToolCall] = []
        errors: list[str] = []
        if marker:
            next_index = first_call_index
            if calls_text.lstrip().startswith("["):
                found = self._json_list(calls_text, next_index, errors)
            else:
                found = [self._one_call(piece, next_index + k, errors) for k, piece in enumerate(calls_text.split(TOOL_CALLS))]
            calls = [call for call in found if call is not None]
        return ParsedTurn(content=content.strip(), tool_calls=calls, errors=errors, reasoning=reasoning,
                          reasoning_tokens=reasoning_tokens)

    def _json_list(self, text: str, first: int, errors: list[str]) -> list[ParsedToolCall | None]:
        """Nemo's form: one JSON list of {"name", "arguments", "id"}."""
        try:
            items, _ = json.JSONDecoder().raw_decode(text.lstrip())
        except json.JSONDecodeError as exc:
            errors.append(f"invalid JSON after {TOOL_CALLS} ({exc.msg} at char {exc.pos}): {snippet(text)}")
            return []
        if not isinstance(items, list):
            items = [items]
        calls: list[ParsedToolCall | None] = []
        for k, item in enumerate(items):
            given = item.get("id") if isinstance(item, dict) else None
            call = call_from_object(item, given if isinstance(given, str) and given else self.call_id(first + k), TOOL_CALLS)
            if isinstance(call, str):
                errors.append(call)
                call = None
            calls.append(call)
        return calls

    def _one_call(self, piece: str, index: int, errors: list[str]) -> ParsedToolCall | None:
        """`name[CALL_ID]id[ARGS]{...}` or `name[ARGS]{...}`."""
        head, marker, arguments = piece.partition(ARGS)
        name_part, has_id, given = head.partition(CALL_ID)
        match = _NAME.fullmatch(name_part)
        if not marker or not match:
            errors.append(f"a {TOOL_CALLS} call must be name{ARGS}{{json}}: {snippet(piece)}")
            return None
        name = match.group(1)
        try:
            obj, _ = json.JSONDecoder().raw_decode(arguments.strip())
        except json.JSONDecodeError as exc:
            errors.append(f"invalid JSON in the {ARGS} of {name!r} ({exc.msg} at char {exc.pos}): {snippet(arguments)}")
            return None
        compact = compact_arguments(obj)
        if compact is None:
            errors.append(f"the {ARGS} of {name!r} are not a JSON object: {snippet(arguments)}")
            return None
        call_id = given.strip() if has_id and given.strip() else self.call_id(index)
        return ParsedToolCall(name=name, arguments=compact, call_id=call_id)

    def bridge_text(self, messages: list[dict[str, Any]], n_done: int, tools: list[dict[str, Any]] | None) -> str:
        parts = []
        for message in messages[n_done:]:
            content, call_id = _text(message["content"]), message.get("tool_call_id", "")
            if self.variant == "nemo":  # as mistral-common writes it: the output as a JSON value
                result = json.dumps({"content": _json_or_text(content), "call_id": call_id}, ensure_ascii=False)
                parts.append(f"[TOOL_RESULTS]{result}[/TOOL_RESULTS]")
            elif self.variant == "v11":
                parts.append(f"[TOOL_RESULTS]{call_id}[TOOL_CONTENT]{content}[/TOOL_RESULTS]")
            else:
                parts.append(f"[TOOL_RESULTS]{content}[/TOOL_RESULTS]")
        return "".join(parts)

    def written_turn(self, message: dict[str, Any]) -> str:
        reasoning = message.get("reasoning_content")
        text = f"{THINK_OPEN}{reasoning}{THINK_CLOSE}" if reasoning else ""
        calls = [(c.get("function", c), c.get("id", "")) for c in message.get("tool_calls") or []]
        if not calls:
            return text + _text(message.get("content")) + "</s>"
        if self.variant != "v13":  # Nemo's and Small's templates write no content beside calls
            text = ""
        else:
            text += _text(message.get("content"))
        as_object = [(f["name"], json.loads(f["arguments"]) if isinstance(f["arguments"], str) else f["arguments"], i)
                     for f, i in calls]
        if self.variant == "nemo":
            listed = [{"name": name, "arguments": arguments, "id": call_id} for name, arguments, call_id in as_object]
            return text + TOOL_CALLS + json.dumps(listed, ensure_ascii=False) + "</s>"
        for name, arguments, call_id in as_object:
            text += TOOL_CALLS + name + (f"{CALL_ID}{call_id}" if self.variant == "v11" else "")
            text += ARGS + json.dumps(arguments, ensure_ascii=False)
        return text + "</s>"

    def template_message(self, message: dict[str, Any]) -> dict[str, Any]:
        message = super().template_message(message)
        reasoning = message.get("reasoning_content")
        if message.get("role") != "assistant" or not reasoning:
            return message
        # Ministral's template takes reasoning as a `thinking` chunk of the content.
        blocks = [{"type": "thinking", "thinking": reasoning}]
        if message.get("content"):
            blocks.append({"type": "text", "text": _text(message["content"])})
        return {k: v for k, v in message.items() if k != "reasoning_content"} | {"content": blocks}

    def probe_call_id(self, index: int) -> str:
        return self.call_id(index)

    def reference_messages(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        if self.variant != "nemo":
            return messages
        # Nemo's Jinja template writes a tool output as it is (`content|string`) where
        # mistral-common, which the model was trained with, writes it as a JSON value; given
        # the JSON text, the template writes what mistral-common does.
        return [m | {"content": json.dumps(_json_or_text(_text(m["content"])), ensure_ascii=False)}
                if m["role"] == "tool" else m for m in messages]

    def probe_reasoning(self, index: int) -> dict[str, Any]:
        if self.variant != "v13":
            return {}
        return {"reasoning_content": ["The 2019 report first.", "Now its page."][index]}


def _json_or_text(content: str) -> Any:
    try:
        return json.loads(content)
    except json.JSONDecodeError:
        return content


def _template_text(tokenizer: Any) -> str:
    template = tokenizer.chat_template
    if isinstance(template, dict):
        return "\n".join(str(t) for t in template.values())
    return template or ""
