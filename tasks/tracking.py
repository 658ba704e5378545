"""How the pipeline records itself in MLflow (and mirrors a summary to Prefect).

One parent run per pipeline run; one nested run per stage, named after its stage
(docs/architecture.md). Every run carries the same tags (git commit, data md5, config
hash, Prefect flow-run id and UI URL) and the config flattened as params. Everything goes through `MlflowClient` with the
run id named explicitly: MLflow's fluent "active run" is per thread, and Prefect runs
tasks on other threads, so ids travel as plain strings in a `RunContext`.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import time
import traceback
from collections.abc import Iterator
from contextlib import closing, contextmanager
from functools import lru_cache
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

from trainer.errors import AgentRFTError
from trainer.generation.policy import use_mlflow_store
from trainer.rl.metrics import with_retries

_PARAM_BATCH = 100  # MLflow takes at most 100 params per log_batch call
_METRIC_BATCH = 1000


ROOT = Path(__file__).resolve().parents[1]


@lru_cache(maxsize=1)
def git_commit() -> str:
    """This checkout's commit, with `-dirty` when tracked files differ from it (read once)."""
    return commit_of(ROOT)


def commit_of(root: Path) -> str:
    """The commit of the checkout at `root`, with `-dirty` when tracked files differ from it."""
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], cwd=root, capture_output=True, text=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return commit + ("-dirty" if dirty else "")


def resolve_tracking_uri(uri: str) -> str:
    """`sqlite:///relative.db` made absolute, so subprocesses and later runs in other
    directories use the same store (and the same cache keys); a SQLite store is put in WAL
    mode on first use (`write_ahead_log`)."""
    prefix = "sqlite:///"
    if uri.startswith(prefix) and not uri.startswith(prefix + "/"):
        uri = prefix + str(Path(uri[len(prefix):]).resolve())
    if uri.startswith(prefix):
        write_ahead_log(Path(uri[len(prefix):]))
    return uri


_WAL_DONE: set[Path] = set()


def write_ahead_log(db: Path) -> None:
    """SQLite's write-ahead log on the MLflow store, once per file and process.

    MLflow opens SQLite in its default rollback-journal mode, where every reader holds a lock
    that a writer must wait out: the API's polling clients and a training run's metrics then
    take turns, and under load a training stage failed with "database is locked" after
    MLflow's 20 s wait (benchmarks/bench_api_load.py, 100 polls beside a training job). In WAL
    mode readers never block the writer. The mode is kept in the file, so one switch serves
    every later process; a store another process holds busy is left as it is this time."""
    if db in _WAL_DONE or not db.parent.is_dir():
        return
    import sqlite3

    try:
        with closing(sqlite3.connect(db, timeout=5)) as connection:
            connection.execute("PRAGMA journal_mode=WAL")
    except sqlite3.OperationalError:
        return
    _WAL_DONE.add(db)


def mlflow_client(uri: str) -> Any:
    """A client bound to one store for runs *and* registry: MLflow's defaults read
    process-wide state (`set_tracking_uri`, `MLFLOW_REGISTRY_URI`) that other code may set."""
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=uri, registry_uri=uri)


class RunContext(BaseModel):
    """What every stage needs to record into the pipeline's MLflow runs."""

    model_config = ConfigDict(frozen=True)

    tracking_uri: str
    experiment_id: str
    parent_run_id: str
    data_md5: str
    config_hash: str
    config_written_hash: str = ""  # what the config sets (PipelineConfig.written_hash); "" where none was recorded
    config_name: str = ""  # the config's `name` (the parent run's name): what the test ledger calls it
    git_commit: str
    flow_run_id: str
    flow_run_url: str
    mlflow_ui_url: str

    def client(self) -> Any:
        return mlflow_client(self.tracking_uri)

    def tags(self) -> dict[str, str]:
        return {
            "git_commit": self.git_commit,
            "data_md5": self.data_md5,
            "config_hash": self.config_hash,
            "prefect_flow_run_id": self.flow_run_id,
            "prefect_flow_run_url": self.flow_run_url,
        }

    def run_url(self, run_id: str) -> str:
        return f"{self.mlflow_ui_url.rstrip('/')}/#/experiments/{self.experiment_id}/runs/{run_id}"

    def to_json(self) -> dict[str, str]:
        return self.model_dump()


