"""`make bench`: every benchmark of benchmarks/, side by side in one run, as one table of
figures with their goals (issue 7), and the same rows as JSON.

Each benchmark runs as its own process (`python -m benchmarks.<name> ... --json`), so
one's peak memory is not another's and a failure costs only its own rows, with a budget
cut to fit the whole run in under 20 minutes on two shared cores. The rollout, TRL,
training and pipeline figures use the taught tiny model of benchmarks/taught_world.py
(built once, about 20 s), not the demo model, whose bootstrap takes longer than the whole
budget. Timing figures are ratios of runs made in the same process minutes apart;
absolute times on a shared machine drift, ratios much less.

    python benchmarks/run_all.py [--json benchmarks/results.json] [--only trl training]
"""

from __future__ import annotations

import argparse
import json
import os
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

# name -> (module, arguments, timeout in seconds): budgets cut for a 20-minute run
BENCHMARKS: dict[str, tuple[str, list[str], int]] = {
    "tool_server": ("bench_tool_server", ["--duration", "20", "--max-rate-step-s", "5", "--queries", "100",
                                          "--big-corpus-dir", str(REPO / ".cache" / "bench" / "big_corpus")], 540),
    "engine": ("bench_engine", ["--ref-sequences", "4"], 240),
    "rollout": ("bench_rollout", ["--world", "taught", "--k", "32", "--sequential-items", "2"], 240),
    "trl": ("bench_trl", ["--steps", "5", "--eval-k", "32"], 480),
    "training": ("bench_training", ["--rollouts", "8", "--repeats", "2"], 420),
    "pipeline": ("bench_pipeline", [], 360),
}


def run_benchmark(name: str, out_dir: Path, console: Console) -> dict[str, Any] | str:
    """The benchmark's JSON, or why there is none (its output is kept in `out_dir`)."""
    module, arguments, timeout = BENCHMARKS[name]
    out, log = out_dir / f"{name}.json", out_dir / f"{name}.log"
    command = [sys.executable, "-m", f"benchmarks.{module}", *arguments, "--json", str(out)]
    env = os.environ | {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
                        "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PYTHONPATH": str(REPO)}
    started = time.perf_counter()
    with log.open("w") as handle:
        try:
            done = subprocess.run(command, cwd=REPO, env=env, stdout=handle, stderr=subprocess.STDOUT,
                                  timeout=timeout, check=False)
            failure = None if done.returncode == 0 else f"exit code {done.returncode}"
        except subprocess.TimeoutExpired:
            failure = f"over its {timeout} s budget"
    seconds = time.perf_counter() - started
    if failure is None and out.is_file():
        console.print(f"  {name}: {seconds:.0f} s")
        return json.loads(out.read_text()) | {"_seconds": seconds}
    tail = [line for line in log.read_text(errors="replace").splitlines() if line.strip()][-1:] or [""]
    console.print(f"  {name}: [red]failed[/red] after {seconds:.0f} s ({failure}); log {log}: {tail[0][:200]}")
    return f"{name} benchmark failed ({failure}): {tail[0][:160]}"


def row(figure: str, value: Any, goal: str, met: bool | None, note: str = "") -> dict[str, Any]:
    return {"figure": figure, "value": value, "goal": goal, "met": met, "note": note}


def at_least(value: float, goal: float) -> bool:
    return value >= goal


def rollout_rows(r: dict[str, Any]) -> list[dict[str, Any]]:
    f, rows = r["figures"], r["rows"]
    model = f"{r['figures']['world']} model, {rows['engine_0ms']['tool_calls_mean']:.2f} tool calls a rollout"
    return [
        row("rollout throughput, 100 ms tool latency / 0 ms", round(f["latency_100ms_over_0ms"], 2), ">= 0.90",
            at_least(f["latency_100ms_over_0ms"], 0.90), model),
        row("rollouts/s, engine / plain sequential agent loop", round(f["engine_vs_sequential_rollouts_per_s"], 2),
            "report; aim >= 5x", at_least(f["engine_vs_sequential_rollouts_per_s"], 5.0),
            f"tokens/s {f['engine_vs_sequential_tokens_per_s']:.2f}x; {model}"),
        row(f"peak RSS, {f['concurrent_rollouts']} concurrent rollouts (MiB)", round(f["peak_rss_mb_64_concurrent"]),
            "report", None, f"model parameters {f['model_params_mb']:.1f} MiB; process peak incl. tool server"),
    ]


