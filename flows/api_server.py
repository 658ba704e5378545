"""`agentrft api`: OpenAI's fine-tuning API, served here, for the official `openai` SDK.

Point a client at it (`OpenAI(base_url="http://127.0.0.1:8100/v1", api_key=...)`) and the
calls of a fine-tuning script work unchanged: Files (`/v1/files`), jobs
(`/v1/fine_tuning/jobs`, with cancel, pause, resume, events, checkpoints), graders
(`/v1/fine_tuning/alpha/graders/validate` and `/run`), models (`/v1/models`) and chat
completions with tool calls on the fine-tuned models. Answers and errors are OpenAI's
JSON shapes and HTTP statuses (`{"error": {"message", "type", "param", "code"}}`).

A job is a run of the pipeline deployment (`flows/api_jobs.py`): the server serves that
deployment from a child process (`agentrft serve`, the same deployment a cron or the
Prefect UI runs) on the Prefect server that PREFECT_API_URL names, or on one it starts on
loopback. Uploads and job records live under `<work_dir>/api/`.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException

from flows import api_jobs
from flows.api_files import PURPOSES, FileStore, public
from flows.api_jobs import ApiError, JobStore, not_found
from trainer.api_key import RequireApiKey
from trainer.config import PipelineConfig, TrainingConfig, resolved_hyperparameters
from trainer.errors import AgentRFTError, ConfigError, DataError

ROOT = Path(__file__).resolve().parents[1]
# Our grader error kinds -> OpenAI's graders/run `metadata.errors` flags.
ERROR_FLAGS = {
    "sample_parse_error": "sample_parse_error",
    "invalid_variable_error": "invalid_variable_error",
    "formula_parse_error": "formula_parse_error",
    "reference_parse_error": "other_error",
    "python_grader_runtime_error": "python_grader_runtime_error",
    "python_grader_server_error": "python_grader_server_error",
    "python_grader_timeout_error": "python_grader_server_error",
    "model_grader_server_error": "model_grader_server_error",
    "model_grader_refusal_error": "model_grader_refusal_error",
    "model_grader_parse_error": "model_grader_parse_error",
    "endpoint_grader_server_error": "unresponsive_reward_error",
    "other_error": "other_error",
}
_FLAGS = ("formula_parse_error", "invalid_variable_error", "model_grader_parse_error", "model_grader_refusal_error",
          "model_grader_server_error", "other_error", "python_grader_runtime_error", "python_grader_server_error",
          "sample_parse_error", "truncated_observation_error", "unresponsive_reward_error")


def _page(items: list[dict[str, Any]], after: str | None, limit: int) -> dict[str, Any]:
    """OpenAI's cursor page: the items after the one with id `after`, `limit` of them."""
    if not 1 <= limit <= 100:
        raise ApiError(400, f"limit must be between 1 and 100, got {limit}", param="limit", code="invalid_value")
    if after:
        ids = [item["id"] for item in items]
        items = items[ids.index(after) + 1:] if after in ids else []
    return {"object": "list", "data": items[:limit], "has_more": len(items) > limit}


def grader_run_answer(grader: dict[str, Any], result: Any, seconds: float) -> dict[str, Any]:
    """OpenAI's graders/run answer for one GraderResult."""
    flags: dict[str, Any] = dict.fromkeys(_FLAGS, False)
    for kind, message in result.errors.items():
        flag = ERROR_FLAGS.get(kind, "other_error")
        flags[flag] = True
        if flag in ("model_grader_server_error", "python_grader_runtime_error"):
            flags[f"{flag}_details"] = message
        if flag == "python_grader_server_error":
            flags["python_grader_server_error_type"] = kind
    return {
        "reward": result.reward if result.reward is not None else 0.0,
        "sub_rewards": dict(result.sub_rewards),
        "model_grader_token_usage_per_model": {},
        "metadata": {"name": grader.get("name", ""), "type": grader["type"], "errors": flags,
                     "execution_time": seconds, "scores": dict(result.sub_rewards), "token_usage": None,
                     "sampled_model_name": None, "error_messages": dict(result.errors)},
    }


