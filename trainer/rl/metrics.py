"""Where training metrics go: a local JSONL file, and the MLflow run when there is one.

`MetricsSink` writes every logged step as one JSON line (`{"step": N, "train/...": ...}`)
to a local file, and, when an MLflow run id is given (the argument or `MLFLOW_RUN_ID`),
sends the same values to that run with `MlflowClient().log_batch`. The client call names
the run explicitly, so it works from any thread or process without an active fluent run:
the Prefect task that owns the run hands its id to an `accelerate launch`ed trainer. Only
the main process builds a sink; the others never log.

A tracking server that restarts must not cost the run its metrics: every MLflow call is
retried with backoff for up to `unavailable_timeout_s` (`with_retries`); a step whose
metrics could not be sent in that time stops training with an error that says so, and
the local file still holds every step.
"""

from __future__ import annotations

import errno
import json
import math
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

from trainer.errors import InfraError

# MLflow takes at most 1000 metrics per log_batch call.
_MLFLOW_BATCH = 1000
T = TypeVar("T")


_PERMANENT_OS_ERRORS = (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError)
_TRANSIENT_MLFLOW_CODES = {"TEMPORARILY_UNAVAILABLE", "INTERNAL_ERROR", "REQUEST_LIMIT_EXCEEDED",
                           "RESOURCE_EXHAUSTED", "ABORTED", "DEADLINE_EXCEEDED"}


def transient(exc: BaseException) -> bool:
    """Whether `exc` is the tracking store being away or busy (worth a retry): a refused or
    dropped connection, a timeout, a locked SQLite database, a 5xx from the server."""
    import requests
    from mlflow.exceptions import MlflowException
    from sqlalchemy.exc import OperationalError  # MLflow's SQL store

    if isinstance(exc, _PERMANENT_OS_ERRORS) or getattr(exc, "errno", None) == errno.ENOSPC:
        return False
    if isinstance(exc, OSError | requests.exceptions.RequestException | OperationalError):  # incl. "database is locked"
        return True
    if isinstance(exc, MlflowException):
        text = str(exc).lower()
        return exc.error_code in _TRANSIENT_MLFLOW_CODES or any(
            marker in text for marker in ("connection", "max retries", "timed out", "database is locked"))
    return False


def with_retries(call: Callable[[], T], *, what: str, timeout_s: float, first_delay_s: float = 0.5) -> T:
    """`call()`, retried with exponential backoff (capped at 15 s) while it raises, for up
    to `timeout_s`; then an InfraError naming `what` and the last error."""
    deadline = time.monotonic() + timeout_s
    delay = first_delay_s
    while True:
        try:
            return call()
        except Exception as exc:  # MLflow raises requests', urllib3's and its own errors
            if not transient(exc):  # a bug or a refusal: retrying cannot help
                raise
            if time.monotonic() + delay > deadline:
                raise InfraError(
                    f"MLflow: {what} failed for {timeout_s:.0f} s (last error: {type(exc).__name__}: "
                    f"{str(exc)[:300]}); check that the tracking server is up, or raise "
                    "mlflow.unavailable_timeout_s"
                ) from exc
            print(f"MLflow: {what} failed ({type(exc).__name__}); retrying in {delay:.1f} s", flush=True)
            time.sleep(delay)
            delay = min(delay * 2, 15.0)


