"""A tiny model taught scripted tool-use conversations, for tests that need a policy that
sometimes answers right (GRPO, the pipeline).

`teach_model` runs the demo's supervised warm start on five conversations per item
(`scripts`): right answers after a listing, after reading the page or at once, and "0"
at once or after a listing. Sampled at temperature 1 the model mixes them, so rewards vary
within a group, and GRPO with a per-call price has a clear better policy to move to.
Two short tool schemas and 256-character tool outputs keep rollouts under ~400 tokens.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import tempfile
from pathlib import Path

import torch

from envs.finqa.demo_model import BootstrapSettings, encode_conversation, supervised_warm_start
from envs.finqa.generate import TICKERS
from envs.finqa.tiny_model import build_model, tiny_config
from envs.finqa.tokenizer import build_tokenizer
from tests.model_families import build_lock, building_dir, cache_dir, code_digest
from trainer.config.tools import ToolEndpoint
from trainer.data import read_items
from trainer.rollout.tool_client import ToolClient

SYSTEM = "Answer with a number."
TOOLS = [
    {"type": "function", "function": {"name": name, "description": text, "parameters": {
        "type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}}
    for name, text in (("list", "List a directory."), ("cat", "Read a page."))
]
GRADER = {"type": "numeric", "name": "answer", "input": "{{sample.output_text}}", "reference": "{{item.reference_answer}}"}
OUTPUT_CHARS = 256
FIT_STATS = "fit.json"  # beside a fitted model in the cache: its warm-start stats


def copy_items(demo_data_dir: Path, items: list[dict], root: Path, name: str) -> Path:
    """Write `items` as `root/name` and copy their corpus years under `root/corpus`."""
    for item in items:
        year_dir = Path(item["gold_pages"][0]).parent
        shutil.copytree(demo_data_dir / "corpus" / year_dir, root / "corpus" / year_dir, dirs_exist_ok=True)
    path = root / name
    path.write_text("".join(json.dumps(item) + "\n" for item in items))
    return path


def _call(index: int, name: str, path: str) -> dict:
    return {"id": f"call_{index}", "type": "function",
            "function": {"name": name, "arguments": json.dumps({"path": path}, separators=(",", ":"))}}


async def conversation(item: dict, turns: list, endpoints: list[ToolEndpoint]) -> list[dict]:
    """Play `turns` (tool calls as (name, path), answers as text) against the real tools."""
    messages = [{"role": "system", "content": SYSTEM}, *item["messages"]]
    async with ToolClient(endpoints, TOOLS, max_output_chars=OUTPUT_CHARS) as client:
        for index, turn in enumerate(turns):
            if isinstance(turn, str):
                messages.append({"role": "assistant", "content": turn})
                continue
            call = _call(index, *turn)
            messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
            result = await client.call(turn[0], call["function"]["arguments"], item=item, trace_id="trace_t", call_id=call["id"])
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": result.output})
    return messages


def fit_tiny_model(
    conversations: list[tuple[list[dict], list[dict] | None]],
    texts: list[str],
    **settings,
):
    """A tiny Qwen3 (2 layers, width 64) and a tokenizer trained on `texts`, fitted until it
    reproduces `conversations` (each with its tool schemas); returns (model, tokenizer,
    warm-start stats). Loaded from `fitted_model_dir`: fitted once per machine."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = fitted_model_dir(conversations, texts, **settings)
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    return model, AutoTokenizer.from_pretrained(str(folder)), json.loads((folder / FIT_STATS).read_text())


def fitted_model_dir(conversations: list[tuple[list[dict], list[dict] | None]], texts: list[str], **settings) -> Path:
    """The folder of the model (and tokenizer) `_fit` makes of these inputs, with its
    warm-start stats (`fit.json`), in the machine's cache (tests/model_families.py's) under a
    digest of the inputs and of the code that fits and encodes: fitting takes a minute or
    more, and the suite's workers share one build."""
    target = cache_dir() / "taught-demo" / _digest(conversations, texts, sorted(settings.items()))
    with build_lock(target):
        if (target / FIT_STATS).is_file():
            return target
        model, tokenizer, stats = _fit(conversations, texts, **settings)
        # A fit that ran its whole token budget is what these inputs make on any machine; one
        # cut short by its time limit (a loaded machine) is used once and not kept.
        if stats["stopped_by"] != "tokens":
            target = Path(tempfile.mkdtemp(prefix="fit-"))
        with building_dir(target) as out:
            model.save_pretrained(out)
            tokenizer.save_pretrained(out)
            (out / FIT_STATS).write_text(json.dumps(stats))
    return target


