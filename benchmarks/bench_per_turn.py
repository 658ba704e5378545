"""What a per-turn price does: turns, tool calls and score, with and without it.

A tiny model is taught three ways to answer each of four FinQA items: list the year's
directory and read the page in ONE turn (two parallel calls), do the same in TWO turns,
or answer "0" at once. GRPO then trains it for a few steps twice from the same start and
seed: with `penalties.per_turn` (a price per tool-calling turn) and without it, both with
the same price per call. The per-turn price pays for parallel calls: turns per rollout
should fall while calls and score hold. Printed side by side, as the issue asks.

    python -m benchmarks.bench_per_turn [--steps 8] [--price 0.1] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
from pathlib import Path
from typing import Any

from envs.finqa.local import local_tool_endpoints
from tests.taught_model import GRADER, OUTPUT_CHARS, SYSTEM, TOOLS, copy_items, fit_tiny_model
from trainer.config.loading import config_from_dict
from trainer.data import read_items, read_jsonl
from trainer.rl.grpo import train
from trainer.rollout.tool_client import ToolClient

REPO = Path(__file__).resolve().parent.parent


async def _conversation(item: dict, turns: list, endpoints: list) -> list[dict]:
    """`turns`: a list of calls (name, path) per assistant turn, then the answer text."""
    messages = [{"role": "system", "content": SYSTEM}, *item["messages"]]
    index = 0
    async with ToolClient(endpoints, TOOLS, max_output_chars=OUTPUT_CHARS) as client:
        for turn in turns:
            if isinstance(turn, str):
                messages.append({"role": "assistant", "content": turn})
                continue
            calls = [{"id": f"call_{index + i}", "type": "function",
                      "function": {"name": name, "arguments": json.dumps({"path": path}, separators=(",", ":"))}}
                     for i, (name, path) in enumerate(turn)]
            index += len(calls)
            messages.append({"role": "assistant", "content": "", "tool_calls": calls})
            for call in calls:
                result = await client.call(call["function"]["name"], call["function"]["arguments"], item=item,
                                           trace_id="trace_bench", call_id=call["id"])
                messages.append({"role": "tool", "tool_call_id": call["id"], "content": result.output})
    return messages


def world(root: Path) -> tuple[Path, Path, Path]:
    data = REPO / "data"
    items = read_items(data / "train.jsonl", 4)
    copy_items(data, items, root, "items.jsonl")
    with local_tool_endpoints(root / "corpus", max_output_chars=OUTPUT_CHARS) as endpoints:
        conversations = []
        for item in items:
            page, answer = item["gold_pages"][0], f"Answer: {item['reference_answer']}"
            reads = [("list", str(Path(page).parent)), ("cat", page)]
            for turns in ([reads, answer], [[reads[0]], [reads[1]], answer], ["Answer: 0"]):
                conversations.append(asyncio.run(_conversation(item, turns, endpoints)))
    texts = [json.dumps(c) for c in conversations] + [p.read_text() for p in sorted((root / "corpus").rglob("*.txt"))]
    model, tokenizer, _ = fit_tiny_model([(c, TOOLS) for c in conversations], texts, number_weight=3.0)
    model.save_pretrained(root / "model")
    tokenizer.save_pretrained(root / "model")
    return root / "items.jsonl", root / "corpus", root / "model"


def run(items: Path, corpus: Path, model: Path, out: Path, *, steps: int, per_turn: float, seed: int) -> dict[str, Any]:
    with local_tool_endpoints(corpus, max_output_chars=OUTPUT_CHARS) as endpoints:
        config = config_from_dict({
            "model": {"base_model": str(model)},
            "data": {"train_file": str(items), "validation_file": str(items), "test_file": str(items)},
            "tools": {"endpoints": [e.model_dump() for e in endpoints], "schemas": TOOLS,
                      "max_output_chars": OUTPUT_CHARS},
            "grader": GRADER,
            "rollout": {"system_prompt": SYSTEM, "max_turns": 4, "max_new_tokens_per_turn": 96,
                        "max_total_tokens": 1024},
            "penalties": {"per_tool_call": 0.02, "per_turn": per_turn, "correct_only": True},
            "training": {"batch_size": 4, "compute_multiplier": 1.0, "learning_rate": 2e-3, "max_steps": steps,
                         "n_epochs": steps, "eval_interval": steps, "eval_samples": 4, "seed": seed,
                         "scale_rewards": "none", "checkpoint_interval": 1000},
        })
        train(config, model_path=str(model), output_dir=out)
    rows = read_jsonl(out / "metrics.jsonl")
    first, last = rows[0], rows[-1]
    evaluation = read_jsonl(out / "rollouts" / f"eval_step_{steps}.jsonl")
    return {
        "per_turn": per_turn,
        "score": (first["eval/score_mean"], last["eval/score_mean"]),
        "tool_calls": (first["eval/tool_calls_mean"], last["eval/tool_calls_mean"]),
        "tool_turns": (first["eval/tool_turns_mean"], last["eval/tool_turns_mean"]),
        "calls_per_turn": (first["eval/calls_per_turn"], last["eval/calls_per_turn"]),
        "final_statuses": sorted({r["status"] for r in evaluation}),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--price", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=3)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        items, corpus, model = world(Path(tmp))
        results = [run(items, corpus, model, Path(tmp) / f"run_{price}", steps=args.steps, per_turn=price,
                       seed=args.seed) for price in (0.0, args.price)]
    print(f"{'per_turn':>8} | {'score before -> after':>22} | {'calls':>13} | {'tool turns':>13} | calls/turn")
    for r in results:
        print(f"{r['per_turn']:8.2f} | {r['score'][0]:10.3f} -> {r['score'][1]:.3f} | "
              f"{r['tool_calls'][0]:5.2f} -> {r['tool_calls'][1]:.2f} | {r['tool_turns'][0]:5.2f} -> "
              f"{r['tool_turns'][1]:.2f} | {r['calls_per_turn'][0]:.2f} -> {r['calls_per_turn'][1]:.2f}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
