"""The training step against what the machine allows: FLOP rate over the measured matmul
peak, peak memory before and after the completion-span chunked log-probabilities, and how
the step's time grows with the group size and the batch.

(1) FLOP rate. The machine's peak is the best of several float32 matmuls (2048^3 on CPU,
    bf16 8192^3 on a GPU) at the same thread count, measured before and after the step
    (the better one counts). The step is our GRPO update (`PolicyUpdate.update` of
    trainer/rl/update.py: the micro-batch losses, backward, gradient clipping and AdamW) on
    rollouts of `--seq-len` tokens (half of them generated) of a Qwen3 wide enough that
    matmuls dominate. FLOPs counted: 6 * N * T for the forward and backward of every
    matmul weight (N includes the LM head, not the embedding lookup; T counts every
    position of the padded micro-batches) plus 6 * layers * S^2 * d for causal attention.
    The rate is that count over each timed update's wall time, divided by the peak: the
    median of `--repeats` updates (at least 3) with their min and max.
(2) Memory of the update, before and after issue 17's change. "after": the trainer as it
    is (logits only over the completion span, `logits_to_keep`, and the float32
    log-softmax `logprob_chunk_tokens` positions at a time). "before": the same update
    with `_logprobs` replaced, in this benchmark only (`FullSequenceLogprobs`), by what the
    trainer did before: logits at every position of the whole sequences and one float32
    log-softmax over all of them. Each variant runs in a fresh process (peak RSS is a
    process-wide high-water mark): RSS before the first update, peak RSS through
    `--repeats` updates after one warm-up, and updates per second. The model is a small
    Qwen3 with a real vocabulary (32,768 tokens) on rollouts of 1,536 tokens with a
    256-token prompt (a completion span of two 1,024-position chunks), where the
    [batch, length, vocabulary] logits dominate.
(3) Scaling. Whole training steps (`GRPOTrainer._sample` and `_learn`: rollouts of the taught model
    through the real tool server, grading, the update) as the group size doubles (4, 8,
    16 at 2 items) and as the items per step double (1, 2, 4 at a group of 4). Every point
    has its own trainer, warmed up with one step; then `--scaling-rounds` rounds (at least
    3) run `--scaling-steps` steps of every point in turn, so each ratio per doubling is
    the median of the rounds' ratios with their min and max. Linear growth doubles the
    time per doubling; the engine batches more sequences per forward, so it should grow
    less.
(4) On a GPU only: the model-FLOP utilisation of the same update on a Qwen3 of ~0.6B
    parameters (Qwen3-0.6B's shape, built from its config) in bf16 autocast, and the
    peak allocated memory of its update before and after (2) by torch's allocator.

    python -m benchmarks.bench_training [--hidden 768] [--layers 4] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import statistics
import subprocess
import sys
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
from trainer.config.tools import ToolEndpoint
from trainer.rl.grpo import GRPOTrainer
from trainer.rl.loss import chunked_logprobs
from trainer.rl.update import PolicyUpdate
from trainer.rollout.record import RolloutRecord

# The update never calls a tool; the trainer still wants endpoints to exist.
NO_TOOLS = [ToolEndpoint(name=name, server_url=f"http://127.0.0.1:9/tools/{name}") for name in ("list", "cat")]


class FullSequenceLogprobs(PolicyUpdate):
    """The update as it was before issue 17 (for the "before" figure only): logits at
    every position of the whole sequences, then one float32 log-softmax over all of them,
    cut to the completion span afterwards. The change to trainer/rl/update.py that this
    undoes: `logits_to_keep=width - first + 1` in the forward and `chunk=logprob_chunk_tokens`
    in `chunked_logprobs`."""

    def _logprobs(self, batch, *, model=None, entropy=False):
        input_ids, attention, generated, first = self._padded(batch)
        width = input_ids.size(1)
        logits = (model or self.model)(input_ids=input_ids, attention_mask=attention, use_cache=False).logits
        logprobs, ent = chunked_logprobs(logits[:, :-1], input_ids[:, 1:], self.temperature, chunk=width,
                                         with_entropy=entropy, mask=generated[:, 1:])
        return logprobs[:, first - 1 :], {"mask": generated[:, first:], "first": first, "entropy": ent}


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


def spread(values: list[float]) -> dict[str, Any]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "runs": values}


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
                   mixed_precision: str, *, full_sequence: bool = False, max_total_tokens: int = 4096) -> GRPOTrainer:
    """Our trainer, set up on a random model of `model_config` (saved with the world's
    tokenizer, which only supplies the pad id here); no tool is called. `full_sequence`:
    the update's log-probabilities as before issue 17 (`FullSequenceLogprobs`)."""
    model_dir = out / "model"
    build_model(model_config, seed=0).save_pretrained(model_dir)
    AutoTokenizer.from_pretrained(world.model).save_pretrained(model_dir)
    config = training_config(world, [], rollout={"max_total_tokens": max_total_tokens}, micro_batch_size=micro_batch_size,
                             mixed_precision=mixed_precision)
    trainer = GRPOTrainer(config, model_path=str(model_dir), output_dir=out / "run", endpoints=NO_TOOLS)
    trainer.setup()
    if full_sequence:
        u = trainer.updater
        trainer.updater = FullSequenceLogprobs(u.accelerator, u.model, u.optimizer, config=u.config,
                                               tokenizer=u.tokenizer, reference=u.reference,
                                               temperature=u.temperature, kl_coef_of=u.kl_coef_of)
    return trainer


