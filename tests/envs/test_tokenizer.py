"""The demo tokenizer (digits, tickers, special tokens, determinism, save and reload) and the
tiny Qwen3 model built on it (seeded init, parameter count, reload with identical logits)."""

from __future__ import annotations

import hashlib
import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer, Qwen3ForCausalLM

from envs.finqa.tiny_model import build_model, count_parameters, tiny_config
from envs.finqa.tokenizer import CHAT_TEMPLATE, build_tokenizer
from trainer.errors import ConfigError
from trainer.generation.modeling import load_model_and_tokenizer

REPO_ROOT = Path(__file__).resolve().parents[2]
TICKERS = ["ACME", "ZETA", "NOVA", "BRK.B"]  # BRK.B: punctuation inside a ticker


def make_corpus(n_lines: int = 400) -> list[str]:
    """FinQA-like lines; ZETA and BRK.B never occur, yet extra_tokens spells them too."""
    rng = random.Random(7)
    metrics = ["revenue", "net income", "operating expenses", "cash flow", "total assets"]
    lines = []
    for i in range(n_lines):
        ticker = rng.choice(["ACME", "NOVA"])
        year = rng.randint(2010, 2022)
        value = rng.randint(100, 99_999) / 10
        metric = rng.choice(metrics)
        lines.append(
            f"In {year}, {ticker} reported {metric} of ${value:,} million "
            f"(page {i % 9 + 1} of reports/{ticker}/{year})."
        )
    return lines


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(make_corpus(), vocab_size=1024, extra_tokens=TICKERS)


def tokens(tokenizer, text: str) -> list[str]:
    return tokenizer.convert_ids_to_tokens(tokenizer(text, add_special_tokens=False).input_ids)


def test_digits_are_one_token_each(tokenizer):
    assert tokens(tokenizer, "2019") == ["2", "0", "1", "9"]
    assert tokens(tokenizer, " 12.5") == ["Ġ", "1", "2", ".", "5"]
    digit_tokens = [
        t for t in tokens(tokenizer, "$1,234,567.89 in 2021 and 3%") if any(c.isdigit() for c in t)
    ]
    assert digit_tokens == list("123456789") + list("2021") + ["3"]


@pytest.mark.parametrize("ticker", ["ACME", "ZETA", "NOVA", "BRK.B"])
@pytest.mark.parametrize(
    "template",
    [
        "{t}",
        " {t}",
        "What was {t}'s revenue?",
        "the {t} report",
        "reports/{t}/2019/page_3.txt",
        '{{"ticker":"{t}","year":2019}}',
        "({t})",
        "{t}, {t}.",
        "\n{t}: 12",
    ],
)
def test_tickers_are_spelled_the_same_in_every_context(tokenizer, ticker, template):
    text = template.format(t=ticker)
    ids = tokenizer(text, add_special_tokens=False).input_ids
    spelled = tokenizer.convert_tokens_to_ids(list(ticker))
    # One character a token wherever the ticker stands: copying it is copying letters.
    windows = [ids[i : i + len(spelled)] for i in range(len(ids))]
    assert windows.count(spelled) == text.count(ticker)
    assert tokenizer.decode(ids) == text


def test_ticker_keeps_its_space_and_slash_as_separate_tokens(tokenizer):
    for text, ticker, before in [("of ACME's", "ACME", "Ġ"), ("buy BRK.B now", "BRK.B", "Ġ"), ("reports/NOVA/2019", "NOVA", "/")]:
        toks = tokens(tokenizer, text)
        start = toks.index(ticker[0])
        assert toks[start - 1 : start + len(ticker)] == [before, *ticker]


