"""A job's runs read back: its Prefect flow runs (status, logs, cancellation, the training
ETA, the model lock they hold) and its MLflow runs (per-step metrics, checkpoints, the
registered result)."""

from __future__ import annotations

import re
import uuid
from typing import Any

from flows.openai_api.errors import ERROR_FLAGS, OPENAI_ERROR_FLAGS
from flows.openai_api.jobs import PIPELINE_DEPLOYMENT_NAME, fine_tuned_name

# A reinforcement checkpoint's metrics: OpenAI's names, then the project's figures beside them.
CHECKPOINT_METRICS = {
    "train/loss": "train_loss", "train/reward_mean": "train_mean_reward", "eval/reward_mean": "valid_mean_reward",
    "train/score_mean": "train_score_mean", "train/tool_calls_mean": "train_tool_calls_mean",
    "train/tokens_mean": "train_tokens_mean", "eval/score_mean": "valid_score_mean",
    "eval/tool_calls_mean": "valid_tool_calls_mean", "eval/tokens_mean": "valid_tokens_mean",
}
# The prefixes of the training stage's per-step metrics that jobs read back.
STEP_PREFIXES = ("train/", "eval/", "timing/", "progress/", "warm_start/")
# A supervised job's (the warm start's) figures, OpenAI's names for them.
SUPERVISED_METRICS = {
    "warm_start/train_loss": "train_loss", "warm_start/train_mean_token_accuracy": "train_mean_token_accuracy",
    "warm_start/valid_loss": "valid_loss", "warm_start/valid_mean_token_accuracy": "valid_mean_token_accuracy",
}


def job_stage(record: dict[str, Any]) -> str:
    """The stage whose per-step metrics and models a job reports: the warm start for a
    supervised job, the RFT training for a reinforcement job."""
    return "warm_start" if record["method"].get("type") == "supervised" else "rft_training"


def supervised_metrics(metrics: dict[str, float], step: int, total_steps: int | None) -> dict[str, Any]:
    """A supervised job's `metrics` event `data` in OpenAI's shape (`step`, `total_steps`,
    `train_loss`, `train_mean_token_accuracy`, `valid_loss`, `valid_mean_token_accuracy`,
    `full_valid_loss`, `full_valid_mean_token_accuracy`), the warm start's MLflow metrics
    beside them under `agentrft`. Validation runs over every validation demonstration, so the
    `full_valid_*` figures are the `valid_*` ones."""
    data: dict[str, Any] = {"step": step, "total_steps": total_steps}
    data.update({ours: metrics.get(key) for key, ours in SUPERVISED_METRICS.items()})
    data["full_valid_loss"], data["full_valid_mean_token_accuracy"] = data["valid_loss"], data["valid_mean_token_accuracy"]
    data["agentrft"] = dict(metrics)
    return {key: value for key, value in data.items() if value is not None}


def supervised_message(data: dict[str, Any]) -> str:
    """OpenAI's line for a supervised metrics event: `Step 3/6: training loss=0.47, validation
    loss=0.51, full validation loss=0.51`."""
    head = f"Step {data['step']}" + (f"/{data['total_steps']}" if data.get("total_steps") else "")
    parts = [f"{label}={data[key]:.2f}" for key, label in (("train_loss", "training loss"), ("valid_loss", "validation loss"),
                                                           ("full_valid_loss", "full validation loss")) if key in data]
    return f"{head}: {', '.join(parts)}"


def _grader_entries(grader: dict[str, Any]) -> list[tuple[str, str, str | None]]:
    """(name, type, sub-reward metric or None) of each grader OpenAI reports on: a multi
    grader's sub-graders, else the one grader."""
    from trainer.rollout.evaluate import sub_reward_key

    if grader.get("type") == "multi":
        return [(name, str((sub or {}).get("type")), sub_reward_key(name))
                for name, sub in (grader.get("graders") or {}).items()]
    return [(str(grader.get("name") or ""), str(grader.get("type")), None)]


def reinforcement_metrics(metrics: dict[str, float], step: int, total_steps: int | None,
                          grader: dict[str, Any]) -> dict[str, Any]:
    """A reinforcement job's `metrics` event `data` in the shape OpenAI's RFT guide shows
    (`step`, `total_steps`, `scores`, `usage`, `errors`, `timing` and its top-level figures),
    from one training step's MLflow metrics; those stay beside them under `agentrft`.
    `valid_*` (and `full_valid_*`) are the step's evaluation on the `eval_samples` validation
    items, present at evaluation steps only."""
    splits = [(split, prefix) for split, prefix in (("train", "train/"), ("valid", "eval/"))
              if f"{prefix}reward_mean" in metrics]
    get = metrics.get

    def count(prefix: str, key: str) -> float | None:
        mean, rollouts = get(f"{prefix}{key}"), get(f"{prefix}rollouts")
        return None if mean is None or rollouts is None else mean * rollouts

    scores: dict[str, Any] = {f"{split}_reward_mean": get(f"{prefix}reward_mean") for split, prefix in splits}
    scores["graders"] = [
        {"name": name, "type": kind, **{f"{split}_reward_mean": get(f"{prefix}{key}" if key else f"{prefix}reward_mean")
                                        for split, prefix in splits}}
        for name, kind, key in _grader_entries(grader)]
    samples: dict[str, Any] = {}
    for split, prefix in splits:
        for ours, theirs in (("reasoning_tokens_mean", "reasoning_tokens"), ("tokens_mean", "completion_tokens")):
            samples[f"{split}_{theirs}_mean"] = get(f"{prefix}{ours}")
            samples[f"{split}_{theirs}_count"] = count(prefix, ours)
    errors: dict[str, Any] = {"name": str(grader.get("name") or ""), "type": str(grader.get("type"))}
    for split, prefix in splits:
        counts = dict.fromkeys(OPENAI_ERROR_FLAGS, 0.0)
        for key, value in metrics.items():
            if key.startswith(f"{prefix}grader_error/"):
                counts[ERROR_FLAGS.get(key.rsplit("/", 1)[-1], "other_error")] += value
        rollouts = max(get(f"{prefix}rollouts") or 0.0, 1.0)
        for flag, n in counts.items():
            errors[f"{split}_{flag}_mean"], errors[f"{split}_{flag}_count"] = n / rollouts, n
    timing = {name: get(key) for name, key in (("sampling", "timing/sampling_s"), ("training", "timing/training_s"),
                                               ("eval", "timing/eval_s"), ("full_iteration", "timing/step_s"))
              if key in metrics}
    data: dict[str, Any] = {
        "step": step, "total_steps": total_steps, "scores": scores,
        "usage": {"graders": [], "samples": samples}, "errors": {"graders": [errors]},
        "timing": {"step": timing, "graders": []},
        "train_mean_reward": get("train/reward_mean"), "full_valid_mean_reward": get("eval/reward_mean"),
        "reasoning_tokens_mean": get("train/reasoning_tokens_mean"), "completion_tokens_mean": get("train/tokens_mean"),
        "valid_reasoning_tokens_mean": get("eval/reasoning_tokens_mean"),
        "full_valid_mean_parse_error": errors.get("valid_sample_parse_error_mean"),
        "agentrft": dict(metrics),
    }
    return {key: value for key, value in data.items() if value is not None}


