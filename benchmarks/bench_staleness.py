"""One-step off-policy training (`training.max_staleness: 1`) against synchronous training,
with tools that take 300 ms to answer.

Synchronously, a step samples its rollouts (the tools' waits included), then updates the
weights: the two add up. One step off-policy, step t+1's rollouts are sampled (with the
weights of step t - 1) while step t updates, so a step costs about the longer of the two,
and TIS weighs each token for the lag. On the embedded engine a frozen copy of the weights
samples, in a child process by default on a CPU (`--sampler`, `rollout.overlap_sampler`): in a
thread it shares the trainer's GIL, and with this tiny model both halves are Python-bound,
so they mostly take turns.

Both arms train the taught tiny model of benchmarks/taught_world.py on the same seeds
with the same settings, interleaved (the order alternates, so drift hits both alike):
`--steps` steps of `--batch-size` items x `--group-size` rollouts, `--ppo-epochs` passes
per step at `--learning-rate`, tools behind 300 ms of latency (envs/finqa/faults.py) in a
process of their own, as a user's tool server is. Time is the steps' wall time without
their evaluations. Each trained model is then scored on the validation split (`--eval-k`
samples per item, 0 ms tools, one seed): "at equal score" means the off-policy arm's mean
is within the seeds' spread of the synchronous arm's. Reported per seed: the speedup over
the whole run, each arm's sampling and update seconds per step, the bound a perfect
overlap of the synchronous arm's two halves would give, the sum over its steps of
(sampling + update) over the sum of max(sampling, update) (a step's update is short when
many of its groups tie, and long when none does, so this is below the ratio of the
means), and the steady-state speedup: the ratio of the median step times
of steps 2 to N - 1 (off-policy, nothing overlaps the first step's sampling or the last
step's update, which a run of N steps pays once).

The overlap can only hide the shorter half: 1.5x needs an update that takes at least half
as long as the sampling. `--ppo-epochs` sets that share here (4: about 0.7 of the
sampling; 2: about 0.35). The learning rate is the one bench_trl's grid chose on the
validation items (1e-4); at 3e-4 the off-policy arm lost 0.14 of validation score on each
of 6 seeds (6 steps of 2 x 8), as a policy that moves too far in a step makes a one-step-old
sample a poor guide.

    python -m benchmarks.bench_staleness [--backend transformers|vllm] [--sampler auto|process|thread]
        [--steps 12] [--seeds 3] [--ppo-epochs 4] [--latency-ms 300] [--json out.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.bench_trl import eval_score
from benchmarks.taught_world import TaughtWorld, taught_world, training_config
from envs.finqa.faults import FaultConfig
from envs.finqa.local import local_tool_endpoints, tool_endpoints_in_process
from tests.taught_model import OUTPUT_CHARS
from trainer.config.tools import ToolEndpoint
from trainer.data import read_jsonl
from trainer.generation.vllm_launch import launched_server, server_args
from trainer.rl.grpo import train

VLLM_PYTHON = Path(__file__).resolve().parent.parent / ".venv-vllm" / "bin" / "python"


def one_run(world: TaughtWorld, endpoints: list[ToolEndpoint], staleness: int, seed: int, out: Path,
            args: Any) -> dict[str, Any]:
    rollout: dict[str, Any] = {"max_concurrent_rollouts": args.batch_size * args.group_size,
                               "overlap_sampler": args.sampler}
    if args.backend == "vllm":  # the one server both arms share (weights synced at each run's start)
        rollout |= {"backend": "vllm", "vllm": {"launch": False, "urls": [args.url], "python": str(VLLM_PYTHON)}}
    config = training_config(
        world, endpoints, rollout=rollout,
        max_steps=args.steps, n_epochs=args.steps, batch_size=args.batch_size,
        compute_multiplier=args.group_size / 8, ppo_epochs=args.ppo_epochs, learning_rate=args.learning_rate,
        eval_interval=args.steps,
        seed=seed, max_staleness=staleness,
    )
    started = time.perf_counter()
    result = train(config, model_path=str(world.model), output_dir=out)
    wall = time.perf_counter() - started
    rows = [r for r in read_jsonl(out / "metrics.jsonl") if r["step"] > 0]
    return {
        "staleness": staleness, "seed": seed, "steps": len(rows), "wall_s": wall,
        "seconds": sum(r["timing/step_s"] - r["timing/eval_s"] for r in rows),
        # the steps between the first (its sampling overlaps nothing) and the last (its update)
        "steady_step_s": (statistics.median(r["timing/step_s"] - r["timing/eval_s"] for r in rows[1:-1])
                          if len(rows) > 2 else None),
        # a perfect overlap of this run's steps: each would take the longer of its two halves
        "overlap_bound": (sum(r["timing/sampling_s"] + r["timing/training_s"] for r in rows)
                          / sum(max(r["timing/sampling_s"], r["timing/training_s"]) for r in rows)),
        "sampling_s": statistics.mean(r["timing/sampling_s"] for r in rows),
        "training_s": statistics.mean(r["timing/training_s"] for r in rows),
        "reward_mean": statistics.mean(r["train/reward_mean"] for r in rows),
        "policy_lag_max": max(r["train/policy_lag_max"] for r in rows),
        "model": str(result.model_dir),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--seeds", type=int, default=3, help="seeds, each trained in both arms")
    parser.add_argument("--latency-ms", type=float, default=300.0, help="tool latency while training")
    parser.add_argument("--batch-size", type=int, default=4, help="items a step (the taught world has 4)")
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--ppo-epochs", type=int, default=4, help="passes a step: the update's share of a step")
    parser.add_argument("--learning-rate", type=float, default=1e-4,
                        help="bench_trl's grid choice on the validation items")
    parser.add_argument("--eval-k", type=int, default=16, help="samples per validation item of the final scores")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (the same in both arms)")
    parser.add_argument("--backend", choices=["transformers", "vllm"], default="transformers",
                        help="where rollouts are generated: the embedded engine (a frozen copy of the weights, in "
                        "a thread beside the update) or one vLLM server launched here from .venv-vllm")
    parser.add_argument("--sampler", choices=["auto", "process", "thread"], default="auto",
                        help="embedded engine: where the frozen copy samples (rollout.overlap_sampler; auto: a "
                        "process on a CPU, a thread on a GPU)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.sampler == "auto":
        args.sampler = "thread" if torch.cuda.is_available() else "process"
    torch.set_num_threads(args.threads)
    world = taught_world()
    seeds = [3 + n for n in range(args.seeds)]
    runs: dict[int, list[dict[str, Any]]] = {0: [], 1: []}
    with tempfile.TemporaryDirectory(prefix="bench_staleness_") as tmp, contextlib.ExitStack() as stack:
        if args.backend == "vllm":
            server_argv, env = server_args(
                max_model_len=768, model_dir=world.model, max_concurrent=args.batch_size * args.group_size,
                extra_args=["--dtype", "float32", "--enforce-eager", "--distributed-executor-backend=uni"])
            server = stack.enter_context(launched_server(
                str(VLLM_PYTHON), str(world.model), args=server_argv, log_path=Path(tmp) / "vllm.log",
                startup_timeout_s=600, env={**env, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}))
            args.url = server.url
        with tool_endpoints_in_process(world.corpus, max_output_chars=OUTPUT_CHARS,
                                       faults=FaultConfig(latency_ms=args.latency_ms)) as endpoints:
            print("warm-up: one step of each arm, untimed", flush=True)
            for staleness in (0, 1):
                one_run(world, endpoints, staleness, 99, Path(tmp) / f"warmup_{staleness}",
                        argparse.Namespace(**{**vars(args), "steps": 2}))
            for n, seed in enumerate(seeds):
                for staleness in (1, 0) if n % 2 else (0, 1):
                    print(f"seed {seed}, max_staleness {staleness}: {args.steps} steps", flush=True)
                    runs[staleness].append(one_run(world, endpoints, staleness, seed,
                                                   Path(tmp) / f"{seed}_{staleness}", args))
        with local_tool_endpoints(world.corpus, max_output_chars=OUTPUT_CHARS) as endpoints:
            for arm in runs.values():
                for run in arm:
                    run["eval"] = eval_score(run.pop("model"), world, endpoints, args.eval_k, "validation")
    speedups = [(s["steps"] / s["seconds"]) / (o["steps"] / o["seconds"]) for o, s in zip(runs[0], runs[1], strict=True)]
    bounds = [o["overlap_bound"] for o in runs[0]]
    steady = ([o["steady_step_s"] / s["steady_step_s"] for o, s in zip(runs[0], runs[1], strict=True)]
              if args.steps > 2 else [])
    scores = {arm: [r["eval"]["score"] for r in runs[arm]] for arm in runs}
    results = {
        "steps": args.steps, "seeds": seeds, "latency_ms": args.latency_ms, "batch_size": args.batch_size,
        "group_size": args.group_size, "ppo_epochs": args.ppo_epochs, "learning_rate": args.learning_rate, "eval_k": args.eval_k,
        "threads": args.threads, "backend": args.backend,
        "sampler": args.sampler if args.backend == "transformers" else None,
        "runs": runs, "speedups": speedups, "steady_speedups": steady, "overlap_bounds": bounds,
        "score_sync": scores[0], "score_off_policy": scores[1],
        "score_sync_mean": statistics.mean(scores[0]), "score_off_policy_mean": statistics.mean(scores[1]),
    }
    print(f"\n{'seed':>4} {'arm':>10} {'steps/s':>8} {'sample s':>9} {'update s':>9} {'lag':>4} {'val score':>9}")
    for arm, name in ((0, "sync"), (1, "off-policy")):
        for r in runs[arm]:
            print(f"{r['seed']:>4} {name:>10} {r['steps'] / r['seconds']:>8.3f} {r['sampling_s']:>9.2f} "
                  f"{r['training_s']:>9.2f} {r['policy_lag_max']:>4.0f} {r['eval']['score']:>9.3f}")
    print(f"\nspeedup off-policy / sync per seed: {', '.join(f'{x:.2f}' for x in speedups)} "
          f"(median {statistics.median(speedups):.2f}; a perfect overlap of the sync arm's steps: "
          f"{', '.join(f'{b:.2f}' for b in bounds)})")
    if steady:
        print(f"steady state (median step of steps 2 to {args.steps - 1}): {', '.join(f'{x:.2f}' for x in steady)} "
              f"(median {statistics.median(steady):.2f})")
    print(f"validation score: sync {results['score_sync_mean']:.3f} {scores[0]}, "
          f"off-policy {results['score_off_policy_mean']:.3f} {scores[1]}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main()
