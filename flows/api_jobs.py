"""The fine-tuning jobs of the API: each a run of the pipeline deployment.

A job body (OpenAI's `POST /v1/fine_tuning/jobs`, `method.type: reinforcement`) becomes
the pipeline config by `flows/openai_job.py`, laid over the server's own config, with the
uploaded files' stored paths. Its life, in OpenAI's statuses:

- `validating_files`: the RFT content checks on the files (row shapes, tool schemas, the
  grader's `{{item.*}}` fields), run on a worker thread after the job is created; a
  failure fails the job with an `error` naming the file and the line.
- `queued` / `running` / `succeeded` / `failed` / `cancelled`: the state of the job's
  Prefect flow run of the pipeline deployment (Scheduled or Pending, Running, Completed,
  Failed or Crashed, Cancelling or Cancelled). The run is an ordinary run of that
  deployment, visible and cancellable in the Prefect UI.
- `paused`: a paused job's flow run is cancelled (its message says paused); `resume`
  starts a new run of the deployment with the same parameters: the stages that finished
  are served from the stage cache and training continues from its last checkpoint (the
  registered model's lock that the killed run held is freed first). Only a queued or
  running job pauses. OpenAI's SDK lists no `paused` status; its models keep the string.

Events are the job's own (created, validated, ignored fields, paused, ...), the Prefect
logs of its flow runs (the stages' progress lines) and one `metrics` event per training
step from MLflow. Checkpoints are the kept checkpoints the training stage logged as MLflow
models; their names (`ft:...:ckpt-step-N`) resolve to those models.
"""

from __future__ import annotations

import json
import re
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from flows.openai_job import config_from_openai_job
from trainer.config import PipelineConfig, merge_overrides, missing_env_vars
from trainer.errors import AgentRFTError, ConfigError

ORGANIZATION = "agentrft"
PIPELINE_DEPLOYMENT_NAME = "agent-rft-pipeline/scheduled"
_CHECKPOINT_SUFFIX = re.compile(r"^(ft:.+):ckpt-step-(\d+)$")
# Training and evaluation figures a checkpoint reports (MLflow name -> checkpoint metric).
CHECKPOINT_METRICS = {
    "train/reward_mean": "train_reward_mean", "train/score_mean": "train_score_mean",
    "train/tool_calls_mean": "train_tool_calls_mean", "train/tokens_mean": "train_tokens_mean",
    "eval/reward_mean": "valid_reward_mean", "eval/score_mean": "valid_score_mean",
    "eval/tool_calls_mean": "valid_tool_calls_mean", "eval/tokens_mean": "valid_tokens_mean",
}


