"""Qwen2.5 / Hermes and Qwen3: ChatML turns, `<tool_call>` JSON blocks, tool results in
a user turn as `<tool_response>` blocks.

    <|im_start|>assistant
    <think>
    The 2019 report first.
    </think>

    <tool_call>
    {"name": "search", "arguments": {"query": "ACME 2019"}}
    </tool_call><|im_end|>
    <|im_start|>user
    <tool_response>
    reports/ACME/2019/page_3.txt
    </tool_response><|im_end|>
    <|im_start|>assistant

Several blocks in one turn are parallel calls. A block holds JSON, or (Qwen3.5, Qwen3-Coder)
`<function=NAME>` with one `<parameter=KEY>` per argument, whose text is typed by the tool's
schema as vLLM's qwen3_coder parser does. Qwen3 adds the `<think>` block; its template
shows reasoning only on assistant turns after the last user query (the "think gate") and,
with `enable_thinking: false`, opens each generation with an empty `<think>\\n\\n</think>\\n\\n`
that it leaves out of earlier turns when it re-renders them. A rollout never re-renders:
it keeps the ids it sampled (the empty think block included, since the model saw it) and
appends only the tool results and the next generation prompt, so every turn of a tool
rollout is token-exact. QwQ and templates whose generation prompt already opens `<think>`
are read the same way (the reasoning then starts in the prompt).
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
from trainer.errors import ConfigError

TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
TOOL_TAGS = (TOOL_CALL_OPEN, TOOL_CALL_CLOSE, "<tool_response>", "</tool_response>")
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
# A model's text decoded without skip_special_tokens still ends with its end-of-turn marker.
_END_MARKERS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>")


def parse_tool_call_blocks(text: str, *, first_call_index: int = 0,
                           tools: list[dict[str, Any]] | None = None) -> ParsedTurn:
    """Split text into what lies outside `<tool_call>` blocks, the calls and the malformed
    blocks (bad JSON, no name, arguments not an object, an unclosed tag). A block holds JSON
    (Qwen2.5, Qwen3) or Qwen3.5's XML (`<function=NAME>` with `<parameter=KEY>` values, typed
    by the tool's schema in `tools`). Call ids are `call_<n>` from `first_call_index`. Never
    raises."""
    text = text.rstrip()
    for marker in _END_MARKERS:
        text = text.removesuffix(marker)
    content_parts: list[str] = []
    calls: list[ParsedToolCall] = []
    errors: list[str] = []
    pos = 0
    while (start := text.find(TOOL_CALL_OPEN, pos)) >= 0:
        content_parts.append(text[pos:start])
        body_start = start + len(TOOL_CALL_OPEN)
        end = text.find(TOOL_CALL_CLOSE, body_start)
        next_open = text.find(TOOL_CALL_OPEN, body_start)
        if end < 0 or 0 <= next_open < end:
            # The block runs to the next opening tag or to the end of the text.
            pos = next_open if next_open >= 0 else len(text)
            errors.append(f"unclosed {TOOL_CALL_OPEN} tag: {snippet(text[body_start:pos])}")
            continue
        body = text[body_start:end]
        call_id = f"call_{first_call_index + len(calls)}"
        if body.lstrip().startswith("<function="):
            call = _xml_call(body, call_id, tools)
        else:
            try:
                call = call_from_object(json.loads(body), call_id, TOOL_CALL_OPEN)
            except json.JSONDecodeError as exc:
                call = f"invalid JSON in {TOOL_CALL_OPEN} ({exc.msg} at char {exc.pos}): {snippet(body)}"
        if isinstance(call, ParsedToolCall):
            calls.append(call)
        else:
            errors.append(call)
        pos = end + len(TOOL_CALL_CLOSE)
    content_parts.append(text[pos:])
    content = "".join(content_parts)
    if TOOL_CALL_CLOSE in content:
        errors.append(f"{TOOL_CALL_CLOSE} without an opening {TOOL_CALL_OPEN}")
        content = content.replace(TOOL_CALL_CLOSE, "")
    return ParsedTurn(content=content.strip(), tool_calls=calls, errors=errors)


_XML_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>(.*)</function>\s*", re.DOTALL)
_XML_PARAMETER = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.DOTALL)


def _xml_call(body: str, call_id: str, tools: list[dict[str, Any]] | None) -> ParsedToolCall | str:
    """Qwen3.5's (and Qwen3-Coder's) call: the template writes an object or a list as JSON
    and any other value as text, so a value is read by its parameter's type in the schema
    (text where the schema says string or says nothing)."""
    match = _XML_FUNCTION.fullmatch(body)
    if not match:
        return f"a {TOOL_CALL_OPEN} must hold <function=NAME>...</function>: {snippet(body)}"
    name, inner = match.group(1).strip(), match.group(2)
    schema = next((t.get("function", t).get("parameters") or {} for t in tools or []
                   if t.get("function", t).get("name") == name), {})
    properties = schema.get("properties") or {}
    arguments: dict[str, Any] = {}
    for key, raw in _XML_PARAMETER.findall(inner):
        value = _typed(raw, (properties.get(key) or {}).get("type"))
        if value is _INVALID:
            return f"<parameter={key}> of {name!r} is not of type {properties[key]['type']}: {snippet(raw)}"
        arguments[key] = value
    if _XML_PARAMETER.sub("", inner).strip():
        return f"text outside <parameter> tags in the call to {name!r}: {snippet(inner)}"
    return ParsedToolCall(name=name, arguments=json.dumps(arguments, ensure_ascii=False, separators=(",", ":")),
                          call_id=call_id)


_INVALID = object()


def _typed(raw: str, kind: Any) -> Any:
    if kind in (None, "string") or not isinstance(kind, str):
        return raw
    if kind == "boolean":
        return {"true": True, "false": False}.get(raw.strip().lower(), _INVALID)
    try:
        value = json.loads(raw)
    except json.JSONDecodeError:
        return _INVALID
    ok = {"integer": int, "number": (int, float), "object": dict, "array": list, "null": type(None)}.get(kind, object)
    return value if isinstance(value, ok) and not (kind in ("integer", "number") and isinstance(value, bool)) \
        else _INVALID


class HermesFormat(ChatFormat):
    """Qwen2.5 and the Hermes tool format (Hermes 2 Pro / 3, and this project's demo model)."""

    name = "qwen2.5"
    stop_tokens: ClassVar[tuple[str, ...]] = ("<|im_end|>", "<|endoftext|>")
    # What the template writes after the sampled <|im_end|>.
    turn_tail = "\n"

    def __init__(self, tokenizer: Any, *, enable_thinking: bool | None = None):
        super().__init__(tokenizer, enable_thinking=enable_thinking)
        template = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else ""
        # Qwen3.5 and Qwen3-Coder write calls as <function=NAME> XML; Qwen3-Coder also ends
        # each tool response with a newline ("</tool_response>\n<|im_end|>").
        self.xml_calls = "<function=" in template
        self.response_newline = "</tool_response>\n<|im_end|>" in self._rendered_tool_result()

    def parse(self, token_ids: list[int], *, first_call_index: int = 0,
              tools: list[dict[str, Any]] | None = None) -> ParsedTurn:
        return parse_tool_call_blocks(self.decode(token_ids), first_call_index=first_call_index, tools=tools)

    def _rendered_tool_result(self) -> str:
        call = {"id": "call_0", "type": "function", "function": {"name": "search", "arguments": "{}"}}
        try:
            return self.render([{"role": "user", "content": "q"}, {"role": "assistant", "content": "", "tool_calls": [call]},
                                {"role": "tool", "tool_call_id": "call_0", "content": "r"}], None,
                               add_generation_prompt=False)
        except ConfigError:
            return ""  # the start-up check reports what the template refuses

    def bridge_text(self, messages: list[dict[str, Any]], n_done: int, tools: list[dict[str, Any]] | None) -> str:
        results = messages[n_done:]
        text = self.turn_tail
        if results and self.response_newline:
            text += "<|im_start|>user\n"
            text += "".join(f"<tool_response>\n{_text(m['content'])}\n</tool_response>\n" for m in results)
            text += "<|im_end|>\n"
        elif results:
            text += "<|im_start|>user"
            text += "".join(f"\n<tool_response>\n{_text(m['content'])}\n</tool_response>" for m in results)
            text += "<|im_end|>\n"
        return text

    def written_turn(self, message: dict[str, Any]) -> str:
        content = _text(message.get("content"))
        blocks = []
        for call in message.get("tool_calls") or []:
            function = call.get("function", call)
            arguments = function["arguments"]
            arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
            if self.xml_calls:
                parameters = "".join(
                    f"<parameter={key}>\n"
                    f"{json.dumps(value, ensure_ascii=False) if isinstance(value, (dict, list)) else _xml_value(value)}"
                    "\n</parameter>\n" for key, value in arguments.items())
                blocks.append(f"<tool_call>\n<function={function['name']}>\n{parameters}</function>\n</tool_call>")
                continue
            blocks.append(f'<tool_call>\n{{"name": "{function["name"]}", "arguments": '
                          f'{json.dumps(arguments, ensure_ascii=False)}}}\n</tool_call>')
        # Qwen3-Coder's template sets a blank line between the content and the first call.
        text = "\n".join([content + "\n" * self.xml_calls, *blocks] if content else blocks)
        return self._reasoning_text(message) + text + "<|im_end|>"

    def _reasoning_text(self, message: dict[str, Any]) -> str:
        return ""


class Qwen3Format(HermesFormat):
    """Qwen3 (and QwQ): the Hermes format with a `<think>` block before the answer."""

    name = "qwen3"
    has_thinking_switch = True

    def __init__(self, tokenizer: Any, *, enable_thinking: bool | None = None):
        super().__init__(tokenizer, enable_thinking=enable_thinking)
        # Whether the generation prompt leaves a <think> block open (QwQ, Qwen3.5): the
        # sampled text then starts inside the reasoning.
        prompt = self.generation_prompt
        self.prompt_opens_reasoning = prompt.rfind(THINK_OPEN) > prompt.rfind(THINK_CLOSE)
        close_ids = self.encode(THINK_CLOSE)
        self._think_close_id = close_ids[0] if len(close_ids) == 1 else None

    def parse(self, token_ids: list[int], *, first_call_index: int = 0,
              tools: list[dict[str, Any]] | None = None) -> ParsedTurn:
        text = self.decode(token_ids)
        opened = self.prompt_opens_reasoning or text.lstrip().startswith(THINK_OPEN)
        if not opened:
            return parse_tool_call_blocks(text, first_call_index=first_call_index, tools=tools)
        head, closed, rest = text.partition(THINK_CLOSE)
        reasoning = head.lstrip()
        reasoning = reasoning.removeprefix(THINK_OPEN).strip("\n")
        if not closed:  # stopped inside the reasoning: no answer, no calls
            for marker in _END_MARKERS:
                reasoning = reasoning.rstrip().removesuffix(marker)
            return ParsedTurn(content="", tool_calls=[], errors=[], reasoning=reasoning.strip("\n"),
                              reasoning_tokens=len(token_ids), reasoning_open=True)
        parsed = parse_tool_call_blocks(rest.lstrip("\n"), first_call_index=first_call_index, tools=tools)
        return ParsedTurn(content=parsed.content, tool_calls=parsed.tool_calls, errors=parsed.errors,
                          reasoning=reasoning, reasoning_tokens=self._reasoning_tokens(token_ids, head + closed))

    def _reasoning_tokens(self, token_ids: list[int], reasoning_text: str) -> int:
        if self._think_close_id is not None and self._think_close_id in token_ids:
            return token_ids.index(self._think_close_id) + 1
        return len(self.encode(reasoning_text))  # a tokenizer without a </think> token

    def _reasoning_text(self, message: dict[str, Any]) -> str:
        reasoning = (message.get("reasoning_content") or "").strip("\n")
        if self.prompt_opens_reasoning:
            return f"{reasoning}\n{THINK_CLOSE}\n\n"
        if self.generation_prompt.rstrip().endswith(THINK_CLOSE):  # thinking off: the prompt closed it
            return ""
        return f"{THINK_OPEN}\n{reasoning}\n{THINK_CLOSE}\n\n"

    def probe_reasoning(self, index: int) -> dict[str, Any]:
        if self.generation_prompt.rstrip().endswith(THINK_CLOSE):
            return {}
        return {"reasoning_content": ["The 2019 report first.", "Now its page."][index]}


def _xml_value(value: Any) -> str:
    """A scalar as the XML templates write it (Jinja's `string` filter: True, None)."""
    return str(value)


def _text(content: Any) -> str:
    if isinstance(content, list):  # OpenAI content parts
        return "".join(part.get("text", "") for part in content if isinstance(part, dict))
    return "" if content is None else str(content)
