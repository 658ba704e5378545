"""After promotion: the served model's recent traffic, window by window.

Each run reads the production traffic (`monitor.traffic_file`, a JSONL log the serving
side appends to, or the `serve-model --trace-to` traces in `monitor.traces_experiment`),
takes its last `monitor.windows` windows of `monitor.window_rows` requests, and for each:

- **drift**: the expectation suite derived from earlier traffic (the one `validate_data`
  checks the training data against) runs as a GX Checkpoint on the window's requests;
  failed expectations and KL divergences per field are logged;
- **quality**: every final answer (a response without tool calls) is graded by the job's
  grader against the row's reference fields (rows without them count only when the grader
  needs none: an endpoint or model grader); tool calls and completion tokens per response.

Everything goes to one MLflow run (`monitor`, in the job's experiment, tagged with the
registered model version watched), a metric per window (step = window number, oldest
first), a plot and a report. The run fails, naming why, when the latest window fails more
than `max_failed_expectations` expectations (the fields that drifted) or its score falls
more than `max_score_drop` below the reference (`reference_score`, else the oldest window
read). A failed run is what a Prefect automation acts on: roll back, page, retrain.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tasks.scoring import assistant_message
from trainer.data import read_jsonl
from trainer.errors import DataError
from trainer.graders import grade, sample_from_text

STAGE = "monitor"


@dataclass
class Window:
    number: int
    rows: list[tuple[int, dict[str, Any]]]  # (line in the log, row)
    metrics: dict[str, float] = field(default_factory=dict)
    failures: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class MonitorResult:
    run_id: str
    version: str | None
    windows: list[dict[str, Any]]
    passed: bool
    reasons: list[str]


def traffic_from_file(path: Path) -> list[tuple[int, dict[str, Any]]]:
    if not path.is_file():
        raise DataError(f"monitor.traffic_file {path} does not exist; point it at the JSONL log the serving side "
                        "appends requests and responses to, or set it to null to read serve-model's traces")
    return list(enumerate(read_jsonl(path), start=1))


def traffic_from_traces(tracking_uri: str, experiment: str, limit: int) -> list[tuple[int, dict[str, Any]]]:
    """serve-model's traces as traffic rows, oldest first: messages and tools from the
    request, the chat completion as `response`, the `item` expectation's reference fields."""
    import mlflow

    mlflow.set_tracking_uri(tracking_uri)
    found = mlflow.get_experiment_by_name(experiment)
    if found is None:
        raise DataError(f"monitor.traces_experiment {experiment!r} is not in {tracking_uri}: start the model with "
                        f"`agentrft serve-model --trace-to {tracking_uri}` (it writes there) or set monitor.traffic_file")
    traces = mlflow.search_traces(locations=[found.experiment_id], max_results=limit, order_by=["timestamp_ms DESC"],
                                  return_type="list")
    rows = []
    for trace in reversed(traces):
        root = next(s for s in trace.data.spans if s.parent_id is None)
        item = next((a.value for a in trace.info.assessments if a.name == "item" and isinstance(a.value, dict)), {})
        rows.append({**item, **(root.inputs or {}), "response": root.outputs, "trace_id": trace.info.trace_id})
    return list(enumerate(rows, start=1))


def score_window(window: Window, grader: dict[str, Any], min_scored_rows: int) -> None:
    scores, calls, tokens = [], [], []
    for _, row in window.rows:
        if row.get("response") is None:
            continue  # a request whose answer the log does not hold
        message = assistant_message(row["response"])
        tool_calls = message.get("tool_calls") or []
        calls.append(len(tool_calls))
        usage = row.get("response", {}).get("usage") if isinstance(row.get("response"), dict) else None
        if usage and "completion_tokens" in usage:
            tokens.append(usage["completion_tokens"])
        if tool_calls:
            continue  # a step of an episode, not its answer
        content = message.get("content")
        text = content if isinstance(content, str) else json.dumps(content or "")
        result = grade(grader, sample_from_text(text, []), {k: v for k, v in row.items() if k != "response"})
        if result.reward is not None:
            scores.append(result.reward)
    m = window.metrics
    m["monitor/requests"] = float(len(window.rows))
    m["monitor/scored_rows"] = float(len(scores))
    if len(scores) >= min_scored_rows:
        m["monitor/score_mean"] = statistics.mean(scores)
    if calls:
        m["monitor/tool_calls_mean"] = statistics.mean(calls)
    if tokens:
        m["monitor/completion_tokens_mean"] = statistics.mean(tokens)


def check_window(window: Window, context: Any, suite: Any, source: str) -> None:
    from tasks.validate import run_checkpoint

    report = run_checkpoint(context, suite, f"window {window.number}", Path(source), window.rows)
    window.failures = report.failures
    window.metrics["monitor/failed_expectations"] = float(len(report.failures))
    for column, kl in sorted(report.kl_divergence.items()):
        window.metrics[f"monitor/kl_{column}"] = kl