class ApiError(AgentRFTError):
    """An error answered in OpenAI's shape: HTTP status, message, param, code."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.param, self.code, self.kind = status, param, code, kind

    def body(self) -> dict[str, Any]:
        return {"error": {"message": str(self), "type": self.kind, "param": self.param, "code": self.code}}


def not_found(what: str, ident: str) -> ApiError:
    return ApiError(404, f"No such {what}: {ident!r}", param="id", code="not_found", kind="not_found_error")


# --- creating a job -----------------------------------------------------------------------


def _file_path(files: Any, job: dict[str, Any], key: str) -> str:
    file_id = job.get(key)
    record = files.get(str(file_id)) if file_id else None
    if record is None:
        raise ApiError(400, f"{key}: no uploaded file {file_id!r} (upload it with POST /v1/files first)",
                       param=key, code="invalid_file")
    if record["purpose"] != "fine-tune":
        raise ApiError(400, f"{key}: file {file_id} has purpose {record['purpose']!r}, not 'fine-tune'",
                       param=key, code="invalid_file")
    return str(files.path(record))


def _check_method(body: dict[str, Any]) -> dict[str, Any]:
    from trainer.graders import GraderConfigError, validate_grader

    method = body.get("method")
    kind = method.get("type") if isinstance(method, dict) else None
    if kind != "reinforcement":
        raise ApiError(400, f"method.type {kind!r} is not supported here: this server runs reinforcement "
                       "fine-tuning only (method.type 'reinforcement')", param="method.type", code="invalid_value")
    rft = method.get("reinforcement")
    if not isinstance(rft, dict) or "grader" not in rft:
        raise ApiError(400, "method.reinforcement.grader is required", param="method.reinforcement.grader",
                       code="invalid_value")
    try:
        validate_grader(rft["grader"])
    except GraderConfigError as exc:
        raise ApiError(400, f"method.reinforcement.grader: {exc}", param="method.reinforcement.grader",
                       code="invalid_grader") from None
    for index, tool in enumerate(rft.get("tools") or []):
        where = f"method.reinforcement.tools[{index}]"
        if not isinstance(tool, dict) or not (tool.get("server_url") or (tool.get("function") or {}).get("server_url")):
            raise ApiError(400, f"{where}: a tool needs a server_url (the endpoint its calls are POSTed to)",
                           param=f"{where}.server_url", code="invalid_value")
    return rft


def job_config(body: dict[str, Any], files: Any, base: dict[str, Any]) -> tuple[PipelineConfig, list[str]]:
    """The pipeline config of a job body, and notes on what was ignored or defaulted.
    Raises ApiError (400) naming the field; nothing is stored."""
    rft = _check_method(body)
    notes = []
    job = {"model": body.get("model"), "method": body["method"], "training_file": _file_path(files, body, "training_file")}
    if body.get("validation_file"):
        job["validation_file"] = _file_path(files, body, "validation_file")
    else:
        job["validation_file"] = base["data"]["validation_file"]
        notes.append(f"no validation_file: the server config's validation items ({job['validation_file']}) are "
                     "used for in-training evaluation, checkpoint choice and the baseline")
    test_id = (body.get("metadata") or {}).get("test_file")
    if test_id:
        job["test_file"] = _file_path(files, {"metadata.test_file": test_id}, "metadata.test_file")
    else:
        notes.append("no metadata.test_file: a seeded half of the validation items is the test split of the "
                     "regression evaluation")
    hyper = dict(rft.get("hyperparameters") or {})
    for key in [k for k, v in hyper.items() if v == "auto"]:
        del hyper[key]  # "auto": the server config's value
    job["method"] = {"type": "reinforcement", "reinforcement": {**rft, "hyperparameters": hyper}}
    for key in ("seed", "suffix"):
        if body.get(key) is not None:
            job[key] = body[key]
    if body.get("hyperparameters"):
        notes.append("top-level hyperparameters are deprecated and ignored: method.reinforcement.hyperparameters "
                     "are used")
    if body.get("integrations"):
        notes.append("integrations are ignored: metrics are recorded in this server's MLflow store")
    if "learning_rate_multiplier" in hyper and base["training"].get("learning_rate") is not None:
        # An absolute learning rate overrides a multiplier: the job's choice would do nothing.
        notes.append("the job's learning_rate_multiplier replaces the server config's training.learning_rate "
                     f"({base['training']['learning_rate']})")
        base = merge_overrides(base, {"training": {"learning_rate": None}})
    try:
        config, mapped_notes = config_from_openai_job(job, source="job", base=base)
    except ConfigError as exc:
        raise ApiError(400, str(exc).removeprefix("job: "), code="invalid_value") from None
    missing = missing_env_vars(config)
    if missing:
        raise ApiError(400, "environment variables named by tool headers are not set on the server: "
                       + ", ".join(missing), param="method.reinforcement.tools", code="invalid_value")
    return config, notes + mapped_notes


def new_job(body: dict[str, Any], config: PipelineConfig, notes: list[str]) -> dict[str, Any]:
    now = int(time.time())
    job_id = f"ftjob-{uuid.uuid4().hex[:24]}"
    record = {
        "id": job_id, "created_at": now, "model": body["model"], "training_file": body["training_file"],
        "validation_file": body.get("validation_file"), "suffix": body.get("suffix"),
        "seed": body.get("seed") if body.get("seed") is not None else config.training.seed,
        "metadata": body.get("metadata"), "method": body["method"], "integrations": body.get("integrations"),
        "parameters": {"config": config.model_dump(mode="json"), "refresh": []},
        "flow_run_ids": [], "paused": False, "cancelled": False, "error": None, "events": [],
    }
    add_event(record, f"Created fine-tuning job: {job_id}")
    for note in notes:
        add_event(record, note, level="warn")
    add_event(record, "Validating training file: " + body["training_file"]
              + (f" and validation file: {body['validation_file']}" if body.get("validation_file") else ""))
    return record


def add_event(record: dict[str, Any], message: str, *, level: str = "info") -> None:
    record["events"].append({"object": "fine_tuning.job.event", "id": f"ftevent-{uuid.uuid4().hex[:24]}",
                             "created_at": int(time.time()), "level": level, "message": message,
                             "data": {}, "type": "message"})


def content_problem(config: PipelineConfig, record: dict[str, Any], files: Any) -> dict[str, Any] | None:
    """The first RFT content failure of the job's files as OpenAI's job `error`, or None."""
    from tasks.data_checks import check_gradable, check_row_shapes
    from trainer.data import read_numbered

    named = [("training_file", record["training_file"], config.data.train_file)]
    if record["validation_file"]:
        named.append(("validation_file", record["validation_file"], config.data.validation_file))
    test_id = (record["metadata"] or {}).get("test_file")
    if test_id:
        named.append(("metadata.test_file", test_id, config.data.test_file))
    for param, file_id, path in named:
        numbered = read_numbered(path)
        failures = check_row_shapes(numbered, Path(path)) + check_gradable(config.grader, numbered, Path(path))
        if failures:
            first = failures[0]
            sample = first["samples"][0] if first["samples"] else {}
            filename = files.get(file_id)["filename"] if files.get(file_id) else file_id
            message = (f"{param} {file_id} ({filename}) line {sample.get('line')}: {first['expectation']} "
                       f"({first['column']}): {sample.get('error', first['observed'])}; expected {first['expected']}"
                       f" ({first['unexpected_count']} rows fail)")
            return {"code": f"invalid_{param.split('.')[-1]}", "message": message, "param": param}
    return None


# --- the job's Prefect flow runs ------------------------------------------------------------


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


# --- MLflow: the job's pipeline runs, step metrics, checkpoints, model --------------------------


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


def fine_tuned_name(record: dict[str, Any]) -> str:
    """OpenAI's `ft:<base>:<org>:<suffix>:<id>` for the job's model."""
    base = Path(str(record["model"]).rstrip("/")).name.replace(":", "-")
    suffix = (record["suffix"] or "").replace(":", "-")
    return f"ft:{base}:{ORGANIZATION}:{suffix}:{record['id'].removeprefix('ftjob-')}"


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


def split_checkpoint_name(model: str) -> tuple[str, int | None]:
    """`ft:...:ckpt-step-N` -> (`ft:...`, N); any other name -> (name, None)."""
    match = _CHECKPOINT_SUFFIX.match(model)
    return (match.group(1), int(match.group(2))) if match else (model, None)


class JobStore:
    """Job records, one JSON file each; one lock serialises their updates."""

    def __init__(self, root: Path):
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        self.lock = threading.RLock()

    def save(self, record: dict[str, Any]) -> None:
        with self.lock:
            partial = self.root / f"{record['id']}.partial"
            partial.write_text(json.dumps(record))
            partial.replace(self.root / f"{record['id']}.json")

    def get(self, job_id: str) -> dict[str, Any]:
        path = self.root / f"{job_id}.json"
        if not job_id.startswith("ftjob-") or not path.is_file():
            raise not_found("fine-tuning job", job_id)
        with self.lock:
            return json.loads(path.read_text())

    def list(self) -> list[dict[str, Any]]:
        with self.lock:
            records = [json.loads(p.read_text()) for p in self.root.glob("ftjob-*.json")]
        return sorted(records, key=lambda r: (-r["created_at"], r["id"]))