class MetricsSink:
    """JSONL locally, plus MLflow when a run id is given. `tracking_uri` None uses MLflow's
    own resolution (MLFLOW_TRACKING_URI, else ./mlruns)."""

    def __init__(self, path: Path, *, run_id: str | None = None, tracking_uri: str | None = None,
                 unavailable_timeout_s: float = 300.0):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.run_id = run_id or os.environ.get("MLFLOW_RUN_ID") or None
        self.tracking_uri = tracking_uri
        self.timeout_s = unavailable_timeout_s
        self._client = None
        self._already_logged: set[int] = set()
        # Traces handed to MLflow's background export and not yet seen in the store:
        # (trace id, record, step, kind).
        self._unconfirmed: list[tuple[str, Any, int, str]] = []
        if self.run_id:
            from mlflow import MlflowClient

            # MLflow's REST client retries a refused connection 7 times with exponential
            # backoff (minutes) before raising; the sink's own retries, with their deadline
            # (unavailable_timeout_s), decide instead.
            os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
            os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "30")

            self._client = MlflowClient(tracking_uri=tracking_uri)

    def _retry(self, call: Callable[[], T], what: str) -> T:
        return with_retries(call, what=what, timeout_s=self.timeout_s)

    def log(self, metrics: dict[str, float], step: int) -> None:
        """Append one step's metrics; non-finite values are kept locally (as null) but not
        sent to MLflow, which rejects them in some stores."""
        row = {"step": step, **{k: (v if math.isfinite(v) else None) for k, v in metrics.items()}}
        with self.path.open("a", encoding="utf-8") as handle:
            handle.write(json.dumps(row) + "\n")
        if self._client is None or step in self._already_logged:
            return
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(key, float(value), now, step) for key, value in metrics.items() if math.isfinite(value)]
        for start in range(0, len(batch), _MLFLOW_BATCH):
            part = batch[start : start + _MLFLOW_BATCH]
            self._retry(lambda part=part: self._client.log_batch(self.run_id, metrics=part),
                        f"logging the metrics of step {step}")

    def rewrite(self, history: Sequence[dict[str, Any]]) -> None:
        """Replace the local file by `history` (rows as `log` writes them): a resumed run
        drops the lines of steps that were logged after its checkpoint.

        MLflow cannot forget a logged step, so a run killed between logging a step and
        checkpointing it keeps its first values: steps the MLflow run already holds beyond
        `history` are not sent again (the run keeps one value per step and metric)."""
        with self.path.open("w", encoding="utf-8") as handle:
            for row in history:
                handle.write(json.dumps(row) + "\n")
        if self._client is not None:
            kept = {row["step"] for row in history}
            logged = self._retry(
                lambda: {m.step for key in ("timing/step_s", "eval/score_mean")
                         for m in self._client.get_metric_history(self.run_id, key)},
                "reading the run's metric history",
            )
            self._already_logged = logged - kept

    def log_artifacts(self, local_dir: Path, artifact_path: str) -> None:
        """Upload a directory to the MLflow run, when there is one."""
        if self._client is not None:
            self._retry(lambda: self._client.log_artifacts(self.run_id, str(local_dir), artifact_path),
                        f"uploading {local_dir}")

    def log_traces(self, records: Sequence[Any], *, step: int, kind: str) -> None:
        """Log rollouts as MLflow traces of the run (trainer/rollout/traces.py)."""
        if self._client is None or not records:
            return
        from trainer.rollout.traces import log_rollout_traces

        run = self._retry(lambda: self._client.get_run(self.run_id), "reading the run")
        uri = self.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or self._client.tracking_uri
        ids = self._retry(lambda: log_rollout_traces(records, experiment_id=run.info.experiment_id,
                                                     run_id=self.run_id, step=step, kind=kind, tracking_uri=uri,
                                                     flush=False),
                          f"logging the rollout traces of step {step}")
        self._unconfirmed.extend((trace_id, record, step, kind) for trace_id, record in zip(ids, records, strict=True))

    def flush_traces(self, rounds: int = 3) -> None:
        """Wait until the traces logged so far are in the store (`log_traces` does not), and
        log again those that are not there whole: MLflow's background export logs a warning
        and drops a trace whose write failed (a SQLite store locked by another writer). A
        trace still missing after `rounds` is named in a warning, never dropped unsaid."""
        if self._client is None:
            return
        import mlflow

        for attempt in range(rounds):
            self._retry(mlflow.flush_trace_async_logging, "flushing the rollout traces")
            missing = [entry for entry in self._unconfirmed if not self._stored(*entry[:2])]
            self._unconfirmed = []
            if not missing:
                return
            steps = sorted({step for _, _, step, _ in missing})
            if attempt == rounds - 1:
                print(f"MLflow: {len(missing)} rollout traces of steps {steps} are not in the store after "
                      f"{rounds} tries (the rollouts themselves are in the run's rollouts/ files)", flush=True)
                return
            print(f"MLflow: {len(missing)} rollout traces of steps {steps} did not reach the store; logging them "
                  "again", flush=True)
            for step, kind in sorted({(step, kind) for _, _, step, kind in missing}):
                self.log_traces([record for _, record, s, k in missing if (s, k) == (step, kind)], step=step, kind=kind)

    def _stored(self, trace_id: str, record: Any) -> bool:
        """Whether the store holds trace `trace_id` with every span `log_rollout_traces` gave it."""
        from mlflow.exceptions import MlflowException

        from trainer.rollout.traces import span_count

        try:
            trace = self._retry(lambda: self._client.get_trace(trace_id), f"reading trace {trace_id}")
        except MlflowException as exc:
            if exc.error_code == "RESOURCE_DOES_NOT_EXIST":
                return False
            raise
        return len(trace.data.spans) == span_count(record)


def step_metrics(everything: list[Any], gathered: list[tuple[Any, float | None]], counts: list[tuple], *,
                 group_size: int, lr: float, update: dict[str, float], infra: dict[str, float]) -> dict[str, float]:
    """A training step's `train/` and `timing/` metrics from every process's records:
    `everything` (every rollout sampled), `gathered` (the batch's rollouts with their
    advantages, None when left out of the loss) and each process's `counts` (silent groups,
    resample rounds, dropped groups, sampling s, training s, largest policy lag), after
    the update's own metrics and the generator's `infra/` ones."""
    from trainer.rollout.evaluate import summarize

    # The slowest process sets the pace of a step.
    sampling_s = max(c[3] for c in counts)
    training_s = max(c[4] for c in counts)
    metrics = summarize(everything, prefix="train").metrics
    metrics.update(update)
    metrics.update(infra)
    metrics.update({
        "train/rollouts_per_s": len(everything) / max(sampling_s, 1e-9),
        "train/tokens_per_s": sum(r.tokens_generated for r in everything) / max(sampling_s, 1e-9),
        "train/grader_errors": float(sum(1 for r in everything if r.grader_errors)),
        "train/zero_variance_group_share": sum(c[0] for c in counts) / max(1, len(gathered) // group_size),
        "train/resample_rounds": float(max(c[1] for c in counts)),
        "train/dropped_groups": float(sum(c[2] for c in counts)),
        "train/rollouts_in_loss": float(sum(1 for _, a in gathered if a is not None)),
        "train/policy_lag_max": float(max(c[5] for c in counts)),
        "train/lr": lr,
        "timing/sampling_s": sampling_s,
        "timing/training_s": training_s,
    })
    return metrics
