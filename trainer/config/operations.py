"""Where the pipeline runs and reports: `mlflow`, `schedule`, the post-promotion
`monitor` and the OpenAI-compatible `api` server."""

from __future__ import annotations

import warnings
from typing import Any

from pydantic import Field, field_validator, model_validator

from trainer.config.section import Section
from trainer.outbound import check_entries


class MlflowConfig(Section):
    tracking_uri: str = Field("sqlite:///mlflow.db", description="MLflow tracking URI (SQLite or a server).")
    experiment: str = Field("agent-rft", description="Experiment name.")
    unavailable_timeout_s: float = Field(
        300.0, gt=0, description="How long logging keeps retrying an unreachable tracking server."
    )
    traces_per_evaluation: int = Field(
        8, ge=0, description="Rollouts of each evaluation (and of each training step) kept as MLflow traces."
    )


class ScheduleConfig(Section):
    cron: str = Field("0 2 * * *", description="Cron of the served pipeline deployment (default nightly).")
    timezone: str = Field("UTC", description="Timezone of the cron.")


class MonitorConfig(Section):
    """`agentrft monitor`: the served model's recent traffic against the expectation suite
    and the grader, window by window."""

    traffic_file: str | None = Field(
        None, description="JSONL log of production requests the serving side appends to: rows shaped as the "
        "items (messages, tools, reference fields where known, timestamp) plus `response`, what the model "
        "answered (an OpenAI message, a chat completion or text). None: read traces_experiment.")
    traces_experiment: str | None = Field(
        "agentrft-served", description="MLflow experiment (in mlflow.tracking_uri) of `serve-model --trace-to` "
        "traces, read when traffic_file is None; reference fields come from each trace's `item` expectation.")
    window_rows: int = Field(200, ge=1, description="Requests per window (the suite's distribution checks need "
                             "200 rows, the derivation's distribution_min_rows).")
    windows: int = Field(3, ge=1, description="The most recent windows read at each run.")
    expectations_suite: str | None = Field(
        None, description="Suite the windows are checked against (None: data.expectations_suite, the one derived "
        "from earlier traffic); none at all: no drift check.")
    max_failed_expectations: int = Field(
        0, ge=0, description="Failed expectations allowed in the latest window before the run fails (drift).")
    max_score_drop: float = Field(
        0.1, ge=0, description="Largest fall of the latest window's mean score below the reference before the run "
        "fails.")
    reference_score: float | None = Field(
        None, description="The score windows are compared to (None: the oldest window read).")
    min_scored_rows: int = Field(
        20, ge=1, description="Graded answers a window needs for its score to count (rows with reference fields, "
        "or a grader that needs none).")
    cron: str = Field("15 * * * *", description="Cron of the served monitor deployment (default hourly).")


class ApiConfig(Section):
    """`agentrft api`: what the server accepts from the holders of its key."""

    max_file_bytes: int = Field(
        512 * 1024 * 1024, ge=1, description="Largest upload (OpenAI: 512 MB); a larger one is a 413 and leaves "
        "nothing behind. `--max-file-bytes` overrides it.")
    max_json_bytes: int = Field(
        1024 * 1024, ge=1, description="Largest JSON body of the other routes (jobs, graders, chat completions): "
        "larger ones get a 413 before they are read whole.")
    allowed_hosts: list[str] | None = Field(
        None, description="Where the requests a job or a key holder names may go (tools' server_url, endpoint "
        "graders' url, model graders' base_url): host, host:port or CIDR entries, checked when a job is made and "
        "on the resolved address at connect time; link-local and metadata addresses only where named explicitly. "
        "None: loopback (127.0.0.1, ::1, localhost) and the hosts this config names itself.")
    allow_any_host: bool = Field(
        False, description="Let jobs and graders call any host (no allowed_hosts check). `--allow-any-host` sets it.")
    allow_unfenced_python_graders: bool = Field(
        False, description="Run python graders sent to the API on a kernel without Landlock (no file-system fence): "
        "off, they are refused with the reason. `--allow-unfenced-python-graders` sets it.")
    max_chat_queue: int = Field(
        16, ge=1, description="Chat completions waiting per served model beyond those generating; more get a 429 "
        "with Retry-After.")

    @model_validator(mode="before")
    @classmethod
    def _old_name(cls, raw: Any) -> Any:
        """`allowed_tool_hosts`, the old name (tools only), read as allowed_hosts."""
        if isinstance(raw, dict) and "allowed_tool_hosts" in raw:
            raw = dict(raw)
            old = raw.pop("allowed_tool_hosts")
            if old is not None:
                if raw.get("allowed_hosts") is not None:
                    raise ValueError("api.allowed_tool_hosts is the old name of api.allowed_hosts: give one of them")
                warnings.warn("api.allowed_tool_hosts is deprecated: it is read as api.allowed_hosts, which covers "
                              "graders too", DeprecationWarning, stacklevel=2)
                raw["allowed_hosts"] = old
        return raw

    @field_validator("allowed_hosts")
    @classmethod
    def _entries(cls, entries: list[str] | None) -> list[str] | None:
        return check_entries(entries, "api.allowed_hosts")
