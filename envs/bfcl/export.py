"""BFCL v4's single-turn categories as OpenAI RFT rows, written from the installed package.

Run in BFCL's own environment (`.venv-bfcl/bin/python -m envs.bfcl.export --out DIR`;
`envs/bfcl/data.py` does it for the project). Nothing of BFCL is committed: the rows are made
from `bfcl_eval` at run time, the way BFCL's own inference makes a request of an OpenAI-style
function-calling model, so the model sees what it sees on the leaderboard:

- the question's first (only) turn as `messages` (the live categories' system messages kept);
- the functions as BFCL loads them for inference (`load_dataset_entry`: its language hint
  appended to each description, Java and JavaScript parameters as strings), turned into Chat
  Completions tools by BFCL's own `convert_to_tool` for OpenAI's chat API: its `dict` becomes
  `object`, `float` `number`, `tuple` `array`, `any` `string` (`GORILLA_TO_OPENAPI`), and a
  dotted name `math.factorial` the tool name `math_factorial` (envs/bfcl/calls.py maps it back);
- reference fields: `bfcl_id`, `category`, `tool_names` (tool name -> BFCL's name) and
  `ground_truth` (BFCL's possible answer; none for the relevance categories).

Splits: the non-live AST categories (`SPLIT_CATEGORIES`) are split by item, seeded, into
train / validation / test (70/15/15); the categories kept for evaluation only
(`EVAL_CATEGORIES`: live_*, irrelevance) never reach train and are split by item between
validation and test. `all.jsonl` holds every item of every category, for holding a model
against the leaderboard. Rows are in a round-robin of categories, so the first N items of a
file cover every category. `manifest.json` records bfcl-eval's version, the sha256 of every
source file read and the counts; `demonstrations.jsonl` holds the train split's ground-truth
calls as OpenAI supervised rows (an assistant message with `tool_calls`), those BFCL's checker
accepts (a few possible answers mark a required argument optional).

Standard library and bfcl_eval only.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import json
import os
import random
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from envs.bfcl.calls import answer_calls, tool_name, tool_names

SPLIT_CATEGORIES = ("simple_python", "multiple", "parallel", "parallel_multiple")
EVAL_CATEGORIES = ("live_simple", "live_multiple", "live_parallel", "live_parallel_multiple",
                   "irrelevance", "live_irrelevance", "live_relevance")
CATEGORIES = SPLIT_CATEGORIES + EVAL_CATEGORIES
SHARES = {"train": 0.70, "validation": 0.15}  # the rest is test


def entries(category: str) -> list[dict[str, Any]]:
    """BFCL's rows of `category`, as its inference reads them, with their possible answers."""
    from bfcl_eval.utils import (
        is_relevance_or_irrelevance,
        load_dataset_entry,
        load_ground_truth_entry,
    )

    rows = load_dataset_entry(category, include_prereq=False, include_language_specific_hint=True)
    if not is_relevance_or_irrelevance(category):
        answers = {entry["id"]: entry["ground_truth"] for entry in load_ground_truth_entry(category)}
        for row in rows:
            row["ground_truth"] = answers[row["id"]]
    return rows


def to_row(entry: dict[str, Any], category: str) -> dict[str, Any]:
    """One BFCL entry as an OpenAI RFT row."""
    from bfcl_eval.constants.enums import ModelStyle
    from bfcl_eval.constants.type_mappings import GORILLA_TO_OPENAPI
    from bfcl_eval.model_handler.utils import convert_to_tool

    if len(entry["question"]) != 1:
        raise ValueError(f"{entry['id']}: {len(entry['question'])} turns; only single-turn entries are rows")
    names = tool_names(entry["function"], where=entry["id"])
    tools = convert_to_tool(entry["function"], GORILLA_TO_OPENAPI, ModelStyle.OPENAI_COMPLETIONS)
    row = {"id": entry["id"], "messages": entry["question"][0], "tools": tools, "category": category,
           "bfcl_id": entry["id"], "tool_names": names}
    if "ground_truth" in entry:
        row["ground_truth"] = entry["ground_truth"]
    return row


