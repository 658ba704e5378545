"""Benchmark the generation engine on simulated multi-turn agent rollouts.

Each sequence: a prompt, then turns of `--gen-tokens` generated tokens, each followed by
`--tool-tokens` "tool output" tokens that arrive `--tool-latency-ms` later. The engine runs all
`--sequences` concurrently (continuous batching, KV kept across turns); the reference
(`sequential_generate`) runs them one at a time and re-encodes the whole context every turn.
Prints tokens/s of both, the time of 8 turns over 4 turns (about 2 when a turn costs the same
whatever came before), and peak memory.

Both are warmed up once. The engine's 8-turn/4-turn ratio is measured `--repeats` times
(4 turns, then 8, in each repeat) and reported as the median with its min and max. The
tokens/s comparison runs the engine on the reference's `--ref-sequences` sequences (the
same tokens), so both sides do the same work.

    .venv/bin/python benchmarks/bench_engine.py [--sequences 64] [--tool-latency-ms 0] [--json out.json]
"""

from __future__ import annotations

import argparse
import heapq
import json
import resource
import statistics
import time
from pathlib import Path

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from trainer.generation.backend import SamplingParams
from trainer.generation.engine import TransformersBackend
from trainer.generation.sampling import sequence_generator, sequential_generate


def demo_model(vocab_size: int) -> Qwen3ForCausalLM:
    """A random-init model of the demo's size (the figures are about the engine, not the model)."""
    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=4096,
    )
    return Qwen3ForCausalLM(config).eval()


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def tokens_for(seq: int, turn: int, n: int, vocab_size: int) -> list[int]:
    generator = torch.Generator().manual_seed(seq * 1000 + turn)
    return torch.randint(0, vocab_size, (n,), generator=generator).tolist()


def run_engine(model, args, n_seqs: int, n_turns: int) -> tuple[float, int, int]:
    """All sequences at once; returns (seconds, generated tokens, KV cache bytes at the end)."""
    backend = TransformersBackend(model, stop_token_ids=[], max_slots=n_seqs, max_len=4096)
    params = SamplingParams(temperature=1.0, max_new_tokens=args.gen_tokens)
    turns_done = dict.fromkeys(range(n_seqs), 0)
    tool_results: list[tuple[float, int]] = []  # (due time, seq): a heap
    generated = 0
    start = time.perf_counter()
    for seq in range(n_seqs):
        backend.submit(str(seq), tokens_for(seq, 0, args.prompt_len, args.vocab_size), params)
    while backend.has_work() or tool_results:
        now = time.perf_counter()
        while tool_results and tool_results[0][0] <= now:
            _, seq = heapq.heappop(tool_results)
            tool = tokens_for(seq, turns_done[seq], args.tool_tokens, args.vocab_size)
            backend.submit(str(seq), tool, params)
        if not backend.has_work():
            time.sleep(max(0.0, tool_results[0][0] - time.perf_counter()))
            continue
        for turn in backend.step():
            seq = int(turn.seq_id)
            generated += len(turn.token_ids)
            turns_done[seq] += 1
            if turns_done[seq] < n_turns:
                heapq.heappush(
                    tool_results, (time.perf_counter() + args.tool_latency_ms / 1000, seq)
                )
    seconds = time.perf_counter() - start
    return seconds, generated, backend.kv_cache_bytes()


