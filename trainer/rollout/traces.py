"""Rollouts as MLflow traces: open one in the MLflow UI instead of reading JSONL.

One trace per rollout, linked to the MLflow run that produced it. Its spans follow the
rollout's timeline: each assistant turn (a CHAT_MODEL span with what the model wrote and
its finish_reason), the tool calls that turn made (TOOL spans with name, arguments,
output, latency and status; calls of one turn overlap, as they ran concurrently), and the
grading (an EVALUATOR span with score, reward, penalties and grader errors; flushed
traces also carry them as assessments, with the item's reference fields as the expectation
`item`, for MLflow scorers). Tags make
them searchable with `mlflow.search_traces(filter_string=...)`: `rollout.trace_id` (the id
the tool servers saw), `item_id`, `score`, `reward`, `status`, `step` and `kind` (train,
eval, baseline, candidate, ...).

MLflow exports traces to the process's tracking URI (`mlflow.set_tracking_uri`), so the
caller points it at the store of the run first; the export is asynchronous and, unless the
caller says `flush=False` (the trainer, at every step: a flush waits about a second for
MLflow's export queue, which was most of a small step's time), flushed before returning.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from trainer.rollout.record import RolloutRecord

_NS = 1_000_000_000


def _ns(seconds: float) -> int:
    return int(seconds * _NS)


def _text(value: Any, limit: int = 4000) -> str:
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    return text if len(text) <= limit else text[: limit - 12] + "...[cut]"


def log_rollout_traces(
    records: Sequence[RolloutRecord], *, experiment_id: str, run_id: str, step: int, kind: str, tracking_uri: str,
    flush: bool = True, items: Mapping[str, dict[str, Any]] | None = None,
) -> list[str]:
    """Log `records` as traces of `run_id`; returns the MLflow trace ids. Each trace carries
    its grade as assessments (`score` and `reward` feedback from the grader, or the
    grader's error) and, when `items` (item id -> data row) has its item, the expectation
    `item`: the row's reference fields, which an MLflow scorer of the same grader reads
    (tasks/scoring.py)."""
    import mlflow
    from mlflow import MlflowClient

    if not records:
        return []
    mlflow.set_tracking_uri(tracking_uri)
    client = MlflowClient(tracking_uri=tracking_uri)
    ids = []
    for record in records:
        ids.append(_log_one(client, record, experiment_id=experiment_id, run_id=run_id, step=step, kind=kind))
    if flush:  # assessments need the trace in the store: not logged on the trainer's unflushed traces
        mlflow.flush_trace_async_logging()
        for trace_id, record in zip(ids, records, strict=True):
            _log_grade(trace_id, record, (items or {}).get(record.item_id))
    return ids


def item_fields(item: dict[str, Any]) -> dict[str, Any]:
    """What of a data row a grader may read besides the conversation: every field but
    `messages` and `tools` (reference answers, ids, categories)."""
    return {key: value for key, value in item.items() if key not in ("messages", "tools")}


def _log_grade(trace_id: str, record: RolloutRecord, item: dict[str, Any] | None) -> None:
    import mlflow
    from mlflow.entities import AssessmentError, AssessmentSource, AssessmentSourceType

    source = AssessmentSource(source_type=AssessmentSourceType.CODE, source_id="agentrft-grader")
    if record.score is not None:
        mlflow.log_feedback(trace_id=trace_id, name="score", value=record.score, source=source)
        mlflow.log_feedback(trace_id=trace_id, name="reward", value=record.reward, source=source)
    elif record.grader_errors:
        kind, message = next(iter(record.grader_errors.items()))
        mlflow.log_feedback(trace_id=trace_id, name="score", source=source,
                            error=AssessmentError(error_code=kind, error_message=message))
    if item is not None:
        mlflow.log_expectation(trace_id=trace_id, name="item", value=item_fields(item),
                               source=AssessmentSource(source_type=AssessmentSourceType.CODE, source_id="dataset"))


def span_count(record: RolloutRecord) -> int:
    """How many spans `_log_one` gives `record`'s trace: the rollout, each turn, the tool
    calls of those turns, and the grade."""
    turns = len(record.turn_seconds)
    return 2 + turns + sum(1 for call in record.tool_calls if 1 <= call.turn <= turns)


def _log_one(client: Any, record: RolloutRecord, *, experiment_id: str, run_id: str, step: int, kind: str) -> str:
    start = record.started_at or 0.0
    user = [m for m in record.messages if m.get("role") in ("system", "user")]
    tags = {
        "rollout.trace_id": record.trace_id,
        "item_id": record.item_id,
        "status": record.status,
        "score": "" if record.score is None else f"{record.score:.6g}",
        "reward": "" if record.reward is None else f"{record.reward:.6g}",
        "step": str(step),
        "kind": kind,
    }
    root = client.start_trace(
        f"rollout {record.item_id}", span_type="AGENT", inputs={"messages": user}, tags=tags,
        experiment_id=experiment_id, run_id=run_id, start_time_ns=_ns(start),
        attributes={"trace_id": record.trace_id, "sample_index": str(record.sample_index)},
    )
    trace_id, parent = root.trace_id, root.span_id
    assistant = [m for m in record.messages if m.get("role") == "assistant"]
    clock = start
    for turn, seconds in enumerate(record.turn_seconds, start=1):
        message = assistant[turn - 1] if turn - 1 < len(assistant) else {}
        span = client.start_span(f"turn {turn}", trace_id=trace_id, parent_id=parent, span_type="CHAT_MODEL",
                                 start_time_ns=_ns(clock),
                                 attributes={"tokens": record.turn_tokens[turn - 1] if turn - 1 < len(record.turn_tokens) else 0,
                                             "finish_reason": record.finish_reasons[turn - 1]
                                             if turn - 1 < len(record.finish_reasons) else ""})
        client.end_span(trace_id, span.span_id, outputs={"content": _text(message.get("content", "")),
                                                         "tool_calls": message.get("tool_calls", [])},
                        end_time_ns=_ns(clock + seconds))
        clock += seconds
        longest = 0.0
        for call in (c for c in record.tool_calls if c.turn == turn):
            tool = client.start_span(f"tool {call.name}", trace_id=trace_id, parent_id=parent, span_type="TOOL",
                                     inputs={"name": call.name, "arguments": call.arguments}, start_time_ns=_ns(clock),
                                     attributes={"latency_s": round(call.latency_s, 6), "call_id": call.call_id,
                                                 "error": call.error or ""})
            client.end_span(trace_id, tool.span_id, outputs={"output": _text(call.output)},
                            status="ERROR" if call.error else "OK", end_time_ns=_ns(clock + call.latency_s))
            longest = max(longest, call.latency_s)
        clock += longest
    grade = client.start_span("grade", trace_id=trace_id, parent_id=parent, span_type="EVALUATOR",
                              inputs={"final_answer": _text(record.final_answer)}, start_time_ns=_ns(clock))
    client.end_span(trace_id, grade.span_id, outputs={
        "score": record.score, "reward": record.reward, "penalties": record.penalties,
        "grader_errors": record.grader_errors, "sub_rewards": record.sub_rewards,
    }, status="ERROR" if record.grader_errors else "OK", end_time_ns=_ns(clock))
    client.end_trace(trace_id, outputs={"final_answer": _text(record.final_answer), "status": record.status,
                                        "score": record.score, "reward": record.reward},
                     status="ERROR" if record.status == "infra_error" else "OK",
                     end_time_ns=_ns(max(clock, start + record.latency_s)))
    return trace_id