def test_tickers_spend_no_merges_and_match_whole_words_only(tokenizer):
    vocab = tokenizer.backend_tokenizer.get_vocab(with_added_tokens=False)
    assert not [piece for piece in vocab if len(piece) > 1 and any(t[:2] in piece for t in TICKERS)]
    # ACMEX is not a ticker: it may merge, and it decodes as it was.
    assert tokenizer.decode(tokenizer("ACMEX ACME").input_ids) == "ACMEX ACME"
    assert tokens(tokenizer, "ACMEX ACME")[-5:] == ["Ġ", "A", "C", "M", "E"]


def test_special_and_tool_tokens(tokenizer):
    assert (tokenizer.pad_token, tokenizer.pad_token_id) == ("<|endoftext|>", 0)
    assert tokenizer.convert_tokens_to_ids("<|im_start|>") == 1
    assert (tokenizer.eos_token, tokenizer.eos_token_id) == ("<|im_end|>", 2)
    text = '<|im_start|>assistant\n<tool_call>\n{"name":"search"}\n</tool_call><|im_end|>'
    toks = tokens(tokenizer, text)
    for tag in ["<|im_start|>", "<tool_call>", "</tool_call>", "<|im_end|>"]:
        assert tag in toks
    assert tokens(tokenizer, "<tool_response>x</tool_response>") == [
        "<tool_response>",
        "x",
        "</tool_response>",
    ]
    ids = tokenizer(text).input_ids
    # Tool tags are not special: skipping specials keeps them for the tool-call parser.
    assert tokenizer.decode(ids, skip_special_tokens=True) == (
        'assistant\n<tool_call>\n{"name":"search"}\n</tool_call>'
    )
    assert tokenizer.decode(ids) == text


@pytest.mark.parametrize(
    "text", ["a , b .", "  two  spaces\n\ttab", "café €12 — ok", "x=1;y=[2,3]", "ACMEX acme"]
)
def test_decode_inverts_encode(tokenizer, text):
    assert tokenizer.decode(tokenizer(text).input_ids) == text


def test_vocab_holds_trained_and_added_tokens(tokenizer):
    # 1024 BPE budget (whatever the small corpus fills) + 4 tool tags; tickers add nothing.
    assert 300 < len(tokenizer) <= 1024 + 4
    assert len(tokenizer) == len(tokenizer.backend_tokenizer.get_vocab(with_added_tokens=False)) + 4
    assert tokenizer.chat_template == CHAT_TEMPLATE


