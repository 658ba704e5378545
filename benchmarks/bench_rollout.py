"""Rollout throughput of the agent loop, side by side, as ratios in one run.

Rows (same model, items, seed and tool server on loopback):
  1. this engine (batched, KV cache kept across turns, tools overlapped with decoding)
     against a plain sequential agent loop (one rollout at a time, `model.generate` per
     turn on the re-rendered conversation, as TRL's tool loop does);
  2. the engine's throughput with 100 ms of injected tool latency / with 0 ms
     (goal >= 0.90: tool latency hidden behind decoding);
  3. peak resident memory with 64 concurrent rollouts, with the model's size for scale.

Usage: python benchmarks/bench_rollout.py [--model PATH] [--items 16] [--k 4] [--json out.json]
The model defaults to the demo base model (built on first use). `--world taught` runs the
taught tiny model of benchmarks/taught_world.py on its four items instead (two tools,
three turns, 256-character outputs; seconds to build, where the demo model takes minutes):

    python -m benchmarks.bench_rollout --world taught --k 16
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from envs.finqa.faults import FaultConfig
from envs.finqa.local import local_tool_endpoints
from trainer.chat_format import parse_assistant_output
from trainer.config import load_config
from trainer.data import read_items
from trainer.policy import load_policy
from trainer.rollout import RolloutSettings, run_rollouts_async
from trainer.tools import ToolClient, new_trace_id


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


def engine_run(world: World, endpoints, k: int, max_concurrent: int) -> dict:
    policy, settings = world.policy, world.settings
    backend = policy.backend(max_slots=max_concurrent, max_len=settings.max_total_tokens, seed=0)

    async def go():
        async with ToolClient(endpoints, world.tools, max_output_chars=world.max_output_chars) as client:
            return await run_rollouts_async(
                backend, policy.tokenizer, world.items, n_per_item=k, tool_client=client,
                grader=world.grader, settings=settings, tools=world.tools, max_concurrent=max_concurrent,
            )

    started = time.perf_counter()
    records = asyncio.run(go())
    seconds = time.perf_counter() - started
    tokens = sum(r.tokens_generated for r in records)
    return {"rollouts": len(records), "seconds": seconds, "rollouts_per_s": len(records) / seconds,
            "tokens_per_s": tokens / seconds, "tool_calls_mean": sum(len(r.tool_calls) for r in records) / len(records)}


def sequential_run(world: World, items, endpoints, k: int) -> dict:
    """One rollout at a time; every turn re-renders and re-encodes the whole conversation."""
    model, tokenizer, settings = world.policy.model, world.policy.tokenizer, world.settings
    torch.manual_seed(0)

    async def one(client, item) -> tuple[int, int]:
        messages = [{"role": "system", "content": settings.system_prompt}, *item["messages"]]
        trace_id, generated, calls = new_trace_id(), 0, 0
        for _ in range(settings.max_turns):
            tools = world.tools if world.tools is not None else item["tools"]
            text = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
            ids = torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]], device=model.device)
            if ids.shape[1] + settings.max_new_tokens_per_turn > settings.max_total_tokens:
                break
            with torch.no_grad():
                out = model.generate(ids, max_new_tokens=settings.max_new_tokens_per_turn, do_sample=True,
                                     temperature=settings.temperature, eos_token_id=tokenizer.eos_token_id,
                                     pad_token_id=tokenizer.pad_token_id)
            new = out[0, ids.shape[1]:].tolist()
            generated += len(new)
            parsed = parse_assistant_output(tokenizer.decode(new, skip_special_tokens=True), first_call_index=calls)
            if not parsed.tool_calls:
                break
            messages.append({"role": "assistant", "content": parsed.content, "tool_calls": [
                {"id": c.call_id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                for c in parsed.tool_calls]})
            for call in parsed.tool_calls:  # one call at a time, as a plain loop does
                result = await client.call(call.name, call.arguments, item=item, trace_id=trace_id, call_id=call.call_id)
                messages.append({"role": "tool", "tool_call_id": call.call_id, "content": result.output})
            calls += len(parsed.tool_calls)
            if calls >= settings.max_episode_steps:
                break
        return generated, calls

    async def go():
        async with ToolClient(endpoints, world.tools, max_output_chars=world.max_output_chars) as client:
            return [await one(client, item) for item in items for _ in range(k)]

    started = time.perf_counter()
    results = asyncio.run(go())
    seconds = time.perf_counter() - started
    tokens = sum(g for g, _ in results)
    return {"rollouts": len(results), "seconds": seconds, "rollouts_per_s": len(results) / seconds,
            "tokens_per_s": tokens / seconds, "tool_calls_mean": sum(c for _, c in results) / len(results)}


def demo(args) -> World:
    config = load_config(args.config)
    return World(
        policy=load_policy(args.model or resolve_base_model(config), device=config.model.device),
        items=read_items(Path(config.data.eval_file), args.items),
        settings=RolloutSettings.from_config(config.rollout, config.penalties),
        tools=None, grader={"type": "numeric", "name": "a"}, corpus=Path(config.data.corpus_dir),
    )


def taught(args) -> World:
    from benchmarks.taught_world import taught_world, training_config
    from tests.taught_model import GRADER, OUTPUT_CHARS, TOOLS

    built = taught_world()
    config = training_config(built, [])
    return World(
        policy=load_policy(args.model or str(built.model), device="cpu"), items=built.items(),
        settings=RolloutSettings.from_config(config.rollout, config.penalties),
        tools=TOOLS, grader=GRADER, corpus=built.corpus, max_output_chars=OUTPUT_CHARS,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="configs/demo.yaml")
    parser.add_argument("--world", choices=["demo", "taught"], default="demo",
                        help="demo: the config's model and eval items; taught: benchmarks/taught_world.py")
    parser.add_argument("--model")
    parser.add_argument("--items", type=int, default=16)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--sequential-items", type=int, default=4, help="the plain loop is slow: fewer items")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (1: steady on a shared machine)")
    parser.add_argument("--json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    world = taught(args) if args.world == "taught" else demo(args)
    rows = {}
    with local_tool_endpoints(world.corpus, max_output_chars=world.max_output_chars) as endpoints:
        engine_run(world, endpoints, 1, 64)  # warm-up: first-call allocations and lazy imports
        rows["engine_0ms"] = engine_run(world, endpoints, args.k, 64)
        rows["sequential_0ms"] = sequential_run(world, world.items[: args.sequential_items], endpoints, args.k)
    faults = FaultConfig(latency_ms=100)
    with local_tool_endpoints(world.corpus, max_output_chars=world.max_output_chars, faults=faults) as endpoints:
        rows["engine_100ms"] = engine_run(world, endpoints, args.k, 64)
    rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    params_mb = sum(p.numel() * p.element_size() for p in world.policy.model.parameters()) / 2**20

    figures = {
        "engine_vs_sequential_rollouts_per_s": rows["engine_0ms"]["rollouts_per_s"] / rows["sequential_0ms"]["rollouts_per_s"],
        "engine_vs_sequential_tokens_per_s": rows["engine_0ms"]["tokens_per_s"] / rows["sequential_0ms"]["tokens_per_s"],
        "latency_100ms_over_0ms": rows["engine_100ms"]["rollouts_per_s"] / rows["engine_0ms"]["rollouts_per_s"],
        "peak_rss_mb_64_concurrent": rss_mb,
        "model_params_mb": params_mb,
        "concurrent_rollouts": min(64, len(world.items) * args.k),
        "world": args.world,
    }
    print(f"{'run':<16}{'rollouts':>9}{'seconds':>9}{'rollouts/s':>12}{'tokens/s':>10}{'calls':>7}")
    for name, row in rows.items():
        print(f"{name:<16}{row['rollouts']:>9}{row['seconds']:>9.1f}{row['rollouts_per_s']:>12.2f}"
              f"{row['tokens_per_s']:>10.0f}{row['tool_calls_mean']:>7.2f}")
    print(f"engine / sequential, rollouts per second: {figures['engine_vs_sequential_rollouts_per_s']:.2f}x"
          f" (tokens per second {figures['engine_vs_sequential_tokens_per_s']:.2f}x)")
    print(f"throughput with 100 ms tool latency / 0 ms: {figures['latency_100ms_over_0ms']:.2f} (goal >= 0.90)")
    print(f"peak RSS with {figures['concurrent_rollouts']} concurrent rollouts: {rss_mb:.0f} MiB (model parameters {params_mb:.1f} MiB)")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "figures": figures}, indent=2))


if __name__ == "__main__":
    main()
