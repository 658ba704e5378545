"""The real model at its own size: SmolLM2-135M-Instruct (134.5M parameters, imported from the
package index, cached per machine) on the units recipe (envs/units/smollm2.yaml: its prompt,
template, tools and sampling settings), side by side in one run.

(1) Rollouts/s on the embedded transformers engine against a launched vLLM server (CPU, the
    separate `.venv-vllm`), on the same `--items` training items, `--k` rollouts each, the same
    seeds, through the real units tool server on loopback. Each backend is warmed up with one
    rollout per item, then `--repeats` batches are timed; the best batch counts (as in
    bench_vllm). Both sample the recipe's policy: the base model under its LoRA wrapper on the
    engine, the base weights on vLLM (before the first step no adapter is loaded).
(2) The update, LoRA (the recipe's r16) against full fine-tuning, each in a fresh process (peak
    RSS is a process-wide high-water mark): one group of `--rollouts` rollouts shaped as (1)
    measured them (median length, median first generated position), the recipe's micro-batch,
    `--update-repeats` timed updates after one warm-up; seconds per update, resident memory
    before the first update and its peak through the updates (the high-water mark is reset
    after the setup, whose own peak is not the update's), parameters trained. Memory is given
    back before each update (trainer/memory.py `release_memory`, untimed), as the trainer does
    after a step once the process is large; a third arm, LoRA with the heap kept, shows what
    that costs the update.
(3) The FLOP rate of those updates over this machine's float32 matmul peak (the best 2048^3
    matmul at the same thread count, measured before and after in the same process). FLOPs
    counted: every linear layer's forward (2 per weight per position; the LM head only over
    the completion span, which is all the update computes), the backward to the inputs (2 more)
    and, for trained weights only, to the weights (2 more): full fine-tuning 6 x, a frozen base
    under LoRA 4 x plus the adapters' 6 x; causal attention 6 x layers x length^2 x width.
The sync of a LoRA adapter and of full weights at this size: bench_weight_sync --model smollm2
--lora 16 (run_all's `weight_sync_real`).

    python -m benchmarks.bench_real_model [--items 8] [--k 4] [--rollouts 8] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.taught_world import REPO

CPU_SERVER_ARGS = ["--dtype", "float32", "--enforce-eager"]
PEAK_N = 2048
UPDATE_VARIANTS = ["lora", "full", "lora-kept"]


def recipe(model: Path, url: str, out: Path, *, backend: str = "transformers", lora: bool = True) -> Any:
    """The units recipe's config on `model`, its tools at `url`, MLflow and outputs in `out`."""
    from trainer.config.loading import load_config

    overrides: dict[str, Any] = {
        "model": {"base_model": str(model)},
        "tools": {"endpoints": [{"name": "calculate", "server_url": f"{url}/tools/calculate"}]},
        "rollout": {"backend": backend,
                    "vllm": {"launch": True, "extra_args": CPU_SERVER_ARGS, "startup_timeout_s": 900}},
        "mlflow": {"tracking_uri": f"sqlite:///{out / 'mlflow.db'}"},
    }
    if not lora:
        overrides["training"] = {"lora": None}
    return load_config(REPO / "envs" / "units" / "smollm2.yaml", overrides)


def rollouts(model: Path, url: str, out: Path, backend: str, args) -> dict[str, Any]:
    """(1) for one backend."""
    from benchmarks.bench_vllm import rollout_rate
    from trainer.generation.engine import TransformersBackend
    from trainer.rl.grpo import GRPOTrainer

    config = recipe(model, url, out, backend=backend)
    trainer = GRPOTrainer(config, model_path=str(model), output_dir=out / "run")
    trainer.setup()
    trainer.train_items = trainer.train_items[:args.items]
    try:
        def make_backend(seed: int):
            if backend == "vllm":
                return trainer.generator.backend(seed)
            policy = trainer.accelerator.unwrap_model(trainer.model).eval()
            return TransformersBackend(policy, stop_token_ids=trainer.stop_token_ids,
                                       max_slots=config.rollout.max_concurrent_rollouts,
                                       max_len=config.rollout.max_total_tokens, seed=seed)

        rollout_rate(trainer, make_backend(0), 1, seed=0)  # warm-up
        rates = [rollout_rate(trainer, make_backend(seed), args.k, seed) for seed in range(1, args.repeats + 1)]
        launched = getattr(trainer.generator, "launched", [])
    finally:
        trainer.cleanup()
    best = max(rates, key=lambda r: r["rollouts_per_s"])
    return best | {"backend": backend, "batches_s": [round(r["seconds"], 1) for r in rates],
                   "seq_len": round(statistics.median(r["seq_len_median"] for r in rates)),
                   "first_generated": round(statistics.median(r["first_generated_median"] for r in rates)),
                   "server_startup_s": launched[0].startup_s if launched else None}