class FineTuningApi:
    """The state behind the routes: files, jobs, the server config, loaded models."""

    def __init__(self, config: PipelineConfig, work_dir: Path):
        self.base = config.model_dump(mode="json")
        self.files = FileStore(work_dir / "files")
        self.jobs = JobStore(work_dir / "jobs")
        self.validating = ThreadPoolExecutor(max_workers=1, thread_name_prefix="validating-files")
        self.models: dict[str, Any] = {}

    # jobs

    def create_job(self, body: dict[str, Any]) -> dict[str, Any]:
        for key in ("model", "training_file"):
            if not body.get(key):
                raise ApiError(400, f"{key} is required", param=key, code="missing_required_parameter")
        config, notes = api_jobs.job_config(body, self.files, self.base)
        record = api_jobs.new_job(body, config, notes)
        self.jobs.save(record)
        self.validating.submit(self._validate_and_queue, record["id"], config)
        return self.view(record)

    def _validate_and_queue(self, job_id: str, config: PipelineConfig) -> None:
        try:
            problem = api_jobs.content_problem(config, self.jobs.get(job_id), self.files)
        except (DataError, ConfigError) as exc:
            problem = {"code": "invalid_file", "message": str(exc), "param": "training_file"}
        with self.jobs.lock:
            record = self.jobs.get(job_id)
            if record["cancelled"]:
                return
            if problem:
                record["error"], record["finished_at"] = problem, int(time.time())
                api_jobs.add_event(record, f"File validation failed: {problem['message']}", level="error")
            else:
                try:
                    record["flow_run_ids"].append(api_jobs.start_flow_run(record))
                    api_jobs.add_event(record, "Files validated, moving job to queued state "
                                       f"(Prefect flow run {record['flow_run_ids'][-1]})")
                except Exception as exc:
                    record["error"] = {"code": "server_error", "param": None,
                                       "message": f"could not start the pipeline deployment: {exc}"}
                    api_jobs.add_event(record, record["error"]["message"], level="error")
            self.jobs.save(record)

    def view(self, record: dict[str, Any]) -> dict[str, Any]:
        """OpenAI's job object, its status read from Prefect (and its model from MLflow)."""
        runs = api_jobs.flow_runs(record["flow_run_ids"][-1:])
        status, run = api_jobs.job_status(record, runs)
        error = record["error"]
        fine_tuned, trained_tokens, finished_at = None, None, None
        if status == "failed" and error is None and run is None:
            from prefect.settings import PREFECT_API_URL

            error = {"code": "flow_run_missing", "param": None,
                     "message": f"the job's Prefect flow run {record['flow_run_ids'][-1]} is not on the Prefect "
                                f"server {PREFECT_API_URL.value()} (another server, or its database made anew)"}
        elif status == "failed" and error is None:
            stopped = run.state.name == "Stopped"
            error = {"code": "pipeline_stopped" if stopped else "pipeline_failed", "param": None,
                     "message": run.state.message or f"Prefect flow run {run.id} ended {run.state.name}"}
        if status in ("succeeded", "failed", "cancelled") and run is not None and run.end_time:
            finished_at = int(run.end_time.timestamp())
        elif record.get("finished_at"):
            finished_at = record["finished_at"]
        if status == "succeeded":
            if "result" not in record:
                with self.jobs.lock:
                    record = self.jobs.get(record["id"])
                    record["result"] = api_jobs.job_result(record)
                    self.jobs.save(record)
            if record["result"] and record["result"]["version"]:
                fine_tuned = api_jobs.fine_tuned_name(record)
        if status in ("running", "succeeded", "failed", "cancelled", "paused") and record["flow_run_ids"]:
            client, parents = api_jobs.pipeline_runs(record)
            steps = api_jobs.step_metrics(client, api_jobs.training_runs(client, parents))
            trained_tokens = int(sum(s["metrics"].get("train/tokens_mean", 0.0) * s["metrics"].get("train/rollouts", 0.0)
                                     for s in steps.values())) if steps else None
        estimated_finish = api_jobs.training_eta(record["flow_run_ids"][-1]) if status == "running" else None
        hyper = resolved_hyperparameters(TrainingConfig.model_validate(record["parameters"]["config"]["training"]))
        return {
            "object": "fine_tuning.job", "id": record["id"], "created_at": record["created_at"],
            "model": record["model"], "organization_id": api_jobs.ORGANIZATION, "status": status, "error": error,
            "fine_tuned_model": fine_tuned, "finished_at": finished_at, "trained_tokens": trained_tokens,
            "estimated_finish": estimated_finish, "training_file": record["training_file"],
            "validation_file": record["validation_file"], "result_files": [], "seed": record["seed"],
            "hyperparameters": {key: hyper[key] for key in ("n_epochs", "batch_size", "learning_rate_multiplier")},
            "method": record["method"], "metadata": record["metadata"], "integrations": record["integrations"],
            "user_provided_suffix": record["suffix"],
            "prefect_flow_run_ids": record["flow_run_ids"],
        }

    def cancel(self, job_id: str, *, pause: bool = False) -> dict[str, Any]:
        with self.jobs.lock:
            record = self.jobs.get(job_id)
            status, _ = api_jobs.job_status(record, api_jobs.flow_runs(record["flow_run_ids"][-1:]))
            allowed = ("queued", "running") if pause else ("validating_files", "queued", "running", "paused")
            if status not in allowed:
                raise ApiError(400, f"job {job_id} is {status}; only a {', '.join(allowed)} job can be "
                               + ("paused" if pause else "cancelled"), param="id", code="invalid_state")
            verb = "paused" if pause else "cancelled"
            if record["flow_run_ids"]:
                api_jobs.set_flow_run_cancelled(record["flow_run_ids"][-1], f"{verb} through the fine-tuning API")
            if pause:
                record["paused"] = True
                api_jobs.add_event(record, "Job paused: its flow run is cancelled; resume continues from the "
                                   "finished stages and the last training checkpoint")
            else:
                record["cancelled"], record["paused"] = True, False
                api_jobs.add_event(record, "Job cancelled")
            self.jobs.save(record)
        return self.view(record)

    def resume(self, job_id: str) -> dict[str, Any]:
        with self.jobs.lock:
            record = self.jobs.get(job_id)
            if not record["paused"]:
                status, _ = api_jobs.job_status(record, api_jobs.flow_runs(record["flow_run_ids"][-1:]))
                raise ApiError(400, f"job {job_id} is {status}, not paused", param="id", code="invalid_state")
            self._wait_until_final(record["flow_run_ids"][-1])
            if api_jobs.release_model_lock(record):
                api_jobs.add_event(record, "Released the registered model's lock that the paused run held")
            record["flow_run_ids"].append(api_jobs.start_flow_run(record))
            record["paused"] = False
            api_jobs.add_event(record, f"Job resumed (Prefect flow run {record['flow_run_ids'][-1]})")
            self.jobs.save(record)
        return self.view(record)

    @staticmethod
    def _wait_until_final(run_id: str, timeout: float = 120.0) -> None:
        """A paused run must have stopped before its successor starts (they share the
        training folder)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            run = api_jobs.flow_runs([run_id])[run_id]
            if run.state.is_final():
                return
            time.sleep(1)
        raise ApiError(409, f"the paused job's flow run {run_id} has not stopped yet; try again",
                       param="id", code="invalid_state")

    def events(self, job_id: str) -> list[dict[str, Any]]:
        """The job's events, newest first."""
        record = self.jobs.get(job_id)
        events = list(record["events"])
        if record["flow_run_ids"]:
            for log in api_jobs.flow_run_logs(record["flow_run_ids"]):
                level = "error" if log.level >= 40 else "warn" if log.level >= 30 else "info"
                events.append({"object": "fine_tuning.job.event", "id": f"ftevent-{log.id.hex[:24]}",
                               "created_at": int(log.timestamp.timestamp()), "level": level,
                               "message": log.message, "data": {"flow_run_id": str(log.flow_run_id)},
                               "type": "message"})
            client_, parents = api_jobs.pipeline_runs(record)
            steps = api_jobs.step_metrics(client_, api_jobs.training_runs(client_, parents))
            for step, entry in steps.items():
                metrics = entry["metrics"]
                summary = ", ".join(f"{k} {metrics[k]:.4g}" for k in ("train/reward_mean", "train/score_mean",
                                                                       "eval/reward_mean") if k in metrics)
                events.append({"object": "fine_tuning.job.event", "id": f"ftevent-{job_id[6:18]}step{step:06d}",
                               "created_at": int(entry["timestamp"] / 1000), "level": "info",
                               "message": f"Step {step}: {summary}", "data": {"step": step, **metrics},
                               "type": "metrics"})
        view = self.view(record)
        if view["status"] in ("succeeded", "failed", "cancelled"):
            message = {"succeeded": f"The job has successfully completed: {view['fine_tuned_model']}",
                       "failed": f"The job failed: {(view['error'] or {}).get('message')}",
                       "cancelled": "The job was cancelled"}[view["status"]]
            events.append({"object": "fine_tuning.job.event", "id": f"ftevent-{job_id[6:24]}end",
                           "created_at": view["finished_at"] or int(time.time()),
                           "level": "error" if view["status"] == "failed" else "info", "message": message,
                           "data": {}, "type": "message"})
        return sorted(events, key=lambda e: (-e["created_at"], e["id"]))

    # models

    def model_entries(self) -> list[dict[str, Any]]:
        from tasks.tracking import mlflow_client, resolve_tracking_uri

        entries = []
        for record in self.jobs.list():
            if self.view(record)["fine_tuned_model"] is None:
                continue
            record = self.jobs.get(record["id"])  # with the result that view() recorded
            result = record["result"]
            client = mlflow_client(resolve_tracking_uri(record["parameters"]["config"]["mlflow"]["tracking_uri"]))
            version = client.get_model_version(result["registered_model"], result["version"])
            entries.append({"id": api_jobs.fine_tuned_name(record), "object": "model", "created": record["created_at"],
                            "owned_by": api_jobs.ORGANIZATION, "root": record["model"],
                            "registered_model": result["registered_model"], "version": result["version"],
                            "aliases": sorted(version.aliases or []),
                            "model_uri": f"models:/{result['registered_model']}/{result['version']}"})
        return entries

    def model_uri(self, name: str) -> tuple[str, str]:
        """The `models:/` URI a fine-tuned model or checkpoint name stands for, and its store."""
        from tasks.tracking import resolve_tracking_uri

        base, step = api_jobs.split_checkpoint_name(name)
        for record in self.jobs.list():
            if api_jobs.fine_tuned_name(record) != base:
                continue
            tracking_uri = resolve_tracking_uri(record["parameters"]["config"]["mlflow"]["tracking_uri"])
            if step is not None:
                for checkpoint in api_jobs.checkpoints(record):
                    if checkpoint["step_number"] == step:
                        return checkpoint["model_uri"], tracking_uri
                break
            entry = next((e for e in self.model_entries() if e["id"] == name), None)
            if entry:
                return entry["model_uri"], tracking_uri
        raise ApiError(404, f"The model {name!r} does not exist (GET /v1/models lists the fine-tuned models)",
                       param="model", code="model_not_found", kind="invalid_request_error")

    def service(self, name: str) -> Any:
        from trainer.model_server import EngineService
        from trainer.policy import load_registered_policy

        if name not in self.models:
            uri, tracking_uri = self.model_uri(name)
            self.models[name] = EngineService(load_registered_policy(uri, tracking_uri=tracking_uri, device="cpu"),
                                              max_slots=8, max_len=2048)
        return self.models[name]

    def close(self) -> None:
        self.validating.shutdown(wait=False, cancel_futures=True)
        for service in self.models.values():
            service.close()


