"""The fine-tuning jobs of the API: each a run of the pipeline deployment.

A job body (OpenAI's `POST /v1/fine_tuning/jobs`, `method.type: reinforcement`) becomes
the pipeline config by `flows/openai_api/job_body.py`, laid over the server's own config, with the
uploaded files' stored paths. A supervised body (`method.type: supervised`, or no method with
the legacy top-level `hyperparameters`) becomes the warm start's section (`supervised_job_config`)
and runs the pipeline deployment with `method: supervised`: the warm start, then registration.
`dpo` is refused. Its life, in OpenAI's statuses:

- `validating_files`: the RFT content checks on the files (row shapes, tool schemas, the
  grader's `{{item.*}}` fields), or a supervised job's demonstration checks, run on a worker
  thread after the job is created; a failure fails the job with an `error` naming the file
  and the line.
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
step from MLflow, in OpenAI's shapes (runs.py). Checkpoints are the kept checkpoints the
training stage (or a supervised job's warm start) logged as MLflow models; their names
(`ft:...:ckpt-step-N`) resolve to those models.
"""

from __future__ import annotations

import json
import math
import os
import re
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from flows.openai_api.errors import ApiError, not_found
from flows.openai_api.job_body import config_from_openai_job
from trainer.config.loading import config_from_dict, merge_overrides, missing_env_vars
from trainer.config.pipeline import PipelineConfig
from trainer.errors import ConfigError, DataError
from trainer.outbound import HostPolicy

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


SUPERVISED_HYPERPARAMETERS = {"n_epochs": "a positive integer", "batch_size": "a positive integer",
                              "learning_rate_multiplier": "a positive number"}


def method_of(body: dict[str, Any]) -> Any:
    """The job's `method.type`; `supervised` when the body names no method (OpenAI's default,
    the legacy form with top-level `hyperparameters`)."""
    method = body.get("method")
    if method is None:
        return "supervised"
    return method.get("type") if isinstance(method, dict) else None


def _good_value(key: str, value: Any) -> bool:
    if value == "auto":
        return True
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return False
    return value > 0 if key == "learning_rate_multiplier" else isinstance(value, int) and value >= 1


