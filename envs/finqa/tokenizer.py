"""Build the demo's tokenizer: a small byte-level BPE trained on the demo's own text.

No pretrained chat model can be downloaded for the embedded demo, so it trains its own
tokenizer with the `tokenizers` library and wraps it as a `transformers` fast tokenizer
that saves, reloads with `AutoTokenizer` and carries the chat template
(`trainer.chat_format.CHAT_TEMPLATE`, Qwen/Hermes style).

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
  `skip_special_tokens=True` keeps them for `trainer.chat_format.parse_assistant_output`.

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

from trainer.chat_format import CHAT_TEMPLATE, TOOL_TAGS
from trainer.errors import ConfigError

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
