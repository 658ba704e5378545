"""gpt-oss: OpenAI's harmony format. A turn is a run of messages on channels: `analysis`
(the reasoning), `commentary` (tool calls, addressed `to=functions.NAME`, and preambles)
and `final` (the answer). Sampling stops at `<|call|>` (a tool call) or `<|return|>` (the
answer); `<|end|>` closes a message inside the turn.

    <|start|>assistant<|channel|>analysis<|message|>The 2019 report first.<|end|>
    <|start|>assistant<|channel|>commentary to=functions.search <|constrain|>json<|message|>{"query":"ACME 2019"}<|call|>
    <|start|>functions.search to=assistant<|channel|>commentary<|message|>{"pages": [...]}<|end|>
    <|start|>assistant

The recipient may stand in the role (`<|start|>assistant to=functions.search<|channel|>...`,
as the published template writes it) or after the channel (as harmony's docs do); both are
read. Tool results are written as harmony writes them (openai-harmony, vLLM's gpt-oss
server): the output text as it is. The published Jinja template instead JSON-encodes a tool
message's content (`content | tojson`), which quotes a plain string; it agrees with harmony
only for outputs given as objects, which is how the self-check hands them to it. Harmony
calls one tool per turn. The analysis of earlier turns stays in a tool rollout, as harmony
keeps it until a final answer.

Why not openai-harmony itself: its encoder loads the o200k vocabulary from OpenAI's servers
(or a tiktoken file a machine must be given by hand), and no such server is reachable here, in
CI or on the GPU machines; rendering through the model's own template and reading the channels
from its token ids needs neither. openai-harmony is the reference this format is tested
against (tests/trainer/test_chat_format_references.py, with the o200k vocabulary a package on
the index carries): the first prompt, a turn's parse and the bridge agree token for token.
"""

from __future__ import annotations

import json
import re
from typing import Any, ClassVar

from trainer.chat_formats.base import (
    ChatFormat,
    ParsedToolCall,
    ParsedTurn,
    compact_arguments,
    snippet,
)
from trainer.chat_formats.hermes import _text

START, CHANNEL, MESSAGE = "<|start|>", "<|channel|>", "<|message|>"
TERMINATORS = ("<|end|>", "<|call|>", "<|return|>")
_RECIPIENT = re.compile(r"to=([^\s<]+)")
_CHANNEL_NAME = re.compile(r"<\|channel\|>\s*([A-Za-z_]+)")