def supervised_hyperparameters(body: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """A supervised job's hyperparameters, checked (each a value or "auto"), and the field
    they came from: `method.supervised.hyperparameters`, or the legacy top-level one."""
    method = body.get("method")
    if method is None:
        hyper, where = body.get("hyperparameters") or {}, "hyperparameters"
    else:
        section = method.get("supervised") or {}
        if not isinstance(section, dict):
            raise ApiError(400, "method.supervised must be an object", param="method.supervised", code="invalid_value")
        hyper, where = section.get("hyperparameters") or {}, "method.supervised.hyperparameters"
    if not isinstance(hyper, dict):
        raise ApiError(400, f"{where} must be an object", param=where, code="invalid_value")
    for key, value in hyper.items():
        param = f"{where}.{key}"
        if key not in SUPERVISED_HYPERPARAMETERS:
            raise ApiError(400, f"{param}: not a supervised hyperparameter here (they are "
                           f"{', '.join(SUPERVISED_HYPERPARAMETERS)})", param=param, code="invalid_value")
        if not _good_value(key, value):
            raise ApiError(400, f"{param}: expected {SUPERVISED_HYPERPARAMETERS[key]} or \"auto\", got {value!r}",
                           param=param, code="invalid_value")
    return dict(hyper), where


def check_method(body: dict[str, Any]) -> dict[str, Any]:
    """The job's method section (`method.reinforcement`, or the supervised hyperparameters'
    holder), checked; a 400 naming the field for anything this server does not run."""
    from trainer.graders import GraderConfigError, validate_grader

    method = body.get("method")
    kind = method_of(body)
    if kind == "supervised":
        hyper, _ = supervised_hyperparameters(body)
        return {"hyperparameters": hyper}
    if kind == "dpo":
        raise ApiError(400, "method.type 'dpo' (direct preference optimization) is not supported by this server: "
                       "it runs 'supervised' jobs (demonstrations) and 'reinforcement' jobs (a grader scores sampled "
                       "answers)", param="method.type", code="unsupported_method")
    if kind != "reinforcement":
        raise ApiError(400, f"method.type {kind!r} is not supported here: this server runs 'supervised' and "
                       "'reinforcement' jobs", param="method.type", code="invalid_value")
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


def grader_urls(grader: Any, param: str) -> list[tuple[str, str]]:
    """(field, URL) of every request `grader` would send: endpoint graders' `url`, model graders'
    `base_url` (or the default they fall back to), inside multi graders too."""
    from trainer.graders.model_graders import DEFAULT_BASE_URL

    if not isinstance(grader, dict):
        return []
    kind = grader.get("type")
    if kind == "endpoint":
        return [(f"{param}.url", str(grader.get("url")))]
    if kind in ("score_model", "label_model"):
        return [(f"{param}.base_url", str(grader.get("base_url") or os.environ.get("OPENAI_BASE_URL")
                                          or DEFAULT_BASE_URL))]
    if kind == "multi":
        return [found for name, sub in (grader.get("graders") or {}).items()
                for found in grader_urls(sub, f"{param}.graders.{name}")]
    return []


def tool_urls(rft: dict[str, Any]) -> list[tuple[str, str]]:
    return [(f"method.reinforcement.tools[{index}].server_url",
             str(tool.get("server_url") or (tool.get("function") or {}).get("server_url")))
            for index, tool in enumerate(rft.get("tools") or [])]


def check_outbound(policy: HostPolicy | None, urls: list[tuple[str, str]]) -> None:
    """A 400 naming the first field whose URL `policy` refuses (None: any host)."""
    if policy is None:
        return
    for param, url in urls:
        refusal = policy.url_refusal(url)
        if refusal:
            raise ApiError(400, f"{param}: {url!r} is not a host this server calls: {refusal}. The server's "
                           "operator can allow it (api.allowed_hosts, or --allow-any-host)", param=param,
                           code="host_not_allowed")


def with_allowed_hosts(grader: dict[str, Any], entries: list[str]) -> dict[str, Any]:
    """A copy of `grader` whose HTTP graders carry `allowed_hosts: entries` (whatever they said)."""
    if grader.get("type") in ("endpoint", "score_model", "label_model"):
        return {**grader, "allowed_hosts": list(entries)}
    if grader.get("type") == "multi":
        return {**grader, "graders": {name: with_allowed_hosts(sub, entries) for name, sub in grader["graders"].items()}}
    return grader


def job_config(body: dict[str, Any], files: Any, base: dict[str, Any], *, base_model: str | None = None,
               policy: HostPolicy | None = None) -> tuple[PipelineConfig, list[str]]:
    """The pipeline config of a job body (its model checked and resolved as `base_model`), and
    notes on what was ignored or defaulted. Every URL the job names must pass `policy` (None:
    any host), and the policy is written into the config: its tools' and HTTP graders'
    `allowed_hosts`, checked again on each connection wherever the job's stages run. Raises
    ApiError (400) naming the field; nothing is stored."""
    rft = check_method(body)
    check_outbound(policy, tool_urls(rft) + grader_urls(rft["grader"], "method.reinforcement.grader"))
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
    if policy is not None:
        base = merge_overrides(base, {"tools": {"allowed_hosts": list(policy.entries)},
                                      "api": {"allowed_hosts": list(policy.entries)}})
        job["method"]["reinforcement"]["grader"] = with_allowed_hosts(rft["grader"], policy.entries)
    try:
        config, mapped_notes = config_from_openai_job(job, source="job", base=base)
    except ConfigError as exc:
        raise ApiError(400, str(exc).removeprefix("job: "), code="invalid_value") from None
    missing = missing_env_vars(config)
    if missing:
        raise ApiError(400, "environment variables named by tool headers are not set on the server: "
                       + ", ".join(missing), param="method.reinforcement.tools", code="invalid_value")
    return config, notes + mapped_notes


def supervised_job_config(body: dict[str, Any], files: Any, base: dict[str, Any], *,
                          base_model: str | None = None) -> tuple[PipelineConfig, list[str]]:
    """The pipeline config of a supervised job: the warm start (`warm_start.when: always`) on
    the training file, the validation file as its validation demonstrations, the job's
    hyperparameters ("auto": the server config's value), laid over the server's config."""
    hyper, where = supervised_hyperparameters(body)
    notes = []
    ws: dict[str, Any] = {"demonstrations_file": _file_path(files, body, "training_file"), "when": "always",
                          "validation_file": None}
    if body.get("validation_file"):
        ws["validation_file"] = _file_path(files, body, "validation_file")
    else:
        notes.append("no validation_file: only the training loss and token accuracy are measured")
    ws.update({key: value for key, value in hyper.items() if value != "auto"})
    if body.get("seed") is not None:
        ws["seed"] = body["seed"]
    if "learning_rate_multiplier" in ws and base["warm_start"].get("learning_rate") is not None:
        notes.append("the job's learning_rate_multiplier replaces the server config's warm_start.learning_rate "
                     f"({base['warm_start']['learning_rate']})")
        ws["learning_rate"] = None
    overrides: dict[str, Any] = {"model": {"base_model": base_model or body["model"]}, "warm_start": ws}
    if body.get("suffix"):
        overrides["name"] = str(body["suffix"])
        overrides["promotion"] = {"registered_model": str(body["suffix"])}
    if body.get("method") is not None and body.get("hyperparameters"):
        notes.append(f"top-level hyperparameters are deprecated and ignored: {where} are used")
    if body.get("integrations"):
        notes.append("integrations are ignored: metrics are recorded in this server's MLflow store")
    try:
        config = config_from_dict(merge_overrides(base, overrides), source="job")
    except ConfigError as exc:
        raise ApiError(400, str(exc).removeprefix("job: "), code="invalid_value") from None
    return config, notes


def supervised_method(body: dict[str, Any]) -> dict[str, Any]:
    """The job's `method` as OpenAI shows it (the legacy top-level form made explicit)."""
    hyper, _ = supervised_hyperparameters(body)
    return {"type": "supervised", "supervised": {"hyperparameters": hyper}}


def new_job(body: dict[str, Any], config: PipelineConfig, notes: list[str]) -> dict[str, Any]:
    now = int(time.time())
    job_id = f"ftjob-{uuid.uuid4().hex[:24]}"
    record = {
        "id": job_id, "created_at": now, "model": body["model"], "training_file": body["training_file"],
        "validation_file": body.get("validation_file"), "suffix": body.get("suffix"),
        "seed": body.get("seed") if body.get("seed") is not None else config.training.seed,
        "metadata": body.get("metadata"), "method": body["method"], "integrations": body.get("integrations"),
        "parameters": {"config": config.model_dump(mode="json"), "refresh": [],
                       **({"method": "supervised"} if body["method"]["type"] == "supervised" else {})},
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
    """The first content failure of the job's files (RFT rows, or a supervised job's
    demonstrations) as OpenAI's job `error`, or None."""
    from tasks.data_checks import check_gradable, check_row_shapes
    from trainer.data import read_demonstrations, read_numbered

    if record["method"]["type"] == "supervised":
        for param, path in (("training_file", config.warm_start.demonstrations_file),
                            ("validation_file", config.warm_start.validation_file)):
            if path is None:
                continue
            try:
                read_demonstrations(path)
            except DataError as exc:
                file_id = record[param]
                filename = files.get(file_id)["filename"] if files.get(file_id) else file_id
                text = str(exc)
                line = re.match(rf"{re.escape(str(path))}:(\d+): ", text)
                where = f"line {line.group(1)}: {text[line.end():]}" if line else text.replace(f"{path}: ", "", 1)
                return {"code": f"invalid_{param}", "param": param, "message": f"{param} {file_id} ({filename}) {where}"}
        return None
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
