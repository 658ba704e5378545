"""`FineTuningApi`: what the routes do. Jobs are created, validated and queued as runs of
the pipeline deployment; their view, events and checkpoints are read from Prefect and
MLflow; fine-tuned models are served for chat completions, one engine per model."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from flows.openai_api.coalesce import Coalesced, digest
from flows.openai_api.errors import ERROR_FLAGS, OPENAI_ERROR_FLAGS, ApiError
from flows.openai_api.files import FileStore
from flows.openai_api.jobs import (
    ORGANIZATION,
    JobStore,
    add_event,
    check_method,
    content_problem,
    fine_tuned_name,
    grader_urls,
    job_config,
    method_of,
    new_job,
    split_checkpoint_name,
    supervised_job_config,
    supervised_method,
)
from flows.openai_api.runs import (
    checkpoints,
    flow_run_logs,
    flow_runs,
    job_result,
    job_stage,
    job_status,
    pipeline_runs,
    reinforcement_message,
    reinforcement_metrics,
    release_model_lock,
    set_flow_run_cancelled,
    start_flow_run,
    step_metrics,
    supervised_message,
    supervised_metrics,
    total_steps,
    training_eta,
    training_runs,
)
from trainer.config.pipeline import PipelineConfig
from trainer.config.training import TrainingConfig, resolved_hyperparameters
from trainer.config.warm_start import WarmStartConfig, resolved_warm_start
from trainer.errors import ConfigError, DataError
from trainer.graders.python_grader import require_fence
from trainer.outbound import LOOPBACK, HostPolicy


def _has_python_grader(grader: Any) -> bool:
    if not isinstance(grader, dict):
        return False
    if grader.get("type") == "python":
        return True
    return grader.get("type") == "multi" and any(_has_python_grader(g) for g in (grader.get("graders") or {}).values())


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
    flags: dict[str, Any] = dict.fromkeys(OPENAI_ERROR_FLAGS, False)
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


def own_hosts(config: PipelineConfig) -> list[str]:
    """host:port of every URL the server's own config names: its tools, its grader's judges
    and endpoints, its vLLM servers, and its tools.allowed_hosts."""
    urls = [endpoint.server_url for endpoint in config.tools.endpoints] + config.rollout.vllm.urls
    urls += [url for _, url in grader_urls(config.grader, "grader")]
    entries = list(config.tools.allowed_hosts or [])
    for url in urls:
        parts = urlsplit(url)
        if parts.hostname:
            host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
            entries.append(f"{host}:{parts.port or (443 if parts.scheme == 'https' else 80)}")
    return entries


def outbound_policy(config: PipelineConfig) -> HostPolicy | None:
    """The server's policy: None with api.allow_any_host; api.allowed_hosts where set; else
    loopback and the hosts its own config names."""
    if config.api.allow_any_host:
        return None
    if config.api.allowed_hosts is not None:
        return HostPolicy(config.api.allowed_hosts)
    return HostPolicy(dict.fromkeys([*LOOPBACK, *own_hosts(config)]))


class FineTuningApi:
    """The state behind the routes: files, jobs, the server config, loaded models."""

    def __init__(self, config: PipelineConfig, work_dir: Path):
        from trainer.graders.python_grader import fence_problems

        self.base = config.model_dump(mode="json")
        self.settings = config.api
        # Graders sent over the network run fenced off the server's files (Landlock) and the
        # network and processes (seccomp); where the machine cannot fence them they are refused
        # unless the operator accepts the risk.
        self.python_fence_problems = fence_problems()
        self.python_graders_fenced = not self.python_fence_problems
        # Where the requests that jobs and graders name may go (None: anywhere).
        self.outbound = outbound_policy(config)
        self.files = FileStore(work_dir / "files", max_bytes=config.api.max_file_bytes)
        self.jobs = JobStore(work_dir / "jobs")
        self.validating = ThreadPoolExecutor(max_workers=1, thread_name_prefix="validating-files")
        self.models: dict[str, Any] = {}
        self._reads = Coalesced(ttl_s=1.0)  # a job's view and events, polled by many clients at once

    # jobs

    def check_python_graders(self, grader: Any, param: str) -> None:
        """A python grader (alone or inside a multi) where no fence can hold it: refused,
        unless the server was started to accept that."""
        if self.python_graders_fenced or self.settings.allow_unfenced_python_graders:
            return
        if _has_python_grader(grader):
            raise ApiError(400, "python graders are refused by this server: its kernel offers no Landlock file-system "
                           "fence, so a python grader could read and write the server's files (the MLflow store, the "
                           "registry's models, the code). Use another grader type, run the server on Linux 5.13 or "
                           "later, or start it with --allow-unfenced-python-graders to accept that risk ("
                           + "; ".join(self.python_fence_problems) + ")",
                           param=param, code="python_grader_unfenced")

    def base_model_of(self, model: str) -> str:
        """The base model a job names, checked: a model folder, a `models:/` URI of the store, an
        `ft:` name this server made (as its `models:/` URI) or a hub id the model cache holds."""
        from tasks.tracking import mlflow_client, resolve_tracking_uri

        if model.startswith("ft:"):
            try:
                return self.model_uri(model)[0]
            except ApiError:
                raise ApiError(400, f"model {model!r} is no fine-tuned model of this server (GET /v1/models lists "
                               "them)", param="model", code="model_not_found") from None
        if model.startswith("models:/"):
            name, sep, ref = model.removeprefix("models:/").partition("@")
            name, slash, version = name.partition("/") if not sep else (name, "", "")
            client = mlflow_client(resolve_tracking_uri(self.base["mlflow"]["tracking_uri"]))
            try:
                if sep:
                    client.get_model_version_by_alias(name, ref)
                elif slash:
                    client.get_model_version(name, version)
                else:
                    client.get_registered_model(name)
            except Exception:
                raise ApiError(400, f"model {model!r} is not in this server's MLflow registry", param="model",
                               code="model_not_found") from None
            return model
        path = Path(model)
        if path.is_absolute() or model.startswith((".", "~")) or path.exists():
            if not (path.expanduser() / "config.json").is_file():
                raise ApiError(400, f"model {model!r} is not a model folder (no config.json in it); give a "
                               "transformers model folder, a models:/ URI, an ft: name of this server or a hub id "
                               "the server's model cache holds", param="model", code="model_not_found")
            return str(path.expanduser())
        from huggingface_hub import try_to_load_from_cache

        if not isinstance(try_to_load_from_cache(model, "config.json"), str):
            raise ApiError(400, f"model {model!r} is neither a model folder, a models:/ URI, an ft: name of this "
                           "server, nor a hub id in the server's model cache (this server does not download "
                           "models)", param="model", code="model_not_found")
        return model

    def create_job(self, body: dict[str, Any]) -> dict[str, Any]:
        for key in ("model", "training_file"):
            if not body.get(key):
                raise ApiError(400, f"{key} is required", param=key, code="missing_required_parameter")
        section = check_method(body)
        if method_of(body) == "supervised":
            base_model = self.base_model_of(str(body["model"]))
            config, notes = supervised_job_config(body, self.files, self.base, base_model=base_model)
            body = {**body, "method": supervised_method(body)}
        else:
            self.check_python_graders(section.get("grader"), "method.reinforcement.grader")
            base_model = self.base_model_of(str(body["model"]))
            config, notes = job_config(body, self.files, self.base, base_model=base_model, policy=self.outbound)
        if not self.settings.allow_unfenced_python_graders:
            # In the job's config, so the requirement travels with it to any work pool (a
            # training deployment's workers do not share this server's environment).
            config = config.model_copy(update={"grader": require_fence(config.grader)})
        record = new_job(body, config, notes)
        self.jobs.save(record)
        self.validating.submit(self._validate_and_queue, record["id"], config)
        return self.view(record)

    def _validate_and_queue(self, job_id: str, config: PipelineConfig) -> None:
        try:
            problem = content_problem(config, self.jobs.get(job_id), self.files)
        except (DataError, ConfigError) as exc:
            problem = {"code": "invalid_file", "message": str(exc), "param": "training_file"}
        with self.jobs.lock:
            record = self.jobs.get(job_id)
            if record["cancelled"]:
                return
            if problem:
                record["error"], record["finished_at"] = problem, int(time.time())
                add_event(record, f"File validation failed: {problem['message']}", level="error")
            else:
                try:
                    record["flow_run_ids"].append(start_flow_run(record))
                    add_event(record, "Files validated, moving job to queued state "
                                       f"(Prefect flow run {record['flow_run_ids'][-1]})")
                except Exception as exc:
                    record["error"] = {"code": "server_error", "param": None,
                                       "message": f"could not start the pipeline deployment: {exc}"}
                    add_event(record, record["error"]["message"], level="error")
            self.jobs.save(record)

    def view(self, record: dict[str, Any]) -> dict[str, Any]:
        """OpenAI's job object, its status read from Prefect (and its model from MLflow); reads
        of the same record at once share one (coalesce.py)."""
        return self._reads.get(("view", record["id"], digest(record)), lambda: self._view(record))

    def _view(self, record: dict[str, Any]) -> dict[str, Any]:
        runs = flow_runs(record["flow_run_ids"][-1:])
        status, run = job_status(record, runs)
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
                    record["result"] = job_result(record)
                    self.jobs.save(record)
            if record["result"] and record["result"]["version"]:
                fine_tuned = fine_tuned_name(record)
        if status in ("running", "succeeded", "failed", "cancelled", "paused") and record["flow_run_ids"]:
            client, parents = pipeline_runs(record)
            steps = step_metrics(client, training_runs(client, parents, job_stage(record)))
            trained_tokens = int(sum(s["metrics"].get("train/tokens_mean", 0.0) * s["metrics"].get("train/rollouts", 0.0)
                                     + s["metrics"].get("warm_start/tokens", 0.0)
                                     for s in steps.values())) if steps else None
        estimated_finish = training_eta(record["flow_run_ids"][-1]) if status == "running" else None
        if job_stage(record) == "warm_start":
            hyper = resolved_warm_start(WarmStartConfig.model_validate(record["parameters"]["config"]["warm_start"]))
        else:
            hyper = resolved_hyperparameters(TrainingConfig.model_validate(record["parameters"]["config"]["training"]))
        return {
            "object": "fine_tuning.job", "id": record["id"], "created_at": record["created_at"],
            "model": record["model"], "organization_id": ORGANIZATION, "status": status, "error": error,
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
            status, _ = job_status(record, flow_runs(record["flow_run_ids"][-1:]))
            allowed = ("queued", "running") if pause else ("validating_files", "queued", "running", "paused")
            if status not in allowed:
                raise ApiError(400, f"job {job_id} is {status}; only a {', '.join(allowed)} job can be "
                               + ("paused" if pause else "cancelled"), param="id", code="invalid_state")
            verb = "paused" if pause else "cancelled"
            if record["flow_run_ids"]:
                set_flow_run_cancelled(record["flow_run_ids"][-1], f"{verb} through the fine-tuning API")
            if pause:
                record["paused"] = True
                add_event(record, "Job paused: its flow run is cancelled; resume continues from the "
                                   "finished stages and the last training checkpoint")
            else:
                record["cancelled"], record["paused"] = True, False
                add_event(record, "Job cancelled")
            self.jobs.save(record)
        return self.view(record)

    def resume(self, job_id: str) -> dict[str, Any]:
        with self.jobs.lock:
            record = self.jobs.get(job_id)
            if not record["paused"]:
                status, _ = job_status(record, flow_runs(record["flow_run_ids"][-1:]))
                raise ApiError(400, f"job {job_id} is {status}, not paused", param="id", code="invalid_state")
            self._wait_until_final(record["flow_run_ids"][-1])
            if release_model_lock(record):
                add_event(record, "Released the registered model's lock that the paused run held")
            record["flow_run_ids"].append(start_flow_run(record))
            record["paused"] = False
            add_event(record, f"Job resumed (Prefect flow run {record['flow_run_ids'][-1]})")
            self.jobs.save(record)
        return self.view(record)

    @staticmethod
    def _wait_until_final(run_id: str, timeout: float = 120.0) -> None:
        """A paused run must have stopped before its successor starts (they share the
        training folder)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            run = flow_runs([run_id])[run_id]
            if run.state.is_final():
                return
            time.sleep(1)
        raise ApiError(409, f"the paused job's flow run {run_id} has not stopped yet; try again",
                       param="id", code="invalid_state")

    def events(self, job_id: str) -> list[dict[str, Any]]:
        """The job's events, newest first; reads of the same record at once share one."""
        record = self.jobs.get(job_id)
        return self._reads.get(("events", job_id, digest(record)), lambda: self._events(record))

    def _events(self, record: dict[str, Any]) -> list[dict[str, Any]]:
        job_id = record["id"]
        events = list(record["events"])
        if record["flow_run_ids"]:
            for log in flow_run_logs(record["flow_run_ids"]):
                level = "error" if log.level >= 40 else "warn" if log.level >= 30 else "info"
                events.append({"object": "fine_tuning.job.event", "id": f"ftevent-{log.id.hex[:24]}",
                               "created_at": int(log.timestamp.timestamp()), "level": level,
                               "message": log.message, "data": {"flow_run_id": str(log.flow_run_id)},
                               "type": "message"})
            client_, parents = pipeline_runs(record)
            supervised = job_stage(record) == "warm_start"
            steps = step_metrics(client_, training_runs(client_, parents, job_stage(record)))
            planned, grader = total_steps(steps), record["parameters"]["config"]["grader"]
            for step, entry in steps.items():
                if supervised and step == 0:  # OpenAI's supervised events start at step 1
                    continue
                data = (supervised_metrics(entry["metrics"], step, planned) if supervised
                        else reinforcement_metrics(entry["metrics"], step, planned, grader))
                message = supervised_message(data) if supervised else reinforcement_message(data)
                events.append({"object": "fine_tuning.job.event", "id": f"ftevent-{job_id[6:18]}step{step:06d}",
                               "created_at": int(entry["timestamp"] / 1000), "level": "info",
                               "message": message, "data": data, "type": "metrics"})
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
            entries.append({"id": fine_tuned_name(record), "object": "model", "created": record["created_at"],
                            "owned_by": ORGANIZATION, "root": record["model"],
                            "registered_model": result["registered_model"], "version": result["version"],
                            "aliases": sorted(version.aliases or []),
                            "model_uri": f"models:/{result['registered_model']}/{result['version']}"})
        return entries

    def model_uri(self, name: str) -> tuple[str, str]:
        """The `models:/` URI a fine-tuned model or checkpoint name stands for, and its store."""
        from tasks.tracking import resolve_tracking_uri

        base, step = split_checkpoint_name(name)
        for record in self.jobs.list():
            if fine_tuned_name(record) != base:
                continue
            tracking_uri = resolve_tracking_uri(record["parameters"]["config"]["mlflow"]["tracking_uri"])
            if step is not None:
                for checkpoint in checkpoints(record):
                    if checkpoint["step_number"] == step:
                        return checkpoint["model_uri"], tracking_uri
                break
            entry = next((e for e in self.model_entries() if e["id"] == name), None)
            if entry:
                return entry["model_uri"], tracking_uri
        raise ApiError(404, f"The model {name!r} does not exist (GET /v1/models lists the fine-tuned models)",
                       param="model", code="model_not_found", kind="invalid_request_error")

    def service(self, name: str) -> Any:
        from trainer.generation.policy import load_registered_policy
        from trainer.serving.model_server import EngineService

        if name not in self.models:
            uri, tracking_uri = self.model_uri(name)
            self.models[name] = EngineService(load_registered_policy(uri, tracking_uri=tracking_uri, device="cpu"),
                                              max_slots=8, max_len=2048, max_queue=self.settings.max_chat_queue)
        return self.models[name]

    def close(self) -> None:
        self.validating.shutdown(wait=False, cancel_futures=True)
        for service in self.models.values():
            service.close()
