"""`make bench`: every benchmark of benchmarks/, side by side in one run, as one table of
figures with their goals, and the same rows as JSON in benchmarks/results.json, which only
this script writes.

Each benchmark runs as its own process (`python -m benchmarks.<name> ... --json`), so
one's peak memory is not another's and a failure costs only its own rows. The rollout,
TRL, training, pipeline and vLLM figures use the taught tiny model of
benchmarks/taught_world.py (built once and cached), not the demo model, whose bootstrap
takes longer than the whole budget.

Noise. On a shared 2-core machine one run cannot carry a verdict, so every noisy figure
is the median of at least 3 runs with their min and max: the benchmarks repeat their
timed parts internally (interleaved, so drift hits both sides of a ratio alike), and
run_all runs the pipeline benchmark 3 times. A verdict is "met" only when the whole range
meets the goal, "not met" when none of it does, and "straddles" otherwise. Figures that
are one measurement (memory, the vLLM rows) say so.

Budget on 2 cores, in seconds (the timeout of each process; typical runs take less):
tool_server 600 (with a 30 s soak through the tool client; 1800 on a machine's first run,
which writes and embeds the 100,000-page corpus and caches it), engine 240, rollout 300,
trl 1200 (a learning-rate grid for each trainer on the validation items, then the test
comparison), training 540, pipeline 3 x 200 (a failed run is not repeated), vllm 840 (only
where .venv-vllm exists; 3 steps, 16 rollouts per item), memory 600 (one update at
Qwen's vocabulary before and after, about 2 minutes and 14 GiB at the peak of "before"),
staleness 480 (both arms, 5 seeds, 12 steps, about 3 minutes), staleness_ppo2 and
staleness_thread 420 each (3 seeds, about 2 minutes each), staleness_vllm 720 (3 seeds on
one vLLM server, about 4 minutes), api_load 2400 (`agentrft api` under load, about 15
minutes), real_model 1800 (SmolLM2-135M on the engine and on vLLM, its update with LoRA and
in full, about 10 minutes), prefix_update 1200 (the update shared and plain, SmolLM2-135M and
the demo model, about 9 minutes), prefix 1500 (the prefix cache on and off in sampling,
SmolLM2 and the demo model, 3 repeats each, about 15 minutes): 222 minutes at worst, 88 to
98 typically.

    python benchmarks/run_all.py [--json benchmarks/results.json] [--only trl training] [--logs DIR]

With `--only`, the other benchmarks' rows of the existing file are kept and the partial run
is recorded beside them (`partial_runs`: date, commit, machine, benchmarks).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

REPO = Path(__file__).resolve().parent.parent
VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
SEARCH_QUERIES = 100  # queries of each search-latency measurement

# name -> (module, arguments, timeout in seconds per run, runs)
BENCHMARKS: dict[str, tuple[str, list[str], int, int]] = {
    "tool_server": ("bench_tool_server", ["--duration", "20", "--max-rate-step-s", "5", "--queries", str(SEARCH_QUERIES),
                                          "--soak-seconds", "30",
                                          "--big-corpus-dir", str(REPO / ".cache" / "bench" / "big_corpus")], 600, 1),
    "engine": ("bench_engine", ["--ref-sequences", "4", "--repeats", "3"], 240, 1),
    "rollout": ("bench_rollout", ["--world", "taught", "--k", "32", "--repeats", "3"], 300, 1),
    "trl": ("bench_trl", ["--steps", "5", "--seeds", "8", "--latency-seeds", "3", "--eval-k", "64"], 1200, 1),
    "training": ("bench_training", ["--rollouts", "8", "--repeats", "3", "--scaling-rounds", "3"], 540, 1),
    "pipeline": ("bench_pipeline", [], 200, 3),
    "vllm": ("bench_vllm", ["--k", "16", "--steps", "3"], 840, 1),
    "memory": ("bench_memory", [], 600, 1),
    # max_staleness 1 / 0: the update's share of a step is what the overlap can hide
    # (ppo_epochs 4: about 0.7 of the sampling, 2: about 0.35); the frozen copy samples in a
    # child process, or in a thread of the trainer (its GIL shared with the update).
    "staleness": ("bench_staleness", ["--steps", "12", "--seeds", "5", "--ppo-epochs", "4"], 480, 1),
    "staleness_ppo2": ("bench_staleness", ["--steps", "12", "--seeds", "3", "--ppo-epochs", "2"], 420, 1),
    "staleness_thread": ("bench_staleness", ["--steps", "12", "--seeds", "3", "--ppo-epochs", "4",
                                             "--sampler", "thread"], 420, 1),
    "staleness_vllm": ("bench_staleness", ["--backend", "vllm", "--steps", "12", "--seeds", "3", "--ppo-epochs", "4"],
                       720, 1),
    # 10, 100 and 1,000 training items x 3 training seeds, and a 1,000-item epoch: about 3
    # hours here (finished arms are committed in benchmarks/data_scaling and kept while the
    # code that makes them is unchanged).
    "data_scaling": ("bench_data_scaling", [], 6 * 3600, 1),
    # `agentrft api` under load: a 300 MB upload, 20 jobs at once, 100 polls while one trains,
    # 50 chat completions at once, a kill -9 mid-job (about 15 minutes here).
    "api_load": ("bench_api_load", [], 2400, 1),
    # a full weight sync to a vLLM server, from the trainer's folder and over HTTP
    "weight_sync": ("bench_weight_sync", ["--repeats", "3"], 900, 1),
    # the same at the real model's size (SmolLM2-135M-Instruct, envs/units), full weights and a
    # rank-16 LoRA adapter
    "weight_sync_real": ("bench_weight_sync", ["--repeats", "3", "--model", "smollm2", "--lora", "16"], 1800, 1),
    # the real-model recipe at its size: rollouts/s on the engine and on vLLM, the update with
    # LoRA and in full (seconds, peak memory, FLOP rate over the matmul peak)
    "real_model": ("bench_real_model", [], 1800, 1),
    # the update with each group's prompt forwarded once against every rollout forwarded whole:
    # SmolLM2-135M at the units recipe's shape and the demo model, 2 rounds of fresh processes
    # (about 9 minutes here)
    "prefix_update": ("bench_prefix_update", ["--rounds", "2", "--repeats", "2"], 1200, 1),
    # the prefix cache on and off, alternating in fresh processes: SmolLM2 at the units recipe's
    # shape and the demo model on FinQA, 2 items x 8 each, 3 repeats
    "prefix": ("bench_prefix", ["--items", "2", "--repeats", "3"], 1500, 1),
}
# Run only when named in --only (`make bench-data`); a full run keeps their rows from the
# existing file, with the partial run that made them.
OPT_IN = ("data_scaling",)


BIG_CORPUS = REPO / ".cache" / "bench" / "big_corpus"
FIRST_TOOL_SERVER_RUN_S = 1800  # no cached 100,000-page corpus: it is written and embedded first


def run_benchmark(name: str, out_dir: Path, console: Console) -> list[dict[str, Any]] | str:
    """The JSON of each of the benchmark's runs, or why there is none (its output is kept
    in `out_dir`)."""
    module, arguments, timeout, runs = BENCHMARKS[name]
    if name == "tool_server" and not (BIG_CORPUS / ".complete").is_file():
        console.print(f"  tool_server: first run, the 100,000-page corpus is built (budget {FIRST_TOOL_SERVER_RUN_S} s)")
        timeout = FIRST_TOOL_SERVER_RUN_S
    results = []
    for index in range(runs):
        suffix = f"_{index + 1}" if runs > 1 else ""
        out, log = out_dir / f"{name}{suffix}.json", out_dir / f"{name}{suffix}.log"
        command = [sys.executable, "-m", f"benchmarks.{module}", *arguments, "--json", str(out)]
        env = os.environ | {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
                            "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PYTHONPATH": str(REPO)}
        started = time.perf_counter()
        with log.open("w") as handle:
            # A session of its own: past its budget the benchmark is stopped with everything it
            # started (a Prefect server, a training subprocess, a vLLM server).
            process = subprocess.Popen(command, cwd=REPO, env=env, stdout=handle, stderr=subprocess.STDOUT,
                                       start_new_session=True)
            try:
                code = process.wait(timeout=timeout)
                failure = None if code == 0 else f"exit code {code}"
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGTERM)
                try:
                    process.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    os.killpg(process.pid, signal.SIGKILL)
                    process.wait()
                failure = f"over its {timeout} s budget"
        seconds = time.perf_counter() - started
        if failure is None and out.is_file():
            console.print(f"  {name}{suffix}: {seconds:.0f} s")
            results.append(json.loads(out.read_text()) | {"_seconds": seconds})
            continue
        tail = [line for line in log.read_text(errors="replace").splitlines() if line.strip()][-1:] or [""]
        console.print(f"  {name}{suffix}: [red]failed[/red] after {seconds:.0f} s ({failure}); log {log}: "
                      f"{tail[0][:200]}")
        return f"{name} benchmark failed ({failure}): {tail[0][:160]}"
    return results


def verdict(low: float, high: float, goal: float, *, at_most: bool = False) -> str:
    """"met" when the whole range [low, high] meets the goal, "not met" when none of it
    does, "straddles" otherwise."""
    if at_most:
        return "met" if high <= goal else "not met" if low > goal else "straddles"
    return "met" if low >= goal else "not met" if high < goal else "straddles"


def row(figure: str, value: Any, goal: str, result: str | None, note: str = "", *,
        low: float | None = None, high: float | None = None, runs: int = 1) -> dict[str, Any]:
    return {"figure": figure, "value": value, "min": low, "max": high, "runs": runs, "goal": goal,
            "verdict": result, "note": note}


def ranged(figure: str, spread: dict[str, Any], goal: float, note: str, *, at_most: bool = False,
           digits: int = 2) -> dict[str, Any]:
    """A noisy figure: its median, min and max over runs, and the verdict of the range."""
    low, high = round(spread["min"], digits), round(spread["max"], digits)
    return row(figure, round(spread["median"], digits), f"{'<=' if at_most else '>='} {goal:g}",
               verdict(spread["min"], spread["max"], goal, at_most=at_most), note, low=low, high=high,
               runs=len(spread["runs"]))


def spread_of(values: list[float]) -> dict[str, Any]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "runs": values}


def rollout_rows(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    f = results[0]["figures"]
    model = f"{f['world']} model, {f['items']} items x {f['k']} rollouts on both loops"
    calls = (f"tool calls a rollout: engine {f['tool_calls_mean']:.2f}, sequential loop "
             f"{f['sequential_tool_calls_mean']:.2f}")
    return [
        ranged(f"rollout throughput, 100 ms tool latency / 0 ms, at {f['tool_calls_mean']:.2f} tool calls a rollout",
               f["latency_100ms_over_0ms"], 0.90,
               f"{model}; with so few calls a rollout waits little on its tools: this row says nothing about "
               f"tool-heavy rollouts"),
        ranged("rollouts/s, engine / plain sequential agent loop (one rollout at a time, generate per turn)",
               f["engine_vs_sequential_rollouts_per_s"], 5.0,
               f"aim, not a gate; tokens/s {f['engine_vs_sequential_tokens_per_s']['median']:.2f}x; {model}; {calls}"),
        row(f"peak RSS, {f['concurrent_rollouts']} concurrent rollouts (MiB)", round(f["peak_rss_mb_64_concurrent"]),
            "report", None, f"one run; model parameters {f['model_params_mb']:.1f} MiB; process peak incl. tool server"),
    ]


def trl_rows(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    r = results[0]
    rows = []
    for latency, goal in (("0ms", 1.5), ("100ms", 3.0)):
        run = r["runs"].get(latency)
        if run is None:
            continue
        per_seed = ", ".join(f"{x:.2f}" for x in run["speedups"])
        rows.append(ranged(f"RFT steps/s, ours / TRL GRPOTrainer, {latency} tools", spread_of(run["speedups"]),
                           goal, f"per seed {per_seed}; ours {statistics.median(run['ours_steps_per_s']):.2f}, "
                           f"TRL {statistics.median(run['trl_steps_per_s']):.2f} steps/s (medians); "
                           f"{r['steps']} steps of 2 items x 4"))
    g = r["grid"]
    rates = g["chosen"]
    for speed in rows:  # the steps-per-second rows so far
        speed["note"] += f"; learning rates ours {rates['ours']:g}, TRL {rates['trl']:g}"
    rows.append(row("learning rate of each trainer, its best of the grid on validation items",
                    f"ours {rates['ours']:g}, TRL {rates['trl']:g}", "chosen on validation items only", None,
                    "; ".join(f"{side} ({g['rules'][side]}): " + ", ".join(f"{rate} {mean:.3f}"
                                                                          for rate, mean in g["means"][side].items())
                              for side in ("ours", "trl"))
                    + f" (mean of {len(g['seeds'])} seeds x {g['eval_k']} samples x {g['items']} validation items)"))
    whose = {rule: side for side, rule in g["rules"].items()}
    for rule, e in r["eval"].items():
        n = len(e["seeds"])
        needed = -(-3 * n // 4)  # 6 of 8
        met = e["ours_mean"] >= e["trl_mean"] and e["seeds_ours_not_lower"] >= needed
        rows.append(row(f"eval score after {r['steps']} steps, ours vs TRL (mean of {n} seeds), malformed call "
                        f"`{rule}` ({'our trainer' if whose.get(rule) == 'ours' else 'TRL'}'s rule)",
                        f"{e['ours_mean']:.3f} vs {e['trl_mean']:.3f}",
                        f"ours >= TRL on average and on >= {needed} of {n} seeds",
                        "met" if met else "not met",
                        f"ours not lower on {e['seeds_ours_not_lower']} of {n}; per-seed differences "
                        f"{', '.join(f'{d:+.2f}' for d in e['differences'])} (mean {e['mean_difference']:+.3f}, "
                        f"Wilcoxon signed-rank p = {e['wilcoxon_p']:.2f}); per seed ours "
                        f"{', '.join(f'{x:.2f}' for x in e['ours'])}; TRL {', '.join(f'{x:.2f}' for x in e['trl'])}; "
                        f"start {r['eval_start'][rule]['score']:.3f}; {r['eval_k']} samples x {r['eval_items']} "
                        f"{r['eval_split']} items, read once by this run"))
    return rows


def training_rows(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    r = results[0]
    f, m = r["flops"], r["flops"]["model"]
    size = f"{m['params'] / 1e6:.1f}M params, {m['params_mib']} MiB"
    rows = [
        ranged("training-step FLOP rate / measured matmul peak (CPU)", f["flops_over_peak"], 0.30,
               f"{f['achieved_flops_per_s'] / 1e9:.1f} / {f['peak_flops_per_s'] / 1e9:.1f} GFLOP/s, {f['threads']} "
               f"threads; Qwen3 hidden {m['hidden']} x {m['layers']} layers ({size}), {f['rollouts']} x "
               f"{f['seq_len']} tokens; 6*N*T + causal attention"),
    ]
    mem = r["memory"]
    before, after = mem["before"], mem["after"]
    shape = (f"{mem['rollouts']} rollouts x {mem['seq_len']} tokens ({mem['prompt_len']} prompt), vocab "
             f"{mem['model']['vocab']}, micro-batches of {mem['micro_batch_size']}, chunks of "
             f"{after['logprob_chunk_tokens']}")
    rows.append(row("peak RSS of the update (MiB), full-sequence float32 logits -> completion span, chunked",
                    f"{before['peak_rss_mib']:.0f} -> {after['peak_rss_mib']:.0f}", "lower after",
                    "met" if after["peak_rss_mib"] < before["peak_rss_mib"] else "not met",
                    f"one run each, fresh processes; above the pre-update RSS {before['update_extra_mib']:.0f} -> "
                    f"{after['update_extra_mib']:.0f} MiB; one full float32 logits tensor "
                    f"{mem['full_logits_copy_mib']:.0f} MiB; {shape}"))
    rows.append(row("updates/s, full-sequence logits -> completion span, chunked",
                    f"{before['updates_per_s']:.3f} -> {after['updates_per_s']:.3f}", "report", None,
                    f"median of {len(after['update_s'])} updates each; {shape}"))
    g = r.get("gpu")
    if g:
        rows.append(ranged("GPU MFU, ~0.6B Qwen3 bf16 training step", g["mfu"], 0.40, g["device"]))
        rows.append(row("GPU peak allocated memory of the update (GiB), full-sequence -> completion span",
                        f"{g['before']['peak_memory_gib']} -> {g['after']['peak_memory_gib']}", "report", None,
                        f"{g['rollouts']} x {g['seq_len']} tokens, micro-batches of {g['micro_batch_size']}"))
    else:
        rows.append(row("GPU MFU, ~0.6B Qwen3 bf16 training step", "no GPU", ">= 0.40", None,
                        "torch.cuda is not available"))
    s = r.get("scaling")
    if s:
        ratios = s["time_ratio_per_doubling"]
        points = sorted(s["points"], key=lambda p: (p["group_size"], p["items"]))
        for label, keys, pick in (("the group (4, 8, 16)", ("group_4_to_8", "group_8_to_16"),
                                   lambda p: p["items"] == 2),
                                  ("items per step (1, 2, 4)", ("items_1_to_2", "items_2_to_4"),
                                   lambda p: p["group_size"] == 4)):
            curve = ", ".join(f"{p['step_s']:.2f}" for p in points if pick(p))
            for key in keys:
                rows.append(ranged(f"scaling: step time per doubling of {label}, {key.split('_', 1)[1].replace('_', ' ')}",
                                   ratios[key], 2.0, f"median step seconds {curve}; {s['rounds']} rounds",
                                   at_most=True))
    return rows


def engine_rows(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    f = results[0]["figures"]
    return [ranged("generation time, 8 tool turns / 4 tool turns", f["engine_8_over_4_turns_time"], 2.2,
                   f"{f['sequences']} sequences; re-encoding reference {f['reference_8_over_4_turns_time']:.2f} "
                   f"(one run)", at_most=True)]


def pipeline_rows(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    shares = [r["bookkeeping_share"] for r in results]
    walls = ", ".join(f"{r['wall_s']:.0f}" for r in results)
    bookkeeping = ", ".join(f"{r['bookkeeping_s']:.1f}" for r in results)
    outcomes = ", ".join(sorted({r["outcome"] for r in results}))
    return [ranged("pipeline bookkeeping / wall time (micro preset)", spread_of(shares), 0.05,
                   f"wall seconds {walls}; bookkeeping {bookkeeping} s; outcome {outcomes}", at_most=True, digits=3)]


def tool_server_rows(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    r = results[0]
    rows = []
    for key, goal in (("demo", 20.0), ("big", 50.0)):
        s = r["search"].get(key)
        if s:
            p95 = s["http"]["p95"]
            rows.append(row(f"search tool p95 over {s['pages']:,} pages (ms)", p95, f"<= {goal:g} ms",
                            "met" if p95 <= goal else "not met",
                            f"one run of {SEARCH_QUERIES} queries over HTTP; in-process index p95 "
                            f"{s['index']['p95']} ms"))
    soak = r.get("soak")
    if soak:
        rows.append(row("tool client soak: ReadError/RemoteProtocolError retries", soak["connection_drop_retries"],
                        "0", "met" if soak["connection_drop_retries"] == 0 else "not met",
                        f"{soak['sent']} calls at {soak['rate']:g}/s for {soak['seconds']} s through ToolClient; "
                        f"latency p50 {soak['p50']} ms, p99 {soak['p99']} ms; stale-connection resends "
                        f"{soak['stale_connection_resends']}; infra errors {soak['infra_errors']}"))
    return rows


def memory_rows(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    r = results[0]
    before, after = r["before"], r["after"]
    ratio = r["extra_ratio_before_over_after"]
    return [row(f"memory of one update at vocabulary {r['vocab']:,}, span logits -> fused over generated tokens (MiB)",
                f"{before['update_extra_mib']:.0f} -> {after['update_extra_mib']:.0f} ({ratio:.1f}x lower)",
                ">= 4x lower", "met" if ratio >= 4 else "not met",
                f"above the pre-update RSS, one update each in a fresh process; peak RSS {before['peak_rss_mib']:.0f} -> "
                f"{after['peak_rss_mib']:.0f} MiB; {r['micro_batch_size']} rollouts x ({r['prompt']} prompt + "
                f"{r['span']}-position span, {r['generated_per_row']} generated), {r['dtype']} on {r['device']}, chunks "
                f"of {after['logprob_chunk_tokens']}; update {before['update_s']} -> {after['update_s']} s; losses "
                f"differ by {r['loss_difference']:.1e}")]


def vllm_rows(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    v, t = results[0]["vllm"], results[0]["transformers"]
    note = "one run; taught model, float32 on CPU"
    return [
        row("rollouts/s, vLLM backend / transformers engine (CPU)", round(v["rollouts_per_s"] / t["rollouts_per_s"], 2),
            "report", None, f"{v['rollouts_per_s']:.1f} vs {t['rollouts_per_s']:.1f} rollouts/s (best of its "
            f"batches); {note}"),
        row("GRPO step seconds, vLLM backend / transformers engine", round(v["step_s"] / t["step_s"], 2), "report",
            None, f"{v['step_s']:.2f} vs {t['step_s']:.2f} s (medians); weight sync {v['sync_s']:.2f} s a step, "
            f"{v['sync_share']:.0%} of it; server start-up {v['server_startup_s'] or 0:.0f} s; {note}"),
        row("sampler-trainer logprob max difference on vLLM", f"{v['sampler_diff_max']:.1e}", "report", None, note),
    ]


def data_scaling_rows(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    # the epoch arm is one run: a figure without a verdict
    return [row(r["figure"], r["value"], r["goal"], None if r["runs"] == 1 else r["verdict"], r["note"],
                low=r.get("min"), high=r.get("max"), runs=r["runs"]) for r in results[0]["rows"]]


def api_load_rows(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    r = results[0]
    up, jobs, poll, chat, restart = r["upload"], r["jobs"], r["polling"], r["chat"], r["restart"]
    grown = up["rss_peak_mib"] - up["rss_before_mib"]
    refused = {code: n for code, n in chat["codes"].items() if code not in ("200", "429")}
    return [
        row(f"agentrft api: memory taken by a {up['file_mb']:.0f} MB upload (MiB)", round(grown), "<= 100 MiB",
            "met" if grown <= 100 else "not met", f"resident memory {up['rss_before_mib']:.0f} -> peak "
            f"{up['rss_peak_mib']:.0f} MiB, {up['seconds']:.1f} s; one run (before the upload was streamed: "
            "984 -> 2,777 MiB for 300 MB)"),
        row("agentrft api: 20 jobs created at once, recorded with a flow run", f"{jobs['with_flow_run']} of 20",
            "20 of 20", "met" if jobs["with_flow_run"] == jobs["recorded"] == 20 else "not met",
            f"accepted {jobs['accepted']}, records {jobs['recorded']}; statuses {jobs['statuses']} (one registered "
            f"model: they run in turn); create p50 {jobs['create_p50_s']:.2f} s, p95 {jobs['create_p95_s']:.2f} s"),
        row("agentrft api: p95 of 100 concurrent jobs.retrieve / list_events while a job trains (s)",
            round(poll["p95_s"], 2), "<= 1 s", "met" if poll["p95_s"] <= 1 else "not met",
            f"p50 {poll['p50_s']:.2f} s, max {poll['max_s']:.2f} s; one run"),
        row("serve-model: 50 concurrent chat completions, answers other than 200 or 429", sum(refused.values()),
            "0", "met" if not refused and chat["alive"] else "not met",
            f"codes {chat['codes']}; 8 slots, queue 16; served p95 {chat['served_p95_s'] or 0:.1f} s; resident "
            f"memory {chat['rss_before_mib']:.0f} -> peak {chat['rss_peak_mib']:.0f} MiB; one run"),
        row("agentrft api: a kill -9 mid-job, then a restart: the job's end", restart["final_status"], "succeeded",
            "met" if restart["final_status"] == "succeeded" else "not met",
            f"answering again {restart['answering_s']:.0f} s after the restart; status read back "
            f"{restart['status_read_back']}; error {restart['error']}"),
    ]


def weight_sync_rows(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    r = results[0]
    rows = [row(f"full weight sync to a vLLM server, over HTTP / from the trainer's folder "
                f"({r['parameters'] / 1e6:.1f}M parameters, {r['megabytes']:.0f} MB)", round(r["http_over_path"], 2),
                "report", None, f"medians of {len(r['seconds']['http'])}: {r['http_s']:.2f} vs {r['path_s']:.2f} s "
                f"(write, RPC, load, prefix-cache reset); one CPU server on loopback, {Path(r['model']).name}")]
    if "lora_rank" in r:
        rows.append(row(f"LoRA adapter sync (rank {r['lora_rank']}, {r['lora_megabytes']:.1f} MB) / full weight sync "
                        f"from the trainer's folder ({r['parameters'] / 1e6:.1f}M parameters)",
                        round(r["lora_path_s"] / r["path_s"], 3), "report", None,
                        f"medians of {len(r['seconds']['lora_path'])}: adapter {r['lora_path_s']:.2f} s from the "
                        f"folder, {r['lora_http_s']:.2f} s over HTTP; full weights {r['path_s']:.2f} s from the folder, "
                        f"{r['http_s']:.2f} s over HTTP (save, load, unload)"))
    return rows


def real_model_rows(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    r = results[0]
    engine, vllm, lora, full, kept = (r["transformers"], r["vllm"], r["update_lora"], r["update_full"],
                                      r["update_lora-kept"])
    shape = (f"{lora['rollouts']} rollouts of {lora['seq_len']} tokens ({lora['seq_len'] - lora['first_generated']} "
             f"from the first generated one), micro-batch {lora['micro_batch_size']}")

    def rate(v: dict[str, Any]) -> str:
        return (f"{statistics.median(v['flops_over_peak']):.1%} ({v['update_flops'] / v['update_s_median'] / 1e9:.0f} "
                f"of {v['matmul_peak_flops_per_s'] / 1e9:.0f} GFLOP/s)")

    return [
        row("SmolLM2-135M rollouts/s, launched vLLM / embedded engine (CPU)",
            round(vllm["rollouts_per_s"] / engine["rollouts_per_s"], 2), "report", None,
            f"{vllm['rollouts_per_s']:.2f} vs {engine['rollouts_per_s']:.2f} rollouts/s, {engine['rollouts']} a batch, "
            f"the same items and seeds, best of {len(engine['batches_s'])}; generated tokens/s {vllm['tokens_per_s']:.0f} "
            f"vs {engine['tokens_per_s']:.0f}; vLLM start-up {vllm['server_startup_s'] or 0:.0f} s; one run"),
        row("SmolLM2-135M update seconds, full fine-tuning / LoRA r16", round(full["update_s_median"] /
            lora["update_s_median"], 2), "report", None,
            f"{full['update_s_median']:.1f} vs {lora['update_s_median']:.1f} s (medians of {len(lora['update_s'])}); "
            f"{shape}; trained parameters {full['trained_parameters'] / 1e6:.1f}M vs {lora['trained_parameters'] / 1e6:.1f}M"),
        row("SmolLM2-135M update peak resident memory, full fine-tuning / LoRA r16 (MiB)",
            f"{full['peak_rss_mib']:.0f} / {lora['peak_rss_mib']:.0f}", "report", None,
            f"the high-water mark through the updates, each in a fresh process; before the first update "
            f"{full['rss_before_update_mib']:.0f} / {lora['rss_before_update_mib']:.0f} MiB; one run"),
        row("SmolLM2-135M update FLOP rate / this machine's float32 matmul peak, LoRA and full",
            f"{statistics.median(lora['flops_over_peak']):.1%} / {statistics.median(full['flops_over_peak']):.1%}",
            "report", None, f"LoRA {rate(lora)}, full {rate(full)}; {lora['threads']} threads; frozen weights "
            "counted 4x (no weight gradient), trained 6x"),
        row("SmolLM2-135M LoRA update seconds, memory given back before it / heap kept",
            round(lora["update_s_median"] / kept["update_s_median"], 2), "report", None,
            f"{lora['update_s_median']:.1f} vs {kept['update_s_median']:.1f} s (medians of {len(kept['update_s'])}); "
            f"what trainer/memory.py release_memory after a step costs the next update; peak resident "
            f"{lora['peak_rss_mib']:.0f} vs {kept['peak_rss_mib']:.0f} MiB"),
    ]


def prefix_update_rows(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    r = results[0]
    rows = []
    for model, label, goal in (("smollm2", "SmolLM2-135M, units recipe (LoRA r16)", 3.0),
                               ("demo", "demo model (full fine-tuning)", None)):
        m = r.get(model)
        if not m:
            continue
        shared = ", ".join(f"{x['update_s_median']:.2f}" for x in m["runs"]["shared"])
        plain = ", ".join(f"{x['update_s_median']:.2f}" for x in m["runs"]["plain"])
        note = (f"update seconds shared {shared}, plain {plain} (medians of each round's timed updates, fresh "
                f"processes, rounds alternating); tokens forwarded bound it at {m['token_bound']:.2f}x; a group of "
                f"{m['group']} x ({m['prompt']} prompt + {m['completion_mean']:.0f} tokens) in one micro-batch; "
                f"{m['threads']} threads on a machine shared with other jobs")
        if not m["shared_applied"]:
            note += "; the shared forward fell back to the plain one"
        figure = f"update seconds, plain / shared prefix, {label}"
        rows.append(ranged(figure, spread_of(m["speedups"]), goal, note) if goal else
                    row(figure, round(statistics.median(m["speedups"]), 2), "report", None, note,
                        low=round(min(m["speedups"]), 2), high=round(max(m["speedups"]), 2),
                        runs=len(m["speedups"])))
        peak, extra = m["peak_rss_mib"], m["update_extra_mib"]
        rows.append(row(f"peak RSS of the update (MiB), plain -> shared prefix, {label}",
                        f"{peak['plain']} -> {peak['shared']}", "lower with sharing",
                        "met" if peak["shared"] < peak["plain"] else "not met",
                        f"the highest of {len(m['runs']['shared'])} fresh processes each, the high-water mark reset "
                        f"after the setup; above the RSS before the first update {extra['plain']} -> "
                        f"{extra['shared']} MiB", runs=len(m["runs"]["shared"])))
def prefix_rows(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    worlds = results[0]["worlds"]
    names = {"units": "SmolLM2-135M, units recipe", "demo": "demo model, FinQA"}
    rows = []
    for world, w in worlds.items():
        shared, unshared = w["runs"]["shared"], w["runs"]["unshared"]
        ratios = [a["rollouts_per_s"] / b["rollouts_per_s"] for a, b in zip(shared, unshared, strict=True)]
        first = shared[0]
        note = (f"{statistics.median(a['rollouts_per_s'] for a in shared):.2f} vs "
                f"{statistics.median(b['rollouts_per_s'] for b in unshared):.2f} rollouts/s (medians), "
                f"{first['rollouts']} rollouts a batch ({w['items']} items x {w['group']}), prompts of "
                f"{first['prompt_tokens_mean']:.0f} tokens, {first['hit_share']:.0%} of their tokens from the cache, "
                f"{first['generated_tokens'] / first['rollouts']:.0f} generated tokens and "
                f"{first['tool_calls_mean']:.2f} tool calls a rollout; each run a fresh process, alternating; "
                "shared 2-core machine")
        if world == "units":
            rows.append(ranged(f"rollouts/s, prefix cache on / off, {names[world]} (groups of 8)",
                               spread_of(ratios), 3.0, note))
        else:
            rows.append(ranged(f"rollouts/s, prefix cache on / off, {names[world]} (groups of 8)",
                               spread_of(ratios), 1.0, note + "; goal: no slower"))
        rows.append(row(f"peak resident memory of a batch, prefix cache on / off, {names[world]} (MiB)",
                        f"{statistics.median(a['peak_rss_mib'] for a in shared):.0f} / "
                        f"{statistics.median(b['peak_rss_mib'] for b in unshared):.0f}", "report", None,
                        f"each run's process high-water mark (model, warm-up, batch); key/value bytes at the end: "
                        f"slots {first['kv_cache_mib'] - first['prefix_cache_mib']:.0f} + prefix cache "
                        f"{first['prefix_cache_mib']:.0f} MiB on, {unshared[0]['kv_cache_mib']:.0f} MiB off"))
    if "demo" in worlds:
        d = worlds["demo"]["runs"]["shared"]
        beyond = statistics.median(r["samples_sharing_beyond_prompt"] for r in d)
        saves = statistics.median(r["tree_saves_token_share"] for r in d)
        rows.append(row("demo rollouts whose first turn and tool answers equal another of their group's "
                        "(a prefix tree over turns would share them)", round(beyond, 3), "report", None,
                        f"the demo's temperature 1; such a tree would save "
                        f"{saves:.1%} of the tokens the engine computes (the repeated second-turn pre-fill); "
                        f"median of {len(d)} batches of {d[0]['rollouts']}"))
    return rows


def staleness_rows(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    r = results[0]
    sync = r["runs"]["0"]  # the synchronous arm (JSON keys are strings)
    where = (f"embedded engine (a frozen copy samples in a {r.get('sampler') or 'thread'})"
             if r["backend"] == "transformers" else "one vLLM server (CPU)")
    arm = r["backend"] if r["backend"] == "vllm" else f"{r['backend']} {r.get('sampler') or 'thread'}"
    arm += f", ppo_epochs {r['ppo_epochs']}"
    setting = (f"{r['steps']} steps of {r['batch_size']} items x {r['group_size']}, ppo_epochs {r['ppo_epochs']}, "
               f"learning rate {r['learning_rate']:g}, {r['latency_ms']:g} ms tools, {where}, seeds {r['seeds']}")
    parts = (f"sync arm: sampling {statistics.median(x['sampling_s'] for x in sync):.2f} s + update "
             f"{statistics.median(x['training_s'] for x in sync):.2f} s a step (medians); a perfect overlap of its "
             f"steps (each the longer of its two halves) gives {', '.join(f'{b:.2f}' for b in r['overlap_bounds'])}x")
    sync_scores, off_scores = r["score_sync"], r["score_off_policy"]
    # "at equal score": the off-policy mean within the seeds' spread of the synchronous arm
    equal = min(sync_scores) <= r["score_off_policy_mean"] <= max(sync_scores)
    steady = r.get("steady_speedups") or []
    if steady:
        parts += (f"; steady state (median step of steps 2 to {r['steps'] - 1}): "
                  f"{', '.join(f'{x:.2f}' for x in steady)}, median {statistics.median(steady):.2f}")
    return [
        ranged(f"steps/s, max_staleness 1 / 0, {r['latency_ms']:g} ms tools, {arm}", spread_of(r["speedups"]),
               1.5, f"per seed {', '.join(f'{x:.2f}' for x in r['speedups'])}; {parts}; {setting}"),
        row(f"validation score after {r['steps']} steps, max_staleness 1 vs 0, {arm}",
            f"{r['score_off_policy_mean']:.3f} vs {r['score_sync_mean']:.3f}",
            "off-policy mean within the sync seeds' range", "met" if equal else "not met",
            f"per seed 1: {', '.join(f'{x:.2f}' for x in off_scores)}; 0: "
            f"{', '.join(f'{x:.2f}' for x in sync_scores)}; {r['eval_k']} samples per validation item"),
    ]


ROWS: dict[str, tuple[Callable[[list[dict[str, Any]]], list[dict[str, Any]]], list[str]]] = {
    # name -> (rows from its runs' JSON, the figures it owns: named in the rows when it fails)
    "rollout": (rollout_rows, ["rollout throughput, 100 ms tool latency / 0 ms", "rollouts/s vs sequential loop",
                               "peak RSS, 64 concurrent rollouts"]),
    "trl": (trl_rows, ["RFT steps/s vs TRL, 0 ms and 100 ms tools", "eval score vs TRL"]),
    "training": (training_rows, ["training-step FLOP rate / peak", "peak RSS of the update, before and after",
                                 "GPU MFU", "scaling curves"]),
    "engine": (engine_rows, ["generation time, 8 tool turns / 4"]),
    "pipeline": (pipeline_rows, ["pipeline bookkeeping / wall time"]),
    "tool_server": (tool_server_rows, ["search tool p95, 2,800 and 100,000 pages", "tool client soak"]),
    "vllm": (vllm_rows, ["vLLM backend vs transformers engine"]),
    "memory": (memory_rows, ["memory of one update at vocabulary 151,936"]),
    "staleness": (staleness_rows, ["steps/s and score, max_staleness 1 / 0, embedded engine, sampler process"]),
    "staleness_ppo2": (staleness_rows, ["steps/s and score, max_staleness 1 / 0, embedded engine, ppo_epochs 2"]),
    "staleness_thread": (staleness_rows, ["steps/s and score, max_staleness 1 / 0, embedded engine, sampler thread"]),
    "staleness_vllm": (staleness_rows, ["steps/s and score, max_staleness 1 / 0, vLLM"]),
    "data_scaling": (data_scaling_rows, ["validation gain by distinct training items"]),
    "weight_sync": (weight_sync_rows, ["full weight sync over HTTP / from the trainer's folder"]),
    "weight_sync_real": (weight_sync_rows, ["full weight sync over HTTP / from the trainer's folder (SmolLM2)",
                                            "LoRA adapter sync / full weight sync (SmolLM2)"]),
    "real_model": (real_model_rows, ["SmolLM2-135M rollouts/s, launched vLLM / embedded engine (CPU)",
                                     "SmolLM2-135M update seconds, full fine-tuning / LoRA r16",
                                     "SmolLM2-135M update peak resident memory, full fine-tuning / LoRA r16 (MiB)",
                                     "SmolLM2-135M update FLOP rate / this machine's float32 matmul peak, LoRA and full",
                                     "SmolLM2-135M LoRA update seconds, memory given back before it / heap kept"]),
    "prefix": (prefix_rows, ["rollouts/s, prefix cache on / off, SmolLM2-135M and demo model",
                             "peak resident memory, prefix cache on / off",
                             "demo rollouts sharing more than the prompt"]),
    "api_load": (api_load_rows, ["agentrft api: upload memory, 20 jobs at once, polling p95, chat burst, "
                                 "kill -9 and restart"]),
    "prefix_update": (prefix_update_rows, ["update seconds, plain / shared prefix, SmolLM2-135M and the demo model",
                                           "peak RSS of the update, plain -> shared prefix"]),
}


def machine() -> dict[str, Any]:
    """What the figures were measured on."""
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").is_file() else ""
    memory = next((int(line.split()[1]) // 1024 for line in Path("/proc/meminfo").read_text().splitlines()
                   if line.startswith("MemTotal")), None) if Path("/proc/meminfo").is_file() else None
    import torch

    return {"cpu": cpu, "cpus": os.cpu_count(), "memory_mib": memory, "platform": platform.platform(),
            "python": platform.python_version(), "torch": torch.__version__,
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None}


def git_state() -> dict[str, Any]:
    def git(*args: str) -> str:
        done = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, check=False)
        return done.stdout.strip() if done.returncode == 0 else ""

    return {"commit": git("rev-parse", "HEAD") or None, "dirty": bool(git("status", "--porcelain"))}


def merged(previous: dict[str, Any], partial: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """`--only`: the previous file with the rerun benchmarks' rows replaced (or added) and the
    partial run recorded in `partial_runs` (its date, commit, machine and benchmarks); the
    top-level date, commit and machine stay those of the last full run."""
    figures = {r["figure"] for r in partial["rows"]}
    kept = [r for r in previous.get("rows", [])
            if r.get("benchmark") not in names and r["figure"] not in figures]
    runs = previous.get("partial_runs", []) + [{
        key: partial[key] for key in ("date", "commit", "dirty", "machine", "load_average_start",
                                      "load_average_end", "wall_s")} | {"benchmarks": names}]
    seconds = previous.get("benchmark_seconds", {}) | partial["benchmark_seconds"]
    return previous | {"rows": kept + partial["rows"], "benchmark_seconds": seconds, "partial_runs": runs}


def kept_opt_in(previous: dict[str, Any], full: dict[str, Any]) -> dict[str, Any]:
    """A full run: the opt-in benchmarks' rows of the previous file, and the partial runs
    that made them, carried over."""
    rows = [r for r in previous.get("rows", []) if r.get("benchmark") in OPT_IN]
    runs = [run for run in previous.get("partial_runs", []) if set(run["benchmarks"]) & set(OPT_IN)]
    seconds = {name: s for name, s in previous.get("benchmark_seconds", {}).items() if name in OPT_IN}
    return full | {"rows": full["rows"] + rows, "benchmark_seconds": full["benchmark_seconds"] | seconds,
                   **({"partial_runs": runs} if runs else {})}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, default=REPO / "benchmarks" / "results.json")
    parser.add_argument("--only", nargs="+", choices=list(BENCHMARKS), help="run these benchmarks only")
    parser.add_argument("--logs", type=Path, default=None, help="keep each benchmark's output here")
    args = parser.parse_args(argv)
    console = Console(width=None if sys.stdout.isatty() else 200)  # a log file gets whole lines
    names = args.only or [name for name in BENCHMARKS if name not in OPT_IN]
    for name in [n for n in ("vllm", "staleness_vllm", "weight_sync", "weight_sync_real", "real_model") if n in names]:
        if not VLLM_PYTHON.is_file():
            console.print(f"skipping {name}: {VLLM_PYTHON} is missing (make vllm)")
            names.remove(name)

    started_at = datetime.datetime.now(datetime.UTC)
    started = time.perf_counter()
    load_start = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="bench_all_") as tmp_dir:
        out_dir = args.logs or Path(tmp_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        console.print("building the taught world (cached after the first run)")
        subprocess.run([sys.executable, "-m", "benchmarks.taught_world"], cwd=REPO, check=True,
                       stdout=subprocess.DEVNULL, env=os.environ | {"HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)})
        console.print(f"running {len(names)} benchmarks (logs in {out_dir})")
        results = {name: run_benchmark(name, out_dir, console) for name in names}
    wall_s = time.perf_counter() - started

    rows: list[dict[str, Any]] = []
    for name in sorted(names, key=list(ROWS).index):
        to_rows, figures = ROWS[name]
        result = results[name]
        if isinstance(result, str):
            new = [row(figure, None, "", None, result) for figure in figures]
        else:
            new = to_rows(result)
        rows += [{**r, "benchmark": name} for r in new]

    table = Table(title=f"make bench: {len(rows)} figures in {wall_s / 60:.1f} min "
                        f"({os.cpu_count()} CPUs, load average {load_start[0]:.1f} at start, "
                        f"{os.getloadavg()[0]:.1f} at end)")
    for column in ("figure", "value", "range", "goal", "verdict", "note"):
        table.add_column(column, overflow="fold")
    marks = {"met": "[green]met[/green]", "not met": "[red]not met[/red]", "straddles": "[yellow]straddles[/yellow]",
             None: "-"}
    for r in rows:
        spread = f"[{r['min']}, {r['max']}] of {r['runs']}" if r["min"] is not None else "-"
        table.add_row(r["figure"], "null" if r["value"] is None else str(r["value"]), spread, r["goal"],
                      marks[r["verdict"]], r["note"])
    console.print(table)
    summary = {
        "date": started_at.isoformat(timespec="seconds"),
        **git_state(),
        "machine": machine(),
        "load_average_start": load_start[0],
        "load_average_end": os.getloadavg()[0],
        "wall_s": round(wall_s, 1),
        "benchmark_seconds": {name: round(sum(r["_seconds"] for r in runs), 1)
                              for name, runs in results.items() if isinstance(runs, list)},
        "rows": rows,
    }
    if args.only and args.json.is_file():
        summary = merged(json.loads(args.json.read_text()), summary, names)
    elif args.json.is_file():
        summary = kept_opt_in(json.loads(args.json.read_text()), summary)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(summary, indent=2) + "\n")
    console.print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