def trl_rows(r: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for latency, goal in (("0ms", 1.5), ("100ms", 3.0)):
        run = r["runs"].get(latency)
        if run is None:
            continue
        rows.append(row(f"RFT steps/s, ours / TRL GRPOTrainer, {latency} tools", round(run["speedup"], 2),
                        f">= {goal:g}x", at_least(run["speedup"], goal),
                        f"ours {run['ours_steps_per_s']:.3f}, TRL {run['trl_steps_per_s']:.3f} steps/s; "
                        f"{r['steps']} steps of 2 items x 4, {len(run['seeds'])} seed(s)"))
    # Every trained model counts: one per seed and latency.
    ours = [x["eval_score"] for run in r["runs"].values() for x in run["ours"]]
    trl = [x["eval_score"] for run in r["runs"].values() for x in run["trl"]]
    mean_ours, mean_trl = sum(ours) / len(ours), sum(trl) / len(trl)
    rows.append(row(f"eval score after {r['steps']} steps, ours vs TRL", f"{mean_ours:.3f} vs {mean_trl:.3f}",
                    "not lower", mean_ours >= mean_trl,
                    f"start {r['eval_start']:.3f}; mean of {len(ours)} runs each (ours "
                    f"{', '.join(f'{x:.2f}' for x in ours)}; TRL {', '.join(f'{x:.2f}' for x in trl)}), "
                    f"{r['eval_k']} samples per item"))
    return rows


def training_rows(r: dict[str, Any]) -> list[dict[str, Any]]:
    f, m = r["flops"], r["flops"]["model"]
    size = f"{m['params'] / 1e6:.1f}M params, {m['params_mib']} MiB"
    rows = [
        row("training-step FLOP rate / measured matmul peak (CPU)", round(f["flops_over_peak"], 2), ">= 0.30",
            at_least(f["flops_over_peak"], 0.30),
            f"{f['achieved_flops_per_s'] / 1e9:.1f} / {f['peak_flops_per_s'] / 1e9:.1f} GFLOP/s, {f['threads']} "
            f"threads; Qwen3 hidden {m['hidden']} x {m['layers']} layers ({size}), {f['rollouts']} x {f['seq_len']} "
            f"tokens; 6*N*T + causal attention"),
        row("peak RSS, training step (MiB)", round(f["peak_rss_mib"]), "report", None,
            f"model {size}; RSS {f['rss_before_update_mib']:.0f} MiB before the update"),
    ]
    g = r.get("gpu")
    rows.append(row("GPU MFU, ~0.6B Qwen3 bf16 training step", round(g["mfu"], 2) if g else "no GPU", ">= 0.40",
                    at_least(g["mfu"], 0.40) if g else None, g["device"] if g else "torch.cuda is not available"))
    s = r.get("scaling")
    if s:
        ratios = s["time_ratio_per_doubling"]
        points = sorted(s["points"], key=lambda p: (p["group_size"], p["items"]))
        curve = {key: ", ".join(f"{p['step_s']:.2f}" for p in points if pick(p))
                 for key, pick in (("group", lambda p: p["items"] == 2), ("items", lambda p: p["group_size"] == 4))}
        group = [ratios["group_4_to_8"], ratios["group_8_to_16"]]
        items = [ratios["items_1_to_2"], ratios["items_2_to_4"]]
        rows.append(row("scaling: step time per doubling of the group (4, 8, 16)",
                        " / ".join(f"{x:.2f}" for x in group), "<= 2.0 (linear)", max(group) <= 2.0,
                        f"step seconds {curve['group']} at 2 items"))
        rows.append(row("scaling: step time per doubling of items per step (1, 2, 4)",
                        " / ".join(f"{x:.2f}" for x in items), "<= 2.0 (linear)", max(items) <= 2.0,
                        f"step seconds {curve['items']} at a group of 4"))
    return rows


def engine_rows(r: dict[str, Any]) -> list[dict[str, Any]]:
    f = r["figures"]
    return [row("generation time, 8 tool turns / 4 tool turns", round(f["engine_8_over_4_turns_time"], 2),
                "<= 2.2", f["engine_8_over_4_turns_time"] <= 2.2,
                f"{f['sequences']} sequences; re-encoding reference {f['reference_8_over_4_turns_time']:.2f}")]


def pipeline_rows(r: dict[str, Any]) -> list[dict[str, Any]]:
    return [row("pipeline bookkeeping / wall time (micro preset)", f"{r['bookkeeping_share']:.1%}", "<= 5%",
                r["bookkeeping_share"] <= 0.05,
                f"{r['bookkeeping_s']:.1f} of {r['wall_s']:.1f} s; compute {r['compute_s']:.1f} s "
                f"(rollouts/eval {r['rollouts_and_eval_s']:.1f}, training steps {r['training_steps_s']:.1f})")]


def tool_server_rows(r: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for key, goal in (("demo", 20.0), ("big", 50.0)):
        s = r["search"].get(key)
        if s:
            p95 = s["http"]["p95"]
            rows.append(row(f"search tool p95 over {s['pages']:,} pages (ms)", p95, f"<= {goal:g} ms", p95 <= goal,
                            f"over HTTP; in-process index p95 {s['index']['p95']} ms"))
    return rows


ROWS: dict[str, tuple[Callable[[dict[str, Any]], list[dict[str, Any]]], list[str]]] = {
    # name -> (rows from its JSON, the figures it owns: named in the rows when it fails)
    "rollout": (rollout_rows, ["rollout throughput, 100 ms tool latency / 0 ms", "rollouts/s vs sequential loop",
                               "peak RSS, 64 concurrent rollouts"]),
    "trl": (trl_rows, ["RFT steps/s vs TRL, 0 ms and 100 ms tools", "eval score vs TRL"]),
    "training": (training_rows, ["training-step FLOP rate / peak", "peak RSS, training step", "GPU MFU",
                                 "scaling curves"]),
    "engine": (engine_rows, ["generation time, 8 tool turns / 4"]),
    "pipeline": (pipeline_rows, ["pipeline bookkeeping / wall time"]),
    "tool_server": (tool_server_rows, ["search tool p95, 2,800 and 100,000 pages"]),
}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, default=REPO / "benchmarks" / "results.json")
    parser.add_argument("--only", nargs="+", choices=list(BENCHMARKS), help="run these benchmarks only")
    parser.add_argument("--logs", type=Path, default=None, help="keep each benchmark's output here")
    args = parser.parse_args(argv)
    console = Console(width=None if sys.stdout.isatty() else 200)  # a log file gets whole lines
    names = args.only or list(BENCHMARKS)

    started = time.perf_counter()
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
            rows += [row(figure, None, "", None, result) for figure in figures]
        else:
            rows += to_rows(result)

    table = Table(title=f"make bench: {len(rows)} figures in {wall_s / 60:.1f} min "
                        f"({os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f})")
    for column in ("figure", "value", "goal", "met?", "note"):
        table.add_column(column, overflow="fold")
    marks = {True: "[green]yes[/green]", False: "[red]no[/red]", None: "-"}
    for r in rows:
        table.add_row(r["figure"], "null" if r["value"] is None else str(r["value"]), r["goal"], marks[r["met"]],
                      r["note"])
    console.print(table)
    summary = {"wall_s": round(wall_s, 1), "cpus": os.cpu_count(), "rows": rows,
               "benchmark_seconds": {k: round(v["_seconds"], 1) for k, v in results.items() if isinstance(v, dict)}}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(summary, indent=2) + "\n")
    console.print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
