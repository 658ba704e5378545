"""`agentrft api`: OpenAI's fine-tuning API, served here, for the official `openai` SDK.

Point a client at it (`OpenAI(base_url="http://127.0.0.1:8100/v1", api_key=...)`) and the
calls of a fine-tuning script work unchanged: Files (`/v1/files`), jobs
(`/v1/fine_tuning/jobs`, with cancel, pause, resume, events, checkpoints), graders
(`/v1/fine_tuning/alpha/graders/validate` and `/run`), models (`/v1/models`) and chat
completions with tool calls on the fine-tuned models. Answers and errors are OpenAI's
JSON shapes and HTTP statuses (`{"error": {"message", "type", "param", "code"}}`).

A job is a run of the pipeline deployment (`flows/openai_api/jobs.py`): the server serves that
deployment from a child process (`agentrft serve`, the same deployment a cron or the
Prefect UI runs) on the Prefect server that PREFECT_API_URL names, or on one it starts on
loopback. Uploads and job records live under `<work_dir>/api/`.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException

from flows.openai_api.errors import ApiError, not_found
from flows.openai_api.files import PURPOSES, FileTooLarge, public
from flows.openai_api.jobs import check_outbound, grader_urls
from flows.openai_api.multipart import receive_upload
from flows.openai_api.runs import checkpoints
from flows.openai_api.service import FineTuningApi, _page, grader_run_answer
from trainer.api_key import RequireApiKey
from trainer.config.pipeline import PipelineConfig
from trainer.errors import ConfigError, DataError


def create_api_app(config: PipelineConfig, *, work_dir: Path, api_key: str | None = None) -> FastAPI:
    """The fine-tuning API over `config` (the server's own config: everything a job does
    not set), storing under `work_dir`."""
    from trainer.graders import GraderConfigError, grade_async, sample_from_text, validate_grader
    from trainer.graders.context import GraderContext
    from trainer.serving.model_server import (
        BodyTooLarge,
        capped_body,
        chat_completion,
        parse_chat_request,
    )

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

    async def capped(request: Request) -> bytes:
        try:
            return await capped_body(request, config.api.max_json_bytes, setting="api.max_json_bytes")
        except BodyTooLarge as exc:
            raise ApiError(413, str(exc), code="request_too_large") from None

    async def json_body(request: Request) -> dict[str, Any]:
        raw = await capped(request)
        try:
            body = json.loads(raw)
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
        try:
            upload, purpose = await receive_upload(request, api.files)
        except FileTooLarge as exc:
            raise ApiError(413, str(exc), param="file", code="file_too_large") from None
        except DataError as exc:
            raise ApiError(400, f"Invalid file format: {exc}", param="file", code="invalid_file_format") from None
        if purpose not in PURPOSES:
            upload.abort()
            raise ApiError(400, f"purpose {purpose!r} is not supported here; use 'fine-tune'", param="purpose",
                           code="invalid_value")
        try:
            record = await blocking(api.files.commit, upload, purpose)
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
        found = await blocking(checkpoints, record)
        return _page([{k: v for k, v in c.items() if k != "model_uri"} for c in found], after, limit)

    # graders

    async def grader_of(body: dict[str, Any]) -> dict[str, Any]:
        """The body's grader, checked: its fields, and every URL it would call against the
        server's allowed hosts (a name is resolved: on a worker thread)."""
        grader = body.get("grader")
        try:
            validate_grader(grader)
        except GraderConfigError as exc:
            raise ApiError(400, f"grader: {exc}", param="grader", code="invalid_grader") from None
        await blocking(check_outbound, api.outbound, grader_urls(grader, "grader"))
        return grader

    @app.post("/v1/fine_tuning/alpha/graders/validate")
    async def validate(request: Request) -> dict[str, Any]:
        return {"grader": await grader_of(await json_body(request))}

    @app.post("/v1/fine_tuning/alpha/graders/run")
    async def run_grader(request: Request) -> dict[str, Any]:
        body = await json_body(request)
        grader = await grader_of(body)
        sample = body.get("model_sample")
        if not isinstance(sample, str):
            raise ApiError(400, "model_sample must be a string (the model's output text)", param="model_sample")
        api.check_python_graders(grader, "grader")
        fence = "best_effort" if api.settings.allow_unfenced_python_graders else "required"
        # Checked again on the address each connection resolves to.
        allowed = api.outbound.entries if api.outbound is not None else None
        started = time.perf_counter()
        try:
            result = await grade_async(grader, sample_from_text(sample), body.get("item") or {},
                                       context=GraderContext(python_fence=fence, allowed_hosts=allowed))
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
        body = parse_chat_request(await capped(request))
        if isinstance(body, Response):
            return body
        if not body.model:
            raise ApiError(400, "model is required", param="model", code="missing_required_parameter")
        service = await blocking(api.service, body.model)
        return await chat_completion(service, body, model_name=body.model)

    return app
