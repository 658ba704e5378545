"""The demo model builder's parts: calculator expressions from FinQA programs, the scripted
demonstrator against the real tool server, the weighted SFT encoding and the model pin."""

from __future__ import annotations

import asyncio
import json
import re
import shutil
from pathlib import Path

import pytest

from envs.finqa.calculator import evaluate
from envs.finqa.demo_model import (
    BootstrapSettings,
    ScriptedPolicy,
    collect_demonstrations,
    copy_accuracy,
    encode_conversation,
    plan_of,
    program_expression,
    verify_model_pin,
    write_model_pin,
)
from envs.finqa.generate import TICKERS, execute_program
from envs.finqa.local import local_tool_endpoints
from envs.finqa.tiny_model import build_model, tiny_config
from envs.finqa.tokenizer import build_tokenizer
from trainer.data import read_items
from trainer.errors import DataError
from trainer.graders import grade

GRADER = {"type": "numeric", "name": "a", "input": "{{sample.output_text}}", "reference": "{{item.reference_answer}}"}


@pytest.mark.parametrize(
    ("program", "percent", "expected"),
    [
        ("346.9", False, "346.9"),
        ("subtract(542.6, 537.0)", False, "542.6-537.0"),
        ("subtract(54.8, 41.6), divide(#0, 41.6)", True, "((54.8-41.6)/41.6)*100"),
        ("add(1, 2), add(#0, 3), divide(#1, const_3)", False, "((1+2)+3)/3"),
        ("greater(3, 2)", False, None),
    ],
)
def test_program_expression(program: str, percent: bool, expected: str | None) -> None:
    expression = program_expression(program, percent=percent)
    assert expression == expected
    if expression is not None:
        value = evaluate(expression)
        assert value == pytest.approx(execute_program(program) * (100 if percent else 1))


