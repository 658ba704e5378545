"""A job's runs read back: its Prefect flow runs (status, logs, cancellation, the training
ETA, the model lock they hold) and its MLflow runs (per-step metrics, checkpoints, the
registered result)."""

from __future__ import annotations

import re
import uuid
from typing import Any

from flows.openai_api.jobs import PIPELINE_DEPLOYMENT_NAME, fine_tuned_name

# Training and evaluation figures a checkpoint reports (MLflow name -> checkpoint metric).
CHECKPOINT_METRICS = {
    "train/reward_mean": "train_reward_mean", "train/score_mean": "train_score_mean",
    "train/tool_calls_mean": "train_tool_calls_mean", "train/tokens_mean": "train_tokens_mean",
    "eval/reward_mean": "valid_reward_mean", "eval/score_mean": "valid_score_mean",
    "eval/tool_calls_mean": "valid_tool_calls_mean", "eval/tokens_mean": "valid_tokens_mean",
}


def start_flow_run(record: dict[str, Any]) -> str:
    """A new run of the pipeline deployment with the job's parameters; returns its id."""
    from prefect.deployments import run_deployment

    run = run_deployment(PIPELINE_DEPLOYMENT_NAME, parameters=record["parameters"], timeout=0,
                         tags=["openai-job", record["id"]], flow_run_name=f"{record['id']}-{len(record['flow_run_ids']) + 1}")
    return str(run.id)


def flow_runs(ids: list[str]) -> dict[str, Any]:
    from prefect.client.orchestration import get_client

    if not ids:
        return {}
    from prefect.exceptions import ObjectNotFound

    runs = {}
    with get_client(sync_client=True) as client:
        for run_id in ids:
            try:
                runs[run_id] = client.read_flow_run(uuid.UUID(run_id))
            except ObjectNotFound:  # another Prefect server, or its database made anew
                runs[run_id] = None
    return runs


def set_flow_run_cancelled(run_id: str, message: str) -> None:
    """Cancel a flow run as the UI does: Cancelling while it runs (its runner stops it),
    Cancelled at once when it has not started."""
    from prefect.client.orchestration import get_client
    from prefect.states import Cancelled, Cancelling

    with get_client(sync_client=True) as client:
        run = client.read_flow_run(uuid.UUID(run_id))
        if run.state is None or run.state.is_final():
            return
        state = Cancelling(message=message) if run.state.is_running() else Cancelled(message=message)
        client.set_flow_run_state(run.id, state, force=True)


def flow_run_logs(ids: list[str]) -> list[Any]:
    """Every log line of the flow runs, in the order Prefect keeps them."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    log_filter = LogFilter(flow_run_id=LogFilterFlowRunId(any_=[uuid.UUID(i) for i in ids]))
    logs: list[Any] = []
    with get_client(sync_client=True) as client:
        while True:
            page = client.read_logs(log_filter=log_filter, limit=200, offset=len(logs))
            logs += page
            if len(page) < 200:
                return logs


_TRAINING_PROGRESS = re.compile(r"^GRPO: (\d+)/(\d+) steps, .*ETA (\d+) s")


def training_eta(flow_run_id: str) -> int | None:
    """When training should end, from the newest progress line of the trainer (its ETA);
    None before training has reported one. The regression evaluation after it is not counted."""
    for log in reversed(flow_run_logs([flow_run_id])):
        match = _TRAINING_PROGRESS.match(log.message)
        if match:
            return int(log.timestamp.timestamp()) + int(match.group(3))
    return None


def release_model_lock(record: dict[str, Any]) -> bool:
    """Free the registered model's lock that a paused job's killed run may still hold: its
    Prefect concurrency lease would expire only minutes later, and the resumed run would
    wait for it. Only when no live flow run trains that model; the limit is deleted and the
    next holder makes it anew. Returns whether one was deleted."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        FlowRunFilter,
        FlowRunFilterState,
        FlowRunFilterStateType,
    )
    from prefect.client.schemas.objects import StateType
    from prefect.exceptions import ObjectNotFound

    from tasks.locks import limit_name

    model = record["parameters"]["config"]["promotion"]["registered_model"]
    live = FlowRunFilter(state=FlowRunFilterState(type=FlowRunFilterStateType(
        any_=[StateType.RUNNING, StateType.PENDING, StateType.CANCELLING])))
    with get_client(sync_client=True) as client:
        for run in client.read_flow_runs(flow_run_filter=live):
            if ((run.parameters.get("config") or {}).get("promotion") or {}).get("registered_model") == model:
                return False
        try:
            client.delete_global_concurrency_limit_by_name(limit_name(model))
        except ObjectNotFound:
            return False
    return True


_STATUS = {"SCHEDULED": "queued", "PENDING": "queued", "RUNNING": "running", "COMPLETED": "succeeded",
           "FAILED": "failed", "CRASHED": "failed", "CANCELLED": "cancelled", "CANCELLING": "cancelled",
           "PAUSED": "paused"}


