"""Llama 3.1 - 3.3: header-framed turns, tool calls as bare JSON, tool results in the
`ipython` role.

    <|start_header_id|>assistant<|end_header_id|>

    {"name": "search", "parameters": {"query": "ACME 2019"}}<|eot_id|><|start_header_id|>ipython<|end_header_id|>

    "reports/ACME/2019/page_3.txt"<|eot_id|><|start_header_id|>assistant<|end_header_id|>

The published templates put the tool schemas in the first user message (or the system
message with `tools_in_user_message=false`: the template's, and so the prompt's, business)
and render a string tool result as a JSON string (`content | tojson`: Jinja's `iterable`
test is true for strings), which the bridge reproduces. They render one call per
assistant message; a model that writes several joins them with `; ` (what vLLM's
`llama3_json` parser reads), and each result gets its own `ipython` turn. A turn may open
with `<|python_tag|>` and end with `<|eom_id|>` (ipython mode); both are read.
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
    snippet,
)
from trainer.chat_formats.hermes import _text

PYTHON_TAG = "<|python_tag|>"
_END_MARKERS = ("<|eot_id|>", "<|eom_id|>", "<|end_of_text|>")
# A turn that starts like a call is one, or a malformed one: never a final answer.
_CALL_START = re.compile(r'\s*\{\s*"(name|function)"\s*:')
_SEPARATOR = re.compile(r"\s*;?\s*")


class Llama3Format(ChatFormat):
    name = "llama3"
    stop_tokens: ClassVar[tuple[str, ...]] = ("<|eot_id|>", "<|eom_id|>")
    skip_special_tokens = False  # <|python_tag|> is special and marks a call

    def parse(self, token_ids: list[int], *, first_call_index: int = 0,
              tools: list[dict[str, Any]] | None = None) -> ParsedTurn:
        text = self.decode(token_ids).rstrip()
        for marker in _END_MARKERS:
            text = text.removesuffix(marker)
        tagged = text.lstrip().startswith(PYTHON_TAG)
        body = text.lstrip().removeprefix(PYTHON_TAG)
        if not tagged and not _CALL_START.match(body):
            content = self.tokenizer.decode(token_ids, skip_special_tokens=True)
            return ParsedTurn(content=content.strip(), tool_calls=[], errors=[])
        calls: list[ParsedToolCall] = []
        errors: list[str] = []
        decoder = json.JSONDecoder()
        pos = _SEPARATOR.match(body, 0).end()
        while pos < len(body):
            try:
                obj, end = decoder.raw_decode(body, pos)
            except json.JSONDecodeError as exc:
                errors.append(f"invalid JSON in a tool call ({exc.msg} at char {exc.pos}): {snippet(body[pos:])}")
                break
            call = call_from_object(obj, f"call_{first_call_index + len(calls)}", "a tool call")
            if isinstance(call, ParsedToolCall):
                calls.append(call)
            else:
                errors.append(call)
            pos = _SEPARATOR.match(body, end).end()
        return ParsedTurn(content="", tool_calls=calls, errors=errors)

    def bridge_text(self, messages: list[dict[str, Any]], n_done: int, tools: list[dict[str, Any]] | None) -> str:
        return "".join(
            "<|start_header_id|>ipython<|end_header_id|>\n\n" + json.dumps(_text(m["content"]), ensure_ascii=False)
            + "<|eot_id|>"
            for m in messages[n_done:]
        )

    def written_turn(self, message: dict[str, Any]) -> str:
        calls = message.get("tool_calls") or []
        if not calls:
            return _text(message.get("content")).strip() + "<|eot_id|>"
        written = []
        for call in calls:
            function = call.get("function", call)
            arguments = function["arguments"]
            arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
            written.append(json.dumps({"name": function["name"], "parameters": arguments}, ensure_ascii=False))
        return "; ".join(written) + "<|eot_id|>"
