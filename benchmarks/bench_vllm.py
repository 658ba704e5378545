"""Rollouts on vLLM against the embedded transformers engine, side by side in one run.

Rows (the taught tiny model of benchmarks/taught_world.py, its items, the same seeds and
the FinQA tool server on loopback; float32 on the CPU):
  1. rollouts/s and generated tokens/s of a batch of multi-turn tool rollouts, on the
     vLLM backend (one server launched by the trainer from .venv-vllm) and on the
     transformers engine over the same weights;
  2. GRPO steps on each backend (rollouts + one optimizer update + the weight sync):
     seconds per step, the weight sync's seconds per step and its share of the step;
  3. the vLLM server's start-up time.
A 1M-parameter model on two cores is not where vLLM shines (its per-request overhead
dominates); the figures show what the backend costs and what the sync costs, not what it
buys on a GPU (benchmarks/gpu_check.sh measures that).

    python -m benchmarks.bench_vllm [--k 16] [--steps 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.taught_world import TaughtWorld, taught_world
from envs.finqa.local import local_tool_endpoints
from tests.taught_model import GRADER, OUTPUT_CHARS, SYSTEM, TOOLS
from trainer.config.loading import config_from_dict
from trainer.config.pipeline import PipelineConfig
from trainer.config.tools import ToolEndpoint
from trainer.data import read_jsonl
from trainer.generation.backend import GenerationBackend
from trainer.generation.engine import TransformersBackend
from trainer.rl.grpo import GRPOTrainer
from trainer.rollout.loop import run_rollouts_async
from trainer.rollout.record import RolloutRecord
from trainer.rollout.tool_client import ToolClient

REPO = Path(__file__).resolve().parent.parent
CPU_SERVER_ARGS = ["--dtype", "float32", "--enforce-eager", "--kv-cache-memory-bytes", str(256 << 20),
                   "--max-num-seqs", "64"]


def bench_config(world: TaughtWorld, endpoints: list[ToolEndpoint], out: Path, backend: str,
                 steps: int, concurrency: int) -> PipelineConfig:
    return config_from_dict({
        "model": {"base_model": str(world.model)},
        "data": {"train_file": str(world.items_file), "validation_file": str(world.items_file), "test_file": None},
        "tools": {"endpoints": [e.model_dump() for e in endpoints], "schemas": TOOLS,
                  "max_output_chars": OUTPUT_CHARS, "max_retries": 2},
        "grader": GRADER,
        "rollout": {"system_prompt": SYSTEM, "max_turns": 3, "max_new_tokens_per_turn": 48, "max_total_tokens": 768,
                    "max_concurrent_rollouts": concurrency, "backend": backend,
                    "vllm": {"launch": True, "extra_args": CPU_SERVER_ARGS, "startup_timeout_s": 600}},
        "training": {"batch_size": 2, "compute_multiplier": 1.0, "learning_rate": 1e-3, "max_steps": steps, "n_epochs": steps,
                     "eval_interval": 1000, "eval_samples": 1, "checkpoint_interval": 1000, "mixed_precision": "no",
                     "seed": 3},
        "mlflow": {"tracking_uri": f"sqlite:///{out / 'mlflow.db'}"},
    })


def rollout_rate(trainer: GRPOTrainer, backend: GenerationBackend, k: int, seed: int) -> dict[str, float]:
    """One batch of k rollouts per item; rollouts/s, tokens/s and the rollouts' shape."""
    tools = trainer.config.tools

    async def run() -> list[RolloutRecord]:
        async with ToolClient.from_config(tools, trainer.endpoints, seed=seed) as client:
            return await run_rollouts_async(
                backend, trainer.chat, trainer.train_items, n_per_item=k, tool_client=client,
                grader=trainer.config.grader, settings=trainer.settings, tools=tools.schemas,
                max_concurrent=trainer.config.rollout.max_concurrent_rollouts,
            )

    trainer.accelerator.unwrap_model(trainer.model).eval()
    started = time.perf_counter()
    records = asyncio.run(run())
    seconds = time.perf_counter() - started
    return {
        "rollouts": len(records),
        "seconds": seconds,
        "rollouts_per_s": len(records) / seconds,
        "tokens_per_s": sum(r.tokens_generated for r in records) / seconds,
        "tool_calls_mean": sum(len(r.tool_calls) for r in records) / len(records),
        "infra_errors": sum(r.status == "infra_error" for r in records),
        # the rollouts' shape: tokens in all, and where the first generated token stands
        "seq_len_median": statistics.median(len(r.token_ids) for r in records),
        "first_generated_median": statistics.median(r.gen_mask.index(1) for r in records if 1 in r.gen_mask),
    }


