"""Rollout throughput of the agent loop, side by side, as ratios in one run.

Rows (same model, the same items, `--k` rollouts of each, the same rollout rules and
token budgets, the same sampling settings and the tool server on loopback):
  1. this engine (batched, KV cache kept across turns, a turn's tool calls sent
     concurrently while other rollouts decode) against a plain sequential agent loop
     written for this benchmark: one rollout at a time, `model.generate` per turn on the
     whole re-rendered conversation (no KV cache kept between turns), tool calls one
     after another. It is the simplest correct loop, not TRL's (TRL batches a turn across
     rollouts; benchmarks/bench_trl.py measures TRL itself);
  2. the engine's throughput with 100 ms of injected tool latency / with 0 ms
     (goal >= 0.90: tool latency hidden behind decoding);
  3. peak resident memory with 64 concurrent rollouts, with the model's size for scale.

Both loops follow the engine's rules: temperature and top_p from the config and no top-k
(`model.generate` is given `top_k=0`, else transformers would add its default of 50); a
turn gets at most `max_new_tokens_per_turn` tokens and no more than the room left under
`max_total_tokens`, and none is started with fewer than 32 tokens of room; a cut turn, a
malformed call, the tool-call budget or the turn limit ends the rollout. Each loop is
warmed up once (one rollout per item) before anything is timed, and the timed runs are
repeated `--repeats` times, interleaved (engine at 0 ms, sequential loop, engine at
100 ms), so each ratio is reported as the median of the repeats with its min and max.

Usage: python -m benchmarks.bench_rollout [--world taught] [--k 32] [--repeats 3] [--json out.json]
`--world taught` (the default) runs the taught tiny model of benchmarks/taught_world.py on
its four training items (two tools, three turns, 256-character outputs); `--world demo`
the demo config's base model on `--items` validation items (slower to load and to run).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from envs.finqa.faults import FaultConfig
from envs.finqa.local import local_tool_endpoints
from trainer.config.loading import load_config
from trainer.data import split_items
from trainer.generation.policy import load_policy
from trainer.rollout.loop import MIN_TURN_TOKENS, run_rollouts_async
from trainer.rollout.record import RolloutSettings
from trainer.rollout.tool_client import ToolClient
from trainer.wire import new_trace_id


@dataclass
class World:
    """What both loops run: the policy, items, settings, tools (None: each item's own),
    grader, the corpus the tool server serves and its output limit."""

    policy: Any
    items: list[dict]
    settings: RolloutSettings
    tools: list[dict] | None
    grader: dict
    corpus: Path
    max_output_chars: int = 2000


def engine_run(world: World, endpoints, k: int, max_concurrent: int, seed: int = 0) -> dict:
    policy, settings = world.policy, world.settings
    backend = policy.backend(max_slots=max_concurrent, max_len=settings.max_total_tokens, seed=seed)

    async def go():
        async with ToolClient(endpoints, world.tools, max_output_chars=world.max_output_chars) as client:
            return await run_rollouts_async(
                backend, policy.chat, world.items, n_per_item=k, tool_client=client,
                grader=world.grader, settings=settings, tools=world.tools, max_concurrent=max_concurrent,
            )

    started = time.perf_counter()
    records = asyncio.run(go())
    seconds = time.perf_counter() - started
    tokens = sum(r.tokens_generated for r in records)
    return {"rollouts": len(records), "seconds": seconds, "rollouts_per_s": len(records) / seconds,
            "tokens_per_s": tokens / seconds, "tool_calls_mean": sum(len(r.tool_calls) for r in records) / len(records)}


def sequential_run(world: World, endpoints, k: int, seed: int = 0) -> dict:
    """One rollout at a time; every turn re-renders and re-encodes the whole conversation."""
    model, tokenizer, chat, settings = world.policy.model, world.policy.tokenizer, world.policy.chat, world.settings
    stop = world.policy.stop_token_ids  # the engine's stop tokens
    model.eval()
    torch.manual_seed(seed)

    async def one(client, item) -> tuple[int, int]:
        messages = [{"role": "system", "content": settings.system_prompt}, *item["messages"]]
        tools = world.tools if world.tools is not None else item["tools"]
        trace_id, generated, calls, turns = new_trace_id(), 0, 0, 0
        while True:
            text = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
            ids = torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]], device=model.device)
            room = settings.max_total_tokens - ids.shape[1]
            if room < min(MIN_TURN_TOKENS, settings.max_new_tokens_per_turn):
                break
            budget = min(settings.max_new_tokens_per_turn, room)
            with torch.no_grad():
                out = model.generate(ids, max_new_tokens=budget, do_sample=True, temperature=settings.temperature,
                                     top_p=settings.top_p, top_k=0, eos_token_id=stop,
                                     pad_token_id=tokenizer.pad_token_id)
            new = out[0, ids.shape[1]:].tolist()
            generated += len(new)
            turns += 1
            if not new or new[-1] not in stop:
                break  # cut by the token limit: neither a call nor an answer
            parsed = chat.parse(new, first_call_index=calls)
            if not parsed.tool_calls and not parsed.errors:
                break  # the final answer
            if parsed.errors or any(client.check_call(c.name, c.arguments, item=item) for c in parsed.tool_calls):
                break  # a malformed call ends the rollout (the engine's default rule)
            if calls + len(parsed.tool_calls) > settings.max_episode_steps or turns >= settings.max_turns:
                break
            messages.append({"role": "assistant", "content": parsed.content, "tool_calls": [
                {"id": c.call_id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                for c in parsed.tool_calls]})
            for call in parsed.tool_calls:  # one call at a time, as a plain loop does
                result = await client.call(call.name, call.arguments, item=item, trace_id=trace_id, call_id=call.call_id)
                messages.append({"role": "tool", "tool_call_id": call.call_id, "content": result.output})
            calls += len(parsed.tool_calls)
        return generated, calls

    async def go():
        async with ToolClient(endpoints, world.tools, max_output_chars=world.max_output_chars) as client:
            return [await one(client, item) for item in world.items for _ in range(k)]

    started = time.perf_counter()
    results = asyncio.run(go())
    seconds = time.perf_counter() - started
    tokens = sum(g for g, _ in results)
    return {"rollouts": len(results), "seconds": seconds, "rollouts_per_s": len(results) / seconds,
            "tokens_per_s": tokens / seconds, "tool_calls_mean": sum(c for _, c in results) / len(results)}


def demo(args) -> World:
    config = load_config(args.config)
    return World(
        policy=load_policy(args.model or config.model.base_model, device=config.model.device),
        items=split_items(config.data, "validation", args.items),
        settings=RolloutSettings.from_config(config.rollout, config.penalties),
        tools=config.tools.schemas, grader=config.grader, corpus=Path(config.data.train_file).parent / "corpus",
        max_output_chars=config.tools.max_output_chars,
    )


def taught(args) -> World:
    from benchmarks.taught_world import taught_world, training_config
    from tests.taught_model import GRADER, OUTPUT_CHARS, TOOLS

    built = taught_world()
    config = training_config(built, [])
    return World(
        policy=load_policy(args.model or str(built.model), device="cpu"), items=built.items("train"),
        settings=RolloutSettings.from_config(config.rollout, config.penalties),
        tools=TOOLS, grader=GRADER, corpus=built.corpus, max_output_chars=OUTPUT_CHARS,
    )


def spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "runs": values}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="envs/finqa/demo.yaml", help="the demo world's config")
    parser.add_argument("--world", choices=["demo", "taught"], default="taught",
                        help="taught: benchmarks/taught_world.py; demo: the config's model and validation items")
    parser.add_argument("--model")
    parser.add_argument("--items", type=int, default=16, help="validation items of the demo world")
    parser.add_argument("--k", type=int, default=32, help="rollouts per item, on both loops")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs of each loop (median, min, max)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (1: steady on a shared machine)")
    parser.add_argument("--json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    world = taught(args) if args.world == "taught" else demo(args)
    runs: dict[str, list[dict]] = {"engine_0ms": [], "sequential_0ms": [], "engine_100ms": []}
    concurrent = min(64, len(world.items) * args.k)
    with local_tool_endpoints(world.corpus, max_output_chars=world.max_output_chars) as endpoints, \
            local_tool_endpoints(world.corpus, max_output_chars=world.max_output_chars,
                                 faults=FaultConfig(latency_ms=100)) as slow_endpoints:
        engine_run(world, endpoints, 1, 64)  # warm-ups: first-call allocations and lazy imports
        sequential_run(world, endpoints, 1)
        for repeat in range(args.repeats):
            print(f"repeat {repeat + 1} of {args.repeats}", flush=True)
            runs["engine_0ms"].append(engine_run(world, endpoints, args.k, 64, seed=repeat))
            runs["sequential_0ms"].append(sequential_run(world, endpoints, args.k, seed=repeat))
            runs["engine_100ms"].append(engine_run(world, slow_endpoints, args.k, 64, seed=repeat))
    rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    params_mb = sum(p.numel() * p.element_size() for p in world.policy.model.parameters()) / 2**20

    def ratios(a: str, b: str, key: str) -> dict[str, float]:
        return spread([x[key] / y[key] for x, y in zip(runs[a], runs[b], strict=True)])

    figures = {
        "engine_vs_sequential_rollouts_per_s": ratios("engine_0ms", "sequential_0ms", "rollouts_per_s"),
        "engine_vs_sequential_tokens_per_s": ratios("engine_0ms", "sequential_0ms", "tokens_per_s"),
        "latency_100ms_over_0ms": ratios("engine_100ms", "engine_0ms", "rollouts_per_s"),
        "peak_rss_mb_64_concurrent": rss_mb,
        "model_params_mb": params_mb,
        "concurrent_rollouts": concurrent,
        "rollouts_per_run": len(world.items) * args.k,
        "items": len(world.items),
        "k": args.k,
        "tool_calls_mean": statistics.mean(r["tool_calls_mean"] for r in runs["engine_0ms"]),
        "sequential_tool_calls_mean": statistics.mean(r["tool_calls_mean"] for r in runs["sequential_0ms"]),
        "world": args.world,
    }
    print(f"{'run':<16}{'rollouts':>9}{'seconds':>9}{'rollouts/s':>12}{'tokens/s':>10}{'calls':>7}")
    for name, group in runs.items():
        for row in group:
            print(f"{name:<16}{row['rollouts']:>9}{row['seconds']:>9.1f}{row['rollouts_per_s']:>12.2f}"
                  f"{row['tokens_per_s']:>10.0f}{row['tool_calls_mean']:>7.2f}")
    for key, label in (("engine_vs_sequential_rollouts_per_s", "engine / sequential loop, rollouts per second"),
                       ("engine_vs_sequential_tokens_per_s", "engine / sequential loop, tokens per second"),
                       ("latency_100ms_over_0ms", "engine throughput with 100 ms tool latency / 0 ms (goal >= 0.90)")):
        f = figures[key]
        print(f"{label}: median {f['median']:.2f} (min {f['min']:.2f}, max {f['max']:.2f}, {args.repeats} runs)")
    print(f"peak RSS with {concurrent} concurrent rollouts: {rss_mb:.0f} MiB (model parameters {params_mb:.1f} MiB)")
    if args.json:
        Path(args.json).write_text(json.dumps({"runs": runs, "figures": figures}, indent=2))


if __name__ == "__main__":
    main()