def _prefect_run() -> tuple[str, str]:
    from prefect.runtime import flow_run

    return str(flow_run.id or ""), str(flow_run.ui_url or "")


def _artifact_location(tracking_uri: str) -> str | None:
    """Artifacts of a SQLite store live next to its database (`mlartifacts/`), wherever
    the pipeline was started from; MLflow's default is `./mlruns` of the current folder."""
    if not tracking_uri.startswith("sqlite:///"):
        return None  # a tracking server decides (its --default-artifact-root)
    database = Path(tracking_uri.removeprefix("sqlite:///"))
    return (database.resolve().parent / "mlartifacts").as_uri()


def open_pipeline_run(config: Any, *, data_md5: str, git_commit: str) -> RunContext:
    """Create the parent run (experiment on first use), tagged and with the config as params."""
    tracking_uri = resolve_tracking_uri(config.mlflow.tracking_uri)
    use_mlflow_store(tracking_uri)
    client = mlflow_client(tracking_uri)
    experiment = client.get_experiment_by_name(config.mlflow.experiment)
    experiment_id = (
        experiment.experiment_id if experiment
        else client.create_experiment(config.mlflow.experiment, artifact_location=_artifact_location(tracking_uri))
    )
    flow_run_id, flow_run_url = _prefect_run()
    partial = RunContext(
        tracking_uri=tracking_uri,
        experiment_id=experiment_id,
        parent_run_id="",
        data_md5=data_md5,
        config_hash=config.section_hash(),
        config_written_hash=config.written_hash(),
        config_name=config.name,
        git_commit=git_commit,
        flow_run_id=flow_run_id,
        flow_run_url=flow_run_url,
        mlflow_ui_url=os.environ.get("AGENTRFT_MLFLOW_UI_URL", "http://127.0.0.1:5000"),
    )
    run = client.create_run(experiment_id, run_name=config.name, tags={**partial.tags(), "stage": "pipeline"})
    _log_params(client, run.info.run_id, dict(config))
    return RunContext(**{**partial.to_json(), "parent_run_id": run.info.run_id})


def close_pipeline_run(ctx: RunContext, *, status: str, outcome: dict[str, Any]) -> None:
    """End the parent run with its outcome (FINISHED or FAILED) and a summary artifact."""
    client = ctx.client()
    for key in ("outcome", "reason", "stopped_at"):
        if outcome.get(key):
            client.set_tag(ctx.parent_run_id, key, str(outcome[key])[:5000])
    client.log_dict(ctx.parent_run_id, outcome, "pipeline_outcome.json")
    client.set_terminated(ctx.parent_run_id, status=status)


def flat_params(sections: dict[str, Any]) -> dict[str, str]:
    """Config sections (pydantic models or plain values) flattened as `section.key`
    strings, the way MLflow params are shown. Headers keep their `${VAR}` templates."""
    flat: dict[str, str] = {}

    def walk(prefix: str, value: Any) -> None:
        if hasattr(value, "model_dump"):
            value = value.model_dump(mode="json")
        if isinstance(value, dict):
            for key, sub in value.items():
                walk(f"{prefix}.{key}" if prefix else str(key), sub)
        else:
            flat[prefix] = json.dumps(value) if isinstance(value, list) else str(value)

    walk("", sections)
    return flat


def _log_params(client: Any, run_id: str, sections: dict[str, Any]) -> None:
    from mlflow.entities import Param

    # MLflow caps a param value at 6000 characters; long prompts are cut, visibly.
    params = [
        Param(key, value if len(value) <= 6000 else value[:5980] + "...[cut]")
        for key, value in flat_params(sections).items()
    ]
    for start in range(0, len(params), _PARAM_BATCH):
        client.log_batch(run_id, params=params[start : start + _PARAM_BATCH])


