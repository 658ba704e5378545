"""Rollouts/s with the embedded engine's prefix cache on and off, side by side in one run.

Two worlds, each through the real agent loop, tools and grader:
- `units`: SmolLM2-135M-Instruct on the real-model recipe (envs/units/smollm2.yaml: the
  `chatml-tools` template, a 427-token prompt of which the system prompt, the tool schema
  and two worked exchanges are the same for every item, groups of 8, temperature 0.7);
- `demo`: the shipped demo model on the FinQA demo world (envs/finqa/demo.yaml, groups of 8).

Each measurement is a child process (`--one`) that loads the model, warms the engine up on
one item, then times one batch of `--items` items x 8 samples with `rollout.prefix_cache_tokens`
at the recipe's default or 0 (off), and reports its rollouts/s, the engine's key/value bytes
(slots and prefix cache) and the process's peak RSS. Shared and unshared runs alternate,
`--repeats` times each; the ratio is of the medians.

The demo's rollouts also give the multi-turn figure: how often two samples of a group share
more than the prompt (the same first turn and the same tool answer), and the tokens a prefix
tree over turns would save: the later turns' pre-fill that such samples repeat (their
identical first turns are sampled one by one, so decoding them cannot be shared).

    .venv/bin/python benchmarks/bench_prefix.py [--world units demo] [--items 2] [--repeats 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
GROUP = 8


def units_world(out: Path) -> tuple[Any, Path, list[dict], Any]:
    """The units recipe: its config, the SmolLM2 model folder, validation items and a context
    manager serving its tools (yields the endpoints)."""
    from contextlib import contextmanager

    from envs.tool_server import serve_in_thread
    from envs.units.demo import MODEL_PACKAGE
    from envs.units.generate import generate_dataset
    from envs.units.server import create_app
    from trainer.config.loading import load_config
    from trainer.config.tools import ToolEndpoint
    from trainer.data import read_items
    from trainer.generation.model_import import import_model

    config = load_config(REPO / "envs/units/smollm2.yaml")
    model = import_model(package=MODEL_PACKAGE, log=lambda _: None)  # cached once per machine
    generate_dataset(out, n_train=10, n_validation=40, n_test=10, n_traffic=10)

    @contextmanager
    def tools():
        with serve_in_thread(create_app()) as url:
            yield [ToolEndpoint(name="calculate", server_url=f"{url}/tools/calculate")]

    return config, model, read_items(out / "validation.jsonl"), tools


def demo_world(out: Path) -> tuple[Any, Path, list[dict], Any]:
    """The FinQA demo: its config, the shipped model, validation items and its tools."""
    from functools import partial

    from envs.finqa.demo_model import MODEL_DIR
    from envs.finqa.generate import generate_dataset
    from envs.finqa.local import local_tool_endpoints
    from trainer.config.loading import load_config
    from trainer.data import read_items

    config = load_config(REPO / "envs/finqa/demo.yaml")
    data = REPO / "data"
    if not (data / "validation.jsonl").is_file():
        generate_dataset(data, seed=0)
    tools = partial(local_tool_endpoints, data / "corpus", max_output_chars=config.tools.max_output_chars)
    return config, MODEL_DIR, read_items(data / "validation.jsonl"), tools


WORLDS = {"units": units_world, "demo": demo_world}


def rollouts(config: Any, policy: Any, items: list[dict], endpoints: list, *, k: int, seed: int,
             prefix_cache_tokens: int, temperature: float | None = None) -> tuple[list, Any, float]:
    """`k` rollouts of each item on a fresh engine: the records, the engine, the seconds."""
    from trainer.rollout.loop import run_rollouts_async
    from trainer.rollout.record import RolloutSettings
    from trainer.rollout.tool_client import ToolClient

    rollout = config.rollout
    settings = RolloutSettings.from_config(rollout, config.penalties)
    if temperature is not None:
        settings.temperature = temperature
    backend = policy.backend(max_slots=rollout.max_concurrent_rollouts, max_len=rollout.max_total_tokens, seed=seed,
                             prefix_cache_tokens=prefix_cache_tokens)

    async def run() -> list:
        async with ToolClient.from_config(config.tools, endpoints, seed=seed) as client:
            return await run_rollouts_async(backend, policy.chat, items, n_per_item=k, tool_client=client,
                                            grader=config.grader, settings=settings, tools=config.tools.schemas,
                                            max_concurrent=rollout.max_concurrent_rollouts)

    started = time.perf_counter()
    records = asyncio.run(run())
    return records, backend, time.perf_counter() - started


def shared_turns(records: list, k: int) -> dict[str, float]:
    """How much of a group's samples is the same beyond the prompt: the share of samples whose
    first turn and tool answers equal another sample's of the group, and the tokens a prefix
    tree over turns would save (the pre-fill of the second turn's context that each such
    sample repeats) against all the tokens the engine computes (pre-fill and decode)."""
    beyond = repeated = computed = 0
    for start in range(0, len(records), k):
        group = records[start : start + k]
        keys = []
        for record in group:
            first_gen = record.gen_mask.index(1) if 1 in record.gen_mask else len(record.token_ids)
            # the first turn (generated) and the context after it (tool answers), up to turn 2
            tail = record.gen_mask[first_gen:]
            turn_end = first_gen + (tail.index(0) if 0 in tail else len(tail))
            rest = record.gen_mask[turn_end:]
            context_end = turn_end + (rest.index(1) if 1 in rest else len(rest))
            keys.append((tuple(record.token_ids[:context_end]), context_end - turn_end if rest else 0))
            computed += len(record.token_ids)
        counts = Counter(key for key, _ in keys)
        seen: set = set()
        for key, tool_tokens in keys:
            if counts[key] > 1 and tool_tokens:
                beyond += 1
                if key in seen:
                    repeated += tool_tokens
                seen.add(key)
    return {"samples_sharing_beyond_prompt": beyond / max(len(records), 1),
            "tree_saves_token_share": repeated / max(computed, 1)}


def one(world: str, items: int, prefix_cache_tokens: int, seed: int) -> dict[str, Any]:
    """One measurement, in this process: warm up on one item, then time the batch."""
    import torch

    from trainer.generation.policy import load_config_policy

    torch.set_num_threads(max(1, torch.get_num_threads()))
    with tempfile.TemporaryDirectory() as tmp:
        config, model_dir, all_items, tools = WORLDS[world](Path(tmp))
        policy = load_config_policy(config.model, str(model_dir), device="cpu", dtype="float32")
        batch = all_items[:items]
        with tools() as endpoints:
            rollouts(config, policy, all_items[items : items + 1], endpoints, k=2, seed=seed + 1,
                     prefix_cache_tokens=prefix_cache_tokens)
            records, backend, seconds = rollouts(config, policy, batch, endpoints, k=GROUP, seed=seed,
                                                 prefix_cache_tokens=prefix_cache_tokens)
    stats = backend.prefix_stats()
    prompts = [r.token_ids[: r.gen_mask.index(1)] if 1 in r.gen_mask else r.token_ids for r in records]
    return {
        "world": world, "prefix_cache_tokens": prefix_cache_tokens, "rollouts": len(records),
        "seconds": seconds, "rollouts_per_s": len(records) / seconds,
        "generated_tokens": sum(r.tokens_generated for r in records),
        "prompt_tokens_mean": statistics.mean(len(p) for p in prompts),
        "hit_share": stats["hit_tokens"] / max(stats["prompt_tokens"], 1),
        "kv_cache_mib": backend.kv_cache_bytes() / 2**20, "prefix_cache_mib": stats["bytes"] / 2**20,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "tool_calls_mean": statistics.mean(len(r.tool_calls) for r in records),
        **shared_turns(records, GROUP),
    }


def measure(world: str, items: int, repeats: int, seed: int) -> dict[str, Any]:
    from trainer.config.rollout import RolloutConfig

    default = RolloutConfig().prefix_cache_tokens
    runs: dict[str, list[dict]] = {"shared": [], "unshared": []}
    for _ in range(repeats):
        for mode, tokens in (("shared", default), ("unshared", 0)):
            out = subprocess.run([sys.executable, __file__, "--one", world, "--items", str(items),
                                  "--prefix-cache-tokens", str(tokens), "--seed", str(seed)],
                                 capture_output=True, text=True, cwd=REPO, check=True)
            runs[mode].append(json.loads(out.stdout.strip().splitlines()[-1]))
            row = runs[mode][-1]
            print(f"{world} {mode}: {row['rollouts_per_s']:.2f} rollouts/s, hit share {row['hit_share']:.2f}, "
                  f"peak RSS {row['peak_rss_mib']:.0f} MiB", file=sys.stderr)
    median = {mode: statistics.median(r["rollouts_per_s"] for r in rs) for mode, rs in runs.items()}
    return {"world": world, "items": items, "group": GROUP, "runs": runs,
            "shared_over_unshared_rollouts_per_s": median["shared"] / median["unshared"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world", nargs="+", choices=sorted(WORLDS), default=["units", "demo"])
    parser.add_argument("--items", type=int, default=2, help="items a batch (each sampled 8 times)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--one", choices=sorted(WORLDS), help=argparse.SUPPRESS)
    parser.add_argument("--prefix-cache-tokens", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one(args.one, args.items, args.prefix_cache_tokens, args.seed)))
        return
    result = {"worlds": {w: measure(w, args.items, args.repeats, args.seed) for w in args.world}}
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
