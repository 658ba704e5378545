"""The training step against what the machine allows: FLOP rate over the measured matmul
peak, peak memory, and how the step's time grows with the group size and the batch.

(1) FLOP rate. The machine's peak is the best of several float32 matmuls (2048^3 on CPU,
    bf16 8192^3 on a GPU) at the same thread count, measured before and after the step
    (the better one counts). The step is our GRPO update, `GRPOTrainer._update`: the real
    micro-batch loss (token log-probs, clipped policy loss), backward, gradient clipping
    and AdamW, on rollouts of `--seq-len` tokens (half of them generated) of a Qwen3 wide
    enough that matmuls dominate. FLOPs counted: 6 * N * T for the forward and backward of
    every matmul weight (N includes the LM head, not the embedding lookup; T counts every
    position of the padded micro-batches) plus 6 * layers * S^2 * d for causal attention
    (QK^T and AV, forward and backward, over a sequence of S). The rate is that count over
    the update's wall time, divided by the peak.
(2) Peak resident memory of the process through the update, with the model's own size.
(3) Scaling. Whole training steps (`GRPOTrainer._train_step`: rollouts of the taught model
    through the real tool server, grading, the update) as the group size doubles (4, 8,
    16 at 2 items) and as the items per step double (1, 2, 4 at a group of 4); the median
    of `--scaling-steps` steps each. Linear growth doubles the time per doubling; the
    engine batches more sequences per forward, so it should grow less.
(4) On a GPU only: the model-FLOP utilisation of the same update on a Qwen3 of ~0.6B
    parameters (Qwen3-0.6B's shape, built from its config) in bf16 autocast.

    python -m benchmarks.bench_training [--hidden 768] [--layers 4] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from transformers import AutoTokenizer, Qwen3Config

from benchmarks.taught_world import TaughtWorld, taught_world, training_config
from envs.finqa.local import local_tool_endpoints
from envs.finqa.tiny_model import build_model, tiny_config
from tests.taught_model import OUTPUT_CHARS
from trainer.grpo import GRPOTrainer, token_logprobs
from trainer.rollout import RolloutRecord


def matmul_peak(device: torch.device, dtype: torch.dtype, n: int, repeats: int) -> float:
    """Best FLOP/s of an n x n x n matmul."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    best = float("inf")
    for _ in range(repeats + 1):  # the first warms up
        sync(device)
        started = time.perf_counter()
        torch.mm(a, b)
        sync(device)
        best = min(best, time.perf_counter() - started)
    return 2 * n**3 / best


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def step_flops(config: Qwen3Config, n_params_matmul: int, rows: int, seq_len: int) -> float:
    """Forward + backward FLOPs of `rows` sequences of `seq_len` (see the module docstring)."""
    attention_width = config.num_attention_heads * config.head_dim
    dense = 6 * n_params_matmul * rows * seq_len
    attention = 6 * config.num_hidden_layers * seq_len**2 * attention_width * rows
    return dense + attention


def matmul_params(model: torch.nn.Module) -> int:
    """Parameters that multiply activations: every linear weight, the LM head included."""
    return sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))


def update_trainer(world: TaughtWorld, model_config: Qwen3Config, out: Path, micro_batch_size: int,
                   mixed_precision: str) -> GRPOTrainer:
    """Our trainer, set up on a random model of `model_config` (saved with the world's
    tokenizer, which only supplies the pad id here); no tool server is needed."""
    model_dir = out / "model"
    build_model(model_config, seed=0).save_pretrained(model_dir)
    AutoTokenizer.from_pretrained(world.model).save_pretrained(model_dir)
    config = training_config(world, [], micro_batch_size=micro_batch_size, mixed_precision=mixed_precision)
    trainer = GRPOTrainer(config, model_path=str(model_dir), output_dir=out / "run", endpoints=[])
    trainer.setup()
    return trainer