def verdict(windows: list[Window], options: Any) -> list[str]:
    """Why the latest window fails (empty: it passes)."""
    latest, reasons = windows[-1], []
    if len(latest.failures) > options.max_failed_expectations:
        drifted = sorted({f["column"] for f in latest.failures if f.get("column")})
        kinds = sorted({f["expectation"] for f in latest.failures})
        reasons.append(f"window {latest.number} fails {len(latest.failures)} expectations (allowed "
                       f"{options.max_failed_expectations}): drifted fields {', '.join(drifted) or '-'} ({', '.join(kinds)})")
    reference = options.reference_score
    if reference is None:
        reference = next((w.metrics["monitor/score_mean"] for w in windows if "monitor/score_mean" in w.metrics), None)
    score = latest.metrics.get("monitor/score_mean")
    if reference is not None and score is not None and reference - score > options.max_score_drop:
        reasons.append(f"window {latest.number} scores {score:.3f}, {reference - score:.3f} below the reference "
                       f"{reference:.3f} (allowed drop {options.max_score_drop})")
    return reasons


def plot_windows(windows: list[Window], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    numbers = [w.number for w in windows]
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.2))
    for ax, (key, title) in zip(axes, (("monitor/score_mean", "score"), ("monitor/tool_calls_mean", "tool calls"),
                                       ("monitor/failed_expectations", "failed expectations")), strict=True):
        points = [(n, w.metrics[key]) for n, w in zip(numbers, windows, strict=True) if key in w.metrics]
        if points:
            ax.plot(*zip(*points, strict=True), marker="o")
        ax.set_title(title)
        ax.set_xlabel("window")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def monitor_traffic(config: Any, *, version: str | None, tracking_uri: str, work_dir: Path) -> MonitorResult:
    """One monitor run over the latest windows of traffic; logged to MLflow."""
    from tasks.expectations import gx_context, load_suite
    from tasks.promote import alias_version
    from tasks.tracking import log_json, log_text, mlflow_client

    options = config.monitor
    wanted = options.window_rows * options.windows
    if options.traffic_file:
        source = options.traffic_file
        rows = traffic_from_file(Path(source))[-wanted:]
    elif options.traces_experiment:
        source = f"MLflow experiment {options.traces_experiment}"
        rows = traffic_from_traces(tracking_uri, options.traces_experiment, wanted)
    else:
        raise DataError("monitor: no traffic to read; set monitor.traffic_file or monitor.traces_experiment")
    if not rows:
        raise DataError(f"monitor: {source} holds no requests yet")
    # whole windows, the latest ending at the last request (the oldest may be partial)
    first = len(rows) % options.window_rows
    cuts = ([rows[:first]] if first else []) + [rows[i:i + options.window_rows]
                                                for i in range(first, len(rows), options.window_rows)]
    windows = [Window(number, part) for number, part in enumerate(cuts, start=1)]
    suite_name = options.expectations_suite or config.data.expectations_suite
    client = mlflow_client(tracking_uri)
    name = config.registered_model
    version = version or alias_version(client, name, "champion")
    experiment = client.get_experiment_by_name(config.mlflow.experiment)
    experiment_id = experiment.experiment_id if experiment else client.create_experiment(config.mlflow.experiment)
    run_id = client.create_run(experiment_id, run_name=STAGE, tags={
        "stage": STAGE, "registered_model": name, "version": version or "", "traffic": str(source)}).info.run_id
    try:
        if suite_name:
            root = Path(config.data.expectations_dir)
            suite, context = load_suite(root, suite_name), gx_context(root)
        for window in windows:
            score_window(window, config.grader, options.min_scored_rows)
            if suite_name:
                check_window(window, context, suite, str(source))
            client.log_batch(run_id, metrics=[_metric(k, v, window.number) for k, v in window.metrics.items()])
        reasons = verdict(windows, options)
        out = Path(work_dir) / STAGE / run_id
        out.mkdir(parents=True, exist_ok=True)
        client.log_artifact(run_id, str(plot_windows(windows, out / "windows.png")))
        summary = [{"window": w.number, "first_line": w.rows[0][0], "last_line": w.rows[-1][0], **w.metrics,
                    "failures": w.failures} for w in windows]
        log_json(client, run_id, summary, "windows.json")
        lines = [f"# Monitor of {name} version {version or '(no champion)'}", "", f"Traffic: {source}, "
                 f"{len(rows)} requests in {len(windows)} windows; suite {suite_name or '(none)'}.", "",
                 "| window | requests | scored | score | tool calls | failed expectations |",
                 "| ---: | ---: | ---: | ---: | ---: | ---: |"]
        lines += [f"| {w.number} | {len(w.rows)} | {w.metrics['monitor/scored_rows']:.0f} | "
                  f"{w.metrics.get('monitor/score_mean', float('nan')):.3f} | "
                  f"{w.metrics.get('monitor/tool_calls_mean', float('nan')):.2f} | "
                  f"{w.metrics.get('monitor/failed_expectations', 0):.0f} |" for w in windows]
        lines += ["", "**Verdict:** " + ("; ".join(reasons) if reasons else "passed")]
        log_text(client, run_id, "\n".join(lines) + "\n", "monitor_report.md")
        client.set_tag(run_id, "verdict", "; ".join(reasons)[:5000] if reasons else "passed")
    except BaseException:
        client.set_terminated(run_id, status="FAILED")
        raise
    client.set_terminated(run_id, status="FAILED" if reasons else "FINISHED")
    return MonitorResult(run_id=run_id, version=version, windows=summary, passed=not reasons, reasons=reasons)


def _metric(key: str, value: float, step: int) -> Any:
    import time

    from mlflow.entities import Metric

    return Metric(key=key, value=float(value), timestamp=int(time.time() * 1000), step=step)