def create_api_app(config: PipelineConfig, *, work_dir: Path, api_key: str | None = None) -> FastAPI:
    """The fine-tuning API over `config` (the server's own config: everything a job does
    not set), storing under `work_dir`."""
    from trainer.graders import GraderConfigError, grade_async, sample_from_text, validate_grader
    from trainer.model_server import chat_completion, parse_chat_request

    api = FineTuningApi(config, work_dir)
    app = FastAPI(title="agentrft fine-tuning API")
    if api_key:
        app.add_middleware(RequireApiKey, key=api_key, open_paths=())
    app.state.api = api
    app.router.on_shutdown.append(api.close)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0]
        param = ".".join(str(p) for p in first["loc"] if p not in ("body", "query", "path"))
        return JSONResponse(ApiError(400, f"{param}: {first['msg']}", param=param).body(), status_code=400)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        message = f"Unknown request URL: {request.method} {request.url.path}" if exc.status_code == 404 else exc.detail
        return JSONResponse(ApiError(exc.status_code, str(message)).body(), status_code=exc.status_code)

    async def json_body(request: Request) -> dict[str, Any]:
        try:
            body = await request.json()
        except ValueError:
            raise ApiError(400, "the request body is not valid JSON") from None
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object")
        return body

    def blocking(function: Any, *args: Any, **kwargs: Any) -> Any:
        return asyncio.to_thread(function, *args, **kwargs)

    # files

    @app.post("/v1/files")
    async def upload(request: Request) -> dict[str, Any]:
        form = await request.form()
        upload, purpose = form.get("file"), form.get("purpose")
        if purpose not in PURPOSES:
            raise ApiError(400, f"purpose {purpose!r} is not supported here; use 'fine-tune'", param="purpose",
                           code="invalid_value")
        if upload is None or isinstance(upload, str):
            raise ApiError(400, "file is required (multipart form field `file`)", param="file",
                           code="missing_required_parameter")
        content = await upload.read()
        try:
            record = await blocking(api.files.add, upload.filename or "upload.jsonl", content, purpose)
        except DataError as exc:
            raise ApiError(400, f"Invalid file format: {exc}", param="file", code="invalid_file_format") from None
        return public(record)

    @app.get("/v1/files")
    async def list_files(after: str | None = None, limit: int = 100, purpose: str | None = None,
                         order: str = "desc") -> dict[str, Any]:
        records = [public(r) for r in api.files.list() if purpose in (None, r["purpose"])]
        return _page(records if order == "desc" else records[::-1], after, min(limit, 100))

    def file_record(file_id: str) -> dict[str, Any]:
        record = api.files.get(file_id)
        if record is None:
            raise not_found("file", file_id)
        return record

    @app.get("/v1/files/{file_id}")
    async def get_file(file_id: str) -> dict[str, Any]:
        return public(file_record(file_id))

    @app.get("/v1/files/{file_id}/content")
    async def file_content(file_id: str) -> Response:
        return Response(api.files.path(file_record(file_id)).read_bytes(), media_type="application/octet-stream")

    @app.delete("/v1/files/{file_id}")
    async def delete_file(file_id: str) -> dict[str, Any]:
        file_record(file_id)
        api.files.delete(file_id)
        return {"id": file_id, "object": "file", "deleted": True}

    # jobs

    @app.post("/v1/fine_tuning/jobs")
    async def create_job(request: Request) -> dict[str, Any]:
        return await blocking(api.create_job, await json_body(request))

    @app.get("/v1/fine_tuning/jobs")
    async def list_jobs(request: Request, after: str | None = None, limit: int = 20) -> dict[str, Any]:
        wanted = {key[len("metadata["):-1]: value for key, value in request.query_params.items()
                  if key.startswith("metadata[") and key.endswith("]")}
        records = [r for r in api.jobs.list() if all((r["metadata"] or {}).get(k) == v for k, v in wanted.items())]
        page = _page(records, after, limit)
        page["data"] = [await blocking(api.view, r) for r in page["data"]]
        return page

    @app.get("/v1/fine_tuning/jobs/{job_id}")
    async def get_job(job_id: str) -> dict[str, Any]:
        return await blocking(lambda: api.view(api.jobs.get(job_id)))

    @app.post("/v1/fine_tuning/jobs/{job_id}/cancel")
    async def cancel_job(job_id: str) -> dict[str, Any]:
        return await blocking(api.cancel, job_id)

    @app.post("/v1/fine_tuning/jobs/{job_id}/pause")
    async def pause_job(job_id: str) -> dict[str, Any]:
        return await blocking(api.cancel, job_id, pause=True)

    @app.post("/v1/fine_tuning/jobs/{job_id}/resume")
    async def resume_job(job_id: str) -> dict[str, Any]:
        return await blocking(api.resume, job_id)

    @app.get("/v1/fine_tuning/jobs/{job_id}/events")
    async def job_events(job_id: str, after: str | None = None, limit: int = 20) -> dict[str, Any]:
        return _page(await blocking(api.events, job_id), after, limit)

    @app.get("/v1/fine_tuning/jobs/{job_id}/checkpoints")
    async def job_checkpoints(job_id: str, after: str | None = None, limit: int = 10) -> dict[str, Any]:
        record = api.jobs.get(job_id)
        found = await blocking(api_jobs.checkpoints, record)
        return _page([{k: v for k, v in c.items() if k != "model_uri"} for c in found], after, limit)

    # graders

    def grader_of(body: dict[str, Any]) -> dict[str, Any]:
        grader = body.get("grader")
        try:
            validate_grader(grader)
        except GraderConfigError as exc:
            raise ApiError(400, f"grader: {exc}", param="grader", code="invalid_grader") from None
        return grader

    @app.post("/v1/fine_tuning/alpha/graders/validate")
    async def validate(request: Request) -> dict[str, Any]:
        return {"grader": grader_of(await json_body(request))}

    @app.post("/v1/fine_tuning/alpha/graders/run")
    async def run_grader(request: Request) -> dict[str, Any]:
        body = await json_body(request)
        grader = grader_of(body)
        sample = body.get("model_sample")
        if not isinstance(sample, str):
            raise ApiError(400, "model_sample must be a string (the model's output text)", param="model_sample")
        started = time.perf_counter()
        try:
            result = await grade_async(grader, sample_from_text(sample), body.get("item") or {})
        except ConfigError as exc:
            raise ApiError(400, str(exc), param="grader", code="invalid_grader") from None
        return grader_run_answer(grader, result, time.perf_counter() - started)

    # models

    @app.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        return {"object": "list", "data": await blocking(api.model_entries)}

    @app.get("/v1/models/{model:path}")
    async def get_model(model: str) -> dict[str, Any]:
        entry = next((e for e in await blocking(api.model_entries) if e["id"] == model), None)
        if entry is None:
            raise ApiError(404, f"The model {model!r} does not exist", param="model", code="model_not_found")
        return entry

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        body = parse_chat_request(await request.body())
        if isinstance(body, Response):
            return body
        if not body.model:
            raise ApiError(400, "model is required", param="model", code="missing_required_parameter")
        service = await blocking(api.service, body.model)
        return await chat_completion(service, body, model_name=body.model)

    return app


