"""Stage 3a, warm_start: supervised fine-tuning on demonstrations before RFT, in a subprocess
started with `accelerate launch` (trainer/rl/warm_start.py, `agentrft warm-start`).

It runs as `rft_training` runs its trainer: the same launcher, processes and sharding, the
MLflow run id handed over (the trainer logs `warm_start/train_loss`, ... to it directly), a
folder named by what it trains, and `--resume` always, so a Prefect retry or the re-run of
a killed pipeline continues from the last checkpoint. The warm-started model is logged to
the stage's run as an MLflow model; its `models:/` URI is where the baseline is measured
again and where RFT starts.

`register_warm_start` is a supervised job's last stage (OpenAI's `method.type: supervised`,
served by `agentrft api`): the warm-started model registered as a new `challenger` version
of the registered model. A supervised job has no grader, so there is no regression gate to
pass and `champion` never moves here; the `promote-model` flow promotes it by hand.
"""

from __future__ import annotations

import hashlib
import itertools
import json
from pathlib import Path
from typing import Any

import yaml
from prefect import get_run_logger, task

from tasks.cache import stage_cache
from tasks.results import PromotionResult, WarmStartResult
from tasks.tracking import (
    RunContext,
    log_files,
    log_json,
    log_metrics,
    log_transformers_model,
    publish_summary,
    stage_run,
)
from tasks.train import _worth_a_retry, run_training
from trainer.config.pipeline import PipelineConfig
from trainer.config.warm_start import resolved_warm_start
from trainer.rl.launch import launch_command

STAGE = "warm_start"


def _output_dir(work_dir: Path, effective: PipelineConfig, model_path: str, demonstrations_md5: str) -> Path:
    """The trainer's folder, named by what it trains: a retry finds its checkpoints; a
    finished run there (a refreshed stage) is kept and the new one starts beside it."""
    key = hashlib.sha256(json.dumps([model_path, demonstrations_md5, effective.model_dump(mode="json")],
                                    sort_keys=True).encode())
    name = key.hexdigest()[:16]
    folders = (work_dir.resolve() / STAGE / (name if n == 1 else f"{name}-{n}") for n in itertools.count(1))
    return next(folder for folder in folders if not (folder / "warm_start_result.json").exists())


@task(name=STAGE, persist_result=True, retries=1, retry_delay_seconds=2, retry_condition_fn=_worth_a_retry,
      cache_policy=stage_cache(__name__))
def warm_start(model_path: str, *, model: Any, grader: dict[str, Any], warm_start: Any, training: Any, mlflow: Any,
               demonstrations_md5: str, reason: str, work_dir: str, ctx: RunContext) -> WarmStartResult:
    """Fine-tune `model_path` on the demonstrations (`demonstrations_md5`, their content,
    keys the cache); `reason` says why the pipeline warm-starts."""
    logger = get_run_logger()
    effective = PipelineConfig(name=STAGE, work_dir=work_dir, model=model, grader=grader, warm_start=warm_start,
                               training=training, mlflow=mlflow.model_copy(update={"tracking_uri": ctx.tracking_uri}))
    sections = {"model": model, "warm_start": warm_start, "training": training}
    with stage_run(ctx, STAGE, sections) as (client, run_id):
        client.set_tag(run_id, "reason", reason[:5000])
        client.set_tag(run_id, "demonstrations_md5", demonstrations_md5)
        out = _output_dir(Path(work_dir), effective, model_path, demonstrations_md5)
        out.mkdir(parents=True, exist_ok=True)
        config_path = out / "config.yaml"
        config_path.write_text(yaml.safe_dump(effective.model_dump(mode="json"), sort_keys=False))
        log_metrics(client, run_id, {f"hp/{k}": float(v) for k, v in resolved_warm_start(warm_start).items()})
        argv = ["--config", str(config_path), "--model", model_path, "--output-dir", str(out), "--mlflow-run-id",
                run_id, "--resume"]
        command, env = launch_command(effective, argv, command_name="warm-start")
        env["MLFLOW_TRACKING_URI"] = ctx.tracking_uri
        client.set_tag(run_id, "command", " ".join(command))
        logger.info("warm start: %s", " ".join(command))
        run_training(command, env, out / "warm_start.log", logger, stage=STAGE)
        result = json.loads((out / "warm_start_result.json").read_text())
        uri, _ = log_transformers_model(ctx, run_id, Path(result["model_dir"]), "warm-started", step=result["steps"])
        client.set_tag(run_id, "model", uri)
        log_files(client, run_id, [config_path, out / "warm_start.log", out / "warm_start_result.json"], "")
        final = {k: float(v) for k, v in result["metrics"].items() if isinstance(v, int | float)}
        publish_summary(
            ctx, STAGE, run_id,
            f"# Warm start\n\n{reason}\n\n{result['steps']} steps on {result['examples']} examples. Model "
            f"`{uri}`.\n\n| metric | last step |\n| --- | ---: |\n"
            + "".join(f"| {k} | {v:.4g} |\n" for k, v in final.items() if k.startswith("warm_start/")),
        )
    return WarmStartResult(run_id=run_id, steps=result["steps"], model_uri=uri, path=result["model_dir"],
                           metrics=final)


NOT_GATED = ("a supervised job has no grader, so no regression gate: the version stays challenger (the promote-model "
             "flow makes it champion)")


@task(name="promotion", persist_result=True, cache_policy=stage_cache(__name__))
def register_warm_start(warmed: WarmStartResult, *, registered_model: str, ctx: RunContext) -> PromotionResult:
    """Register the warm-started model as a new `challenger` version of `registered_model`."""
    from tasks.promote import register_candidate, remove_pending

    name = registered_model
    with stage_run(ctx, "promotion", {"registered_model": name}) as (client, run_id):
        removed = remove_pending(client, name)
        if removed:
            client.set_tag(run_id, "removed_pending_versions", ",".join(removed))
        tags = {"pipeline_run_id": ctx.parent_run_id, "data_md5": ctx.data_md5, "git_commit": ctx.git_commit,
                "method": "supervised", "training_step": str(warmed.steps), "warm_start_run_id": warmed.run_id}
        version, _, decision = register_candidate(ctx.tracking_uri, name, warmed.model_uri, run_id, tags,
                                                  passed=False, reasons=[NOT_GATED])
        client.set_tag(run_id, "decision", decision[:5000])
        client.set_tag(run_id, "registered_version", version)
        result = PromotionResult(run_id=run_id, registered_model=name, version=version, champion=False,
                                 previous_champion=None, decision=decision)
        log_json(client, run_id, result.model_dump(), "promotion.json")
        publish_summary(ctx, "promotion", run_id, f"# Promotion\n\n{decision}\n")
    return result
