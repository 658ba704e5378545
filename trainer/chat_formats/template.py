"""Any other chat template, used as it is when it is prefix-stable.

A template is prefix-stable when the prompt of turn k, plus the model's turn and the
template's end-of-turn text, is a prefix of the next prompt. Then the tokens that follow a
sampled turn are what rendering the whole conversation adds after it (`bridge_ids` renders
twice and keeps the difference), and nothing sampled is ever re-tokenised. Tool calls are
read as `<tool_call>` JSON blocks (the Hermes syntax most tool templates share).

`check_prefix_stable` renders a probe conversation (tool calls, parallel calls, results, a
second user turn) and says where the renderings part. Templates that drop earlier reasoning
(DeepSeek-R1's distills, QwQ re-rendered), count turns in the system prompt or use a call
syntax of their own fail it; such a model needs its family's format, and when it has none
the error names the families there are.
"""

from __future__ import annotations

import json
from typing import Any

from trainer.chat_formats.base import ChatFormat, ParsedTurn, divergence
from trainer.chat_formats.hermes import parse_tool_call_blocks
from trainer.errors import ConfigError

FAMILIES = ("qwen3", "qwen2.5", "llama3", "mistral", "gpt-oss")


class TemplateFormat(ChatFormat):
    name = "template"

    def __init__(self, tokenizer: Any, *, enable_thinking: bool | None = None):
        super().__init__(tokenizer, enable_thinking=enable_thinking)
        marker = "4f1c9e0d"  # content no template alters
        prompt = [{"role": "user", "content": "hi"}]
        before = self.render(prompt, None, add_generation_prompt=True)
        turn = self.render([*prompt, {"role": "assistant", "content": marker}], None, add_generation_prompt=False)
        if not turn.startswith(before + marker):
            raise ConfigError(self._unsupported(
                f"it does not render an assistant turn as generation prompt + content "
                f"({divergence(before + marker, turn)})"))
        # What the template writes after an assistant turn's content (ChatML: "<|im_end|>\n"),
        # less the stop token the model samples itself.
        end = turn[len(before) + len(marker):]
        stop = self.tokenizer.eos_token or ""
        self.turn_tail = end[len(stop):] if stop and end.startswith(stop) else end
        self.stop_tokens = (stop,) if stop else ()

    def parse(self, token_ids: list[int], *, first_call_index: int = 0,
              tools: list[dict[str, Any]] | None = None) -> ParsedTurn:
        return parse_tool_call_blocks(self.decode(token_ids), first_call_index=first_call_index, tools=tools)

    def bridge_ids(self, messages: list[dict[str, Any]], n_done: int, tools: list[dict[str, Any]] | None) -> list[int]:
        done = self.render(messages[:n_done], tools, add_generation_prompt=False)
        full = self.render(messages, tools, add_generation_prompt=True)
        if not full.startswith(done):
            raise ConfigError(self._unsupported(
                f"it re-renders the first {n_done} messages differently once more follow ({divergence(done, full)})"))
        return self.encode(self.turn_tail + full[len(done):])

    def bridge_text(self, messages: list[dict[str, Any]], n_done: int, tools: list[dict[str, Any]] | None) -> str:
        done = self.render(messages[:n_done], tools, add_generation_prompt=False)
        full = self.render(messages, tools, add_generation_prompt=False)
        return self.turn_tail + full[len(done):]

    def written_turn(self, message: dict[str, Any]) -> str:
        raise ConfigError(self._unsupported("it does not render an assistant turn after its generation prompt"))

    def check(self) -> None:
        report = check_prefix_stable(self.tokenizer) or check_tools_and_calls(self.tokenizer)
        if report is not None:
            raise ConfigError(self._unsupported(report))

    def _unsupported(self, why: str) -> str:
        return (
            f"the chat template of {self.tokenizer.name_or_path!r} cannot be used as a plain template "
            f"(model.chat_format template): {why}. Rollouts keep the ids the model sampled, so a template must be "
            f"prefix-stable, show the tools and write <tool_call> blocks, or belong to a family this project renders "
            f"exactly ({', '.join(FAMILIES)}): set model.chat_format to the model's family if its template is a "
            "variant of one, or model.chat_template to a template that shows tools (chatml-tools, shipped, for "
            "ChatML models)"
        )