def reinforcement_message(data: dict[str, Any]) -> str:
    """OpenAI's line for a metrics event: `Step 10/20, train mean reward=0.42, full validation
    mean reward=0.68`."""
    parts = [f"Step {data['step']}" + (f"/{data['total_steps']}" if data.get("total_steps") else "")]
    if "train_mean_reward" in data:
        parts.append(f"train mean reward={data['train_mean_reward']:.2f}")
    if "full_valid_mean_reward" in data:
        parts.append(f"full validation mean reward={data['full_valid_mean_reward']:.2f}")
    return ", ".join(parts)


def total_steps(steps: dict[int, dict[str, Any]]) -> int | None:
    """The training's planned steps, as its trainer logged them (`progress/total_steps`)."""
    planned = [entry["metrics"]["progress/total_steps"] for entry in steps.values()
               if "progress/total_steps" in entry["metrics"]]
    return int(planned[-1]) if planned else None


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


def training_runs(client: Any, parents: list[Any], stage: str = "rft_training") -> list[str]:
    """The `stage` runs (rft_training, or a supervised job's warm_start) the job's pipeline
    runs used or started, oldest first."""
    ids: list[str] = []
    for parent in parents:
        linked = parent.data.tags.get(f"stage.{stage}.run_id")
        if linked:
            ids.append(linked)
            continue
        children = client.search_runs([parent.info.experiment_id], f"tags.mlflow.parentRunId = '{parent.info.run_id}'"
                                      f" AND tags.stage = '{stage}'")
        ids += [r.info.run_id for r in sorted(children, key=lambda r: r.info.start_time)]
    return list(dict.fromkeys(ids))


def step_metrics(client: Any, run_ids: list[str]) -> dict[int, dict[str, Any]]:
    """Per training step: its metrics (STEP_PREFIXES) and the time they were logged (a
    resumed training's later runs win for the steps they repeat)."""
    steps: dict[int, dict[str, Any]] = {}
    for run_id in run_ids:
        run = client.get_run(run_id)
        for key in run.data.metrics:
            if not key.startswith(STEP_PREFIXES):
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


def _kept_models(client: Any, run_id: str, stage: str) -> list[tuple[int, str]]:
    """(step, `models:/` URI) of the models a training run kept: the RFT training's ranked
    checkpoints, or the warm start's one model (at its last step)."""
    tags = client.get_run(run_id).data.tags
    if stage == "warm_start":
        steps = step_metrics(client, [run_id])
        return [(max(steps), tags["model"])] if tags.get("model") and steps else []
    return [(int(client.get_logged_model(uri.removeprefix("models:/")).name.rsplit("-", 1)[-1]), uri)
            for key, uri in tags.items() if key.startswith("checkpoint_rank_")]


def checkpoints(record: dict[str, Any]) -> list[dict[str, Any]]:
    """The kept checkpoints (MLflow logged models of the training stage), newest step first."""
    client, parents = pipeline_runs(record)
    stage = job_stage(record)
    names = SUPERVISED_METRICS if stage == "warm_start" else CHECKPOINT_METRICS
    runs = training_runs(client, parents, stage)
    metrics = step_metrics(client, runs)
    found: dict[int, dict[str, Any]] = {}
    for run_id in runs:
        for step, uri in _kept_models(client, run_id, stage):
            model = client.get_logged_model(uri.removeprefix("models:/"))
            values = {"step": float(step)} | {
                name: metrics.get(step, {}).get("metrics", {}).get(key) for key, name in names.items()}
            if stage == "warm_start":
                values["full_valid_loss"] = values["valid_loss"]
                values["full_valid_mean_token_accuracy"] = values["valid_mean_token_accuracy"]
            found[step] = {
                "object": "fine_tuning.job.checkpoint", "id": f"ftckpt-{model.model_id.removeprefix('m-')[:24]}",
                "created_at": int(model.creation_timestamp / 1000),
                "fine_tuned_model_checkpoint": f"{fine_tuned_name(record)}:ckpt-step-{step}",
                "fine_tuning_job_id": record["id"], "step_number": step, "model_uri": uri,
                "metrics": {k: v for k, v in values.items() if v is not None},
            }
    return [found[step] for step in sorted(found, reverse=True)]