def synthetic_rollouts(trainer: GRPOTrainer, n: int, seq_len: int, prompt_len: int,
                       vocab: int) -> tuple[list[RolloutRecord], list[float]]:
    """`n` rollouts of `seq_len` tokens, all after `prompt_len` generated, with the
    sampler's log-probabilities computed by the model itself (so the ratios start at 1),
    one rollout and 256 positions at a time (this must not be the memory peak)."""
    generator = torch.Generator().manual_seed(0)
    item_ids = [str(item["id"]) for item in trainer.train_items]  # each rollout's item has its KL coefficient
    model = trainer.accelerator.unwrap_model(trainer.model)
    device = trainer.accelerator.device
    records = []
    for index in range(n):
        ids = torch.randint(3, vocab, (seq_len,), generator=generator)
        with torch.no_grad(), trainer.accelerator.autocast():
            logits = model(input_ids=ids[None].to(device), logits_to_keep=seq_len - prompt_len + 1).logits
            span, _ = chunked_logprobs(logits[:, :-1], ids[None, prompt_len:].to(device), 1.0, chunk=256)
        logprobs = [0.0] * prompt_len + span[0].float().tolist()
        records.append(RolloutRecord(
            trace_id=f"trace_{index}", item_id=item_ids[index // 4 % len(item_ids)], sample_index=index % 4, messages=[], tool_calls=[],
            final_answer="", status="ok", score=0.0, reward=0.0, token_ids=ids.tolist(),
            gen_mask=[0] * prompt_len + [1] * (seq_len - prompt_len), logprobs=logprobs,
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
        trainer.updater.update(records, advantages, step + 1)
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
        records, advantages = synthetic_rollouts(trainer, rows, args.seq_len, args.seq_len // 2, args.vocab)
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
    return {
        "threads": torch.get_num_threads(),
        "model": {"hidden": args.hidden, "layers": args.layers, "heads": args.heads, "vocab": args.vocab,
                  "intermediate": config.intermediate_size, "params": n_params, "matmul_params": n_matmul,
                  "params_mib": round(param_mib, 1)},
        "rollouts": rows, "seq_len": args.seq_len, "micro_batch_size": args.micro_batch_size,
        "update_s": [round(t, 3) for t in times],
        "step_flops": flops,
        "achieved_flops_per_s": flops / statistics.median(times),
        "peak_flops_per_s": peak,
        "peak_before_after": [peak_before, peak_after],
        "flops_over_peak": spread([flops / t / peak for t in times]),
        "rss_before_update_mib": round(rss_before, 1),
        "peak_rss_mib": round(peak_rss_mib(), 1),
    }


def memory_variant(args, world: TaughtWorld, tmp: Path, variant: str) -> dict[str, Any]:
    """Peak RSS and updates/s of the update in this process, `variant` "before" or "after"."""
    config = tiny_config(args.mem_vocab, hidden_size=args.mem_hidden, num_layers=args.mem_layers, num_heads=4,
                         num_kv_heads=2, intermediate_size=args.mem_hidden * 3,
                         max_position_embeddings=max(2048, args.mem_seq_len))
    config._attn_implementation = "sdpa"
    trainer = update_trainer(world, config, tmp / variant, args.mem_micro_batch_size, "no",
                             full_sequence=variant == "before")
    try:
        records, advantages = synthetic_rollouts(trainer, args.mem_rollouts, args.mem_seq_len, args.mem_prompt_len,
                                                 args.mem_vocab)
        rss_before = rss_mib()
        peak_setup = peak_rss_mib()
        times = time_update(trainer, records, advantages, args.repeats)
        chunk = trainer.config.training.logprob_chunk_tokens
    finally:
        trainer.cleanup()
    peak = peak_rss_mib()
    return {"variant": variant, "rss_before_update_mib": round(rss_before, 1), "peak_rss_mib": round(peak, 1),
            "update_extra_mib": round(peak - rss_before, 1), "peak_before_updates_mib": round(peak_setup, 1),
            "update_s": [round(t, 3) for t in times], "updates_per_s": 1 / statistics.median(times),
            "logprob_chunk_tokens": chunk}


def memory(args) -> dict[str, Any]:
    """Both variants of (2), each in a fresh process, "after" first."""
    out: dict[str, Any] = {"model": {"vocab": args.mem_vocab, "hidden": args.mem_hidden, "layers": args.mem_layers},
                           "rollouts": args.mem_rollouts, "seq_len": args.mem_seq_len,
                           "prompt_len": args.mem_prompt_len, "micro_batch_size": args.mem_micro_batch_size}
    for variant in ("after", "before"):
        with tempfile.NamedTemporaryFile(suffix=".json") as handle:
            command = [sys.executable, "-m", "benchmarks.bench_training", "--memory-variant", variant,
                       "--json", handle.name, *passed_through(args)]
            subprocess.run(command, check=True, cwd=Path(__file__).resolve().parent.parent)
            out[variant] = json.loads(Path(handle.name).read_text())
    full_logits = args.mem_micro_batch_size * args.mem_seq_len * args.mem_vocab * 4 / 2**20
    out["full_logits_copy_mib"] = full_logits  # one float32 [micro-batch, length, vocabulary] tensor
    out["peak_ratio_before_over_after"] = out["before"]["peak_rss_mib"] / out["after"]["peak_rss_mib"]
    out["extra_ratio_before_over_after"] = out["before"]["update_extra_mib"] / max(out["after"]["update_extra_mib"], 1)
    out["speed_ratio_after_over_before"] = out["after"]["updates_per_s"] / out["before"]["updates_per_s"]
    return out


def passed_through(args) -> list[str]:
    """The command-line options a memory subprocess needs."""
    keys = ("mem_vocab", "mem_hidden", "mem_layers", "mem_seq_len", "mem_prompt_len", "mem_rollouts",
            "mem_micro_batch_size", "repeats", "threads")
    return [item for key in keys for item in (f"--{key.replace('_', '-')}", str(getattr(args, key)))]


def scaling(args, world: TaughtWorld, tmp: Path) -> dict[str, Any]:
    """Whole-step seconds per (group size, items per step), in interleaved rounds."""
    torch.set_num_threads(args.scaling_threads)
    points = [(4, 2), (8, 2), (16, 2), (4, 1), (4, 4)]
    trainers: dict[tuple[int, int], GRPOTrainer] = {}
    seconds: dict[tuple[int, int], list[list[float]]] = {p: [] for p in points}
    calls: dict[tuple[int, int], list[float]] = {p: [] for p in points}
    steps_done = dict.fromkeys(points, 0)
    with local_tool_endpoints(world.corpus, max_output_chars=OUTPUT_CHARS) as endpoints:
        try:
            for group, items in points:
                config = training_config(world, endpoints, batch_size=items, compute_multiplier=group / 8)
                trainer = GRPOTrainer(config, model_path=str(world.model), output_dir=tmp / f"scaling_{group}_{items}")
                trainer.setup()
                trainers[(group, items)] = trainer
                steps_done[(group, items)] += 1
                trainer._learn(trainer._sample(1, 0))  # warm-up
            for round_ in range(args.scaling_rounds):
                for point in points:
                    step_s = []
                    for _ in range(args.scaling_steps):
                        steps_done[point] += 1
                        m = trainers[point]._learn(trainers[point]._sample(steps_done[point], steps_done[point] - 1))
                        step_s.append(m["timing/sampling_s"] + m["timing/training_s"])
                        calls[point].append(m["train/tool_calls_mean"])
                    seconds[point].append(step_s)
                print(f"  round {round_ + 1}: " + ", ".join(
                    f"{g}x{i} {statistics.mean(seconds[(g, i)][-1]):.2f} s" for g, i in points), flush=True)
        finally:
            for trainer in trainers.values():
                trainer.cleanup()
    per_round = {p: [statistics.mean(s) for s in seconds[p]] for p in points}
    pairs = {"group_4_to_8": ((8, 2), (4, 2)), "group_8_to_16": ((16, 2), (8, 2)),
             "items_1_to_2": ((4, 2), (4, 1)), "items_2_to_4": ((4, 4), (4, 2))}
    doublings = {name: spread([a / b for a, b in zip(per_round[hi], per_round[lo], strict=True)])
                 for name, (hi, lo) in pairs.items()}
    results = [{"group_size": g, "items": i, "rollouts": g * i, "step_s": statistics.median(per_round[(g, i)]),
                "step_s_rounds": per_round[(g, i)], "tool_calls_mean": statistics.mean(calls[(g, i)])}
               for g, i in points]
    return {"threads": args.scaling_threads, "steps_each": args.scaling_steps, "rounds": args.scaling_rounds,
            "points": results, "time_ratio_per_doubling": doublings}


def gpu_mfu(args, world: TaughtWorld, tmp: Path) -> dict[str, Any]:
    """MFU of the update of a Qwen3-0.6B-shaped model in bf16 autocast on the GPU, and the
    update's peak allocated memory before and after (2)."""
    device = torch.device("cuda")
    peak = matmul_peak(device, torch.bfloat16, 8192, 10)
    config = Qwen3Config(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                         num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True,
                         max_position_embeddings=4096, pad_token_id=0, eos_token_id=2)
    config._attn_implementation = "sdpa"
    out: dict[str, Any] = {"device": torch.cuda.get_device_name(), "rollouts": args.gpu_rollouts,
                           "seq_len": args.gpu_seq_len, "micro_batch_size": args.gpu_micro_batch_size}
    for variant in ("after", "before"):
        trainer = update_trainer(world, config, tmp / f"gpu_{variant}", args.gpu_micro_batch_size, "bf16",
                                 full_sequence=variant == "before")
        try:
            records, advantages = synthetic_rollouts(trainer, args.gpu_rollouts, args.gpu_seq_len,
                                                     args.gpu_seq_len // 2, config.vocab_size)
            torch.cuda.reset_peak_memory_stats()
            allocated = torch.cuda.memory_allocated() / 2**30
            times = time_update(trainer, records, advantages, args.repeats)
            model = trainer.accelerator.unwrap_model(trainer.model)
            n_matmul = matmul_params(model)
            n_params = sum(p.numel() for p in model.parameters())
            memory = torch.cuda.max_memory_allocated() / 2**30
        finally:
            trainer.cleanup()
            torch.cuda.empty_cache()
        flops = step_flops(config, n_matmul, args.gpu_rollouts, args.gpu_seq_len)
        out[variant] = {"update_s": times, "updates_per_s": 1 / statistics.median(times),
                        "allocated_before_update_gib": round(allocated, 2), "peak_memory_gib": round(memory, 2),
                        "mfu": spread([flops / t / peak for t in times])}
        out.update(params=n_params, matmul_params=n_matmul, peak_bf16_flops_per_s=peak)
    out["mfu"] = out["after"]["mfu"]
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--seq-len", type=int, default=512, help="tokens per rollout")
    parser.add_argument("--rollouts", type=int, default=16, help="rollouts per update")
    parser.add_argument("--micro-batch-size", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3, help="timed updates after a warm-up (at least 3)")
    parser.add_argument("--peak-n", type=int, default=2048)
    parser.add_argument("--peak-repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="torch threads of (1) and (2)")
    parser.add_argument("--mem-vocab", type=int, default=32768, help="(2): vocabulary of the model")
    parser.add_argument("--mem-hidden", type=int, default=256, help="(2): hidden size of the model")
    parser.add_argument("--mem-layers", type=int, default=2, help="(2): layers of the model")
    parser.add_argument("--mem-seq-len", type=int, default=1536, help="(2): tokens per rollout")
    parser.add_argument("--mem-prompt-len", type=int, default=256, help="(2): prompt tokens per rollout")
    parser.add_argument("--mem-rollouts", type=int, default=2, help="(2): rollouts per update")
    parser.add_argument("--mem-micro-batch-size", type=int, default=2, help="(2): rollouts per forward/backward")
    parser.add_argument("--memory-variant", choices=["before", "after"], help=argparse.SUPPRESS)
    parser.add_argument("--scaling-steps", type=int, default=2, help="steps per scaling point in each round")
    parser.add_argument("--scaling-rounds", type=int, default=3, help="interleaved rounds of the scaling points")
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
    if args.memory_variant:  # one side of (2), in its own process
        with tempfile.TemporaryDirectory(prefix="bench_training_memory_") as tmp_dir:
            result = memory_variant(args, world, Path(tmp_dir), args.memory_variant)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
        return result

    results: dict[str, Any] = {"loadavg_start": os.getloadavg()[0]}
    with tempfile.TemporaryDirectory(prefix="bench_training_") as tmp_dir:
        tmp = Path(tmp_dir)
        print("(1) FLOP rate of the GRPO update", flush=True)
        results["flops"] = flop_rate(args, world, tmp)
        print("(2) memory of the update, after and before the completion-span chunked log-probabilities", flush=True)
        results["memory"] = memory(args)
        if torch.cuda.is_available():
            print("(4) GPU MFU and memory of a ~0.6B Qwen3 in bf16", flush=True)
            results["gpu"] = gpu_mfu(args, world, tmp)
        else:
            results["gpu"] = None
        if not args.skip_scaling:
            print("(3) scaling of the whole step", flush=True)
            results["scaling"] = scaling(args, world, tmp)
    results["loadavg_end"] = os.getloadavg()[0]

    f = results["flops"]
    m = f["model"]
    r = f["flops_over_peak"]
    print(f"\nmodel: Qwen3 hidden {m['hidden']}, {m['layers']} layers, vocab {m['vocab']}: {m['params'] / 1e6:.1f}M "
          f"parameters ({m['params_mib']} MiB); update of {f['rollouts']} rollouts x {f['seq_len']} tokens, "
          f"micro-batches of {f['micro_batch_size']}, {f['threads']} threads")
    print(f"update seconds {f['update_s']}; {f['achieved_flops_per_s'] / 1e9:.1f} GFLOP/s achieved (median), matmul "
          f"peak {f['peak_flops_per_s'] / 1e9:.1f} GFLOP/s: {r['median']:.2f} of peak (min {r['min']:.2f}, max "
          f"{r['max']:.2f}; goal >= 0.30)")
    mem = results["memory"]
    print(f"memory of the update ({mem['rollouts']} rollouts x {mem['seq_len']} tokens, {mem['prompt_len']} of "
          f"them prompt, vocab {mem['model']['vocab']}, micro-batches of {mem['micro_batch_size']}; one float32 "
          f"full-sequence logits tensor {mem['full_logits_copy_mib']:.0f} MiB):")
    for variant in ("before", "after"):
        v = mem[variant]
        print(f"  {variant:<6} peak RSS {v['peak_rss_mib']:.0f} MiB ({v['update_extra_mib']:.0f} MiB above the "
              f"{v['rss_before_update_mib']:.0f} MiB before the update), {v['updates_per_s']:.3f} updates/s")
    if results["gpu"]:
        g = results["gpu"]
        for variant in ("before", "after"):
            v = g[variant]
            print(f"GPU {g['device']} {variant}: MFU {v['mfu']['median']:.2f} (goal >= 0.40), peak allocated "
                  f"{v['peak_memory_gib']} GiB, {v['updates_per_s']:.2f} updates/s")
    else:
        print("GPU MFU: no GPU")
    if "scaling" in results:
        s = results["scaling"]
        print("scaling (median over rounds of the whole step, seconds):")
        for p in s["points"]:
            print(f"  group {p['group_size']:>2} x {p['items']} items = {p['rollouts']:>2} rollouts: {p['step_s']:.2f}")
        print("  time ratio per doubling: " + ", ".join(
            f"{k} {v['median']:.2f} [{v['min']:.2f}, {v['max']:.2f}]" for k, v in s["time_ratio_per_doubling"].items())
            + " (linear: 2.00)")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return results


if __name__ == "__main__":
    main()
