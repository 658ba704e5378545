"""The units environment's data: conversion and arithmetic questions in OpenAI's RFT row shape.

Each row is `{"id", "messages": [{"role": "user", ...}], "tools", "question",
"reference_answer", "category", "operation"}`: `category` is the quantity's kind (length,
mass, volume, temperature) or `arithmetic`; `operation` is what the right tool call computes
(`convert 3.7 mile kilometer`, `347 * 29`). Reference answers are the exact value to six
significant figures, so a guess from a remembered factor ("about 1.6 km a mile") misses the
grader's 1% band as often as not, and a product of two three-digit numbers is never in a
135M model's head: the tool is what makes an answer right.

Train, validation and test are disjoint by question and by operation (no test item asks a
conversion or a product that a train item asks); production traffic is drawn from the same
mix over 60 days and is unique by question against the splits.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from pathlib import Path
from random import Random

from envs.units.tools import TOOL_SCHEMAS, convert, plural, significant

MIX = {"length": 0.25, "mass": 0.2, "volume": 0.2, "temperature": 0.1, "arithmetic": 0.25}
# The unit pairs people ask about; each split draws its values afresh.
PAIRS = {
    "length": [("mile", "kilometer"), ("kilometer", "mile"), ("foot", "meter"), ("meter", "foot"),
               ("inch", "centimeter"), ("centimeter", "inch"), ("yard", "meter"), ("nautical mile", "kilometer")],
    "mass": [("pound", "kilogram"), ("kilogram", "pound"), ("ounce", "gram"), ("gram", "ounce"),
             ("stone", "kilogram")],
    "volume": [("gallon", "liter"), ("liter", "gallon"), ("cup", "milliliter"), ("pint", "liter"),
               ("quart", "liter"), ("fluid ounce", "milliliter")],
    "temperature": [("fahrenheit", "celsius"), ("celsius", "fahrenheit"), ("kelvin", "fahrenheit")],
}
# Values kept away from a temperature's zero, where a relative grader is undefined.
RANGES = {"fahrenheit": (120, 450), "celsius": (40, 300), "kelvin": (330, 600)}
CONVERT_TEMPLATES = [
    "How many {to} is {value} {from_}?",
    "Convert {value} {from_} to {to}.",
    "What is {value} {from_} in {to}?",
    "{value} {from_} is how many {to}?",
]
TEMPERATURE_TEMPLATES = ["What is {value} degrees {from_} in {to}?", "Convert {value} degrees {from_} to {to}."]
ARITHMETIC = [("*", "What is {a} times {b}?"), ("*", "What is {a} * {b}?"), ("/", "What is {a} divided by {b}?"),
              ("+", "What is {a} plus {b}?"), ("-", "What is {a} minus {b}?")]
TRAFFIC_START = datetime(2026, 9, 1, tzinfo=UTC)
TRAFFIC_DAYS = 60


def _number(rng: Random, low: float, high: float) -> str:
    value = rng.uniform(low, high)
    return str(round(value, rng.choice((0, 1, 1, 2)))).removesuffix(".0")


def _draw(rng: Random, category: str) -> dict:
    if category == "arithmetic":
        op, template = rng.choice(ARITHMETIC)
        if op in "*/":
            a, b = rng.randint(120, 9999), rng.randint(13, 999)
        else:
            a, b = rng.randint(10_000, 999_999), rng.randint(1_000, 99_999)
        expression = f"{a} {op} {b}"
        value = eval(expression)  # noqa: S307 - two integers and one operator, built above
        return {"question": template.format(a=a, b=b), "reference_answer": significant(value, 10),
                "category": category, "operation": expression}
    source, target = rng.choice(PAIRS[category])
    low, high = RANGES.get(source, (1.5, 500))
    value = _number(rng, low, high)
    if category == "temperature":
        template = rng.choice(TEMPERATURE_TEMPLATES)
        if source == "kelvin":  # kelvins have no degrees
            template = template.replace("degrees ", "")
        names = {"from_": source.capitalize(), "to": target.capitalize()}
    else:
        template = rng.choice(CONVERT_TEMPLATES)
        names = {"from_": plural(source), "to": plural(target)}
    question = template.format(value=value, **names)
    return {"question": question[0].upper() + question[1:],
            "reference_answer": significant(convert(float(value), source, target)),
            "category": category, "operation": f"convert {value} {source} {target}"}


def _items(rng: Random, n: int, seen_questions: set[str], taken_operations: set[str]) -> list[dict]:
    categories = list(MIX)
    items: list[dict] = []
    while len(items) < n:
        category = rng.choices(categories, weights=[MIX[c] for c in categories])[0]
        qa = _draw(rng, category)
        key = " ".join(qa["question"].lower().split())
        if key in seen_questions or qa["operation"] in taken_operations:
            continue
        seen_questions.add(key)
        taken_operations.add(qa["operation"])
        items.append(qa)
    return items


def _demonstration(question: str, answer: str) -> list[dict]:
    call = {"id": "call_demo", "type": "function",
            "function": {"name": "calculate", "arguments": json.dumps({"query": question})}}
    return [{"role": "user", "content": question}, {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_demo", "content": answer}, {"role": "assistant", "content": answer.split()[0]}]


# Two worked exchanges before every question (a few-shot prompt, as many production agents
# carry): SmolLM2-135M-Instruct wrote no tool call in 48 tries with one and 8 with two
# (docs/real-model.md). Their answers are what the tool returns for them.
DEMONSTRATIONS = [*_demonstration("How many grams is 2 ounces?", "56.699 grams"),
                  *_demonstration("What is 123 times 45?", "5535")]


def _row(item_id: str, qa: dict) -> dict:
    messages = [*DEMONSTRATIONS, {"role": "user", "content": qa["question"]}]
    return {"id": item_id, "messages": messages, "tools": TOOL_SCHEMAS, **qa}


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows), encoding="utf-8",
                    newline="\n")


def generate_dataset(out_dir: Path, *, seed: int = 0, n_train: int = 600, n_validation: int = 120,
                     n_test: int = 120, n_traffic: int = 1000) -> dict[str, int]:
    """Write train, validation, test and production_traffic JSONL under `out_dir` (overwritten)
    and return the counts."""
    out_dir = Path(out_dir)
    rng = Random(f"{seed}/units")
    seen: set[str] = set()
    taken: set[str] = set()
    splits = {name: _items(rng, size, seen, taken)
              for name, size in (("train", n_train), ("validation", n_validation), ("test", n_test))}
    # Traffic repeats what users ask (operations may recur), never a split's exact question.
    traffic = _items(rng, n_traffic, seen, set())
    for name, items in splits.items():
        write_jsonl(out_dir / f"{name}.jsonl", [_row(f"{name}-{i:05d}", qa) for i, qa in enumerate(items)])
    seconds = sorted(rng.randrange(TRAFFIC_DAYS * 86400) for _ in traffic)
    rows = []
    for i, (qa, second) in enumerate(zip(traffic, seconds, strict=True)):
        row = _row(f"traffic-{i:05d}", qa)
        row["timestamp"] = (TRAFFIC_START + timedelta(seconds=second)).strftime("%Y-%m-%dT%H:%M:%SZ")
        rows.append(row)
    write_jsonl(out_dir / "production_traffic.jsonl", rows)
    return {**{name: len(items) for name, items in splits.items()}, "production_traffic": len(rows)}

