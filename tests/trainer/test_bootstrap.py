"""The demo bootstrap's parts: calculator expressions from FinQA programs, the scripted
demonstrator against the real tool server, and the weighted SFT encoding."""

from __future__ import annotations

import asyncio
import re
import shutil
from pathlib import Path

import pytest

from envs.finqa.calculator import evaluate
from envs.finqa.generate import TICKERS, execute_program
from envs.finqa.local import local_tool_endpoints
from trainer.bootstrap import (
    ScriptedPolicy,
    collect_demonstrations,
    encode_conversation,
    program_expression,
    read_items,
)
from trainer.graders import grade
from trainer.tokenizer import build_tokenizer

GRADER = {"type": "numeric", "name": "a", "input": "{{sample.output_text}}", "reference": "{{item.reference_answer}}"}


@pytest.mark.parametrize(
    ("program", "percent", "expected"),
    [
        ("346.9", False, None),
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
def demos(demo_data_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    items = read_items(demo_data_dir / "train.jsonl", 12)
    corpus = tmp_path_factory.mktemp("corpus")
    for ticker in sorted({item["ticker"] for item in items}):
        shutil.copytree(demo_data_dir / "corpus/reports" / ticker, corpus / "reports" / ticker)
    with local_tool_endpoints(corpus) as endpoints:
        conversations = asyncio.run(
            collect_demonstrations(items, endpoints, demos_per_item=2, seed=0, system_prompt="S", policy=ScriptedPolicy())
        )
    return items, conversations


def test_demonstrations_are_correct_but_wander(demos) -> None:
    items, conversations = demos
    assert len(conversations) == 2 * len(items)
    calls = []
    for index, conversation in enumerate(conversations):
        item = items[index // 2]
        final = conversation[-1]
        assert final["role"] == "assistant" and "tool_calls" not in final
        assert grade(GRADER, {"output_text": final["content"]}, item).reward == 1.0
        tool_calls = [m for m in conversation if m.get("tool_calls")]
        calls.append(len(tool_calls))
        read = [c["function"]["arguments"] for m in tool_calls for c in m["tool_calls"] if c["function"]["name"] == "cat"]
        assert all(any(page in args for args in read) for page in item["gold_pages"])
        # every tool answer came from the real server: no error outputs in a demonstration
        assert not any(m["role"] == "tool" and m["content"].startswith("Error") for m in conversation)
    assert sum(calls) / len(calls) >= 3.0  # redundant browsing on purpose
    assert len(set(calls)) > 1


def test_encoding_trains_only_assistant_tokens_and_weights_copies(demos) -> None:
    items, conversations = demos
    tokenizer = build_tokenizer([str(c) for c in conversations], vocab_size=600, extra_tokens=TICKERS)
    copy_words = re.compile("|".join(rf"\b{t}\b" for t in TICKERS))
    ids, weights = encode_conversation(tokenizer, conversations[0], items[0]["tools"], number_weight=4.0, copy_words=copy_words)
    assert len(ids) == len(weights)
    trained = tokenizer.decode([t for t, w in zip(ids, weights, strict=True) if w > 0])
    context = tokenizer.decode([t for t, w in zip(ids, weights, strict=True) if w == 0])
    assert "<tool_response>" in context and "<tool_response>" not in trained
    assert items[0]["question"] in context
    assert trained.endswith(f"Answer: {items[0]['reference_answer']}<|im_end|>")
    heavy = tokenizer.decode([t for t, w in zip(ids, weights, strict=True) if w == 4.0])
    assert items[0]["ticker"] in heavy
    assert set(heavy.replace(items[0]["ticker"], "")) <= set("0123456789.-%,")