def log_metrics(client: Any, run_id: str, metrics: dict[str, float], step: int = 0, *,
                model_id: str | None = None) -> None:
    """Finite metrics only (infinite KL divergences and the like stay in the JSON reports);
    `model_id` links them to a logged model (its evaluation)."""
    from mlflow.entities import Metric

    now = int(time.time() * 1000)
    batch = [
        Metric(key, float(value), now, step, model_id=model_id)
        for key, value in metrics.items()
        if isinstance(value, int | float) and math.isfinite(value)
    ]
    for start in range(0, len(batch), _METRIC_BATCH):
        part = batch[start : start + _METRIC_BATCH]
        with_retries(lambda part=part: client.log_batch(run_id, metrics=part), what="logging metrics",
                     timeout_s=300.0)


@contextmanager
def fluent_run(run_id: str) -> Iterator[Any]:
    """MLflow's fluent run `run_id` (for the APIs that have no client form). The process's
    active experiment is global and `start_run` refuses a run of another one, so it is set
    to the run's first: a process that ran another experiment before (a scorer, an earlier
    job) logs to this run all the same."""
    import mlflow

    mlflow.set_experiment(experiment_id=mlflow.get_run(run_id).info.experiment_id)
    with mlflow.start_run(run_id=run_id) as run:
        yield run


def log_datasets(ctx: RunContext, run_id: str, files: dict[str, Path]) -> None:
    """Log data files as MLflow dataset inputs (context: train, validation, test) whose
    digest is the data version (DVC md5): the columns that are scalars, to keep it small."""
    import warnings

    import mlflow
    import pandas as pd

    from trainer.data import read_jsonl

    use_mlflow_store(ctx.tracking_uri)
    with fluent_run(run_id):
        for context, path in files.items():
            rows = read_jsonl(path)
            frame = pd.DataFrame([{k: v for k, v in row.items() if isinstance(v, str | int | float | bool)}
                                  for row in rows])
            # MLflow registers its local-file source twice (`file` and no scheme) and warns
            # that a plain path "can be interpreted in multiple ways"; both are the same.
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="The specified dataset source can be interpreted")
                dataset = mlflow.data.from_pandas(frame, source=str(Path(path).resolve()), name=Path(path).name,
                                                  digest=ctx.data_md5[:36])
            mlflow.log_input(dataset, context=context)


def split_dataset(ctx: RunContext, data: Any, split: str) -> Any:
    """The MLflow evaluation dataset of `split` (validation or test) at this data version,
    named `<split>@<DVC md5[:12]>` in the pipeline's experiment: created once, its records
    the split's items as the stages read them (`inputs`: the messages; `expectations`: the
    expectation `item`, the reference fields a grader reads, as tasks/scoring.py takes it),
    then found again by every run of that data version."""
    from mlflow.genai.datasets import create_dataset, search_datasets

    from trainer.data import split_items
    from trainer.rollout.traces import item_fields

    use_mlflow_store(ctx.tracking_uri)
    name = f"{split}@{ctx.data_md5[:12]}"
    found = search_datasets(experiment_ids=[ctx.experiment_id], filter_string=f"name = '{name}'")
    if found:
        return found[0]
    items = split_items(data, split)
    source = data.test_file if split == "test" and data.test_file else data.validation_file
    dataset = create_dataset(name=name, experiment_id=ctx.experiment_id, tags={
        "split": split, "dvc_md5": ctx.data_md5, "file": str(source), "items": str(len(items)),
        "selection": "the test file" if split != "test" or data.test_file else
                     "the seeded half of the validation file (no test_file)"})
    dataset.merge_records([{"inputs": {"messages": item.get("messages", [])},
                            "expectations": {"item": item_fields(item)}} for item in items])
    return dataset


def link_split(ctx: RunContext, run_id: str, data: Any, split: str) -> None:
    """Record on `run_id` that it read `split`: the split's evaluation dataset as an input."""
    import mlflow

    dataset = split_dataset(ctx, data, split)
    with fluent_run(run_id):
        mlflow.log_input(dataset, context=split)