@pytest.fixture(scope="module")
def demo_world(demo_data_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    items = read_items(demo_data_dir / "train.jsonl", 12)
    corpus = tmp_path_factory.mktemp("corpus")
    for ticker in sorted({item["ticker"] for item in items}):
        shutil.copytree(demo_data_dir / "corpus/reports" / ticker, corpus / "reports" / ticker)
    with local_tool_endpoints(corpus) as endpoints:
        yield items, endpoints


@pytest.fixture(scope="module")
def demos(demo_world):
    items, endpoints = demo_world
    conversations = asyncio.run(
        collect_demonstrations(items, endpoints, demos_per_item=2, seed=0, system_prompt="S", policy=ScriptedPolicy())
    )
    return items, conversations


def test_a_parallel_demonstrator_puts_its_waste_in_the_needed_turns(demo_world) -> None:
    items, endpoints = demo_world
    sequential, parallel = (
        asyncio.run(collect_demonstrations(
            items, endpoints, demos_per_item=2, seed=0, system_prompt="S", policy=ScriptedPolicy(parallel=flag)
        ))
        for flag in (False, True)
    )

    def calls(conversation):
        return [c["function"]["name"] for m in conversation for c in m.get("tool_calls") or []]

    def turns(conversation):
        return sum(1 for m in conversation if m["role"] == "assistant")

    # the same seed browses the same way; only how the calls are grouped into turns differs
    assert [calls(c) for c in sequential] == [calls(c) for c in parallel]
    assert sum(map(turns, parallel)) < sum(map(turns, sequential))
    assert all(len(m.get("tool_calls") or []) <= 1 for c in sequential for m in c)


def _item_of(conversation, items):
    return next(item for item in items if item["messages"][0]["content"] == conversation[1]["content"])


def test_demonstrations_are_correct_but_wander(demos) -> None:
    items, conversations = demos
    # an item whose page even a targeted search cannot show is left out (a few percent)
    assert 0.8 * 2 * len(items) <= len(conversations) <= 2 * len(items)
    calls = []
    for conversation in conversations:
        item = _item_of(conversation, items)
        final = conversation[-1]
        assert final["role"] == "assistant" and "tool_calls" not in final
        assert grade(GRADER, {"output_text": final["content"]}, item).reward == 1.0
        tool_calls = [m for m in conversation if m.get("tool_calls")]
        calls.append(sum(len(m["tool_calls"]) for m in tool_calls))
        read = [c["function"]["arguments"] for m in tool_calls for c in m["tool_calls"] if c["function"]["name"] == "cat"]
        shown = " ".join(m["content"] for m in conversation if m["role"] == "tool")
        # every page the answer needs was read, or its row seen in a search result
        assert all(page in shown for page in item["gold_pages"])
        # every page it opens was shown to it by a search first (no guessed page numbers)
        opened = [json.loads(args)["path"] for args in read]
        assert all(page in shown for page in opened)
        # before it answers or computes, it copies the table rows it uses, as written
        written = "\n".join(m["content"] for m in conversation if m["role"] == "assistant")
        rows = [line.split(": ", 1)[1] for line in written.splitlines() if " | " in line]
        assert rows and all(row in shown for row in rows)
        # every tool answer came from the real server: no error outputs in a demonstration
        assert not any(m["role"] == "tool" and m["content"].startswith("Error") for m in conversation)
    assert sum(calls) / len(calls) >= 3.0  # redundant browsing on purpose
    assert len(set(calls)) > 1
    # every item ends with the calculator or answers directly; a lookup computes its value as written
    lookups_computed = rechecked = 0
    for conversation in conversations:
        item = _item_of(conversation, items)
        # the first turn names what the question asks for; the notes above the answer repeat it
        plan = f"Plan: {plan_of(item['program'], percent=item['reference_answer'].endswith('%'))}"
        turns = [m for m in conversation if m["role"] == "assistant"]
        assert turns[0]["content"].splitlines()[0] == plan
        noted = next(m for m in turns if " | " in m["content"])
        assert noted["content"].splitlines()[0] == plan
        calculations = [c["function"] for m in turns for c in m.get("tool_calls") or [] if c["function"]["name"] == "calculator"]
        if calculations:
            # the calculator comes last, right below the notes, maybe twice with the same expression
            assert noted.get("tool_calls") and noted["tool_calls"][0]["function"] == calculations[0]
            assert all(c == calculations[0] for c in calculations) and len(calculations) <= 2
            rechecked += len(calculations) == 2
        if item["category"] == "single_lookup" and calculations:
            expression = json.loads(calculations[0]["arguments"])["expression"]
            assert any(f"| {expression} |" in f"{row} |" for row in noted["content"].splitlines())
            lookups_computed += 1
    assert lookups_computed > 0 and rechecked > 0


@pytest.mark.parametrize(
    ("program", "percent", "plan"),
    [
        ("346.9", False, "value"),
        ("subtract(540, 480)", False, "change"),
        ("subtract(540, 480), divide(#0, 480)", True, "percent change"),
        ("divide(12, 48)", False, "ratio"),
        ("divide(12, 48)", True, "share"),
        ("add(1, 2), add(#0, 3)", False, "total"),
        ("add(1, 2), add(#0, 3), divide(#1, const_3)", False, "average"),
        ("multiply(2, 3)", False, "calculation"),
    ],
)
def test_plan_names_what_the_program_computes(program: str, percent: bool, plan: str) -> None:
    assert plan_of(program, percent=percent) == plan


def test_encoding_trains_only_assistant_tokens_and_weights_copies(demos) -> None:
    items, conversations = demos
    tokenizer = build_tokenizer([str(c) for c in conversations], vocab_size=600, extra_tokens=TICKERS)
    copy_words = re.compile("|".join(rf"\b{t}\b" for t in TICKERS))
    item = _item_of(conversations[0], items)
    ids, weights = encode_conversation(tokenizer, conversations[0], item["tools"], number_weight=4.0, copy_words=copy_words, context_weight=0.1)
    assert len(ids) == len(weights)
    trained = tokenizer.decode([t for t, w in zip(ids, weights, strict=True) if w >= 1])
    context = tokenizer.decode([t for t, w in zip(ids, weights, strict=True) if w < 1])
    assert "<tool_response>" in context and "<tool_response>" not in trained
    assert item["question"] in context
    answer = re.search(r"Answer: (.*)<\|im_end\|>$", trained)
    assert answer and grade(GRADER, {"output_text": f"Answer: {answer[1]}"}, item).reward == 1.0
    heavy = tokenizer.decode([t for t, w in zip(ids, weights, strict=True) if w == 4.0])
    assert item["ticker"] in heavy
    assert set(heavy.replace(item["ticker"], "")) <= set("0123456789.-%,")


def test_copy_accuracy_counts_the_copied_tokens_the_model_predicts(demos) -> None:
    from envs.finqa.demo_model import supervised_warm_start

    items, conversations = demos
    tokenizer = build_tokenizer([str(c) for c in conversations], vocab_size=600, extra_tokens=TICKERS)
    shortest = min(conversations, key=lambda c: len(str(c)))
    example = encode_conversation(tokenizer, shortest, items[0]["tools"], number_weight=4.0)
    assert sum(w > 1 for w in example[1]) >= 4  # the digits the assistant writes
    config = tiny_config(len(tokenizer), hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1,
                         intermediate_size=128, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    model = build_model(config, seed=0)
    assert copy_accuracy(model, [example]) < 0.5  # untrained: digits are a guess
    settings = BootstrapSettings(train_tokens=len(example[0]) * 100, tokens_per_batch=len(example[0]),
                                 learning_rate=1e-2, warmup_steps=5, copy_share=0.0, max_minutes=2.0)
    supervised_warm_start(model, [example], settings, pad_id=tokenizer.pad_token_id, log=lambda _: None)
    assert copy_accuracy(model, [example]) == 1.0  # memorised: every copied token is its first choice
    assert copy_accuracy(model, [([1, 2, 3], [1.0, 1.0, 1.0])]) != copy_accuracy(model, [([1, 2, 3], [1.0, 1.0, 1.0])])  # NaN


def test_copy_batch_repeats_a_span_and_trains_only_the_repeat() -> None:
    import random

    from envs.finqa.demo_model import copy_batch

    examples = [(list(range(100, 400)), [1.0] * 300), (list(range(500, 540)), [1.0] * 40)]
    batch = copy_batch(examples, random.Random(0), tokens_per_batch=500)
    assert sum(len(ids) for ids, _ in batch) >= 500
    for ids, weights in batch:
        half = len(ids) // 2
        assert ids[:half] == ids[half:] and len(weights) == len(ids)
        # the first half and the repeat's first token are unpredictable: no loss there
        assert weights == [0.0] * (half + 1) + [1.0] * (half - 1)


@pytest.mark.parametrize(
    ("result", "written"),
    [("37.2453928225", "37.24"), ("0.372453928", "0.3724"), ("-70.1", "-70.1"), ("8", "8"), ("12.5", "12.5"),
     ("-0.0512345", "-0.0512"), ("1e-05", "1e-05")],
)
def test_calculator_results_are_cut_not_rounded(result: str, written: str) -> None:
    from envs.finqa.demo_model import _cut

    assert _cut(result) == written


def test_model_pin_catches_a_changed_missing_or_extra_file(tmp_path: Path) -> None:
    model_dir, pin_file = tmp_path / "model", tmp_path / "model.pin.json"
    build_model(tiny_config(64, hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=32,
                            pad_token_id=0, eos_token_id=1), seed=0).save_pretrained(model_dir)
    pin = write_model_pin(model_dir, pin_file, {"eval/score_mean": 0.5})
    assert set(pin["files"]) == {"config.json", "generation_config.json", "model.safetensors"}
    assert re.fullmatch(r"[0-9a-f]{32}", pin["md5"]) and pin["evaluation"] == {"eval/score_mean": 0.5}
    assert verify_model_pin(model_dir, pin_file) == json.loads(pin_file.read_text()) == pin

    weights = model_dir / "model.safetensors"
    original = weights.read_bytes()
    weights.write_bytes(original[:-1] + bytes([original[-1] ^ 1]))
    with pytest.raises(DataError, match=rf"{re.escape(str(weights))}: md5 [0-9a-f]{{32}} differs from its pin "
                       rf"{pin['files']['model.safetensors']}.*`git checkout -- {re.escape(str(model_dir))}`.*"
                       "`agentrft model bootstrap`"):
        verify_model_pin(model_dir, pin_file)
    weights.unlink()
    with pytest.raises(DataError, match=r"model\.safetensors: md5 missing differs from its pin"):
        verify_model_pin(model_dir, pin_file)
    weights.write_bytes(original)
    (model_dir / "notes.txt").write_text("x")
    with pytest.raises(DataError, match=r"files \['notes\.txt'\] are not in its pin"):
        verify_model_pin(model_dir, pin_file)
    with pytest.raises(DataError, match="no model directory; restore it with `git checkout"):
        verify_model_pin(tmp_path / "nowhere", pin_file)
    with pytest.raises(DataError, match="cannot read the model pin"):
        verify_model_pin(model_dir, tmp_path / "missing.pin.json")
