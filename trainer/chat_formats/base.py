"""What every chat format shares: the parsed turn, rendering through the tokenizer's own
template, the generation prompt, canonical assistant turns and the start-up self-check.

A format turns messages into the *first* prompt's token ids with the model's published
chat template (`apply_chat_template`: the system prompt, the tool block, dates, defaults
are the template's business), and from there on never renders history again: the engine
keeps the ids it sampled, the format parses them (`parse`) and writes only what comes
after them (`bridge_ids`: the turn's closing tail, the tool results in the family's framing
and the next generation prompt, the last taken from the template itself). The family classes
write those pieces by hand; the self-check (`check`) proves at load, on a probe conversation,
that what the template writes after a turn's stop token is the bridge, and that a turn as the
model writes it parses back to its message, so a fine-tune whose template drifts from its
family is refused before a rollout. Whole-conversation equality with the templates, where a
template renders history as it was sampled, and with the families' reference encoders
(openai-harmony, mistral-common) are tests.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from trainer.errors import ConfigError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

SNIPPET_CHARS = 80


@dataclass(frozen=True)
class ParsedToolCall:
    """One tool call of a turn: `arguments` is a compact JSON object string."""

    name: str
    arguments: str
    call_id: str


@dataclass(frozen=True)
class ParsedTurn:
    """A sampled assistant turn: its answer text, its reasoning, its tool calls (in the
    order written) and the calls it tried to write but that did not parse.

    `reasoning_tokens` counts the sampled tokens of the reasoning (markers included);
    `reasoning_open` is True when the turn stopped inside its reasoning, so neither its
    content nor its calls are real."""

    content: str
    tool_calls: list[ParsedToolCall]
    errors: list[str]
    reasoning: str = ""
    reasoning_tokens: int = 0
    reasoning_open: bool = False


def snippet(text: str) -> str:
    text = text.strip()
    return repr(text if len(text) <= SNIPPET_CHARS else text[:SNIPPET_CHARS] + "...")


def compact_arguments(arguments: Any) -> str | None:
    """A call's arguments as a compact JSON object string, or None when they are not an
    object (a JSON string holding an object is accepted: OpenAI's message shape)."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    if not isinstance(arguments, dict):
        return None
    return json.dumps(arguments, ensure_ascii=False, separators=(",", ":"))


def call_from_object(obj: Any, call_id: str, what: str) -> ParsedToolCall | str:
    """`{"name", "arguments" | "parameters"}` as a call, or the error that says what is wrong
    (`what` names the syntax in the message, e.g. '<tool_call>')."""
    if not isinstance(obj, dict):
        return f'{what} must hold a JSON object {{"name", "arguments"}}: {snippet(json.dumps(obj))}'
    name = obj.get("name")
    if not isinstance(name, str) or not name.strip():
        return f'{what} has no "name" string: {snippet(json.dumps(obj))}'
    # Llama 3 writes "parameters"; a call without arguments takes none.
    arguments = compact_arguments(obj.get("arguments", obj.get("parameters", {})))
    if arguments is None:
        return f'{what} "arguments" of {name!r} is not a JSON object: {snippet(json.dumps(obj))}'
    return ParsedToolCall(name=name, arguments=arguments, call_id=call_id)


def tool_calls_to_openai(calls: list[ParsedToolCall]) -> list[dict[str, Any]]:
    """Calls in OpenAI's message `tool_calls` shape."""
    return [
        {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
        for call in calls
    ]


def assistant_message(parsed: ParsedTurn) -> dict[str, Any]:
    """The turn as an OpenAI assistant message; its reasoning, when it has any, under
    `reasoning_content` (the key vLLM's and Qwen's chat APIs use)."""
    message: dict[str, Any] = {"role": "assistant", "content": parsed.content}
    if parsed.reasoning:
        message["reasoning_content"] = parsed.reasoning
    if parsed.tool_calls:
        message["tool_calls"] = tool_calls_to_openai(parsed.tool_calls)
    return message


def divergence(prefix: str, text: str) -> str:
    at = next(
        (i for i, (a, b) in enumerate(zip(prefix, text, strict=False)) if a != b),
        min(len(prefix), len(text)),
    )
    return f"they part at char {at}: {prefix[at : at + 40]!r} vs {text[at : at + 40]!r}"


def _tool(name: str, description: str, parameter: str) -> dict[str, Any]:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {
                "type": "object",
                "properties": {parameter: {"type": "string", "description": f"The {parameter}."}},
                "required": [parameter],
            },
        },
    }