# --- the command ----------------------------------------------------------------------------


def _tail(lines: deque) -> str:
    return "\n".join(lines) or "(no output)"


def _pump(process: subprocess.Popen, tail: deque) -> None:
    import threading

    def read() -> None:
        for line in process.stderr:
            tail.append(line.rstrip())
            print(line, end="", file=sys.stderr)

    threading.Thread(target=read, daemon=True).start()


def _start_prefect_server(port: int) -> tuple[subprocess.Popen, str]:
    """A Prefect server on loopback (with its SQLite database in the user's Prefect home)."""
    import httpx

    url = f"http://127.0.0.1:{port}/api"
    process = subprocess.Popen([sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1",
                                "--port", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    tail: deque = deque(maxlen=20)
    _pump(process, tail)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AgentRFTError(f"the Prefect server exited with status {process.returncode}:\n{_tail(tail)}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return process, url
        except httpx.HTTPError:
            pass
        time.sleep(1)
    process.terminate()
    raise AgentRFTError(f"the Prefect server did not answer on {url} within 180 s:\n{_tail(tail)}")


def _serve_deployment(config_path: Path, overrides: list[str], env: dict[str, str]) -> subprocess.Popen:
    """`agentrft serve` as a child: the pipeline deployment, ready to run jobs."""
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    # In this process's folder, as `agentrft serve` would be: the config's relative paths mean
    # the same to the jobs' runs as to this server.
    env = {**env, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))}
    process = subprocess.Popen([sys.executable, "-m", "flows.cli", "serve", "--config", str(config_path),
                                *(f"--set={o}" for o in overrides)], env=env,
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    tail: deque = deque(maxlen=30)
    _pump(process, tail)
    deadline = time.monotonic() + 300
    with get_client(sync_client=True) as client:
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise AgentRFTError(f"serving the pipeline deployment failed (status {process.returncode}):\n"
                                    + _tail(tail))
            try:
                client.read_deployment_by_name(api_jobs.PIPELINE_DEPLOYMENT_NAME)
                return process
            except ObjectNotFound:
                time.sleep(1)
    process.terminate()
    raise AgentRFTError(f"the pipeline deployment did not appear within 300 s:\n{_tail(tail)}")


def serve_api(config_path: Path, overrides: list[str], config: PipelineConfig, *, host: str, port: int,
              api_key: str | None, prefect_port: int) -> None:
    """Serve the API until interrupted, with the deployment (and a Prefect server unless
    PREFECT_API_URL names one)."""
    import uvicorn
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from tasks.tracking import mlflow_client, resolve_tracking_uri

    tracking_uri = resolve_tracking_uri(config.mlflow.tracking_uri)
    # The store's schema is made here, once: made by this server's first read while a job's
    # flow run makes it too, SQLite migrations collide.
    mlflow_client(tracking_uri)
    # uvicorn re-raises SIGTERM after its shutdown with the handler it found: make that one
    # an exit, so the `finally` below still stops the children.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    children = []
    try:
        url = PREFECT_API_URL.value()
        if not url:
            server, url = _start_prefect_server(prefect_port)
            children.append(server)
            print(f"Prefect server (UI): {url.removesuffix('/api')}", file=sys.stderr)
        os.environ["PREFECT_API_URL"] = url  # threads that do not copy the context read it from here
        with temporary_settings({PREFECT_API_URL: url}):
            children.append(_serve_deployment(config_path, overrides, {**os.environ, "PREFECT_API_URL": url}))
            config = config.model_copy(update={"mlflow": config.mlflow.model_copy(
                update={"tracking_uri": tracking_uri})})
            work_dir = Path(config.work_dir).resolve() / "api"
            app = create_api_app(config, work_dir=work_dir, api_key=api_key)
            print(f"fine-tuning API: http://{host}:{port}/v1 (jobs run the deployment "
                  f"{api_jobs.PIPELINE_DEPLOYMENT_NAME} on {url})", file=sys.stderr)
            uvicorn.run(app, host=host, port=port, log_level="warning")
    finally:
        for child in reversed(children):
            child.terminate()
            try:
                child.wait(timeout=30)
            except subprocess.TimeoutExpired:
                child.kill()