def demonstration(row: dict[str, Any]) -> dict[str, Any]:
    """A train row's right answer as an OpenAI supervised row: the prompt, then the assistant
    message that makes the ground truth's calls (first accepted value of every argument)."""
    calls = [{"id": f"call_{i}", "type": "function",
              "function": {"name": tool_name(name), "arguments": json.dumps(arguments)}}
             for i, (name, arguments) in enumerate(answer_calls(row["ground_truth"]))]
    return {"messages": [*row["messages"], {"role": "assistant", "content": "", "tool_calls": calls}],
            "tools": row["tools"], "id": row["id"], "category": row["category"]}


def round_robin(groups: Iterable[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Rows taken one from each group in turn, so that every prefix covers every group."""
    groups = [list(g) for g in groups]
    out = []
    for i in range(max((len(g) for g in groups), default=0)):
        out.extend(g[i] for g in groups if i < len(g))
    return out


def split(rows: list[dict[str, Any]], category: str, seed: int) -> dict[str, list[dict[str, Any]]]:
    shuffled = list(rows)
    random.Random(f"{seed}:{category}").shuffle(shuffled)
    if category in EVAL_CATEGORIES:
        half = len(shuffled) // 2
        return {"train": [], "validation": shuffled[:half], "test": shuffled[half:]}
    n_train = round(SHARES["train"] * len(shuffled))
    n_validation = round(SHARES["validation"] * len(shuffled))
    return {"train": shuffled[:n_train], "validation": shuffled[n_train:n_train + n_validation],
            "test": shuffled[n_train + n_validation:]}


def source_files() -> dict[str, Path]:
    """The package files the rows are made from, by their path inside bfcl_eval."""
    import bfcl_eval

    root = Path(bfcl_eval.__file__).parent
    files = {}
    for category in CATEGORIES:
        for sub in ("data", "data/possible_answer"):
            path = root / sub / f"BFCL_v4_{category}.json"
            if path.is_file():
                files[f"{sub}/{path.name}"] = path
    return files


def export(out: Path, seed: int = 0) -> dict[str, Any]:
    """Write the splits, `all.jsonl`, the demonstrations and the manifest into `out`."""
    out.mkdir(parents=True, exist_ok=True)
    by_category = {category: [to_row(e, category) for e in entries(category)] for category in CATEGORIES}
    splits = {category: split(rows, category, seed) for category, rows in by_category.items()}
    files = {"all": round_robin(by_category.values())}
    for name in ("train", "validation", "test"):
        files[name] = round_robin(splits[c][name] for c in CATEGORIES)
    # A possible answer's first accepted values are a right output for all but a few entries
    # (an argument marked optional that the function requires): BFCL's checker says which.
    from envs.bfcl.grader_server import Checker

    checker = Checker(list(SPLIT_CATEGORIES))
    demonstrations = [demonstration(row) for row in files["train"]]
    refused = [d["id"] for d in demonstrations
               if not checker.verdict(d["id"], {"output_tools": d["messages"][-1]["tool_calls"]})["valid"]]
    files["demonstrations"] = [d for d in demonstrations if d["id"] not in refused]
    for name, rows in files.items():
        with open(out / f"{name}.jsonl", "w") as f:
            for row in rows:
                f.write(json.dumps(row, sort_keys=True) + "\n")
    manifest = {
        "bfcl_eval": importlib.metadata.version("bfcl-eval"),
        "licence": "Apache-2.0 (bfcl-eval, the Berkeley Function Calling Leaderboard v4, ShishirPatil/gorilla)",
        "seed": seed,
        "sources": {name: hashlib.sha256(path.read_bytes()).hexdigest() for name, path in source_files().items()},
        "demonstrations_refused_by_bfcl": refused,
        "counts": {category: {name: len(part) for name, part in parts.items()} for category, parts in splits.items()},
        "files": {name: hashlib.sha256((out / f"{name}.jsonl").read_bytes()).hexdigest() for name in files},
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    return manifest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="Folder the rows are written to.")
    parser.add_argument("--seed", type=int, default=0, help="Seed of the split by item.")
    args = parser.parse_args()
    os.environ.setdefault("BFCL_PROJECT_ROOT", tempfile.mkdtemp(prefix="bfcl-"))  # BFCL writes folders at import
    manifest = export(args.out, args.seed)
    print(json.dumps({"bfcl_eval": manifest["bfcl_eval"], "files": manifest["files"]}))


if __name__ == "__main__":
    main()