PROBE_TOOLS = [_tool("search", "Search the reports.", "query"), _tool("read_page", "Read one page.", "path")]


class ChatFormat(ABC):
    """Messages to prompt ids, sampled ids to an assistant message, and the ids that carry
    a rollout from one turn to the next, for one model family."""

    name: ClassVar[str]
    # Whether `model.enable_thinking` means anything to this family.
    has_thinking_switch: ClassVar[bool] = False
    # Token strings that end a sampled turn (those the tokenizer has become stop ids).
    stop_tokens: ClassVar[tuple[str, ...]] = ()
    # Decode sampled ids without the special tokens before parsing (the family's markers
    # are ordinary or non-special added tokens), as transformers' chat pipelines do.
    skip_special_tokens: ClassVar[bool] = True

    def __init__(self, tokenizer: PreTrainedTokenizerBase, *, enable_thinking: bool | None = None):
        if enable_thinking is not None and not self.has_thinking_switch:
            raise ConfigError(
                f"model.enable_thinking is set, but the {self.name} chat format has no thinking "
                "switch (only qwen3 has one); remove the key"
            )
        if not getattr(tokenizer, "chat_template", None):
            raise ConfigError(
                f"the tokenizer of {tokenizer.name_or_path!r} has no chat template; a chat model's "
                "tokenizer carries one (tokenizer_config.json or chat_template.jinja)"
            )
        self.tokenizer = tokenizer
        self.enable_thinking = enable_thinking
        self.stop_token_ids = self._stop_ids()
        self.generation_prompt = self._generation_prompt()

    # -- what a rollout calls ------------------------------------------------------------

    def prompt_ids(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[int]:
        """The first prompt: the conversation so far and the generation prompt."""
        return self.encode(self.render(messages, tools, add_generation_prompt=True))

    @abstractmethod
    def parse(self, token_ids: list[int], *, first_call_index: int = 0,
              tools: list[dict[str, Any]] | None = None) -> ParsedTurn:
        """Split a sampled turn (its stop token included or not) into content, reasoning
        and calls. Never raises: what does not parse is an entry of `errors`. Call ids
        count from `first_call_index` unless the model wrote its own; `tools` (the schemas
        offered) type the arguments of syntaxes that write them as text (Qwen3.5's XML)."""

    def bridge_ids(self, messages: list[dict[str, Any]], n_done: int, tools: list[dict[str, Any]] | None) -> list[int]:
        """The ids that follow a turn the model ended with a stop token: `messages[n_done - 1]`
        is that turn (as `assistant_message` gives it), `messages[n_done:]` are the tool
        results; the ids end with the next generation prompt. They start after a special
        token (the stop token), so encoding them apart is encoding them in place."""
        return self.encode(self.bridge_text(messages, n_done, tools) + self.generation_prompt)

    @abstractmethod
    def bridge_text(self, messages: list[dict[str, Any]], n_done: int, tools: list[dict[str, Any]] | None) -> str:
        """What the template writes after the stop token of `messages[n_done - 1]` and the tool
        results `messages[n_done:]`, up to (not including) the next generation prompt."""

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=self.skip_special_tokens)

    # -- rendering -----------------------------------------------------------------------

    def template_kwargs(self) -> dict[str, Any]:
        return {} if self.enable_thinking is None else {"enable_thinking": self.enable_thinking}

    def template_message(self, message: dict[str, Any]) -> dict[str, Any]:
        """An OpenAI-shaped message as this family's template reads it. Tool-call arguments
        become objects: OpenAI's messages carry them as JSON strings, and the published
        templates write `arguments | tojson`, which would quote a string a second time."""
        calls = message.get("tool_calls")
        if not calls:
            return message
        fixed = []
        for call in calls:
            function = dict(call.get("function", call))
            if isinstance(function.get("arguments"), str):
                try:
                    function["arguments"] = json.loads(function["arguments"])
                except json.JSONDecodeError:
                    pass  # the template shows what the model wrote
            fixed.append({**call, "function": function} if "function" in call else function)
        return {**message, "tool_calls": fixed}

    def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
               *, add_generation_prompt: bool) -> str:
        try:
            return self.tokenizer.apply_chat_template(
                [self.template_message(m) for m in messages], tools=tools or None,
                add_generation_prompt=add_generation_prompt, tokenize=False, **self.template_kwargs(),
            )
        except Exception as exc:  # the template's own raise_exception(...) or a Jinja error
            raise ConfigError(
                f"the chat template of {self.tokenizer.name_or_path!r} ({self.name} format) could not "
                f"render the conversation: {exc}"
            ) from exc

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _generation_prompt(self) -> str:
        """What the template adds for `add_generation_prompt` (empty for Mistral's)."""
        user = [{"role": "user", "content": "4f1c9e0d"}]
        without = self.render(user, None, add_generation_prompt=False)
        with_prompt = self.render(user, None, add_generation_prompt=True)
        if not with_prompt.startswith(without):
            raise ConfigError(
                f"the chat template of {self.tokenizer.name_or_path!r} changes the conversation when "
                f"asked for a generation prompt ({divergence(without, with_prompt)}); it cannot be "
                f"used as the {self.name} format"
            )
        return with_prompt[len(without):]

    def _stop_ids(self) -> list[int]:
        ids = []
        for token in self.stop_tokens:
            token_id = self.tokenizer.convert_tokens_to_ids(token)
            if token_id is None or token_id == self.tokenizer.unk_token_id or self.encode(token) != [token_id]:
                if token == self.stop_tokens[0]:
                    raise ConfigError(
                        f"the {self.name} chat format ends a turn with {token!r}, which the tokenizer of "
                        f"{self.tokenizer.name_or_path!r} does not have as one token; set model.chat_format "
                        "to the model's family (or 'template')"
                    )
                continue
            ids.append(token_id)
        if self.tokenizer.eos_token_id is not None:
            ids.append(self.tokenizer.eos_token_id)
        return sorted(set(ids))

    # -- canonical turns: what a model of this family writes -----------------------------

    def assistant_text(self, context: list[dict[str, Any]], message: dict[str, Any],
                       tools: list[dict[str, Any]] | None) -> str:
        """The text a model of this family samples for `message` after `context`, its stop
        token included: the template's own rendering of the turn where the template renders
        it as a continuation of the prompt, the family's written form where it does not
        (Llama's template refuses two calls; Mistral Nemo's drops the system message once a
        turn follows; QwQ's drops the reasoning)."""
        try:
            prompt = self.render(context, tools, add_generation_prompt=True)
            full = self.render([*context, message], tools, add_generation_prompt=False)
        except ConfigError:
            return self.written_turn(message)
        if not full.startswith(prompt):
            return self.written_turn(message)
        body = full[len(prompt):]
        ends = [body.find(token) + len(token) for token in self.stop_tokens if token in body]
        return body[: min(ends)] if ends else body

    @abstractmethod
    def written_turn(self, message: dict[str, Any]) -> str:
        """`message` as a model of this family writes it, stop token included."""

    def encode_conversation(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                            *, first: int | None = None) -> tuple[list[int], list[int]]:
        """Token ids of a whole conversation built as a rollout builds it (prompt, sampled
        turns, bridges) and the mask of the tokens a model samples (1) rather than reads (0).
        The rollout starts at `messages[first]` (default: the first assistant turn), whatever
        is before it being its prompt; assistant turns after it are followed by tool results only."""
        if first is None:
            first = next((k for k, m in enumerate(messages) if m["role"] == "assistant"), len(messages))
        ids = self.prompt_ids(messages[:first], tools)
        mask = [0] * len(ids)
        k = first
        while k < len(messages):
            turn = self.encode(self.assistant_text(messages[:k], messages[k], tools))
            ids += turn
            mask += [1] * len(turn)
            k += 1
            following = k
            while following < len(messages) and messages[following]["role"] != "assistant":
                following += 1
            if following == k:
                continue
            if any(m["role"] != "tool" for m in messages[k:following]):
                raise ValueError("encode_conversation: only tool results may follow an assistant turn")
            bridge = self.bridge_ids(messages[:following], k, tools)
            ids += bridge
            mask += [0] * len(bridge)
            k = following
        return ids, mask

    # -- the self-check ------------------------------------------------------------------

    def probe_conversation(self) -> list[dict[str, Any]]:
        """A tool conversation: two tool turns (with a thought where the family has one),
        ending at the next prompt."""
        def turn(index: int, name: str, arguments: dict[str, str]) -> dict[str, Any]:
            call = {"id": self.probe_call_id(index), "type": "function",
                    "function": {"name": name, "arguments": json.dumps(arguments)}}
            return {"role": "assistant", "content": "", "tool_calls": [call], **self.probe_reasoning(index)}

        return [
            {"role": "system", "content": "You answer questions about company reports."},
            {"role": "user", "content": "What was ACME's revenue in 2019?"},
            turn(0, "search", {"query": "ACME 2019"}),
            {"role": "tool", "tool_call_id": self.probe_call_id(0), "content": self.probe_output(0)},
            turn(1, "read_page", {"path": "reports/ACME/2019/page_3.txt"}),
            {"role": "tool", "tool_call_id": self.probe_call_id(1), "content": self.probe_output(1)},
        ]

    def probe_call_id(self, index: int) -> str:
        return f"call_{index}"

    def probe_reasoning(self, index: int) -> dict[str, Any]:
        return {}

    def probe_output(self, index: int) -> str:
        return ["reports/ACME/2019/page_3.txt", "Revenue was 12.5 million."][index]

    def reference_messages(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The probe as the template itself is given it (a family may differ in how it
        passes tool outputs; see gpt-oss)."""
        return messages

    def check(self) -> None:
        """Prove on a probe conversation that this format reads and writes what the
        tokenizer's template does: each turn the model would write parses back to its
        message, and what the template writes after a turn's stop token, up to the next
        generation prompt, is what `bridge_ids` appends. A ConfigError says where they part."""
        messages = self.probe_conversation()
        calls = 0
        for k, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            text = self.assistant_text(messages[:k], message, PROBE_TOOLS)
            parsed = self.parse(self.encode(text), first_call_index=calls, tools=PROBE_TOOLS)
            calls += len(parsed.tool_calls)
            expected = [(c["function"]["name"], compact_arguments(c["function"]["arguments"]), c["id"])
                        for c in message.get("tool_calls", [])]
            got = [(c.name, c.arguments, c.call_id) for c in parsed.tool_calls]
            if (got != expected or parsed.errors or parsed.reasoning != message.get("reasoning_content", "")
                    or parsed.content != message["content"]):
                raise ConfigError(self._mismatch(
                    f"a turn written as {text!r} reads back as content {parsed.content!r}, calls {got}, reasoning "
                    f"{parsed.reasoning!r}" + (f", errors {parsed.errors}" if parsed.errors else "")
                    + f" (written: calls {expected})"))
            following = k + 1
            while following < len(messages) and messages[following]["role"] == "tool":
                following += 1
            rendered = self.render(self.reference_messages(messages[:following]), PROBE_TOOLS,
                                   add_generation_prompt=False)
            written = self.bridge_text(messages[:following], k + 1, PROBE_TOOLS)
            if not any(rendered.endswith(stop + written) for stop in self.stop_tokens):
                raise ConfigError(self._mismatch(
                    f"after a turn's stop token the template writes {rendered[-len(written) - 20:]!r}, "
                    f"the format {written!r}"))

    def _mismatch(self, what: str) -> str:
        return (f"the chat template of {self.tokenizer.name_or_path!r} does not match the {self.name} chat "
                f"format: {what}; set model.chat_format to the model's family, or 'template'")