def _fit(
    conversations: list[tuple[list[dict], list[dict] | None]],
    texts: list[str],
    *,
    vocab_size: int = 600,
    extra_tokens: list[str] = TICKERS,
    number_weight: float = 1.0,
    epochs: int = 80,
    batch_share: float = 2.0,
    max_minutes: float = 8.0,
):
    tokenizer = build_tokenizer(texts, vocab_size=vocab_size, extra_tokens=extra_tokens)
    examples = [encode_conversation(tokenizer, c, tools, number_weight=number_weight) for c, tools in conversations]
    model = build_model(
        tiny_config(len(tokenizer), hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=128,
                    pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id),
        seed=0,
    )
    total = sum(len(ids) for ids, _ in examples)
    settings = BootstrapSettings(
        train_tokens=total * epochs, tokens_per_batch=max(int(total * batch_share), 1), learning_rate=1e-2, warmup_steps=5, seed=0,
        max_minutes=max_minutes, copy_share=0.0,  # memorising a few scripts: no copy curriculum
    )
    stats = supervised_warm_start(model, examples, settings, pad_id=tokenizer.pad_token_id, log=lambda _: None)
    return model, tokenizer, stats


def scripts(item: dict) -> list[list]:
    """The five ways the taught model answers an item: right after listing the year's
    directory, right after reading the page, right at once, "0" at once, and "0" after a
    listing. Sampled at temperature 1 the model mixes them (a mean score near 0.6), so
    rewards vary within a group, and the cheapest right answer (no call) is there for RL
    with a per-call price to find."""
    page = item["gold_pages"][0]
    answer = f"Answer: {item['reference_answer']}"
    listing = ("list", str(Path(page).parent))
    return [[listing, answer], [("cat", page), answer], [answer], ["Answer: 0"], [listing, "Answer: 0"]]


def direct_first_scripts(item: dict) -> list[list]:
    """Five ways to answer where the cheapest is the only one ever right: right at once
    (twice), "0" at once, and "0" after a listing (twice). The base scores ~0.4 with ~0.4
    calls a rollout; RL learns to answer at once and right (a higher score with fewer calls:
    the clearly better candidate that the pipeline tests' default gates promote)."""
    page = item["gold_pages"][0]
    answer = f"Answer: {item['reference_answer']}"
    listing = ("list", str(Path(page).parent))
    return [[answer], [answer], ["Answer: 0"], [listing, "Answer: 0"], [listing, "Answer: 0"]]


def silent_scripts(item: dict) -> list[list]:
    """A model that never calls: "0" at once (score 0, no tool call, no signal for RL)."""
    return [["Answer: 0"]]


def teach_model(items_files: list[Path], corpus_dir: Path, endpoints: list[ToolEndpoint], out: Path, *,
                epochs: int = 80, batch_share: float = 2.0, ways=scripts, vocabulary=None) -> Path:
    """Teach a tiny Qwen3 the scripted answers of every item; save it to `out`. Its tokenizer
    learns the text of those conversations (or of `vocabulary`'s, so a model taught never to
    call still has the words of the calls). A model taught the same conversations by the same
    code before, on this machine, is copied from the cache (`fitted_model_dir`) instead:
    teaching takes a minute or more."""
    items = [item for path in items_files for item in read_items(path)]
    conversations = [asyncio.run(conversation(item, turns, endpoints)) for item in items for turns in ways(item)]
    spoken = conversations if vocabulary is None else [
        asyncio.run(conversation(item, turns, endpoints)) for item in items for turns in vocabulary(item)]
    texts = [json.dumps(c) for c in spoken] + [p.read_text() for p in sorted(corpus_dir.rglob("*.txt"))]
    cached = fitted_model_dir([(c, TOOLS) for c in conversations], texts, number_weight=3.0, epochs=epochs,
                              batch_share=batch_share)
    shutil.copytree(cached, out, dirs_exist_ok=True, ignore=shutil.ignore_patterns(FIT_STATS))
    return out


def _digest(*inputs: object) -> str:
    """What a taught model depends on: its inputs, the code that teaches it and encodes its
    conversations."""
    repo = Path(__file__).resolve().parent.parent
    return code_digest(inputs, [Path(__file__), *(repo / "envs" / "finqa" / f for f in (
        "demo_model.py", "tokenizer.py", "tiny_model.py")), *(repo / "trainer" / "chat_formats").glob("*.py")])


def write_demonstrations(items: list[dict], endpoints: list[ToolEndpoint], path: Path, ways=scripts) -> Path:
    """Each item's scripted conversations (played against the real tools) as an OpenAI
    supervised file: one `{"messages", "tools"}` a line."""
    rows = [{"messages": asyncio.run(conversation(item, turns, endpoints)), "tools": TOOLS}
            for item in items for turns in ways(item)]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path
