"""A launched vLLM server's OpenMP threads on a CPU, side by side: vLLM's own default
against what `server_args` gives it (`cpu_thread_env`: half the cores, unbound).

On a CPU the server shares the machine with the trainer. This times a batch of rollouts
(4 items x 8, 300 ms tools, the taught world) alone and beside an update that runs in
another process the whole time (forward and backward passes of the same model, one
torch thread), as a one-step off-policy run has it, for each setting in turn.

    .venv/bin/python -m benchmarks.bench_vllm_threads [--batches 8] [--in-process-engine]

`--in-process-engine` runs the engine inside the API server's process
(VLLM_ENABLE_V1_MULTIPROCESSING=0, as bench_staleness does); the default is the pipeline's
launch, with the engine in worker processes.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.bench_staleness import VLLM_PYTHON
from benchmarks.taught_world import taught_world, training_config
from envs.finqa.faults import FaultConfig
from envs.finqa.local import tool_endpoints_in_process
from tests.taught_model import OUTPUT_CHARS
from trainer.generation.vllm_launch import cpu_thread_env, launched_server, server_args
from trainer.rl.grpo import GRPOTrainer

OURS = cpu_thread_env({})
SETTINGS = {
    "vLLM's default": {"VLLM_CPU_OMP_THREADS_BIND": "auto"},
    "server_args (half the cores, unbound)": OURS,
}


def update_forever(model_dir: str, stop: Any, ready: Any) -> None:
    """What the trainer's update does to the cores: passes of the same model, until stopped."""
    torch.set_num_threads(1)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    ids = torch.randint(0, 100, (8, 96))
    ready.set()
    while not stop.is_set():
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()


def batch_seconds(trainer: GRPOTrainer, batches: int) -> list[float]:
    seconds = []
    for step in range(1, batches + 1):
        started = time.perf_counter()
        trainer._sample(step, 0)
        seconds.append(time.perf_counter() - started)
    return seconds


def one_setting(world, endpoints, env: dict[str, str], args: argparse.Namespace, tmp: Path) -> dict[str, float]:
    argv, base_env = server_args(max_model_len=768, model_dir=world.model, max_concurrent=32,
                                 extra_args=["--dtype", "float32", "--enforce-eager"])
    env = {**{k: v for k, v in base_env.items() if k not in OURS}, **env}
    if args.in_process_engine:
        env |= {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
        argv += ["--distributed-executor-backend=uni"]
    with launched_server(str(VLLM_PYTHON), str(world.model), args=argv, log_path=tmp / "vllm.log",
                         startup_timeout_s=600, env=env) as server:
        rollout = {"max_concurrent_rollouts": 32, "backend": "vllm",
                   "vllm": {"launch": False, "urls": [server.url], "python": str(VLLM_PYTHON)}}
        config = training_config(world, endpoints, rollout=rollout, max_steps=args.batches, n_epochs=args.batches,
                                 batch_size=4, compute_multiplier=1, ppo_epochs=1, learning_rate=1e-4,
                                 eval_interval=args.batches, seed=3, max_staleness=0)
        trainer = GRPOTrainer(config, model_path=str(world.model), output_dir=tmp / "out")
        trainer.setup()
        try:
            batch_seconds(trainer, 1)  # warm-up
            alone = batch_seconds(trainer, args.batches)
            spawn = mp.get_context("spawn")
            stop, ready = spawn.Event(), spawn.Event()
            updater = spawn.Process(target=update_forever, args=(str(world.model), stop, ready))
            updater.start()
            ready.wait()
            try:
                beside = batch_seconds(trainer, args.batches)
            finally:
                stop.set()
                updater.join()
        finally:
            trainer.cleanup()
    return {"alone_s": statistics.median(alone), "beside_s": statistics.median(beside),
            "alone_max_s": max(alone), "beside_max_s": max(beside)}


def main(argv: list[str] | None = None) -> dict[str, dict[str, float]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, default=8, help="timed batches in each condition")
    parser.add_argument("--in-process-engine", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    world = taught_world()
    results = {}
    with tool_endpoints_in_process(world.corpus, max_output_chars=OUTPUT_CHARS,
                                   faults=FaultConfig(latency_ms=300)) as endpoints:
        for name, env in SETTINGS.items():
            with tempfile.TemporaryDirectory(prefix="bench_vllm_threads_") as tmp:
                results[name] = one_setting(world, endpoints, env, args, Path(tmp))
            print(f"{name}: {results[name]}", flush=True)
    default, ours = results.values()
    print(f"\n4 items x 8 rollouts, 300 ms tools, medians of {args.batches} batches, "
          f"engine {'in the API server' if args.in_process_engine else 'in worker processes'}")
    print(f"{'':42}{'alone, s':>10}{'beside an update, s':>22}")
    for name, r in results.items():
        print(f"{name:42}{r['alone_s']:>10.2f}{r['beside_s']:>22.2f}")
    print(f"{'ratio, vLLM default / server_args':42}{default['alone_s'] / ours['alone_s']:>10.2f}"
          f"{default['beside_s'] / ours['beside_s']:>22.2f}")
    return results


if __name__ == "__main__":
    main()
