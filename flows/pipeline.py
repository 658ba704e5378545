"""The Agent RFT pipeline as Prefect flows.

`agent_rft_pipeline` chains the six stages in the order practitioners recommend:
production-matched data first (`validate_data`), a `baseline` of the base model, prompt
and task variants before any training (`prompt_optimization`), GRPO only when those are
exhausted (`rft_training`), a paired `regression_eval` against the baseline and the
champion, and `promotion` through the MLflow registry. Its parameters are the config's
sections (pydantic models, so the Prefect UI renders them as a form) plus `refresh`, the
stages to re-run even when their cached result is current.

Each stage is a cached Prefect task keyed by `tasks.versioning.stage_key`; results are
small dicts (MLflow run ids, model URIs, metrics). The flow opens one MLflow parent run per
pipeline run; each stage that runs adds a nested run; a stage served from cache is named
in the parent's tags (`stage.<name>.run_id`, `stage.<name>.cached`). A gate that fails
stops the flow with its reason; so does a failed stage, with the parent run marked FAILED.

`promote_model` is the hand-driven registry flow: promote a version (or alias) to
`champion`, or roll `champion` back.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from prefect import flow, get_run_logger

from tasks.baseline import baseline
from tasks.evaluate import regression_eval
from tasks.optimize import prompt_optimization
from tasks.promote import (
    alias_version,
    current_champion,
    promotion,
    rollback_champion,
    set_champion,
)
from tasks.tracking import (
    close_pipeline_run,
    mlflow_client,
    open_pipeline_run,
    resolve_tracking_uri,
)
from tasks.train import rft_training
from tasks.validate import validate_data
from tasks.versioning import STAGES, data_version, git_commit, stage_key
from trainer.config import (
    BaselineConfig,
    DataConfig,
    MlflowConfig,
    ModelConfig,
    PenaltyConfig,
    PipelineConfig,
    PromotionConfig,
    PromptOptimizationConfig,
    RolloutConfig,
    ScheduleConfig,
    ToolsConfig,
    TrainingConfig,
)
from trainer.errors import AgentRFTError, ConfigError

Stage = Literal["validate_data", "baseline", "prompt_optimization", "rft_training", "regression_eval", "promotion"]
_DEFAULTS = PipelineConfig()


class PipelineStopped(AgentRFTError):
    """A gate stopped the pipeline; the message says which and why."""


def _champion_to_beat(tracking_uri: str, name: str, candidate_uri: str | None) -> dict[str, Any] | None:
    """The current champion, unless it *is* this candidate (promoted by an earlier run of
    the same stages): then the champion it was compared with, so the cache key is stable."""
    champion = current_champion(tracking_uri, name)
    if champion is None or candidate_uri is None:
        return champion
    client = mlflow_client(tracking_uri)
    version = client.get_model_version(name, champion["version"])
    if version.source != candidate_uri:
        return champion
    previous = version.tags.get("previous_champion")
    return {"version": previous, "uri": f"models:/{name}/{previous}"} if previous else None


def run_stages(config: PipelineConfig, refresh: list[str] | None = None) -> dict[str, Any]:
    """Run the six stages for `config` inside a flow; returns the outcome summary."""
    from trainer.bootstrap import resolve_base_model

    refresh = list(refresh or [])
    unknown = sorted(set(refresh) - set(STAGES))
    if unknown:
        raise ConfigError(f"refresh: unknown stages {unknown}; the stages are {list(STAGES)}")
    logger = get_run_logger()
    data_md5 = data_version(config)
    ctx = open_pipeline_run(config, data_md5=data_md5, git_commit=git_commit())
    client = ctx.client()
    outcome: dict[str, Any] = {"parent_run_id": ctx.parent_run_id, "experiment_id": ctx.experiment_id, "stages": {}}
    current = STAGES[0]

    def run(stage: str, task: Any, upstream: dict[str, Any], **kwargs: Any) -> dict[str, Any]:
        nonlocal current
        current = stage
        key = stage_key(stage, config, data_md5=data_md5, tracking_uri=ctx.tracking_uri, upstream=upstream)
        result = task.with_options(refresh_cache=stage in refresh)(config, ctx, key, **kwargs)
        parent = client.get_run(result["run_id"]).data.tags.get("mlflow.parentRunId")
        cached = parent != ctx.parent_run_id
        client.set_tag(ctx.parent_run_id, f"stage.{stage}.run_id", result["run_id"])
        client.set_tag(ctx.parent_run_id, f"stage.{stage}.cached", str(cached).lower())
        outcome["stages"][stage] = {"run_id": result["run_id"], "cache_key": key, "cached": cached}
        logger.info("%s: %s (MLflow run %s)", stage, "served from cache" if cached else "done", result["run_id"])
        return result

    try:
        validated = run("validate_data", validate_data, {})
        current = "baseline"
        model_path = resolve_base_model(config, log=logger.info)
        base = run("baseline", baseline, {"validate": validated["run_id"], "model": model_path}, model_path=model_path)
        if not base["passed"]:
            raise PipelineStopped(f"baseline gate failed: {base['reason']}")
        variants = run("prompt_optimization", prompt_optimization, {"baseline": base["run_id"], "model": model_path},
                       model_path=model_path)
        outcome["prompt_optimization"] = {"best": variants["best_name"], "verdict": variants["verdict"]}
        if not variants["rft_needed"]:
            outcome.update(outcome="rft_not_needed", decision=variants["verdict"])
            close_pipeline_run(ctx, status="FINISHED", outcome=outcome)
            return outcome
        trained = run("rft_training", rft_training, {"prompt_optimization": variants["run_id"], "model": model_path},
                      model_path=model_path, variant=variants["best_variant"])
        candidate = dict(trained["candidate"])
        if not Path(candidate["path"]).exists():  # the work dir was cleaned: fetch it from MLflow
            candidate["path"] = candidate["model_uri"]
        name = config.promotion.registered_model
        champion = _champion_to_beat(ctx.tracking_uri, name, trained["candidate"]["model_uri"])
        evaluation = run(
            "regression_eval", regression_eval,
            {"rft_training": trained["run_id"], "prompt_optimization": variants["run_id"],
             "champion": champion and champion["version"]},
            base_model=model_path, candidate=candidate, variant=variants["best_variant"], champion=champion,
        )
        promoted = run("promotion", promotion, {"regression_eval": evaluation["run_id"]},
                       candidate=trained["candidate"], evaluation=evaluation)
    except BaseException as exc:
        reason = str(exc) if isinstance(exc, AgentRFTError) else f"{type(exc).__name__}: {exc}"
        outcome.update(outcome="stopped" if isinstance(exc, PipelineStopped) else "failed",
                       stopped_at=current, reason=reason)
        close_pipeline_run(ctx, status="FAILED", outcome=outcome)
        raise
    outcome.update(
        outcome="promoted" if promoted["champion"] else "not_promoted",
        decision=promoted["decision"],
        registered_model=promoted["registered_model"],
        version=promoted["version"],
        before_after=evaluation["before_after"],
        score_gain=evaluation["score_gain"],
        gates={k: v["passed"] for k, v in evaluation["gates"].items()},
    )
    close_pipeline_run(ctx, status="FINISHED", outcome=outcome)
    return outcome


@flow(name="agent-rft-pipeline", persist_result=True, log_prints=True)
def agent_rft_pipeline(
    name: str = _DEFAULTS.name,
    model: ModelConfig = _DEFAULTS.model,
    data: DataConfig = _DEFAULTS.data,
    tools: ToolsConfig = _DEFAULTS.tools,
    grader: dict[str, Any] = _DEFAULTS.grader,
    rollout: RolloutConfig = _DEFAULTS.rollout,
    penalties: PenaltyConfig = _DEFAULTS.penalties,
    baseline: BaselineConfig = _DEFAULTS.baseline,
    prompt_optimization: PromptOptimizationConfig = _DEFAULTS.prompt_optimization,
    training: TrainingConfig = _DEFAULTS.training,
    promotion: PromotionConfig = _DEFAULTS.promotion,
    mlflow: MlflowConfig = _DEFAULTS.mlflow,
    schedule: ScheduleConfig = _DEFAULTS.schedule,
    work_dir: str = _DEFAULTS.work_dir,
    refresh: list[Stage] | None = None,
) -> dict[str, Any]:
    """Validate data, baseline, prompt variants, GRPO, regression eval, promotion."""
    config = PipelineConfig(
        name=name, model=model, data=data, tools=tools, grader=grader, rollout=rollout, penalties=penalties,
        baseline=baseline, prompt_optimization=prompt_optimization, training=training, promotion=promotion,
        mlflow=mlflow, schedule=schedule, work_dir=work_dir,
    )
    return run_stages(config, refresh)


def pipeline_parameters(config: PipelineConfig, refresh: list[str] | None = None) -> dict[str, Any]:
    """The flow's parameters for `config` (as a deployment or `run_deployment` takes them)."""
    params = config.model_dump(mode="json")
    params["refresh"] = list(refresh or [])
    return params


@flow(name="promote-model", persist_result=True, log_prints=True)
def promote_model(
    name: str,
    version_or_alias: str = "challenger",
    action: Literal["promote", "rollback"] = "promote",
    tracking_uri: str = _DEFAULTS.mlflow.tracking_uri,
) -> dict[str, Any]:
    """Promote a registered version (or alias) to `champion`, or roll `champion` back
    (to `version_or_alias` when it names a version, else to the previous champion)."""
    client = mlflow_client(resolve_tracking_uri(tracking_uri))
    logger = get_run_logger()
    target = version_or_alias or ("challenger" if action == "promote" else "")
    if target and not target.isdigit():
        resolved = alias_version(client, name, target)
        if resolved is None:
            raise ConfigError(f"registered model {name!r} has no version or alias {target!r}")
        target = resolved
    if action == "promote":
        previous = set_champion(client, name, target, reason="promoted by hand (promote-model flow)")
        result = {"action": action, "champion": target, "previous_champion": previous}
    else:
        before, after = rollback_champion(client, name, target if version_or_alias.isdigit() else None)
        result = {"action": action, "champion": after, "rolled_back_from": before}
    logger.info("%s: %s", name, result)
    return result