def linear_counts(model: Any) -> dict[str, int]:
    """Weights of the linear layers: the body's frozen or trained weights, the LM head's, the
    LoRA adapters'."""
    import torch

    counts = {"body": 0, "head": 0, "lora": 0}
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear):
            continue
        part = "lora" if ".lora_" in name else "head" if name.endswith("lm_head") else "body"
        counts[part] += module.weight.numel()
    return counts


def update_flops(counts: dict[str, int], model_config: Any, rows: int, seq_len: int, span: int, lora: bool) -> float:
    """Forward and backward FLOPs of one update (the module docstring says what is counted)."""
    base = 4 if lora else 6
    dense = base * (counts["body"] * seq_len + counts["head"] * span) + 6 * counts["lora"] * seq_len
    width = model_config.num_attention_heads * getattr(model_config, "head_dim",
                                                       model_config.hidden_size // model_config.num_attention_heads)
    attention = 6 * model_config.num_hidden_layers * seq_len**2 * width
    return rows * (dense + attention)


def reset_peak() -> None:
    """Reset this process's resident high-water mark (Linux: VmHWM, through clear_refs)."""
    Path("/proc/self/clear_refs").write_text("5")


def peak_since_reset_mib() -> float:
    """The resident high-water mark since `reset_peak`, MiB."""
    status = Path("/proc/self/status").read_text()
    return int(next(line for line in status.splitlines() if line.startswith("VmHWM:")).split()[1]) / 1024


def update_variant(args) -> dict[str, Any]:
    """(2) and (3) for `args.update_variant`, in this (fresh) process."""
    import torch

    from benchmarks.bench_training import matmul_peak, peak_rss_mib, rss_mib
    from benchmarks.bench_training import synthetic_rollouts as shaped_rollouts
    from trainer.memory import release_memory
    from trainer.rl.grpo import GRPOTrainer

    lora = args.update_variant != "full"
    # as the trainer does after a step once the process is large (trainer/memory.py), outside the timed update;
    # "lora-kept" leaves the heap as it is, to show what giving memory back costs the update
    release = args.update_variant != "lora-kept"
    device = torch.device("cpu")
    peak_before = matmul_peak(device, torch.float32, PEAK_N, 3)
    with tempfile.TemporaryDirectory(prefix="bench_real_update_") as tmp:
        # no tool is called; the trainer wants an endpoint to exist
        config = recipe(args.model, "http://127.0.0.1:9", Path(tmp), lora=lora)
        trainer = GRPOTrainer(config, model_path=str(args.model), output_dir=Path(tmp) / "run")
        trainer.setup()
        try:
            model = trainer.accelerator.unwrap_model(trainer.model)
            counts = linear_counts(model)
            trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
            vocab = model.config.vocab_size
            records, advantages = shaped_rollouts(trainer, args.rollouts, args.seq_len, args.first_generated, vocab)
            rss_before = rss_mib()
            reset_peak()  # the setup's own peak (model copies, the format's self-check) is not the update's
            times = []
            for step in range(args.update_repeats + 1):  # the first warms up
                if release:
                    release_memory()
                started = time.perf_counter()
                trainer.updater.update(records, advantages, step + 1)
                times.append(time.perf_counter() - started)
            times = times[1:]
            model_config = model.config
        finally:
            trainer.cleanup()
    peak = max(peak_before, matmul_peak(device, torch.float32, PEAK_N, 3))
    flops = update_flops(counts, model_config, args.rollouts, args.seq_len, args.seq_len - args.first_generated + 1,
                         lora)
    return {"variant": args.update_variant, "release_memory": release, "threads": torch.get_num_threads(),
            "trained_parameters": trained, "linear_weights": counts, "rollouts": args.rollouts, "seq_len": args.seq_len,
            "first_generated": args.first_generated, "micro_batch_size": config.training.micro_batch_size,
            "update_s": [round(t, 2) for t in times], "update_s_median": statistics.median(times),
            "rss_before_update_mib": round(rss_before), "peak_rss_mib": round(peak_since_reset_mib()),
            "process_peak_rss_mib": round(peak_rss_mib()),
            "update_flops": flops, "matmul_peak_flops_per_s": peak,
            "flops_over_peak": [flops / t / peak for t in times]}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--items", type=int, default=8, help="training items of the throughput batches")
    parser.add_argument("--k", type=int, default=4, help="rollouts per item in a throughput batch")
    parser.add_argument("--repeats", type=int, default=2, help="timed throughput batches per backend (best kept)")
    parser.add_argument("--rollouts", type=int, default=8, help="rollouts of one timed update (one group)")
    parser.add_argument("--update-repeats", type=int, default=3, help="timed updates per variant")
    parser.add_argument("--backends", nargs="+", default=["transformers", "vllm"], choices=["transformers", "vllm"])
    parser.add_argument("--json", type=Path, default=None)
    # one variant of (2), in a process of its own (run by main)
    parser.add_argument("--update-variant", choices=UPDATE_VARIANTS, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--model", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--seq-len", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--first-generated", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.update_variant:
        result = update_variant(args)
        args.json.write_text(json.dumps(result, indent=2))
        return result

    from envs.tool_server import serve_in_thread
    from envs.units.demo import MODEL_PACKAGE, ensure_data
    from envs.units.server import create_app
    from trainer.generation.model_import import import_model

    model = import_model(package=MODEL_PACKAGE, log=lambda _: None)
    ensure_data(recipe(model, "http://127.0.0.1:9", Path(tempfile.gettempdir())), log=lambda _: None)
    results: dict[str, Any] = {"model": str(model), "args": {k: v for k, v in vars(args).items() if k != "json"}
                               | {"model": None}}
    with tempfile.TemporaryDirectory(prefix="bench_real_") as tmp, serve_in_thread(create_app()) as url:
        for backend in args.backends:
            results[backend] = rollouts(model, url, Path(tmp) / backend, backend, args)
            print(f"{backend}: {json.dumps(results[backend])}", flush=True)
        shape = results[args.backends[0]]
        for variant in UPDATE_VARIANTS:
            out = Path(tmp) / f"update_{variant}.json"
            subprocess.run([sys.executable, "-m", "benchmarks.bench_real_model", "--update-variant", variant,
                            "--model", str(model), "--seq-len", str(shape["seq_len"]),
                            "--first-generated", str(shape["first_generated"]), "--rollouts", str(args.rollouts),
                            "--update-repeats", str(args.update_repeats), "--json", str(out)],
                           check=True, cwd=REPO)
            results[f"update_{variant}"] = json.loads(out.read_text())
            print(f"update {variant}: {out.read_text()}", flush=True)
    report(results)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return results


def report(r: dict[str, Any]) -> None:
    if "transformers" in r and "vllm" in r:
        engine, vllm = r["transformers"], r["vllm"]
        print(f"\nrollouts, {engine['rollouts']} a batch ({r['args']['items']} items x {r['args']['k']}):")
        print(f"{'':26}{'engine':>10}{'vLLM':>10}{'vLLM/engine':>13}")
        for key, label in (("rollouts_per_s", "rollouts/s"), ("tokens_per_s", "generated tokens/s"),
                           ("tool_calls_mean", "tool calls a rollout")):
            print(f"{label:26}{engine[key]:>10.2f}{vllm[key]:>10.2f}{vllm[key] / engine[key]:>13.2f}")
    lora, full = r["update_lora"], r["update_full"]
    print(f"\nupdate of {lora['rollouts']} rollouts of {lora['seq_len']} tokens (micro-batch {lora['micro_batch_size']}):")
    print(f"{'':26}{'LoRA':>10}{'full':>10}{'full/LoRA':>11}")
    for key, label, scale in (("update_s_median", "seconds", 1), ("peak_rss_mib", "peak resident MiB", 1),
                              ("trained_parameters", "trained parameters (M)", 1e-6)):
        print(f"{label:26}{lora[key] * scale:>10.1f}{full[key] * scale:>10.1f}{full[key] / lora[key]:>11.2f}")
    kept = r.get("update_lora-kept")
    if kept:
        print(f"LoRA update with memory given back before it / without: {lora['update_s_median']:.1f} / "
              f"{kept['update_s_median']:.1f} s ({lora['update_s_median'] / kept['update_s_median']:.2f}x)")
    for v in (lora, full):
        print(f"{v['variant']}: FLOP rate / matmul peak {statistics.median(v['flops_over_peak']):.1%} "
              f"({v['update_flops'] / v['update_s_median'] / 1e9:.0f} of {v['matmul_peak_flops_per_s'] / 1e9:.0f} GFLOP/s)")


if __name__ == "__main__":
    main()
