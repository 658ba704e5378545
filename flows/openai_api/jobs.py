"""The fine-tuning jobs of the API: each a run of the pipeline deployment.

A job body (OpenAI's `POST /v1/fine_tuning/jobs`, `method.type: reinforcement`) becomes
the pipeline config by `flows/openai_api/job_body.py`, laid over the server's own config, with the
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
from urllib.parse import urlparse

from flows.openai_api.errors import ApiError, not_found
from flows.openai_api.job_body import config_from_openai_job
from trainer.config.loading import merge_overrides, missing_env_vars
from trainer.config.pipeline import PipelineConfig
from trainer.errors import ConfigError

ORGANIZATION = "agentrft"


PIPELINE_DEPLOYMENT_NAME = "agent-rft-pipeline/scheduled"


_CHECKPOINT_SUFFIX = re.compile(r"^(ft:.+):ckpt-step-(\d+)$")


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


def check_method(body: dict[str, Any]) -> dict[str, Any]:
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


def _check_tool_hosts(rft: dict[str, Any], allowed: list[str] | None) -> None:
    if allowed is None:
        return
    for index, tool in enumerate(rft.get("tools") or []):
        url = tool.get("server_url") or (tool.get("function") or {}).get("server_url")
        host = urlparse(str(url)).hostname
        if host not in allowed:
            where = f"method.reinforcement.tools[{index}].server_url"
            raise ApiError(400, f"{where}: host {host!r} is not one this server calls (api.allowed_tool_hosts: "
                           f"{', '.join(allowed) or 'none'})", param=where, code="invalid_value")


def job_config(body: dict[str, Any], files: Any, base: dict[str, Any], *, base_model: str | None = None,
               allowed_tool_hosts: list[str] | None = None) -> tuple[PipelineConfig, list[str]]:
    """The pipeline config of a job body (its model checked and resolved as `base_model`), and
    notes on what was ignored or defaulted. Raises ApiError (400) naming the field; nothing is
    stored."""
    rft = check_method(body)
    _check_tool_hosts(rft, allowed_tool_hosts)
    notes = []
    job = {"model": base_model or body.get("model"), "method": body["method"],
           "training_file": _file_path(files, body, "training_file")}
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


def fine_tuned_name(record: dict[str, Any]) -> str:
    """OpenAI's `ft:<base>:<org>:<suffix>:<id>` for the job's model."""
    base = Path(str(record["model"]).rstrip("/")).name.replace(":", "-")
    suffix = (record["suffix"] or "").replace(":", "-")
    return f"ft:{base}:{ORGANIZATION}:{suffix}:{record['id'].removeprefix('ftjob-')}"


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