@contextmanager
def stage_run(ctx: RunContext, stage: str, sections: dict[str, Any]) -> Iterator[tuple[Any, str]]:
    """A nested run for one stage, with the config sections it reads as params: tagged;
    FAILED with the error if it raises."""
    client = ctx.client()
    run = client.create_run(
        ctx.experiment_id,
        run_name=stage,
        tags={**ctx.tags(), "mlflow.parentRunId": ctx.parent_run_id, "stage": stage},
    )
    run_id = run.info.run_id
    _log_params(client, run_id, sections)
    try:
        yield client, run_id
    except BaseException as exc:
        message = str(exc) if isinstance(exc, AgentRFTError) else traceback.format_exc()
        client.set_tag(run_id, "error", message[:5000])
        client.set_terminated(run_id, status="FAILED")
        raise
    client.set_terminated(run_id, status="FINISHED")


def log_text(client: Any, run_id: str, text: str, artifact_file: str) -> None:
    client.log_text(run_id, text, artifact_file)


def log_json(client: Any, run_id: str, value: Any, artifact_file: str) -> None:
    client.log_text(run_id, json.dumps(value, indent=2, default=str), artifact_file)


def log_files(client: Any, run_id: str, files: list[Path], artifact_path: str) -> None:
    for path in files:
        client.log_artifact(run_id, str(path), artifact_path)


def publish_summary(ctx: RunContext, stage: str, run_id: str, markdown: str) -> None:
    """A Prefect markdown artifact for the stage, with the link to its MLflow run."""
    from prefect.artifacts import create_markdown_artifact
    from prefect.context import FlowRunContext, TaskRunContext

    if FlowRunContext.get() is None and TaskRunContext.get() is None:
        return  # called outside a flow (a notebook, a unit test): nothing to attach it to
    link = f"\n\nMLflow run: [{run_id}]({ctx.run_url(run_id)})\n"
    create_markdown_artifact(
        key=stage.replace("_", "-"), markdown=markdown + link, description=f"{stage} summary"
    )


def log_transformers_model(ctx: RunContext, run_id: str, model_dir: Path, name: str, *, step: int = 0) -> tuple[str, str]:
    """Log a saved transformers model directory (weights, tokenizer, chat template) to
    `run_id` as an MLflow model, straight from the checkpoint path (nothing is loaded into
    memory); returns its `models:/` URI and its model id."""
    import mlflow

    use_mlflow_store(ctx.tracking_uri)

    def log() -> Any:
        with fluent_run(run_id), _pipeline_classes_resolved():
            return mlflow.transformers.log_model(
                transformers_model=str(model_dir),
                task="text-generation",
                name=name,
                step=step,
                # Naming the requirements skips MLflow's import-based inference (slow, and it
                # trips on optional packages that are not installed).
                pip_requirements=_model_requirements(),
            )

    info = with_retries(log, what=f"logging model {name}", timeout_s=300.0)
    return info.model_uri, info.model_id


@contextmanager
def _pipeline_classes_resolved() -> Iterator[None]:
    """transformers 5.2x names each task's pipeline class by its import path in the task
    registry; MLflow 3.17's log_model from a checkpoint directory reads `__name__` off it
    (AttributeError). For the duration of the call, `check_task` hands back the class."""
    import importlib

    from transformers import pipelines

    original = pipelines.check_task

    def check_task(task: str, *args: Any, **kwargs: Any) -> Any:
        name, metadata, options = original(task, *args, **kwargs)
        impl = metadata.get("impl")
        if isinstance(impl, str):
            module, _, cls = impl.rpartition(".")
            metadata = {**metadata, "impl": getattr(importlib.import_module(module), cls)}
        return name, metadata, options

    pipelines.check_task = check_task
    try:
        yield
    finally:
        pipelines.check_task = original


def _model_requirements() -> list[str]:
    from importlib.metadata import version

    return [f"{package}=={version(package)}" for package in ("torch", "transformers", "accelerate")]