class GptOssFormat(ChatFormat):
    name = "gpt-oss"
    stop_tokens: ClassVar[tuple[str, ...]] = ("<|return|>", "<|call|>")
    skip_special_tokens = False

    def __init__(self, tokenizer: Any, *, enable_thinking: bool | None = None):
        super().__init__(tokenizer, enable_thinking=enable_thinking)
        ids = {marker: self.encode(marker) for marker in (CHANNEL, MESSAGE, *TERMINATORS)}
        self._ids = {marker: found[0] for marker, found in ids.items() if len(found) == 1}

    def parse(self, token_ids: list[int], *, first_call_index: int = 0,
              tools: list[dict[str, Any]] | None = None) -> ParsedTurn:
        text = self.decode(token_ids)
        reasoning: list[str] = []
        final: list[str] = []
        preamble: list[str] = []
        calls: list[ParsedToolCall] = []
        errors: list[str] = []
        for segment in text.split(START):
            if not segment.strip():
                continue
            header, has_body, rest = segment.partition(MESSAGE)
            if not has_body:
                errors.append(f"a harmony message without {MESSAGE}: {snippet(segment)}")
                continue
            ends = [(rest.find(t), t) for t in TERMINATORS if t in rest]
            body = rest[: min(ends)[0]] if ends else rest
            channel = _CHANNEL_NAME.search(header)
            recipient = _RECIPIENT.search(header)
            if recipient:
                calls_or_error = self._call(recipient.group(1), body, first_call_index + len(calls))
                if isinstance(calls_or_error, str):
                    errors.append(calls_or_error)
                else:
                    calls.append(calls_or_error)
            elif channel and channel.group(1) == "analysis":
                reasoning.append(body)
            elif channel and channel.group(1) == "final":
                final.append(body)
            else:  # a commentary preamble: shown to the user, as content
                preamble.append(body)
        content = "\n".join(final) if final else "\n".join(preamble)
        open_reasoning = bool(reasoning) and not final and not preamble and not calls and not errors
        return ParsedTurn(content=content.strip(), tool_calls=calls, errors=errors, reasoning="\n".join(reasoning),
                          reasoning_tokens=self._analysis_tokens(token_ids), reasoning_open=open_reasoning)

    @staticmethod
    def _call(recipient: str, body: str, index: int) -> ParsedToolCall | str:
        name = recipient.removeprefix("functions.")
        try:
            arguments = compact_arguments(json.loads(body))
        except json.JSONDecodeError as exc:
            return f"invalid JSON in the call to {recipient} ({exc.msg} at char {exc.pos}): {snippet(body)}"
        if arguments is None:
            return f"the arguments of the call to {recipient} are not a JSON object: {snippet(body)}"
        return ParsedToolCall(name=name, arguments=arguments, call_id=f"call_{index}")

    def _analysis_tokens(self, token_ids: list[int]) -> int:
        """Sampled tokens of analysis messages, from their <|channel|> to their terminator."""
        ids = self._ids
        if CHANNEL not in ids or MESSAGE not in ids:
            return 0
        ends = {ids[t] for t in TERMINATORS if t in ids}
        count, i = 0, 0
        while i < len(token_ids):
            if token_ids[i] != ids[CHANNEL]:
                i += 1
                continue
            j = next((k for k in range(i + 1, len(token_ids)) if token_ids[k] == ids[MESSAGE]), len(token_ids))
            end = next((k for k in range(j, len(token_ids)) if token_ids[k] in ends), len(token_ids) - 1)
            if self.tokenizer.decode(token_ids[i + 1 : j]).strip().startswith("analysis"):
                count += end - i + 1
            i = end + 1
        return count

    def bridge_text(self, messages: list[dict[str, Any]], n_done: int, tools: list[dict[str, Any]] | None) -> str:
        called = {
            call["id"]: call["function"]["name"]
            for call in messages[n_done - 1].get("tool_calls") or []
        }
        return "".join(
            f"{START}functions.{called.get(m.get('tool_call_id'), 'unknown')} to=assistant{CHANNEL}commentary"
            f"{MESSAGE}{_text(m['content'])}<|end|>"
            for m in messages[n_done:]
        )

    def written_turn(self, message: dict[str, Any]) -> str:
        """Harmony as the model writes it: the thought, then the call or the answer."""
        text = ""
        if message.get("reasoning_content"):
            text += f"{CHANNEL}analysis{MESSAGE}{message['reasoning_content']}<|end|>{START}assistant"
        calls = message.get("tool_calls") or []
        if not calls:
            return text + f"{CHANNEL}final{MESSAGE}{_text(message.get('content'))}<|return|>"
        function = calls[0].get("function", calls[0])
        arguments = compact_arguments(function["arguments"]) or "{}"
        return text + f"{CHANNEL}commentary to=functions.{function['name']} <|constrain|>json{MESSAGE}{arguments}<|call|>"

    def template_message(self, message: dict[str, Any]) -> dict[str, Any]:
        message = super().template_message(message)
        if message.get("role") != "assistant" or not message.get("reasoning_content"):
            return message
        fixed = {k: v for k, v in message.items() if k != "reasoning_content"}
        fixed["thinking"] = message["reasoning_content"]
        if fixed.get("tool_calls"):
            fixed.pop("content", None)  # the template takes either a thought or content before a call
        return fixed

    def probe_reasoning(self, index: int) -> dict[str, Any]:
        return {"reasoning_content": ["The 2019 report first.", "Now its page."][index]}

    def probe_output(self, index: int) -> str:
        return [json.dumps({"pages": ["reports/ACME/2019/page_3.txt"]}),
                json.dumps({"text": "Revenue was 12.5 million."})][index]

    def reference_messages(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [m | {"content": json.loads(m["content"])} if m["role"] == "tool" else m for m in messages]
