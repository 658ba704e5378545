"""The chat format: how a conversation with tools becomes text, and how the model's text
becomes tool calls again.

The format is Qwen2.5's (Hermes) tool format, which Qwen2.5/Qwen3 and many Llama-3 tool
templates share: tool schemas go in the system turn, the model calls a tool by writing

    <tool_call>
    {"name":"search","arguments":{"query":"ACME revenue"}}
    </tool_call>

(several blocks in one turn are parallel calls) and tool results come back in a user turn
as `<tool_response>` blocks. `CHAT_TEMPLATE` is the demo tokenizer's Jinja template; it
renders the same structure as Qwen2.5's, only more compactly (one JSON line per tool, no
spaces in JSON) because the demo model's context is short. `parse_assistant_output` reads
what any model of this family writes, so the engine works with the demo tokenizer and with
a real chat model's own template alike.

Rendering goes through `tokenizer.apply_chat_template(messages, tools=tools,
add_generation_prompt=True, tokenize=False)`, which returns the string. In transformers 5,
`tokenize=True` returns a `BatchEncoding` (`return_dict=True` is the default); callers that
want ids should render the string and call `tokenizer(text, add_special_tokens=False)`,
or pass `return_dict=False`.

The engine reuses the KV cache across turns. That needs prefix-stable rendering: the
prompt of turn k plus the model's text and end-of-turn marker must be a string prefix of
the next prompt. `CHAT_TEMPLATE` is (when the model writes the canonical form that
`assistant_message` renders back). After a generated turn the engine's text is its
output plus `assistant_turn_end` (for ChatML `<|im_end|>\n`: the sampled eos and a newline),
followed by `continuation_text` (tool responses, the next generation prompt);
`check_prefix_stable` tells whether another model's template allows this.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from trainer.errors import ConfigError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
TOOL_TAGS = (TOOL_CALL_OPEN, TOOL_CALL_CLOSE, "<tool_response>", "</tool_response>")

# Jinja for transformers' apply_chat_template. `tojson` there is json.dumps with
# ensure_ascii=False; separators=(',', ':') makes it compact. Tool-call arguments that are
# already a JSON string (OpenAI message shape) are written as they are.
CHAT_TEMPLATE = r"""
{%- macro text(content) -%}
  {%- if content is string -%}{{ content }}
  {%- elif content is iterable and content is not mapping -%}
    {%- for part in content if part.type == 'text' -%}{{ part.text }}{%- endfor -%}
  {%- endif -%}
{%- endmacro -%}
{%- set has_system = messages[0].role == 'system' -%}
{%- if has_system or tools -%}
  {{- '<|im_start|>system\n' -}}
  {%- if has_system -%}
    {{- text(messages[0].content) -}}
    {%- if tools -%}{{- '\n\n' -}}{%- endif -%}
  {%- endif -%}
  {%- if tools -%}
    {#- One compact signature a line: the demo model's context is short. -#}
    {{- '# Tools\n<tools>\n' -}}
    {%- for tool in tools -%}
      {%- set fn = tool.function if tool.function is defined else tool -%}
      {%- set schema = fn.parameters if fn.parameters is defined else {} -%}
      {%- set required = schema.required if schema.required is defined else [] -%}
      {{- fn.name + '(' -}}
      {%- if schema.properties is defined -%}
        {%- for name, spec in schema.properties.items() -%}
          {{- name + ('' if name in required else '?') + ':' + (spec.type if spec.type is defined else 'any') -}}
          {%- if not loop.last -%}{{- ',' -}}{%- endif -%}
        {%- endfor -%}
      {%- endif -%}
      {{- ') ' + (fn.description if fn.description is defined else '') + '\n' -}}
    {%- endfor -%}
    {{- '</tools>\nCall tools as <tool_call>\n{"name":<name>,"arguments":<json-object>}\n</tool_call>' -}}
  {%- endif -%}
  {{- '<|im_end|>\n' -}}
{%- endif -%}
{%- for message in messages -%}
  {%- if message.role == 'tool' -%}
    {#- Consecutive tool results share one user turn, as in Qwen's template. -#}
    {%- if loop.first or loop.previtem.role != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}
    {{- '\n<tool_response>\n' + text(message.content) + '\n</tool_response>' -}}
    {%- if loop.last or loop.nextitem.role != 'tool' -%}{{- '<|im_end|>\n' -}}{%- endif -%}
  {%- elif not (loop.first and has_system) -%}
    {%- set content = text(message.content) -%}
    {{- '<|im_start|>' + message.role + '\n' + content -}}
    {%- if message.role == 'assistant' and message.tool_calls -%}
      {%- for tool_call in message.tool_calls -%}
        {%- set fn = tool_call.function if tool_call.function is defined else tool_call -%}
        {%- if content or not loop.first -%}{{- '\n' -}}{%- endif -%}
        {{- '<tool_call>\n{"name":' + fn.name | tojson + ',"arguments":' -}}
        {%- if fn.arguments is string -%}{{- fn.arguments -}}
        {%- else -%}{{- fn.arguments | tojson(separators=(',', ':')) -}}{%- endif -%}
        {{- '}\n</tool_call>' -}}
      {%- endfor -%}
    {%- endif -%}
    {{- '<|im_end|>\n' -}}
  {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}
"""

# A model's text decoded without skip_special_tokens still ends with its end-of-turn marker.
_END_MARKERS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>")
_SNIPPET_CHARS = 80


@dataclass(frozen=True)
class ParsedToolCall:
    """One `<tool_call>` block: `arguments` is a compact JSON object string."""

    name: str
    arguments: str
    call_id: str


@dataclass(frozen=True)
class ParsedTurn:
    """An assistant turn split into its text, its tool calls and its malformed blocks."""

    content: str
    tool_calls: list[ParsedToolCall]
    errors: list[str]


def parse_assistant_output(text: str, *, first_call_index: int = 0) -> ParsedTurn:
    """Split a model's turn into text outside tool calls, tool calls and errors.

    Every `<tool_call>` block is a call (several are parallel calls) or one entry in
    `errors` (bad JSON, missing name, arguments not an object, unclosed tag). Call ids are
    `call_<n>` counting from `first_call_index`, so a rollout can keep them unique across
    turns. Never raises.
    """
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
            errors.append(f"unclosed {TOOL_CALL_OPEN} tag: {_snippet(text[body_start:pos])}")
            continue
        call = _parse_call(text[body_start:end], f"call_{first_call_index + len(calls)}")
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


def _parse_call(body: str, call_id: str) -> ParsedToolCall | str:
    """One block's JSON as a call, or the error message that says what is wrong with it."""
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as exc:
        return f"invalid JSON in {TOOL_CALL_OPEN} ({exc.msg} at char {exc.pos}): {_snippet(body)}"
    if not isinstance(obj, dict):
        return f'{TOOL_CALL_OPEN} must hold a JSON object {{"name", "arguments"}}: {_snippet(body)}'
    name = obj.get("name")
    if not isinstance(name, str) or not name.strip():
        return f'{TOOL_CALL_OPEN} has no "name" string: {_snippet(body)}'
    # Llama-3 style tool calls say "parameters"; a call without arguments takes none.
    arguments = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(arguments, str):  # OpenAI style: the arguments object as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            pass  # reported below as not an object
    if not isinstance(arguments, dict):
        return f'{TOOL_CALL_OPEN} "arguments" of {name!r} is not a JSON object: {_snippet(body)}'
    compact = json.dumps(arguments, ensure_ascii=False, separators=(",", ":"))
    return ParsedToolCall(name=name, arguments=compact, call_id=call_id)


def _snippet(text: str) -> str:
    text = text.strip()
    return repr(text if len(text) <= _SNIPPET_CHARS else text[:_SNIPPET_CHARS] + "...")


def final_answer(text: str) -> str:
    """The text of a turn outside any tool call: the answer when the turn calls no tool."""
    return parse_assistant_output(text).content


def tool_calls_to_openai(parsed: ParsedTurn) -> list[dict[str, Any]]:
    """The turn's calls in OpenAI's message `tool_calls` shape."""
    return [
        {
            "id": call.call_id,
            "type": "function",
            "function": {"name": call.name, "arguments": call.arguments},
        }
        for call in parsed.tool_calls
    ]


def assistant_message(parsed: ParsedTurn) -> dict[str, Any]:
    """The turn as an OpenAI assistant message; `CHAT_TEMPLATE` renders it back to the
    canonical text `content + "\\n" + <tool_call> blocks`."""
    message: dict[str, Any] = {"role": "assistant", "content": parsed.content}
    if parsed.tool_calls:
        message["tool_calls"] = tool_calls_to_openai(parsed)
    return message


def _render(
    tokenizer: PreTrainedTokenizerBase,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    add_generation_prompt: bool,
) -> str:
    return tokenizer.apply_chat_template(
        messages, tools=tools or None, add_generation_prompt=add_generation_prompt, tokenize=False
    )


def continuation_text(
    tokenizer: PreTrainedTokenizerBase,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    n_done: int,
) -> str:
    """What rendering all of `messages` plus the generation prompt adds after the first
    `n_done` messages.

    Call it with `messages[n_done - 1]` the assistant turn just generated: the engine holds
    the prompt, the generated text and `assistant_turn_end` for it, and appends this text
    (tool responses, the next generation prompt). The text starts at a turn marker, so it
    can be tokenized on its own with `add_special_tokens=False`. `n_done=0` gives the
    first prompt.
    """
    # n_done=0 gives the whole first prompt (an empty conversation cannot be rendered).
    done = _render(tokenizer, messages[:n_done], tools, False) if n_done else ""
    full = _render(tokenizer, messages, tools, add_generation_prompt=True)
    if not full.startswith(done):
        raise ConfigError(
            f"the chat template of {tokenizer.name_or_path!r} re-renders the first {n_done} "
            f"messages differently once more follow ({_divergence(done, full)}); it cannot "
            "reuse the KV cache across turns: turn KV reuse off for this model"
        )
    return full[len(done) :]


def assistant_turn_end(tokenizer: PreTrainedTokenizerBase) -> str:
    """The text the template puts after an assistant turn's content (for ChatML
    `<|im_end|>\\n`, for Llama-3 `<|eot_id|>`)."""
    marker = "4f1c9e0d"  # content no template alters
    prompt = [{"role": "user", "content": "hi"}]
    before = _render(tokenizer, prompt, None, add_generation_prompt=True)
    turn = _render(tokenizer, [*prompt, {"role": "assistant", "content": marker}], None, False)
    if not turn.startswith(before + marker):
        raise ConfigError(
            f"the chat template of {tokenizer.name_or_path!r} does not render an assistant "
            f"turn as generation prompt + content ({_divergence(before + marker, turn)}); "
            "turn KV reuse off for this model"
        )
    return turn[len(before) + len(marker) :]


_PROBE_TOOL = {
    "type": "function",
    "function": {
        "name": "search",
        "description": "Search the reports.",
        "parameters": {
            "type": "object",
            "properties": {"query": {"type": "string"}},
            "required": ["query"],
        },
    },
}


def _probe_call(call_id: str, query: str) -> dict[str, Any]:
    arguments = json.dumps({"query": query}, separators=(",", ":"))
    return {
        "id": call_id,
        "type": "function",
        "function": {"name": "search", "arguments": arguments},
    }


_PROBE_MESSAGES: list[dict[str, Any]] = [
    {"role": "system", "content": "You answer questions about company reports."},
    {"role": "user", "content": "What was ACME's revenue in 2019?"},
    {"role": "assistant", "content": "", "tool_calls": [_probe_call("call_0", "ACME 2019")]},
    {"role": "tool", "tool_call_id": "call_0", "content": "reports/ACME/2019/page_3.txt"},
    {
        "role": "assistant",
        "content": "Two more pages.",
        "tool_calls": [_probe_call("call_1", "revenue"), _probe_call("call_2", "sales")],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "Revenue was 12.5 million."},
    {"role": "tool", "tool_call_id": "call_2", "content": "No match."},
    {"role": "assistant", "content": "12.5"},
    {"role": "user", "content": "And in 2018?"},
]


def check_prefix_stable(
    tokenizer: PreTrainedTokenizerBase, tools: list[dict[str, Any]] | None = None
) -> str | None:
    """Whether the tokenizer's chat template renders a tool conversation prefix-stably.

    Renders a probe conversation (tool calls, parallel calls, tool results, a second user
    turn) and checks, for every assistant turn, that its rendering starts with the
    generation prompt before it and is a prefix of every later prompt. Returns None when
    it is stable, else a sentence saying where the renderings part. Templates that drop
    earlier reasoning (Qwen3's `<think>`) or count turns in the system prompt fail it.
    """
    tools = tools or [_PROBE_TOOL]
    messages = _PROBE_MESSAGES
    turns = [k for k, message in enumerate(messages) if message["role"] == "assistant"]
    prompts = {k: _render(tokenizer, messages[:k], tools, True) for k in [*turns, len(messages)]}
    for k in turns:
        rendered = _render(tokenizer, messages[: k + 1], tools, False)
        if not rendered.startswith(prompts[k]):
            return (
                f"assistant message {k} is not rendered as the generation prompt before it "
                f"plus its text ({_divergence(prompts[k], rendered)})"
            )
        for later, prompt in prompts.items():
            if later > k and not prompt.startswith(rendered):
                return (
                    f"the first {k + 1} messages render differently once {later} are "
                    f"rendered ({_divergence(rendered, prompt)})"
                )
    return None


def _divergence(prefix: str, text: str) -> str:
    at = next(
        (i for i, (a, b) in enumerate(zip(prefix, text, strict=False)) if a != b),
        min(len(prefix), len(text)),
    )
    return f"they part at char {at}: {prefix[at : at + 40]!r} vs {text[at : at + 40]!r}"