def test_training_is_deterministic(tmp_path):
    corpus = make_corpus()
    first = build_tokenizer(corpus, vocab_size=1024, extra_tokens=TICKERS)
    second = build_tokenizer(iter(corpus), vocab_size=1024, extra_tokens=TICKERS)
    assert first.backend_tokenizer.to_str() == second.backend_tokenizer.to_str()
    first.save_pretrained(tmp_path / "a")
    second.save_pretrained(tmp_path / "b")
    names = sorted(p.name for p in (tmp_path / "a").iterdir())
    assert "tokenizer.json" in names
    for name in names:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()

    # A fresh process has fresh hash seeds: training must not depend on them either.
    corpus_file = tmp_path / "corpus.json"
    corpus_file.write_text(json.dumps(corpus))
    script = (
        "import hashlib, json, sys; from envs.finqa.tokenizer import build_tokenizer; "
        "t = build_tokenizer(json.load(open(sys.argv[1])), vocab_size=1024, "
        f"extra_tokens={TICKERS!r}); "
        "print(hashlib.sha256(t.backend_tokenizer.to_str().encode()).hexdigest())"
    )
    out = subprocess.run(
        [sys.executable, "-c", script, str(corpus_file)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    assert (
        out.stdout.strip() == hashlib.sha256(first.backend_tokenizer.to_str().encode()).hexdigest()
    )


def test_save_and_reload_with_auto_tokenizer(tokenizer, tmp_path):
    tokenizer.save_pretrained(tmp_path)
    reloaded = AutoTokenizer.from_pretrained(tmp_path)
    assert reloaded.chat_template == tokenizer.chat_template
    assert (reloaded.pad_token_id, reloaded.eos_token_id) == (0, 2)
    text = "<|im_start|>user\nACME's 2019 revenue?<|im_end|>\n<tool_call>\nBRK.B ZETA\n</tool_call>"
    assert reloaded(text).input_ids == tokenizer(text).input_ids
    messages = [{"role": "user", "content": "What was NOVA's net income in 2020?"}]
    assert reloaded.apply_chat_template(messages, add_generation_prompt=True, tokenize=False) == (
        "<|im_start|>user\nWhat was NOVA's net income in 2020?<|im_end|>\n<|im_start|>assistant\n"
    )


def test_bad_arguments_raise_config_error():
    with pytest.raises(ConfigError, match="vocab_size=100"):
        build_tokenizer(["a b c"], vocab_size=100)
    with pytest.raises(ConfigError, match="blank entry"):
        build_tokenizer(["a b c"], extra_tokens=["ACME", " "])


def test_tiny_config_shape():
    config = tiny_config(500)
    assert (config.model_type, config.vocab_size, config.head_dim) == ("qwen3", 500, 32)
    assert (config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads) == (
        4,
        4,
        2,
    )
    assert (config.pad_token_id, config.eos_token_id, config.tie_word_embeddings) == (0, 2, True)
    with pytest.raises(ConfigError, match="num_heads"):
        tiny_config(500, hidden_size=100, num_heads=3)


def test_build_model_is_seeded_and_leaves_global_rng_alone():
    config = tiny_config(300, hidden_size=32, num_layers=1, intermediate_size=64)
    torch.manual_seed(123)
    expected_next = torch.rand(1)
    torch.manual_seed(123)
    a, b, c = build_model(config, seed=1), build_model(config, seed=1), build_model(config, seed=2)
    assert torch.equal(torch.rand(1), expected_next)
    for (name, pa), pb in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        assert torch.equal(pa, pb), name
    emb = "model.embed_tokens.weight"
    assert not torch.equal(a.state_dict()[emb], c.state_dict()[emb])


@pytest.mark.parametrize("tie", [True, False])
def test_count_parameters(tie):
    v, h, i, layers, heads, kv, hd = 300, 32, 64, 2, 4, 2, 8
    config = tiny_config(
        v,
        hidden_size=h,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv,
        intermediate_size=i,
        tie_word_embeddings=tie,
    )
    attention = h * heads * hd * 2 + h * kv * hd * 2 + 2 * hd  # q, o, k, v, q_norm, k_norm
    per_layer = attention + 3 * h * i + 2 * h  # mlp and two RMSNorms
    expected = v * h * (1 if tie else 2) + layers * per_layer + h
    model = build_model(config, seed=0)
    assert count_parameters(model) == expected
    model.model.embed_tokens.weight.requires_grad_(False)
    assert count_parameters(model, trainable_only=True) == expected - v * h


def test_saved_tiny_model_reloads_with_identical_logits(tokenizer, tmp_path):
    config = tiny_config(
        len(tokenizer),
        hidden_size=64,
        num_layers=2,
        intermediate_size=128,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    model = build_model(config, seed=0).eval()
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)

    loaded, loaded_tokenizer = load_model_and_tokenizer(str(tmp_path), device="cpu")
    assert isinstance(loaded, Qwen3ForCausalLM)
    assert loaded.dtype == torch.float32
    assert loaded_tokenizer.chat_template == CHAT_TEMPLATE
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "ACME revenue in 2019?"}],
        add_generation_prompt=True,
        tokenize=False,
    )
    ids = tokenizer(text, return_tensors="pt").input_ids
    assert torch.equal(loaded_tokenizer(text, return_tensors="pt").input_ids, ids)
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)
    assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()


def test_load_reports_missing_model(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ConfigError, match="could not be loaded"):
        load_model_and_tokenizer(str(tmp_path / "no-such-model"))
    with pytest.raises(ConfigError, match="not a torch dtype"):
        load_model_and_tokenizer(str(tmp_path), dtype="float99")