def job_status(record: dict[str, Any], runs: dict[str, Any]) -> tuple[str, Any]:
    """OpenAI's status of a job and its newest flow run (None before one exists)."""
    if record["error"]:
        return "failed", None
    if not record["flow_run_ids"]:
        return ("cancelled" if record["cancelled"] else "validating_files"), None
    run = runs[record["flow_run_ids"][-1]]
    if run is None:
        return "failed", None
    if record["paused"]:
        return "paused", run
    return _STATUS[run.state.type.value], run


def _tracking(record: dict[str, Any]) -> tuple[Any, str | None]:
    from tasks.tracking import mlflow_client, resolve_tracking_uri

    mlflow = record["parameters"]["config"]["mlflow"]
    client = mlflow_client(resolve_tracking_uri(mlflow["tracking_uri"]))
    experiment = client.get_experiment_by_name(mlflow["experiment"])
    return client, experiment.experiment_id if experiment else None


def pipeline_runs(record: dict[str, Any]) -> tuple[Any, list[Any]]:
    """The MLflow parent runs of the job's flow runs, oldest first."""
    client, experiment_id = _tracking(record)
    if experiment_id is None or not record["flow_run_ids"]:
        return client, []
    parents = []
    for flow_run_id in record["flow_run_ids"]:
        runs = client.search_runs([experiment_id], f"tags.prefect_flow_run_id = '{flow_run_id}'", max_results=100)
        parents += [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    return client, sorted(parents, key=lambda r: r.info.start_time)


def training_runs(client: Any, parents: list[Any]) -> list[str]:
    """The rft_training runs the job's pipeline runs used or started, oldest first."""
    ids: list[str] = []
    for parent in parents:
        linked = parent.data.tags.get("stage.rft_training.run_id")
        if linked:
            ids.append(linked)
            continue
        children = client.search_runs([parent.info.experiment_id], f"tags.mlflow.parentRunId = '{parent.info.run_id}'"
                                      " AND tags.stage = 'rft_training'")
        ids += [r.info.run_id for r in sorted(children, key=lambda r: r.info.start_time)]
    return list(dict.fromkeys(ids))


def step_metrics(client: Any, run_ids: list[str]) -> dict[int, dict[str, Any]]:
    """Per training step: its `train/` and `eval/` metrics and the time they were logged
    (a resumed training's later runs win for the steps they repeat)."""
    steps: dict[int, dict[str, Any]] = {}
    for run_id in run_ids:
        run = client.get_run(run_id)
        for key in run.data.metrics:
            if not key.startswith(("train/", "eval/")):
                continue
            for point in client.get_metric_history(run_id, key):
                entry = steps.setdefault(point.step, {"metrics": {}, "timestamp": 0})
                entry["metrics"][key] = point.value
                entry["timestamp"] = max(entry["timestamp"], point.timestamp)
    return dict(sorted(steps.items()))


def job_result(record: dict[str, Any]) -> dict[str, Any] | None:
    """The registered version a succeeded job produced: the newest pipeline run's
    promotion stage (None when the pipeline ended before training: RFT not needed)."""
    client, parents = pipeline_runs(record)
    if not parents:
        return None
    tags = parents[-1].data.tags
    promotion = tags.get("stage.promotion.run_id")
    if not promotion:
        return {"outcome": tags.get("outcome"), "registered_model": None, "version": None}
    version = client.get_run(promotion).data.tags.get("registered_version")
    return {"outcome": tags.get("outcome"), "version": version,
            "registered_model": record["parameters"]["config"]["promotion"]["registered_model"]}


def checkpoints(record: dict[str, Any]) -> list[dict[str, Any]]:
    """The kept checkpoints (MLflow logged models of the training stage), newest step first."""
    client, parents = pipeline_runs(record)
    runs = training_runs(client, parents)
    metrics = step_metrics(client, runs)
    found: dict[int, dict[str, Any]] = {}
    for run_id in runs:
        for key, uri in client.get_run(run_id).data.tags.items():
            if not key.startswith("checkpoint_rank_"):
                continue
            model = client.get_logged_model(uri.removeprefix("models:/"))
            step = int(model.name.rsplit("-", 1)[-1])
            values = {"step": float(step)} | {
                name: metrics.get(step, {}).get("metrics", {}).get(key) for key, name in CHECKPOINT_METRICS.items()}
            found[step] = {
                "object": "fine_tuning.job.checkpoint", "id": f"ftckpt-{model.model_id.removeprefix('m-')[:24]}",
                "created_at": int(model.creation_timestamp / 1000),
                "fine_tuned_model_checkpoint": f"{fine_tuned_name(record)}:ckpt-step-{step}",
                "fine_tuning_job_id": record["id"], "step_number": step, "model_uri": uri,
                "metrics": {k: v for k, v in values.items() if v is not None},
            }
    return [found[step] for step in sorted(found, reverse=True)]
