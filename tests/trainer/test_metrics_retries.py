"""MLflow calls are retried only while the store is away or busy: a bug or a refusal
raises at once (an AttributeError inside MLflow's log_model was retried for 300 s per
checkpoint before), and a store that stays away ends in an InfraError naming the limit."""

from __future__ import annotations

import errno

import pytest
import requests
from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import RESOURCE_DOES_NOT_EXIST, TEMPORARILY_UNAVAILABLE
from sqlalchemy.exc import OperationalError

from trainer.errors import InfraError
from trainer.rl.metrics import transient, with_retries


@pytest.mark.parametrize("exc", [
    ConnectionRefusedError(111, "refused"),
    TimeoutError("timed out"),
    requests.exceptions.ConnectionError("dropped"),
    OperationalError("UPDATE runs", {}, Exception("database is locked")),
    MlflowException("API request to http://127.0.0.1:5000 failed with exception Max retries exceeded"),
    MlflowException("server error", error_code=TEMPORARILY_UNAVAILABLE),
])
def test_an_away_or_busy_store_is_transient(exc: BaseException) -> None:
    assert transient(exc)


@pytest.mark.parametrize("exc", [
    AttributeError("'str' object has no attribute '__name__'"),
    FileNotFoundError("model.safetensors"),
    OSError(errno.ENOSPC, "No space left on device"),
    MlflowException("Run with id=abc not found", error_code=RESOURCE_DOES_NOT_EXIST),
    ValueError("bad metric"),
])
def test_bugs_and_refusals_are_not(exc: BaseException) -> None:
    assert not transient(exc)


def test_a_bug_raises_at_once_without_retrying() -> None:
    calls = []

    def broken() -> None:
        calls.append(1)
        raise AttributeError("no __name__")

    with pytest.raises(AttributeError):
        with_retries(broken, what="logging a model", timeout_s=60)
    assert calls == [1]


def test_a_store_away_is_retried_then_named() -> None:
    calls = []

    def away() -> None:
        calls.append(1)
        raise ConnectionRefusedError(111, "refused")

    with pytest.raises(InfraError, match=r"MLflow: logging metrics failed for 0 s .*mlflow.unavailable_timeout_s"):
        with_retries(away, what="logging metrics", timeout_s=0.3, first_delay_s=0.05)
    assert len(calls) >= 2


def test_a_transient_failure_then_success_returns_the_value() -> None:
    answers = iter([ConnectionRefusedError(111, "refused"), "ok"])

    def flaky() -> str:
        answer = next(answers)
        if isinstance(answer, Exception):
            raise answer
        return answer

    assert with_retries(flaky, what="reading the run", timeout_s=10, first_delay_s=0.01) == "ok"


def test_a_trace_the_background_export_lost_is_logged_again(tmp_path) -> None:
    """MLflow's background export drops a trace whose write fails (a warning, no error): at
    the end of training the sink finds every trace it logged that is not in the store whole
    (here one deleted from a real SQLite store before the flush) and logs it again."""
    import mlflow
    from mlflow import MlflowClient

    from trainer.rl.metrics import MetricsSink
    from trainer.rollout.record import RolloutRecord, ToolCallRecord
    from trainer.rollout.traces import span_count

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri)
    experiment = client.create_experiment("traces")
    run_id = client.create_run(experiment).info.run_id
    sink = MetricsSink(tmp_path / "metrics.jsonl", run_id=run_id, tracking_uri=uri)
    call = ToolCallRecord(name="list", arguments="{}", output="a.txt", latency_s=0.01, error=None, call_id="c", turn=1)
    records = [RolloutRecord(trace_id=f"t{i}", item_id=f"item-{i}", sample_index=0, messages=[], final_answer="7",
                             tool_calls=[call] if i else [], status="ok", score=1.0, reward=1.0,
                             turn_seconds=[0.1, 0.2][: i + 1], turn_tokens=[3, 4][: i + 1]) for i in range(2)]
    assert [span_count(r) for r in records] == [3, 5]
    for step in (1, 2):
        sink.log_traces(records, step=step, kind="train")
    mlflow.flush_trace_async_logging()
    lost = mlflow.search_traces(locations=[experiment], return_type="list",
                                filter_string="tags.step = '2' AND tags.item_id = 'item-1'")
    client.delete_traces(experiment, trace_ids=[lost[0].info.trace_id])

    sink.flush_traces()

    kept = mlflow.search_traces(locations=[experiment], return_type="list", max_results=100)
    assert sorted((t.info.tags["step"], t.info.tags["item_id"], len(t.data.spans)) for t in kept) == [
        ("1", "item-0", 3), ("1", "item-1", 5), ("2", "item-0", 3), ("2", "item-1", 5)]
    assert sink._unconfirmed == []