_PROBE_TOOL = {
    "type": "function",
    "function": {
        "name": "search",
        "description": "Search the reports.",
        "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]},
    },
}


def _probe_call(call_id: str, query: str) -> dict[str, Any]:
    arguments = json.dumps({"query": query}, separators=(",", ":"))
    return {"id": call_id, "type": "function", "function": {"name": "search", "arguments": arguments}}


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


def check_prefix_stable(tokenizer: Any, tools: list[dict[str, Any]] | None = None) -> str | None:
    """Whether the tokenizer's chat template renders a tool conversation prefix-stably.

    For every assistant turn of a probe conversation: its rendering starts with the
    generation prompt before it and is a prefix of every later prompt. Returns None when
    it is stable, else a sentence saying where the renderings part."""
    tools = tools or [_PROBE_TOOL]
    messages = _PROBE_MESSAGES

    def render(upto: int, add_generation_prompt: bool) -> str:
        try:
            return tokenizer.apply_chat_template(messages[:upto], tools=tools, add_generation_prompt=add_generation_prompt,
                                                 tokenize=False)
        except Exception as exc:  # the template refuses the probe (one call a turn, roles, ids)
            raise ConfigError(
                f"the chat template of {tokenizer.name_or_path!r} refuses a tool conversation ({exc}); it matches "
                f"none of the families this project renders exactly ({', '.join(FAMILIES)}): set model.chat_format "
                "to the model's family if its template is a variant of one"
            ) from exc

    turns = [k for k, message in enumerate(messages) if message["role"] == "assistant"]
    prompts = {k: render(k, True) for k in [*turns, len(messages)]}
    for k in turns:
        rendered = render(k + 1, False)
        if not rendered.startswith(prompts[k]):
            return (
                f"assistant message {k} is not rendered as the generation prompt before it "
                f"plus its text ({divergence(prompts[k], rendered)})"
            )
        for later, prompt in prompts.items():
            if later > k and not prompt.startswith(rendered):
                return (
                    f"the first {k + 1} messages render differently once {later} are "
                    f"rendered ({divergence(rendered, prompt)})"
                )
    return None


_SHOWN_TOOL = {
    "type": "function",
    "function": {"name": "lookup_probe_7c1e", "description": "A probe tool.",
                 "parameters": {"type": "object", "properties": {"key": {"type": "string"}}}},
}


def check_tools_and_calls(tokenizer: Any) -> str | None:
    """Whether the template shows the tools it is given (a model that cannot see its tools
    makes no calls: it answers from memory, and nothing says why), and writes a tool call in
    the `<tool_call>` syntax the format reads back (another syntax would be read as the
    final answer). None when it does both, else a sentence saying which it does not."""
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tools=[_SHOWN_TOOL],
                                           add_generation_prompt=True, tokenize=False)
    if "lookup_probe_7c1e" not in prompt:
        return ("it does not show the tools it is given (a tool's name is not in the prompt it renders), so the "
                "model cannot call them")
    before = tokenizer.apply_chat_template(_PROBE_MESSAGES[:2], tools=[_PROBE_TOOL], add_generation_prompt=True,
                                           tokenize=False)
    turn = tokenizer.apply_chat_template(_PROBE_MESSAGES[:3], tools=[_PROBE_TOOL], add_generation_prompt=False,
                                         tokenize=False)
    written = turn[len(before):] if turn.startswith(before) else turn
    calls = parse_tool_call_blocks(written, tools=[_PROBE_TOOL]).tool_calls
    if [(c.name, json.loads(c.arguments)) for c in calls] != [("search", {"query": "ACME 2019"})]:
        return ("it writes a tool call in a syntax the format does not read back: the call search(query='ACME "
                f"2019') renders as {written.strip()[:160]!r}, which the format would take for a final answer")
    return None
