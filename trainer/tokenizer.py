"""Build the demo's tokenizer: a small byte-level BPE trained on the demo's own text.

No pretrained chat model can be downloaded for the embedded demo, so it trains its own
tokenizer with the `tokenizers` library and wraps it as a `transformers` fast tokenizer
that saves, reloads with `AutoTokenizer` and carries the chat template
(`trainer.chat_format.CHAT_TEMPLATE`, Qwen/Hermes style).

Choices that help a tiny model learn FinQA-style tool use:
- every digit is its own token, so numbers are spelled the same way everywhere and
  arithmetic-like copying is learnable;
- each company ticker (`extra_tokens`) is one token, with and without a leading space
  ("ACME" and " ACME"), so the model copies a name in one step;
- the ChatML markers are special tokens (`<|im_end|>` is eos, `<|endoftext|>` is pad) and the
  tool tags `<tool_call>`, `</tool_call>`, `<tool_response>`, `</tool_response>` are added
  tokens that are never split but are not special, so decoding with
  `skip_special_tokens=True` keeps them for `trainer.chat_format.parse_assistant_output`.

Training is deterministic: the same texts and arguments give a byte-identical
`tokenizer.json` (BPE breaks count ties by token id, and ids follow the sorted alphabet).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
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

    `vocab_size` is the BPE budget (bytes, merges and the three special tokens); the tool
    tags and `extra_tokens` come on top, so size a model with `len(tokenizer)`.
    `extra_tokens` (company tickers) each become one token, also after a space.
    """
    if vocab_size <= len(_BYTE_ALPHABET) + len(SPECIAL_TOKENS):
        raise ConfigError(
            f"tokenizer vocab_size={vocab_size} leaves no room for merges: it must exceed "
            f"{len(_BYTE_ALPHABET) + len(SPECIAL_TOKENS)} (256 bytes + 3 special tokens)"
        )
    # ignore_merges: a pre-tokenized word that is itself in the vocabulary maps straight to
    # its id. That is what lets `_add_words` make a ticker one token without inventing merges.
    tokenizer = Tokenizer(models.BPE(ignore_merges=True))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
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

    tokenizer, unsplittable = _add_words(tokenizer, extra_tokens)
    tokenizer.add_tokens(
        [AddedToken(tag, normalized=False, special=False) for tag in (*TOOL_TAGS, *unsplittable)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        pad_token=PAD_TOKEN,
        eos_token=EOS_TOKEN,
        chat_template=CHAT_TEMPLATE,
        # The default clean-up would turn "1 ." into "1." and break decode(encode(x)) == x.
        clean_up_tokenization_spaces=False,
    )


def _add_words(tokenizer: Tokenizer, words: Sequence[str]) -> tuple[Tokenizer, list[str]]:
    """Put each word, bare and after a space, into the BPE vocabulary as one token.

    A word the pre-tokenizer keeps whole (letters only: "ACME" -> "ACME", " ACME" -> "ĠACME")
    becomes a vocabulary entry, found whole thanks to `ignore_merges`; unlike an added token
    it also stays one token after a space and decodes like any learned word. A word the
    pre-tokenizer would cut (digits, punctuation: "BRK.B") is returned, to be added as a
    never-split added token instead.
    """
    spec = json.loads(tokenizer.to_str())
    vocab: dict[str, int] = spec["model"]["vocab"]
    unsplittable: list[str] = []
    for word in dict.fromkeys(words):  # drop repeats, keep the caller's order (ids are stable)
        if not word.strip():
            raise ConfigError(f"tokenizer extra_tokens holds a blank entry {word!r}; remove it")
        pieces = [tokenizer.pre_tokenizer.pre_tokenize_str(form) for form in (word, " " + word)]
        if any(len(p) != 1 for p in pieces):
            unsplittable.append(word)
            continue
        for [(piece, _offsets)] in pieces:
            vocab.setdefault(piece, len(vocab))
    return Tokenizer.from_str(json.dumps(spec)), unsplittable