def measure(backend: str, world: TaughtWorld, endpoints: list[ToolEndpoint], out: Path, args) -> dict[str, Any]:
    config = bench_config(world, endpoints, out, backend, args.steps, args.concurrency)
    trainer = GRPOTrainer(config, model_path=str(world.model), output_dir=out / "run", endpoints=endpoints)
    trainer.setup()
    try:
        def make_backend(seed: int) -> GenerationBackend:
            if backend == "vllm":
                return trainer.generator.backend(seed)
            model = trainer.accelerator.unwrap_model(trainer.model).eval()
            return TransformersBackend(model, stop_token_ids=trainer.stop_token_ids,
                                       max_slots=args.concurrency, max_len=768, seed=seed)

        rollout_rate(trainer, make_backend(0), 1, seed=0)  # warm-up: first requests, kernels, caches
        rates = [rollout_rate(trainer, make_backend(seed), args.k, seed) for seed in range(1, args.repeats + 1)]
        syncs_before = len(getattr(trainer.generator, "sync_seconds", []))
        trainer.train()
        rows = read_jsonl(trainer.output_dir / "metrics.jsonl")[1:]
        step_s = [row["timing/step_s"] for row in rows]
        sync_s = list(getattr(trainer.generator, "sync_seconds", [])[syncs_before:]) or [0.0] * len(rows)
        launched = getattr(trainer.generator, "launched", [])
    finally:
        trainer.cleanup()
    best = max(rates, key=lambda r: r["rollouts_per_s"])
    return {
        "backend": backend,
        "rollouts_per_s": best["rollouts_per_s"],
        "tokens_per_s": best["tokens_per_s"],
        "rollouts_per_batch": best["rollouts"],
        "tool_calls_mean": best["tool_calls_mean"],
        "infra_errors": sum(r["infra_errors"] for r in rates),
        "step_s": statistics.median(step_s),
        "sampling_s": statistics.median(row["timing/sampling_s"] for row in rows),
        "training_s": statistics.median(row["timing/training_s"] for row in rows),
        "sync_s": statistics.median(sync_s),
        "sync_share": statistics.median(s / t for s, t in zip(sync_s, step_s, strict=False)),
        # the sampler's log-probabilities against the trainer's recomputation, worst token of any step
        "sampler_diff_max": max(row["train/sampler_diff_max"] for row in rows),
        "server_startup_s": launched[0].startup_s if launched else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--k", type=int, default=16, help="rollouts per item in the throughput batch")
    parser.add_argument("--repeats", type=int, default=2, help="throughput batches per backend (best is kept)")
    parser.add_argument("--steps", type=int, default=3, help="GRPO steps per backend")
    parser.add_argument("--concurrency", type=int, default=32, help="max_concurrent_rollouts")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()

    world = taught_world()
    results = []
    with tempfile.TemporaryDirectory(prefix="bench-vllm-") as tmp, \
            local_tool_endpoints(world.corpus, max_output_chars=OUTPUT_CHARS) as endpoints:
        for backend in ("vllm", "transformers"):
            results.append(measure(backend, world, endpoints, Path(tmp) / backend, args))

    vllm, engine = results
    print(f"\n{len(world.items())} items x {args.k} rollouts, concurrency {args.concurrency}, "
          f"{args.steps} GRPO steps of 2 items x 8 rollouts, float32 on CPU")
    print(f"{'':28}{'vLLM':>12}{'transformers':>14}{'ratio':>8}")
    for key, label, fmt in (
        ("rollouts_per_s", "rollouts/s", "{:.2f}"), ("tokens_per_s", "generated tokens/s", "{:.0f}"),
        ("tool_calls_mean", "tool calls per rollout", "{:.2f}"), ("step_s", "GRPO step, s", "{:.2f}"),
        ("sampling_s", "  of which rollouts, s", "{:.2f}"), ("training_s", "  of which update, s", "{:.2f}"),
        ("sync_s", "weight sync per step, s", "{:.3f}"), ("sync_share", "sync share of a step", "{:.1%}"),
        ("sampler_diff_max", "sampler-trainer logprob diff", "{:.1e}"),
    ):
        ratio = vllm[key] / engine[key] if engine[key] else float("nan")
        print(f"{label:28}{fmt.format(vllm[key]):>12}{fmt.format(engine[key]):>14}{ratio:>8.2f}")
    print(f"{'vLLM server start-up, s':28}{vllm['server_startup_s']:>12.0f}")
    if args.json:
        args.json.write_text(json.dumps({"vllm": vllm, "transformers": engine, "args": vars(args) | {"json": None}},
                                        indent=2))


if __name__ == "__main__":
    main()
