"""The demo's base model, built here because no pretrained chat model can be downloaded.

Three steps, all seeded, so the same data and settings give the same model:

1. A byte-level BPE tokenizer trained on the demo corpus and questions, with every digit
   its own token and every company ticker spelled one letter a token, the same pieces in
   every context (both make copying numbers and names out of the question and the tool
   outputs learnable for a tiny model), and a Qwen-style chat template.
2. Demonstrations from a *scripted policy* that solves training items against the real
   demo tool server. It is imperfect on purpose, as the issue asks: it browses with
   redundant `list`/`search` calls, sometimes opens a wrong page first, and sometimes
   does the arithmetic without the calculator. The imitating model inherits those habits,
   which is what gives RL something to improve: a non-zero baseline with headroom, and
   tool calls and tokens that can be cut.
3. A supervised warm start of a small Qwen3 on those conversations, with the loss on the
   assistant's tokens only and extra weight on the numbers the assistant writes.

The model is saved with `save_pretrained` (loadable with the Auto classes). The demo ships
the built model in `envs/finqa/model/`, pinned by the md5 of each file in
`envs/finqa/model.pin.json` with the evaluation figures measured on it, so a fresh machine
does not spend ~50 minutes building it; `agentrft model bootstrap` rebuilds it from its seed.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import random
import re
import shutil
import tempfile
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from trainer.chat_formats import load_chat_format
from trainer.config.tools import ToolEndpoint
from trainer.data import read_items
from trainer.errors import DataError
from trainer.rollout.tool_client import ToolClient
from trainer.wire import new_trace_id

# Bumped when the demonstrations change for the same data and settings, including through the
# tools they call (v9: the search ranks by table row labels and column years too; v10: parallel
# redundant calls, the calculator on every item; v11: sequential again; v12: a plan line
# and a second, redundant calculator call).
BOOTSTRAP_VERSION = "12"
HELD_OUT_ITEMS = 40  # validation items whose demonstrations measure the built model's copying


@dataclass
class ScriptedPolicy:
    """How the demonstrator browses; each probability is per item (or per page).

    Every item ends with the calculator (a lookup's expression is its value), so whether
    to call it does not depend on the kind of question: when lookups were answered
    directly and changes computed, RL on mixed batches unlearned the calculator for all.
    Browsing waste costs score with a 1M-parameter model: ~5.4 calls in sequential turns
    gave 4.4 calls per rollout but a mean score of 0.12 against 0.22 with lighter browsing
    (2.3 calls), and the same waste as parallel calls in fewer turns (`parallel`) gave 3.4
    calls and 0.10 (the model copied the line item into its first search half as often).
    Waste that comes after the numbers are read costs nothing: `recheck` runs the same
    calculation a second time, whose short result repeats the first. With it and the plan
    line (see `plan_of`), these probabilities give 4.8 calls per rollout and a mean score
    of 0.52."""

    list_company: float = 0.6  # `list reports/<TICKER>` before searching
    search_question: float = 0.3  # a first, redundant search with the whole question
    list_year: float = 0.3  # `list reports/<TICKER>/<YEAR>` before reading a page
    wrong_page_first: float = 0.3  # open a wrong page from the search results first
    calculator: float = 0.85  # use the calculator (else answer directly, mental arithmetic a model cannot copy)
    from_snippet: float = 0.4  # take a row from the search result's snippet instead of reading the page
    recheck: float = 0.85  # after the calculator, call it again with the same expression before answering
    parallel: bool = False  # the redundant calls in the turns of the needed ones, as parallel calls


@dataclass
class BootstrapSettings:
    vocab_size: int = 1024
    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 384
    max_position_embeddings: int = 2048
    demos_per_item: int = 2
    max_items: int | None = None
    train_tokens: int = 20_000_000
    tokens_per_batch: int = 3072
    learning_rate: float = 3e-3
    warmup_steps: int = 30
    number_weight: float = 4.0
    context_weight: float = 0.1
    copy_share: float = 0.2  # warm-start steps on the copy curriculum (0 to memorise a few scripts)
    seed: int = 0
    max_minutes: float = 120.0  # a safety net; the token budget is what should end the warm start
    max_output_chars: int = 2000


# --- 1. tokenizer ---------------------------------------------------------------------


def model_corpus(data_dir: Path, out: Path) -> Path:
    """A copy of the corpus the model is built from: the reports train and validation ask
    about (`REPORT_YEARS`), without the test split's later reports, so that the test split
    reads pages the model never saw (and a rebuild reproduces the model built before those
    reports existed). Returns `out`."""
    from envs.finqa.generate import REPORT_YEARS

    reports = data_dir / "corpus" / "reports"
    if not reports.is_dir():
        raise DataError(f"{reports}: missing; regenerate the demo data (`agentrft data generate`)")
    for source in sorted(reports.glob("*/*")):
        if source.is_dir() and source.name.isdigit() and int(source.name) in REPORT_YEARS:
            shutil.copytree(source, out / "reports" / source.parent.name / source.name, dirs_exist_ok=True)
    return out


def tokenizer_texts(data_dir: Path, tools: list[dict[str, Any]], corpus: Path | None = None) -> Iterable[str]:
    """Corpus pages, questions and tool JSON: what the demo model will read and write."""
    for page in sorted((corpus or data_dir / "corpus").rglob("*.txt")):
        yield page.read_text(encoding="utf-8")
    for name in ("train.jsonl",):
        with (data_dir / name).open(encoding="utf-8") as handle:
            for line in handle:
                row = json.loads(line)
                yield row["question"]
                yield f"Answer: {row['reference_answer']}"
    for tool in tools:
        yield json.dumps(tool, separators=(",", ":"))


# --- 2. scripted demonstrations -------------------------------------------------------


def program_expression(program: str, *, percent: bool) -> str | None:
    """The calculator expression that computes a FinQA program, e.g.
    'subtract(540, 480), divide(#0, 480)' -> '(540-480)/480*100', and a lookup's value
    ('346.9') as it is. None when the program uses an op the calculator lacks."""
    if re.fullmatch(r"-?\d+(?:\.\d+)?", program.strip()):
        return f"({program.strip()})*100" if percent else program.strip()
    steps = re.findall(r"([a-z_]+)\(([^()]*)\)", program)
    if not steps:
        return None
    symbols = {"add": "+", "subtract": "-", "multiply": "*", "divide": "/"}
    parts: list[str] = []
    for op, args_text in steps:
        if op not in symbols:
            return None
        args = []
        for arg in (a.strip() for a in args_text.split(",")):
            if arg.startswith("#"):
                args.append(f"({parts[int(arg[1:])]})")
            elif arg.startswith("const_"):
                args.append(arg[len("const_") :].replace("m", "-", 1))
            else:
                args.append(arg)
        parts.append(f"{args[0]}{symbols[op]}{args[1]}")
    expression = parts[-1]
    return f"({expression})*100" if percent else expression


def plan_of(program: str, *, percent: bool) -> str:
    """What a FinQA program asks for, in the words the demonstrator's first turn writes
    (`Plan: percent change`) and repeats above its calculation: the kind of question is
    decided right below the question, and the expression is written right below its
    restatement, instead of across the whole conversation from the question."""
    ops = re.findall(r"([a-z_]+)\(", program)
    kinds = {
        (): "value",
        ("subtract",): "change",
        ("subtract", "divide"): "percent change",
        ("divide",): "share" if percent else "ratio",
        ("add", "add"): "total",
        ("add", "add", "divide"): "average",
    }
    return kinds.get(tuple(ops), "calculation")


def _call(name: str, arguments: dict[str, Any], index: int) -> dict[str, Any]:
    return {
        "id": f"call_{index}",
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(arguments, separators=(",", ":"))},
    }


def _rows(text: str, needs: Sequence[str]) -> list[str]:
    """The table rows (`label | this year | prior year`) of the line items `needs` in a
    page or a search result, as written."""
    rows = []
    for line in text.splitlines():
        row = line.split(" ... ")[-1]
        if " | " in row and row.split(" | ")[0] in needs:
            rows.append(row)
    return rows


def _same_number(a: str, b: str) -> bool:
    try:
        return float(a) == float(b)
    except ValueError:
        return False


def _cut(value_text: str) -> str:
    """A calculator result as the demonstrator writes it: cut (not rounded, which a copy
    can do) to 2 decimals, or 4 when it is below 1."""
    if "." not in value_text or "e" in value_text.lower():
        return value_text
    whole, decimals = value_text.split(".")
    keep = 4 if whole.lstrip("-") == "0" else 2
    return f"{whole}.{decimals[:keep]}".rstrip("0").rstrip(".")


async def scripted_conversation(
    item: dict[str, Any], client: ToolClient, rng: random.Random, policy: ScriptedPolicy, system_prompt: str
) -> list[dict[str, Any]] | None:
    """One demonstration: the scripted policy solves `item` against the real tools.

    For each report page the answer needs it searches `TICKER YEAR line item` (three short
    copies out of the question, where the whole question is a long one a tiny model
    garbles), opens only pages a search showed it (a model cannot guess page numbers) or
    takes the row straight from the result's snippet, and before computing writes down the
    rows it uses, each after its report's year (`2021: net revenue | 3093 | 3000`):
    copying whole lines is what a small model learns first, and the expression then takes
    its numbers from right above it. Its waste, for RL to remove: listing directories, a
    first search with the whole question, a wrong page before the right one, reading a
    page whose row the snippet already showed, and arithmetic without the calculator.
    Every item ends with the calculator, a lookup's expression being the value itself (see
    ScriptedPolicy), often twice (`recheck`). The first turn names what the question asks
    for (`Plan: change`, see `plan_of`) and the notes above the calculation repeat it.
    None when the search cannot show a needed page (a few items)."""
    from envs.finqa.generate import LINE_ITEMS

    messages: list[dict[str, Any]] = [{"role": "system", "content": system_prompt}, *item["messages"]]
    trace_id = new_trace_id()
    n_calls = 0
    percent = item["reference_answer"].endswith("%")
    plan = f"Plan: {plan_of(item['program'], percent=percent)}"

    async def act(calls: list[tuple[str, dict[str, Any]]], content: str = "") -> list[str]:
        """`calls` in one assistant turn (parallel calls) or, unless the policy is parallel,
        one turn each; their outputs in order."""
        if not policy.parallel and len(calls) > 1:
            return [(await act([call], content if i == len(calls) - 1 else ""))[0] for i, call in enumerate(calls)]
        nonlocal n_calls
        if not n_calls:  # the first turn, right below the question, names what it asks for
            content = "\n".join(filter(None, [plan, content]))
        made = [_call(name, arguments, n_calls + i) for i, (name, arguments) in enumerate(calls)]
        n_calls += len(made)
        messages.append({"role": "assistant", "content": content, "tool_calls": made})
        results = await asyncio.gather(
            *(
                client.call(c["function"]["name"], c["function"]["arguments"], item=item, trace_id=trace_id, call_id=c["id"])
                for c in made
            )
        )
        for call, result in zip(made, results, strict=True):
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": result.output})
        return [result.output for result in results]

    seen: dict[str, str] = {}  # page -> its line in a search result

    def note_search(output: str) -> None:
        for line in output.splitlines():
            if " | " in line:
                seen.setdefault(line.split(" | ")[0].strip(), line)

    ticker, gold_pages = item["ticker"], list(item["gold_pages"])
    named = [a for a in LINE_ITEMS if a in item["question"]]
    # waste that rides along with the first search
    extra: list[tuple[str, dict[str, Any]]] = []
    if rng.random() < policy.list_company:
        extra.append(("list", {"path": f"reports/{ticker}"}))
    if rng.random() < policy.search_question:
        extra.append(("search", {"query": item["question"]}))
    notes: list[str] = []
    for gold in gold_pages:
        year_dir = gold.rsplit("/", 1)[0]
        year = year_dir.rsplit("/", 1)[1]
        # the demonstrator knows which named line items this page holds (a peek, not a turn)
        peek = await client.call("cat", json.dumps({"path": gold}), item=item, trace_id=new_trace_id())
        needs = [a for a in named if _rows(peek.output, [a])]
        if not needs:
            return None
        outputs = await act([*extra, ("search", {"query": f"{ticker} {year} {needs[0]}"})])
        for output in outputs[:-1]:  # a listing has no result lines; the question's search does
            note_search(output)
        extra = []
        seen.pop(gold, None)  # take its row from the direct search, whatever the question's search showed
        note_search(outputs[-1])
        if gold not in seen:
            return None
        rows = _rows(seen[gold], needs)
        if len(rows) < len(needs) or rng.random() >= policy.from_snippet:
            reads: list[tuple[str, dict[str, Any]]] = []
            if rng.random() < policy.list_year:
                reads.append(("list", {"path": year_dir}))
            wrong = [p for p in seen if p not in gold_pages]
            if wrong and rng.random() < policy.wrong_page_first:
                reads.append(("cat", {"path": rng.choice(wrong)}))
            rows = _rows((await act([*reads, ("cat", {"path": gold})]))[-1], needs)
        notes += [f"{year}: {row}" for row in rows]
    note = "\n".join([plan, *notes])
    expression = program_expression(item["program"], percent=percent)
    if expression == item["program"].strip():  # a lookup: its value as the noted row writes it
        cells = [cell for row in rows for cell in row.split(" | ")[1:]]
        expression = next((cell for cell in cells if _same_number(cell, expression)), expression)
    answer = item["reference_answer"]
    if expression is not None and rng.random() < policy.calculator:
        result = (await act([("calculator", {"expression": expression})], content=note))[0]
        if rng.random() < policy.recheck:
            result = (await act([("calculator", {"expression": expression})]))[0]
        answer = _cut(result.strip()) + ("%" if percent else "")
        note = ""
    messages.append({"role": "assistant", "content": f"{note}\nAnswer: {answer}".strip()})
    return messages


async def collect_demonstrations(
    items: Sequence[dict[str, Any]],
    endpoints: list[ToolEndpoint],
    *,
    demos_per_item: int,
    seed: int,
    system_prompt: str,
    policy: ScriptedPolicy | None = None,
    concurrency: int = 16,
    max_output_chars: int = 2000,
    log: Any = None,
) -> list[list[dict[str, Any]]]:
    """Run the scripted policy `demos_per_item` times on every item, in a fixed order;
    `log` hears how many are done every 30 s."""
    policy = policy or ScriptedPolicy()
    tools = items[0]["tools"]
    slots = asyncio.Semaphore(concurrency)
    total, done, last = len(items) * demos_per_item, 0, time.monotonic()
    async with ToolClient(endpoints, tools, max_output_chars=max_output_chars, backoff_s=0.05) as client:

        async def one(item: dict[str, Any], k: int) -> list[dict[str, Any]] | None:
            nonlocal done, last
            async with slots:
                rng = random.Random(f"{seed}:{item['id']}:{k}")
                demo = await scripted_conversation(item, client, rng, policy, system_prompt)
            done += 1
            if log is not None and time.monotonic() - last > 30:
                last = time.monotonic()
                log(f"demo model: demonstrations {done}/{total}")
            return demo

        jobs = [one(item, k) for item in items for k in range(demos_per_item)]
        return [demo for demo in await asyncio.gather(*jobs) if demo is not None]


# --- 3. supervised warm start ---------------------------------------------------------

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?%?")


def encode_conversation(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]],
    *,
    number_weight: float,
    copy_words: re.Pattern[str] = re.compile(r"(?!)"),
    context_weight: float = 0.0,
) -> tuple[list[int], list[float]]:
    """Token ids and per-token loss weights, built piece by piece exactly as a rollout
    builds them (the chat format's prompt, each turn as the model writes it, the tool
    results and next prompt that follow it), so the warm start sees the token boundaries the
    policy will see. Assistant tokens weigh 1, the digits they write (and the `copy_words`
    they copy, e.g. company tickers) weigh `number_weight`, everything else (prompt, tool
    outputs) `context_weight`: a little language modelling of the pages and results, whose
    lines repeat one another, teaches a model trained from scratch to copy out of its context."""
    chat = load_chat_format(tokenizer)
    ids: list[int] = []
    weights: list[float] = []

    def add(text: str, trained: bool) -> None:
        if not text:
            return
        encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids.extend(encoded["input_ids"])
        if not trained:
            weights.extend([context_weight] * len(encoded["input_ids"]))
            return
        # Copies out of the context (numbers, company names) are what a small model learns
        # last; weighting them up is what makes it read the question and the pages.
        numbers = [m.span() for m in _NUMBER.finditer(text)] + [m.span() for m in copy_words.finditer(text)]
        for start, _end in encoded["offset_mapping"]:
            in_number = any(a <= start < b for a, b in numbers)
            weights.append(number_weight if in_number else 1.0)

    first = next(k for k, message in enumerate(messages) if message["role"] == "assistant")
    add(chat.render(messages[:first], tools, add_generation_prompt=True), False)
    k = first
    while k < len(messages):
        add(chat.assistant_text(messages[:k], messages[k], tools), True)
        following = k + 1
        while following < len(messages) and messages[following]["role"] == "tool":
            following += 1
        if following < len(messages):  # a later turn: the tool results and its prompt
            add(chat.bridge_text(messages[:following], k + 1, tools) + chat.generation_prompt, False)
        k = following
    return ids, weights


def _pack(examples: list[tuple[list[int], list[float]]], rng: random.Random, tokens_per_batch: int):
    """Batches of whole conversations of similar length (little padding), about
    tokens_per_batch padded tokens each, in a seeded random order."""
    order = list(range(len(examples)))
    rng.shuffle(order)
    batches: list[list[int]] = []
    for start in range(0, len(order), 256):  # sort within windows: similar lengths, still shuffled
        window = sorted(order[start : start + 256], key=lambda i: len(examples[i][0]))
        batch: list[int] = []
        longest = 0
        for index in window:
            length = len(examples[index][0])
            if batch and max(longest, length) * (len(batch) + 1) > tokens_per_batch:
                batches.append(batch)
                batch, longest = [], 0
            batch.append(index)
            longest = max(longest, length)
        if batch:
            batches.append(batch)
    rng.shuffle(batches)
    yield from batches


def copy_batch(
    examples: list[tuple[list[int], list[float]]], rng: random.Random, tokens_per_batch: int
) -> list[tuple[list[int], list[float]]]:
    """A batch of the copy curriculum: spans of the demonstrations' own tokens, each said
    twice (`span span`), with the loss on the repeat after its first token. Predicting a
    repeat is what forms induction heads (attend to what followed the current token last
    time, copy it): a tiny model trained on the demonstrations alone memorises their
    templates long before it learns to copy a line item or a number out of its context,
    and copying is all this task asks for."""
    batch = []
    while sum(len(ids) for ids, _ in batch) < tokens_per_batch:
        ids, _ = examples[rng.randrange(len(examples))]
        length = rng.randint(16, 64)
        start = rng.randrange(max(1, len(ids) - length))
        span = ids[start : start + length]
        batch.append((span + span, [0.0] * (len(span) + 1) + [1.0] * (len(span) - 1)))
    return batch


def supervised_warm_start(
    model: torch.nn.Module,
    examples: list[tuple[list[int], list[float]]],
    settings: BootstrapSettings,
    *,
    pad_id: int,
    log: Any = print,
) -> dict[str, float]:
    """Weighted next-token cross-entropy on the assistant tokens; AdamW, warmup, cosine.

    Stops after `train_tokens` tokens (reproducible) or `max_minutes` (a guard on slow
    machines, reported when it fires)."""
    torch.manual_seed(settings.seed)
    rng = random.Random(settings.seed)
    device = next(model.parameters()).device
    optimizer = torch.optim.AdamW(model.parameters(), lr=settings.learning_rate, weight_decay=0.01, betas=(0.9, 0.95))
    total_tokens = sum(len(ids) for ids, _ in examples)
    est_steps = max(1, math.ceil(settings.train_tokens / settings.tokens_per_batch))

    def lr_at(step: int) -> float:
        if step < settings.warmup_steps:
            return (step + 1) / settings.warmup_steps
        progress = min(1.0, (step - settings.warmup_steps) / max(1, est_steps - settings.warmup_steps))
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

    model.train()
    started = time.perf_counter()
    seen, step, epoch, loss_value, stopped_by = 0, 0, 0, float("nan"), "tokens"
    copy_rng = random.Random(f"{settings.seed}/copy")
    while seen < settings.train_tokens:
        for packed in _pack(examples, rng, settings.tokens_per_batch):
            if copy_rng.random() < settings.copy_share:
                rows = copy_batch(examples, copy_rng, settings.tokens_per_batch)
            else:
                rows = [examples[i] for i in packed]
            longest = max(len(ids) for ids, _ in rows)
            input_ids = torch.full((len(rows), longest), pad_id, dtype=torch.long)
            weights = torch.zeros((len(rows), longest))
            attention = torch.zeros((len(rows), longest), dtype=torch.long)
            for row, (ids, w) in enumerate(rows):
                input_ids[row, : len(ids)] = torch.tensor(ids)
                weights[row, : len(w)] = torch.tensor(w)
                attention[row, : len(ids)] = 1
            input_ids, weights, attention = input_ids.to(device), weights.to(device), attention.to(device)
            logits = model(input_ids=input_ids, attention_mask=attention).logits[:, :-1].float()
            targets, target_w = input_ids[:, 1:], weights[:, 1:]
            token_loss = torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.size(-1)), targets.reshape(-1), reduction="none"
            ).view_as(targets)
            loss = (token_loss * target_w).sum() / target_w.sum().clamp(min=1.0)
            for group in optimizer.param_groups:
                group["lr"] = settings.learning_rate * lr_at(step)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            step += 1
            seen += int(attention.sum())
            loss_value = loss.item()
            if step % 50 == 0:
                elapsed = time.perf_counter() - started
                eta = elapsed * (settings.train_tokens - seen) / max(seen, 1)
                log(f"warm start step {step}: loss {loss_value:.3f}, {seen / 1e6:.2f}M of "
                    f"{settings.train_tokens / 1e6:.0f}M tokens, {elapsed:.0f}s, ETA {eta / 60:.0f} min")
            if seen >= settings.train_tokens:
                break
            if time.perf_counter() - started > settings.max_minutes * 60:
                stopped_by = "time"
                break
        epoch += 1
        if stopped_by == "time":
            break
    model.eval()
    return {
        "steps": step,
        "tokens": seen,
        "epochs": seen / max(total_tokens, 1),
        "final_loss": loss_value,
        "seconds": time.perf_counter() - started,
        "stopped_by": stopped_by,
    }


def copy_accuracy(model: torch.nn.Module, examples: list[tuple[list[int], list[float]]]) -> float:
    """The share of the tokens the assistant copies (those weighted above 1: the digits,
    tickers and line items it writes) that the model ranks first given everything before
    them. On held-out demonstrations this is what decides the demo model's score: a
    rollout needs a dozen such tokens right in a row (a query, a row, an expression, an
    answer), so 0.8 a token is a few percent a rollout. NaN without any copied token."""
    device = next(model.parameters()).device
    right = total = 0
    model.eval()
    with torch.no_grad():
        for ids, weights in examples:
            tensor = torch.tensor([ids], device=device)
            predicted = model(input_ids=tensor).logits[0, :-1].argmax(-1)
            copied = torch.tensor(weights[1:], device=device) > 1.0
            right += int((predicted == tensor[0, 1:])[copied].sum())
            total += int(copied.sum())
    return right / total if total else float("nan")


# --- the whole build ------------------------------------------------------------------

MODEL_DIR = Path(__file__).resolve().parent / "model"
PIN_FILE = Path(__file__).resolve().parent / "model.pin.json"


def _demonstrations(data_dir: Path, corpus: Path, items: list[dict[str, Any]], settings: BootstrapSettings,
                    system_prompt: str, log: Any) -> tuple[list, list]:
    """The scripted demonstrations on `items` and on the held-out yardstick, against a real
    tool server over `corpus`."""
    from envs.finqa.local import local_tool_endpoints

    with local_tool_endpoints(corpus, max_output_chars=settings.max_output_chars) as endpoints:
        log(f"demo model: {len(items) * settings.demos_per_item} demonstrations against the tool server")
        demos = asyncio.run(
            collect_demonstrations(
                items,
                endpoints,
                demos_per_item=settings.demos_per_item,
                seed=settings.seed,
                system_prompt=system_prompt,
                max_output_chars=settings.max_output_chars,
                log=log,
            )
        )
        # a yardstick only, never trained on: the validation split's first items
        held_out = asyncio.run(
            collect_demonstrations(
                read_items(data_dir / "validation.jsonl", HELD_OUT_ITEMS),
                endpoints,
                demos_per_item=1,
                seed=settings.seed,
                system_prompt=system_prompt,
                max_output_chars=settings.max_output_chars,
            )
        )
    return demos, held_out


def bootstrap_demo_model(
    data_dir: Path,
    out: Path,
    *,
    settings: BootstrapSettings,
    system_prompt: str,
    log: Any = print,
) -> Path:
    """Build the demo base model from `data_dir` (train items, corpus) into `out`:
    tokenizer, demonstrations against the real tool server, warm start. Returns `out`."""
    from envs.finqa.generate import LINE_ITEMS, TICKERS
    from envs.finqa.tiny_model import build_model, count_parameters, tiny_config
    from envs.finqa.tokenizer import build_tokenizer

    started = time.perf_counter()
    items = read_items(data_dir / "train.jsonl", settings.max_items)
    tools = items[0]["tools"]
    scratch = Path(tempfile.mkdtemp(prefix="agentrft-model-corpus-"))
    try:
        corpus = model_corpus(data_dir, scratch / "corpus")
        log("demo model: training the tokenizer")
        tokenizer = build_tokenizer(
            tokenizer_texts(data_dir, tools, corpus), vocab_size=settings.vocab_size, extra_tokens=TICKERS
        )
        demos, held_out = _demonstrations(data_dir, corpus, items, settings, system_prompt, log)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    demo_seconds = time.perf_counter() - started
    # What the assistant copies out of the question (the company, the line items) and the
    # plan it names (see plan_of), the decision its expression rests on.
    copy_words = re.compile("|".join([*(rf"\b{re.escape(word)}\b" for word in [*TICKERS, *LINE_ITEMS]), r"(?<=Plan: )[a-z ]+"]))
    examples = [
        encode_conversation(
            tokenizer, messages, tools, number_weight=settings.number_weight,
            context_weight=settings.context_weight, copy_words=copy_words,
        )
        for messages in demos
    ]
    tool_calls = [sum(len(m.get("tool_calls", [])) for m in conv) for conv in demos]
    log(
        f"demo model: {len(demos)} demonstrations in {demo_seconds:.0f}s, "
        f"{sum(tool_calls) / len(tool_calls):.2f} tool calls each, "
        f"{sum(len(ids) for ids, _ in examples) / len(examples):.0f} tokens each"
    )
    config = tiny_config(
        len(tokenizer),
        hidden_size=settings.hidden_size,
        num_layers=settings.num_layers,
        num_heads=settings.num_heads,
        num_kv_heads=settings.num_kv_heads,
        intermediate_size=settings.intermediate_size,
        max_position_embeddings=settings.max_position_embeddings,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    model = build_model(config, settings.seed)
    stats = supervised_warm_start(model, examples, settings, pad_id=tokenizer.pad_token_id, log=log)
    encode = dict(number_weight=settings.number_weight, copy_words=copy_words)
    stats["held_out_copy_accuracy"] = copy_accuracy(
        model, [encode_conversation(tokenizer, messages, tools, **encode) for messages in held_out]
    )
    log(f"demo model: copies {stats['held_out_copy_accuracy']:.1%} of the copied tokens of held-out demonstrations")
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    record = {
        "settings": asdict(settings),
        "bootstrap_version": BOOTSTRAP_VERSION,
        "parameters": count_parameters(model),
        "demonstrations": len(demos),
        "demo_tool_calls_mean": sum(tool_calls) / len(tool_calls),
        "demo_seconds": demo_seconds,
        "warm_start": stats,
        "total_seconds": time.perf_counter() - started,
    }
    (tmp / "bootstrap.json").write_text(json.dumps(record, indent=2) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    tmp.replace(out)
    log(f"demo model: built in {record['total_seconds']:.0f}s at {out}")
    return out


def model_files_md5(model_dir: Path) -> dict[str, str]:
    """The md5 of every file of a model directory, by name."""
    if not model_dir.is_dir():
        raise DataError(f"{model_dir}: no model directory; restore it with `git checkout {model_dir}` or "
                        "rebuild it with `agentrft model bootstrap`")
    return {
        file.name: hashlib.md5(file.read_bytes(), usedforsecurity=False).hexdigest()
        for file in sorted(model_dir.iterdir())
        if file.is_file()
    }


def write_model_pin(model_dir: Path, pin_file: Path, evaluation: dict[str, Any] | None = None) -> dict[str, Any]:
    """Pin a model directory: each file's md5, plus the evaluation figures recorded for it."""
    files = model_files_md5(model_dir)
    pin = {
        "model_dir": model_dir.name,
        "files": files,
        "md5": hashlib.md5(json.dumps(files, sort_keys=True).encode(), usedforsecurity=False).hexdigest(),
        "evaluation": evaluation or {},
    }
    pin_file.write_text(json.dumps(pin, indent=2) + "\n")
    return pin


def verify_model_pin(model_dir: Path = MODEL_DIR, pin_file: Path = PIN_FILE) -> dict[str, Any]:
    """Check a shipped model against its pin; returns the pin. DataError naming the file
    that differs (or is missing) and how to restore it."""
    try:
        pin = json.loads(pin_file.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise DataError(f"{pin_file}: cannot read the model pin ({exc}); restore it with git") from None
    actual = model_files_md5(model_dir)
    for name, md5 in pin["files"].items():
        if actual.get(name) != md5:
            found = actual.get(name, "missing")
            raise DataError(
                f"{model_dir / name}: md5 {found} differs from its pin {md5} in {pin_file}; restore the shipped "
                f"model with `git checkout -- {model_dir}`, or rebuild and re-pin it with `agentrft model bootstrap`"
            )
    extra = sorted(set(actual) - set(pin["files"]))
    if extra:
        raise DataError(f"{model_dir}: files {extra} are not in its pin {pin_file}; remove them or re-pin")
    return pin