def run_reference(model, args, n_seqs: int, n_turns: int) -> tuple[float, int]:
    """One sequence at a time, the whole context re-encoded every turn; tool latency not added."""
    params = SamplingParams(temperature=1.0, max_new_tokens=args.gen_tokens)
    generated = 0
    start = time.perf_counter()
    for seq in range(n_seqs):
        generator = sequence_generator(0, str(seq))
        context = tokens_for(seq, 0, args.prompt_len, args.vocab_size)
        for turn in range(n_turns):
            out = sequential_generate(model, context, params, [], generator)
            generated += len(out.token_ids)
            context += out.token_ids + tokens_for(seq, turn + 1, args.tool_tokens, args.vocab_size)
    return time.perf_counter() - start, generated


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--sequences", type=int, default=64, help="concurrent sequences in the engine"
    )
    parser.add_argument(
        "--ref-sequences", type=int, default=8, help="sequences run by the slow reference"
    )
    parser.add_argument("--prompt-len", type=int, default=200)
    parser.add_argument("--gen-tokens", type=int, default=30, help="tokens generated per turn")
    parser.add_argument(
        "--tool-tokens", type=int, default=40, help="tool-output tokens appended per turn"
    )
    parser.add_argument("--tool-latency-ms", type=float, default=0.0)
    parser.add_argument("--vocab-size", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=3, help="timed pairs of engine runs (median, min, max)")
    parser.add_argument(
        "--threads", type=int, default=1, help="torch CPU threads (1: steady on a shared machine)"
    )
    parser.add_argument("--json", type=Path, default=None, help="write the figures here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    model = demo_model(args.vocab_size)
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    rss_before = rss_mib()
    run_engine(model, args, 4, 1)  # warm-ups: first-call allocations and lazy imports
    run_reference(model, args, 1, 1)

    repeats = [{n: run_engine(model, args, args.sequences, n) for n in (4, 8)} for _ in range(args.repeats)]
    ratios = [r[8][0] / r[4][0] for r in repeats]
    engine = sorted(repeats, key=lambda r: r[8][0] / r[4][0])[len(repeats) // 2]  # the median repeat
    engine_peak = peak_rss_mib()
    reference = {n: run_reference(model, args, args.ref_sequences, n) for n in (4, 8)}
    engine_same = run_engine(model, args, args.ref_sequences, 8)  # the reference's sequences

    def rate(run: tuple) -> float:
        return run[1] / run[0]

    print(f"model: Qwen3 hidden 128, 4 layers, vocab {args.vocab_size}, random init, cpu")
    print(
        f"turn: {args.gen_tokens} generated + {args.tool_tokens} tool tokens after a "
        f"{args.prompt_len}-token prompt; tool latency {args.tool_latency_ms:g} ms; "
        f"torch threads {args.threads}"
    )
    print(f"{'backend':<10} {'seqs':>5} {'turns':>5} {'seconds':>8} {'tokens':>7} {'tokens/s':>9}")
    for name, n_seqs, runs in (
        ("engine", args.sequences, engine),
        ("reference", args.ref_sequences, reference),
    ):
        for n_turns, run in runs.items():
            print(
                f"{name:<10} {n_seqs:>5} {n_turns:>5} {run[0]:>8.2f} {run[1]:>7} {rate(run):>9.0f}"
            )
    print(f"engine / reference tokens/s (8 turns, the same {args.ref_sequences} sequences): "
          f"{rate(engine_same) / rate(reference[8]):.1f}x")
    print(
        f"time of 8 turns / 4 turns: engine median {statistics.median(ratios):.2f} (min {min(ratios):.2f}, "
        f"max {max(ratios):.2f}, {args.repeats} runs), reference {reference[8][0] / reference[4][0]:.2f}"
    )
    print(
        f"memory: RSS {rss_before:.0f} MiB after building the model, peak {engine_peak:.0f} MiB "
        f"with {args.sequences} concurrent sequences; KV cache {engine[8][2] / 2**20:.1f} MiB "
        f"at 8 turns; parameters {param_bytes / 2**20:.1f} MiB"
    )
    if args.json:
        runs = {f"{name}_{n}_turns": {"seconds": run[0], "tokens": run[1], "tokens_per_s": rate(run)}
                for name, group in (("engine", engine), ("reference", reference)) for n, run in group.items()}
        figures = {
            "engine_8_over_4_turns_time": {"median": statistics.median(ratios), "min": min(ratios),
                                           "max": max(ratios), "runs": ratios},
            "reference_8_over_4_turns_time": reference[8][0] / reference[4][0],
            "engine_over_reference_tokens_per_s": rate(engine_same) / rate(reference[8]),
            "peak_rss_mib": engine_peak, "kv_cache_mib_8_turns": engine[8][2] / 2**20,
            "params_mib": param_bytes / 2**20, "sequences": args.sequences, "threads": args.threads,
        }
        args.json.write_text(json.dumps({"runs": runs, "figures": figures}, indent=2) + "\n")


if __name__ == "__main__":
    main()
