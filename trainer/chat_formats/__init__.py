"""Chat formats: between messages and token ids, one per model family.

A rollout renders its first prompt with the model's published chat template, then keeps
the token ids the model samples and never re-tokenises them: the format parses each
sampled turn into an OpenAI assistant message (content, reasoning, tool calls with JSON
string arguments, parallel calls in order) and writes only the ids that carry the rollout
to the next turn (the tool results in the family's framing and the next generation
prompt). So the tokens the trainer scores are the tokens the sampler drew, whatever the
template would make of the conversation if it rendered it again: Qwen3's think gate,
harmony's dropped analysis and Llama's one-call-per-message rendering do not touch a
rollout.

Families (`model.chat_format`): `qwen3` (and Qwen3.5, QwQ; `enable_thinking`), `qwen2.5` (Hermes
tool format; the demo model), `llama3` (3.1-3.3), `mistral` (Nemo, Small 3.x, Ministral 3),
`gpt-oss` (harmony), and `template`: any other template that is prefix-stable, used as it
is. `auto` reads the family from the tokenizer's template, and every format proves at load,
on a probe conversation, that it reads and writes what the template does
(`ChatFormat.check`); a template that is neither a family's nor prefix-stable is a
ConfigError naming the families.

Why our own and not a library (measured on this project's fixtures: the families' real
vocabularies and published templates, tests/model_families.py). The `renderers` package
(Prime Intellect, 0.1.12) is token-exact on Qwen3 and Llama 3.x and its bridge contract is
this one, but it has no Qwen2.5 or Mistral renderer (its fallback has no bridge: a full
re-render every turn), picks a renderer by exact hub name only (a local path or a fine-tune
needs a typed config), reads Llama's `; `-joined calls as content, and brings ~140 MB of
dependencies (the openai SDK, openai-harmony, a pre-release config package) and, with the
openai SDK 3.x, does not import without an undeclared httpx. transformers 5 parses responses
only where a tokenizer ships a response schema: none of these templates does (its serving
code has fallbacks for Qwen alone). openai-harmony needs the o200k vocabulary from OpenAI's
servers or a file a machine is given by hand; it is the reference the gpt-oss format is tested
against, as mistral-common is for Mistral's. The families here are a few dozen lines each on
top of the template the model ships, and the self-check ties them to it.

May import: `trainer.errors` and the other plumbing modules only; the generation backends,
the rollout loop and serving use it.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainer.chat_formats.base import (
    ChatFormat,
    ParsedToolCall,
    ParsedTurn,
    assistant_message,
    tool_calls_to_openai,
)
from trainer.chat_formats.gpt_oss import GptOssFormat
from trainer.chat_formats.hermes import TOOL_TAGS, HermesFormat, Qwen3Format, parse_tool_call_blocks
from trainer.chat_formats.llama3 import Llama3Format
from trainer.chat_formats.mistral import MistralFormat
from trainer.chat_formats.template import FAMILIES, TemplateFormat, check_prefix_stable
from trainer.errors import ConfigError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

CHAT_FORMATS = ("auto", *FAMILIES, "template")
TEMPLATES = Path(__file__).with_name("templates")  # the chat templates the project ships, by name


def chat_template_text(value: str) -> str:
    """`model.chat_template`: the text of a shipped template (its name) or of a Jinja file."""
    shipped = TEMPLATES / f"{value}.jinja"
    path = shipped if shipped.is_file() else Path(value).expanduser()
    if not path.is_file():
        names = ", ".join(sorted(p.stem for p in TEMPLATES.glob("*.jinja")))
        raise ConfigError(f"model.chat_template {value!r}: neither a template this project ships ({names}) nor a "
                          "Jinja file")
    return path.read_text(encoding="utf-8")


def format_class(name: str) -> type[ChatFormat]:
    match name:
        case "qwen3":
            return Qwen3Format
        case "qwen2.5":
            return HermesFormat
        case "llama3":
            return Llama3Format
        case "mistral":
            return MistralFormat
        case "gpt-oss":
            return GptOssFormat
        case "template":
            return TemplateFormat
    raise ConfigError(f"model.chat_format {name!r} is not one of {', '.join(CHAT_FORMATS)}")


def detect_family(tokenizer: PreTrainedTokenizerBase) -> str:
    """The family whose markers the tokenizer's chat template writes, or 'template'."""
    template = tokenizer.chat_template
    text = "\n".join(map(str, template.values())) if isinstance(template, dict) else str(template or "")
    if "<|channel|>" in text and "<|start|>" in text:
        return "gpt-oss"
    if "[TOOL_CALLS]" in text and "[INST]" in text:
        return "mistral"
    if "<|start_header_id|>" in text and "ipython" in text:
        return "llama3"
    if "<|im_start|>" in text and "<tool_call>" in text:
        return "qwen3" if "<think>" in text else "qwen2.5"
    return "template"


def load_chat_format(tokenizer: PreTrainedTokenizerBase, name: str = "auto", *,
                     enable_thinking: bool | None = None, chat_template: str | None = None) -> ChatFormat:
    """The chat format for `tokenizer`, checked against its template (`chat_template`, a
    shipped name or a file, replaces the tokenizer's first). `auto` detects the family;
    where the detected family's check fails, a prefix-stable template is used as it is,
    else the error says what both checks found."""
    if chat_template is not None:
        tokenizer.chat_template = chat_template_text(chat_template)
    if name != "auto":
        chosen = format_class(name)(tokenizer, enable_thinking=enable_thinking)
        chosen.check()
        return chosen
    family = detect_family(tokenizer)
    try:
        chosen = format_class(family)(tokenizer, enable_thinking=enable_thinking)
        chosen.check()
        return chosen
    except ConfigError as family_error:
        if family == "template":
            raise
        try:
            fallback = TemplateFormat(tokenizer, enable_thinking=enable_thinking)
            fallback.check()
        except ConfigError as template_error:
            raise ConfigError(f"model.chat_format auto: the template looks like {family}'s, but {family_error}. "
                              f"And as a plain template: {template_error}") from None
        return fallback


def describe(chat: ChatFormat) -> dict[str, Any]:
    """What `agentrft config validate` and the run's MLflow params say about the format."""
    info: dict[str, Any] = {"chat_format": chat.name, "stop_tokens": [chat.tokenizer.convert_ids_to_tokens(i)
                                                                   for i in chat.stop_token_ids]}
    if chat.has_thinking_switch:
        info["enable_thinking"] = chat.enable_thinking is not False
    if isinstance(chat, MistralFormat):
        info["variant"] = chat.variant
    return info


__all__ = [
    "CHAT_FORMATS",
    "TEMPLATES",
    "FAMILIES",
    "TOOL_TAGS",
    "ChatFormat",
    "GptOssFormat",
    "HermesFormat",
    "Llama3Format",
    "MistralFormat",
    "ParsedToolCall",
    "ParsedTurn",
    "Qwen3Format",
    "TemplateFormat",
    "assistant_message",
    "chat_template_text",
    "check_prefix_stable",
    "detect_family",
    "describe",
    "format_class",
    "load_chat_format",
    "parse_tool_call_blocks",
    "tool_calls_to_openai",
]