def synthetic_rollouts(trainer: GRPOTrainer, n: int, seq_len: int, vocab: int) -> tuple[list[RolloutRecord], list[float]]:
    """`n` rollouts of `seq_len` tokens, the second half generated, with the sampler's
    log-probabilities computed by the model itself (so the ratios start at 1)."""
    generator = torch.Generator().manual_seed(0)
    model = trainer.accelerator.unwrap_model(trainer.model)
    records = []
    for index in range(n):
        ids = torch.randint(3, vocab, (seq_len,), generator=generator)
        with torch.no_grad(), trainer.accelerator.autocast():
            logits = model(input_ids=ids[None].to(trainer.accelerator.device)).logits
        logprobs = [0.0] + token_logprobs(logits, ids[None].to(logits.device), 1.0)[0].float().tolist()
        records.append(RolloutRecord(
            trace_id=f"trace_{index}", item_id=str(index // 4), sample_index=index % 4, messages=[], tool_calls=[],
            final_answer="", status="ok", score=0.0, reward=0.0, token_ids=ids.tolist(),
            gen_mask=[0] * (seq_len // 2) + [1] * (seq_len - seq_len // 2), logprobs=logprobs,
        ))
    advantages = [random.Random(index).choice((-1.0, 1.0)) for index in range(n)]
    return records, advantages


def time_update(trainer: GRPOTrainer, records, advantages, repeats: int) -> list[float]:
    """Seconds of `repeats` updates after one warm-up."""
    device = trainer.accelerator.device
    times = []
    for step in range(repeats + 1):
        sync(device)
        started = time.perf_counter()
        trainer._update(records, advantages, step + 1)
        sync(device)
        times.append(time.perf_counter() - started)
    return times[1:]


def flop_rate(args, world: TaughtWorld, tmp: Path) -> dict[str, Any]:
    device = torch.device("cpu")
    peak_before = matmul_peak(device, torch.float32, args.peak_n, args.peak_repeats)
    config = tiny_config(args.vocab, hidden_size=args.hidden, num_layers=args.layers, num_heads=args.heads,
                         num_kv_heads=args.heads // 4 or 1, intermediate_size=args.hidden * 8 // 3 // 64 * 64,
                         max_position_embeddings=max(2048, args.seq_len))
    config._attn_implementation = "sdpa"
    trainer = update_trainer(world, config, tmp / "flops", args.micro_batch_size, "no")
    try:
        rss_before = rss_mib()
        rows = args.rollouts
        records, advantages = synthetic_rollouts(trainer, rows, args.seq_len, args.vocab)
        times = time_update(trainer, records, advantages, args.repeats)
        model = trainer.accelerator.unwrap_model(trainer.model)
        n_matmul = matmul_params(model)
        n_params = sum(p.numel() for p in model.parameters())
        param_mib = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
    finally:
        trainer.cleanup()
    peak_after = matmul_peak(device, torch.float32, args.peak_n, args.peak_repeats)
    peak = max(peak_before, peak_after)
    flops = step_flops(config, n_matmul, rows, args.seq_len)
    best = min(times)
    return {
        "threads": torch.get_num_threads(),
        "model": {"hidden": args.hidden, "layers": args.layers, "heads": args.heads, "vocab": args.vocab,
                  "intermediate": config.intermediate_size, "params": n_params, "matmul_params": n_matmul,
                  "params_mib": round(param_mib, 1)},
        "rollouts": rows, "seq_len": args.seq_len, "micro_batch_size": args.micro_batch_size,
        "update_s": [round(t, 3) for t in times],
        "step_flops": flops,
        "achieved_flops_per_s": flops / best,
        "peak_flops_per_s": peak,
        "peak_before_after": [peak_before, peak_after],
        "flops_over_peak": flops / best / peak,
        "rss_before_update_mib": round(rss_before, 1),
        "peak_rss_mib": round(peak_rss_mib(), 1),
    }


def scaling(args, world: TaughtWorld, tmp: Path) -> dict[str, Any]:
    """Median whole-step seconds per (group size, items per step)."""
    torch.set_num_threads(args.scaling_threads)
    points = [(4, 2), (8, 2), (16, 2), (4, 1), (4, 4)]
    results = []
    with local_tool_endpoints(world.corpus, max_output_chars=OUTPUT_CHARS) as endpoints:
        for group, items in points:
            config = training_config(world, endpoints, batch_size=items, compute_multiplier=group / 8,
                                     max_steps=args.scaling_steps + 1)
            trainer = GRPOTrainer(config, model_path=str(world.model), output_dir=tmp / f"scaling_{group}_{items}")
            trainer.setup()
            try:
                steps = [trainer._train_step(step) for step in range(1, args.scaling_steps + 2)][1:]
            finally:
                trainer.cleanup()
            row = {"group_size": group, "items": items, "rollouts": group * items}
            for key in ("sampling_s", "training_s"):
                row[key] = statistics.median(s[f"timing/{key}"] for s in steps)
            row["step_s"] = row["sampling_s"] + row["training_s"]
            row["tool_calls_mean"] = statistics.mean(s["train/tool_calls_mean"] for s in steps)
            results.append(row)
            print(f"  group {group:>2} x {items} items: step {row['step_s']:.2f} s "
                  f"(rollouts {row['sampling_s']:.2f}, update {row['training_s']:.2f})", flush=True)
    by = {(r["group_size"], r["items"]): r["step_s"] for r in results}
    doublings = {
        "group_4_to_8": by[(8, 2)] / by[(4, 2)], "group_8_to_16": by[(16, 2)] / by[(8, 2)],
        "items_1_to_2": by[(4, 2)] / by[(4, 1)], "items_2_to_4": by[(4, 4)] / by[(4, 2)],
    }
    return {"threads": args.scaling_threads, "steps_each": args.scaling_steps, "points": results,
            "time_ratio_per_doubling": doublings, "worst_ratio_per_doubling": max(doublings.values())}


def gpu_mfu(args, world: TaughtWorld, tmp: Path) -> dict[str, Any]:
    """MFU of the update of a Qwen3-0.6B-shaped model in bf16 autocast on the GPU."""
    device = torch.device("cuda")
    peak = matmul_peak(device, torch.bfloat16, 8192, 10)
    config = Qwen3Config(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                         num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True,
                         max_position_embeddings=4096, pad_token_id=0, eos_token_id=2)
    config._attn_implementation = "sdpa"
    trainer = update_trainer(world, config, tmp / "gpu", args.gpu_micro_batch_size, "bf16")
    try:
        records, advantages = synthetic_rollouts(trainer, args.gpu_rollouts, args.gpu_seq_len, config.vocab_size)
        torch.cuda.reset_peak_memory_stats()
        times = time_update(trainer, records, advantages, args.repeats)
        model = trainer.accelerator.unwrap_model(trainer.model)
        n_matmul = matmul_params(model)
        n_params = sum(p.numel() for p in model.parameters())
        memory = torch.cuda.max_memory_allocated() / 2**30
    finally:
        trainer.cleanup()
    flops = step_flops(config, n_matmul, args.gpu_rollouts, args.gpu_seq_len)
    return {"device": torch.cuda.get_device_name(), "params": n_params, "matmul_params": n_matmul,
            "rollouts": args.gpu_rollouts, "seq_len": args.gpu_seq_len, "update_s": times,
            "achieved_flops_per_s": flops / min(times), "peak_bf16_flops_per_s": peak,
            "mfu": flops / min(times) / peak, "peak_memory_gib": round(memory, 2)}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--seq-len", type=int, default=512, help="tokens per rollout")
    parser.add_argument("--rollouts", type=int, default=16, help="rollouts per update")
    parser.add_argument("--micro-batch-size", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3, help="timed updates after a warm-up")
    parser.add_argument("--peak-n", type=int, default=2048)
    parser.add_argument("--peak-repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="torch threads of the FLOP-rate part")
    parser.add_argument("--scaling-steps", type=int, default=2, help="timed steps per scaling point")
    parser.add_argument("--scaling-threads", type=int, default=1,
                        help="torch threads of the scaling part (the taught model is tiny)")
    parser.add_argument("--gpu-rollouts", type=int, default=16)
    parser.add_argument("--gpu-seq-len", type=int, default=1024)
    parser.add_argument("--gpu-micro-batch-size", type=int, default=8)
    parser.add_argument("--skip-scaling", action="store_true")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    world = taught_world()
    results: dict[str, Any] = {"loadavg_start": os.getloadavg()[0]}
    with tempfile.TemporaryDirectory(prefix="bench_training_") as tmp_dir:
        tmp = Path(tmp_dir)
        print("(1, 2) FLOP rate and memory of the GRPO update", flush=True)
        results["flops"] = flop_rate(args, world, tmp)
        if torch.cuda.is_available():
            print("(4) GPU MFU of a ~0.6B Qwen3 in bf16", flush=True)
            results["gpu"] = gpu_mfu(args, world, tmp)
        else:
            results["gpu"] = None
        if not args.skip_scaling:
            print("(3) scaling of the whole step", flush=True)
            results["scaling"] = scaling(args, world, tmp)
    results["loadavg_end"] = os.getloadavg()[0]

    f = results["flops"]
    m = f["model"]
    print(f"\nmodel: Qwen3 hidden {m['hidden']}, {m['layers']} layers, vocab {m['vocab']}: {m['params'] / 1e6:.1f}M "
          f"parameters ({m['params_mib']} MiB); update of {f['rollouts']} rollouts x {f['seq_len']} tokens, "
          f"micro-batches of {f['micro_batch_size']}, {f['threads']} threads")
    print(f"update seconds {f['update_s']}; {f['achieved_flops_per_s'] / 1e9:.1f} GFLOP/s achieved, matmul peak "
          f"{f['peak_flops_per_s'] / 1e9:.1f} GFLOP/s: {f['flops_over_peak']:.2f} of peak (goal >= 0.30)")
    print(f"memory: RSS {f['rss_before_update_mib']} MiB before the update, peak {f['peak_rss_mib']} MiB")
    if results["gpu"]:
        g = results["gpu"]
        print(f"GPU {g['device']}: MFU {g['mfu']:.2f} (goal >= 0.40), peak memory {g['peak_memory_gib']} GiB")
    else:
        print("GPU MFU: no GPU")
    if "scaling" in results:
        s = results["scaling"]
        print("scaling (median whole step, seconds):")
        for p in s["points"]:
            print(f"  group {p['group_size']:>2} x {p['items']} items = {p['rollouts']:>2} rollouts: "
                  f"{p['step_s']:.2f} (rollouts {p['sampling_s']:.2f}, update {p['training_s']:.2f})")
        print("  time ratio per doubling: " + ", ".join(f"{k} {v:.2f}" for k, v in s["time_ratio_per_doubling"].items())
              + " (linear: 2.00)")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return results


if __name__ == "__main__":
    main()
