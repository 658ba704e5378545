"""Build the demo's tokenizer: a small byte-level BPE trained on the demo's own text.

No pretrained chat model can be downloaded for the embedded demo, so it trains its own
tokenizer with the `tokenizers` library and wraps it as a `transformers` fast tokenizer
that saves, reloads with `AutoTokenizer` and carries the chat template
(`CHAT_TEMPLATE` below: Qwen2.5's Hermes tool format, written compactly).

Choices that help a tiny model learn FinQA-style tool use:
- every digit is its own token, so numbers are spelled the same way everywhere and
  arithmetic-like copying is learnable;
- each company ticker (`extra_tokens`) is spelled one character a token, the same pieces
  wherever it stands ("ACME's", " ACME", "reports/ACME/2019": always A C M E, a leading
  space its own token), so copying a name out of the question into a tool call is copying
  letters, like copying digits. Tickers as whole tokens (one id each, or two with " ACME")
  are 40 rare ids whose embeddings barely train: a tiny model only learned their marginal
  (p(correct ticker) ~ 1/40, even when copying the question verbatim), while it copied
  frequent tokens and digits well;
- the ChatML markers are special tokens (`<|im_end|>` is eos, `<|endoftext|>` is pad) and the
  tool tags `<tool_call>`, `</tool_call>`, `<tool_response>`, `</tool_response>` are added
  tokens that are never split but are not special, so decoding with
  `skip_special_tokens=True` keeps them for the chat format's parser (`trainer.chat_formats`).

Training is deterministic: the same texts and arguments give a byte-identical
`tokenizer.json` (BPE breaks count ties by token id, and ids follow the sorted alphabet).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    pre_tokenizers,
    processors,
    trainers,
)
from transformers import PreTrainedTokenizerFast

from trainer.chat_formats import TOOL_TAGS
from trainer.errors import ConfigError

# The demo tokenizer's chat template: the structure of Qwen2.5's (tool schemas in the system
# turn, `<tool_call>` JSON blocks, tool results as `<tool_response>` blocks in a user turn),
# so the `qwen2.5` chat format reads it, written more compactly (one signature a line per
# tool, no spaces in JSON) because the demo model's context is short. `tojson` there is
# json.dumps with ensure_ascii=False; arguments already a JSON string are written as they are.
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

PAD_TOKEN = "<|endoftext|>"
BOS_TURN_TOKEN = "<|im_start|>"
EOS_TOKEN = "<|im_end|>"
# The trainer gives special tokens the first ids in this order: pad 0, im_start 1, eos 2.
SPECIAL_TOKENS = (PAD_TOKEN, BOS_TURN_TOKEN, EOS_TOKEN)

_BYTE_ALPHABET = pre_tokenizers.ByteLevel.alphabet()


def build_tokenizer(
    texts: Iterable[str], *, vocab_size: int = 2048, extra_tokens: Sequence[str] = ()
) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE on `texts` and return it as a chat-ready fast tokenizer.

    `vocab_size` is the BPE budget (bytes, merges and the three special tokens); the four
    tool tags come on top, so size a model with `len(tokenizer)`. `extra_tokens` (company
    tickers) add no tokens: they are spelled one character a token where they stand as
    whole words ("ACMEX" is an ordinary word), so no merges are spent on them either.
    """
    if vocab_size <= len(_BYTE_ALPHABET) + len(SPECIAL_TOKENS):
        raise ConfigError(
            f"tokenizer vocab_size={vocab_size} leaves no room for merges: it must exceed "
            f"{len(_BYTE_ALPHABET) + len(SPECIAL_TOKENS)} (256 bytes + 3 special tokens)"
        )
    words = list(dict.fromkeys(extra_tokens))  # drop repeats; order kept for a stable pattern
    for word in words:
        if not word.strip():
            raise ConfigError(f"tokenizer extra_tokens holds a blank entry {word!r}; remove it")
    tokenizer = Tokenizer(models.BPE())
    spell = [pre_tokenizers.Split(Regex(_spelling_pattern(words)), "isolated")] if words else []
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            *spell,
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    # Keeps character offsets exact (used for assistant-token masks), as Qwen's tokenizer does.
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=_BYTE_ALPHABET,
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)

    tokenizer.add_tokens([AddedToken(tag, normalized=False, special=False) for tag in TOOL_TAGS])
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        pad_token=PAD_TOKEN,
        eos_token=EOS_TOKEN,
        chat_template=CHAT_TEMPLATE,
        # The default clean-up would turn "1 ." into "1." and break decode(encode(x)) == x.
        clean_up_tokenization_spaces=False,
    )


def _spelling_pattern(words: Sequence[str]) -> str:
    """A regex matching each single character of `words` where a word stands whole: one
    alternative a character, its word's prefix in a (fixed-length) look-behind and the
    rest in a look-ahead. Isolating the matches spells the words out before ByteLevel."""
    alternatives = []
    for word in words:
        for k, char in enumerate(word):
            before, after = re.escape(word[:k]), re.escape(word[k + 1 :])
            alternatives.append(rf"(?<=\b{before}){re.escape(char)}(?={after}\b)" if k else rf"\b{re.escape(char)}(?={after}\b)")
    return "|".join(alternatives)
