"""The Agent RFT pipeline as Prefect flows.

`agent_rft_pipeline` chains the stages in the order practitioners recommend:
production-matched data first (`validate_data`), a `baseline` of the base model, prompt
and task variants before any training (`prompt_optimization`), GRPO only when those are
exhausted (`rft_training`), a paired `regression_eval` on the untouched test split against
the baseline and the champion, and `promotion` through the MLflow registry. When the
baseline shows no signal (its `nonzero_baseline` gate fails) and `warm_start` names
demonstrations, the pipeline says so and runs a supervised `warm_start` before RFT, then
measures the baseline again on the warm-started model (`baseline_after_warm_start`, the
RFT stage's real starting point) and gates on that; RFT starts from that model. Its parameter
is the whole config (a pydantic model, so the Prefect UI renders it as a form) plus
`refresh`, the stages to re-run even when their cached result is current (a stage
refreshed re-runs the ones after it too).

Each stage is a Prefect task given only the config sections it reads, cached by those
inputs, the data version and its own code (tasks/cache.py), and returns a small typed
result. The flow opens one MLflow parent run per pipeline run; each stage that runs adds a
nested run; a stage served from cache (its Prefect state is `Cached`) is named in the
parent's tags (`stage.<name>.run_id`, `stage.<name>.cached`). A gate that fails stops the
flow with its reason; so does a failed stage, with the parent run marked FAILED.

Training and promotion of one registered model run one pipeline at a time
(`tasks.locks.model_lock`): a second run waits or stops, as `promotion.concurrent_runs`
says.

With `method: supervised` (a supervised job of `agentrft api`) the flow runs
`run_supervised_stages` instead: the warm start on the demonstrations, then the model
registered as `challenger`.

`promote_model` is the hand-driven registry flow: promote a version (or alias) to
`champion`, or roll `champion` back.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any, Literal

from prefect import flow, get_run_logger
from prefect.states import Failed

from tasks.baseline import baseline
from tasks.data_version import data_version
from tasks.evaluate import regression_eval
from tasks.events import emit_promoted
from tasks.locks import model_lock
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
    git_commit,
    mlflow_client,
    open_pipeline_run,
    resolve_tracking_uri,
)
from tasks.train import rft_training
from tasks.validate import validate_data
from tasks.warm_start import register_warm_start, warm_start
from trainer.config.pipeline import PipelineConfig
from trainer.data import read_demonstrations
from trainer.errors import AgentRFTError, ConfigError

Stage = Literal["validate_data", "baseline", "prompt_optimization", "warm_start", "baseline_after_warm_start",
                "rft_training", "regression_eval", "promotion"]
STAGES: tuple[str, ...] = Stage.__args__
# Where a run may end early: the stages before the test split is read (a run that tries
# configs, seeds or data sizes on the validation split alone).
StopAfter = Literal["baseline", "prompt_optimization", "warm_start", "rft_training"]
STOP_AFTER: tuple[str, ...] = StopAfter.__args__


class PipelineStopped(AgentRFTError):
    """A gate stopped the pipeline; the message says which and why."""


def _champion_to_beat(tracking_uri: str, name: str, candidate_uri: str | None) -> dict[str, Any] | None:
    """The current champion, unless it *is* this candidate (promoted by an earlier run of
    the same stages): then the champion it was compared with, so the inputs stay the same."""
    champion = current_champion(tracking_uri, name)
    if champion is None or candidate_uri is None:
        return champion
    version = mlflow_client(tracking_uri).get_model_version(name, champion["version"])
    if version.source != candidate_uri:
        return champion
    previous = version.tags.get("previous_champion")
    return {"version": previous, "uri": f"models:/{name}/{previous}"} if previous else None


def _run_in_store(client: Any, run_id: str) -> bool:
    """Whether the store holds `run_id` as an active run (any other MLflow error, such as
    an unreachable server, is raised: it says nothing about the cache)."""
    from mlflow.exceptions import MlflowException

    try:
        return client.get_run(run_id).info.lifecycle_stage == "active"
    except MlflowException as exc:
        if exc.error_code == "RESOURCE_DOES_NOT_EXIST":
            return False
        raise


def _say_python_fence(grader: dict[str, Any], logger: Any, client: Any, parent_run_id: str) -> None:
    """Whether the grader's python graders run fenced, found before any stage (they grade in
    this process, in the training processes and on other work pools): unfenced is said once
    here, in the run's log, and tagged; a fence they require and cannot have stops the run."""
    from trainer.graders.python_grader import check_python_fence, python_graders, unfenced_message

    if not python_graders(grader):
        return
    try:
        unfenced = check_python_fence(grader)
    except AgentRFTError as exc:
        client.set_tag(parent_run_id, "python_grader_fence", f"refused: {exc}"[:5000])
        raise ConfigError(f"grader: {exc}. Run it where Landlock and seccomp are available, or drop "
                          "`fence: required` from the grader (and AGENTRFT_PYTHON_GRADER_FENCE from the "
                          "environment) to accept running it unfenced") from None
    client.set_tag(parent_run_id, "python_grader_fence", ("unfenced: " + "; ".join(unfenced))[:5000] if unfenced
                   else "fenced")
    if unfenced:
        logger.warning(unfenced_message(unfenced))


def _demonstrations_md5(config: PipelineConfig) -> str:
    """The md5 of the warm start's demonstrations (and validation demonstrations), after
    checking every line of them; "" without a warm start."""
    ws = config.warm_start
    if not ws.enabled:
        return ""
    digest = hashlib.md5(usedforsecurity=False)
    for path in filter(None, (ws.demonstrations_file, ws.validation_file)):
        read_demonstrations(path)
        digest.update(Path(path).read_bytes())
    return digest.hexdigest()


def _warm_start_reason(config: PipelineConfig, base: Any) -> str:
    """Why the pipeline warm-starts (and says so), or "" when it does not."""
    ws = config.warm_start
    if not ws.enabled:
        return ""
    where = f"warm-starting on the demonstrations in {ws.demonstrations_file}"
    if ws.when == "always":
        return f"warm_start.when is always: {where}, then measuring the baseline again"
    gate = base.gates["nonzero_baseline"]
    if gate.passed:
        return ""
    return (f"the baseline shows no signal ({gate.value:.0%} of items solved at least once, gate "
            f"{gate.limit:.0%}; {base.metrics.get('baseline/tool_calls_mean', 0.0):.2f} tool calls a rollout): {where}, "
            "then measuring the baseline again and gating on it")


def run_stages(config: PipelineConfig, refresh: list[str] | None = None,
               stop_after: str | None = None) -> dict[str, Any]:
    """Run the stages for `config` inside a flow (or those up to `stop_after`, one of
    STOP_AFTER: the test split is then never read); returns the outcome summary."""
    refresh = list(refresh or [])
    unknown = sorted(set(refresh) - set(STAGES))
    if unknown:
        raise ConfigError(f"refresh: unknown stages {unknown}; the stages are {list(STAGES)}")
    if stop_after is not None and stop_after not in STOP_AFTER:
        raise ConfigError(f"stop_after: {stop_after!r} is not one of {list(STOP_AFTER)} (the stages before the "
                          "test split is read)")
    first_refreshed = min((STAGES.index(stage) for stage in refresh), default=len(STAGES))
    logger = get_run_logger()
    ctx = open_pipeline_run(config, data_md5=data_version(config.data), git_commit=git_commit())
    client = ctx.client()
    outcome: dict[str, Any] = {"parent_run_id": ctx.parent_run_id, "experiment_id": ctx.experiment_id, "stages": {}}
    current = STAGES[0]
    c = config

    def run(stage: str, task: Any, *args: Any, **kwargs: Any) -> Any:
        nonlocal current
        current = stage
        def call(refresh: bool) -> tuple[Any, bool]:
            if stage == "rft_training" and c.training.deployment:  # on the training deployment's work pool
                from flows.training import run_training_deployment

                return run_training_deployment(c.training.deployment, *args, refresh=refresh, ctx=ctx, **kwargs)
            state = task.with_options(refresh_cache=refresh)(*args, ctx=ctx, **kwargs, return_state=True)
            if state.is_failed() and state.name == "Stopped":  # a verdict (on the data), not a crash
                raise PipelineStopped(state.message)
            return state.result(), state.name == "Cached"

        result, cached = call(STAGES.index(stage) >= first_refreshed)
        if cached and not _run_in_store(client, result.run_id):
            # Prefect's cache is machine-wide and knows the store by its URI: a store made
            # anew at the same path (a re-clone, `rm mlflow.db`) or a stage run deleted in
            # the UI would otherwise be served results whose runs it does not hold.
            logger.info("%s: the cached result's MLflow run %s is not in %s (deleted, or the store was made "
                        "anew); running the stage again", stage, result.run_id, ctx.tracking_uri)
            result, cached = call(True)
        client.set_tag(ctx.parent_run_id, f"stage.{stage}.run_id", result.run_id)
        client.set_tag(ctx.parent_run_id, f"stage.{stage}.cached", str(cached).lower())
        outcome["stages"][stage] = {"run_id": result.run_id, "cached": cached}
        logger.info("%s: %s (MLflow run %s)", stage, "served from cache" if cached else "done", result.run_id)
        return result

    def stopped_after(stage: str, **fields: Any) -> bool:
        if stage != stop_after:
            return False
        outcome.update(outcome="stopped_after", stopped_after=stage,
                       decision=f"stopped after {stage}, as asked: the test split was not read", **fields)
        close_pipeline_run(ctx, status="FINISHED", outcome=outcome)
        return True

    evaluation_sections = {"model": c.model, "data": c.data, "tools": c.tools, "grader": c.grader,
                           "rollout": c.rollout, "penalties": c.penalties}
    try:
        demonstrations = _demonstrations_md5(c)  # checked line by line before anything runs
        _say_python_fence(c.grader, logger, client, ctx.parent_run_id)
        validated = run("validate_data", validate_data, c.data, c.grader)
        outcome["test_split"] = validated.test_split
        base = run("baseline", baseline, c.model.base_model, **evaluation_sections, gates=c.baseline,
                   traces=c.mlflow.traces_per_evaluation, work_dir=c.work_dir)
        reason = _warm_start_reason(c, base)
        if reason:
            logger.warning(reason)
            client.set_tag(ctx.parent_run_id, "warm_start", reason[:5000])
            outcome["warm_start"] = {"reason": reason}
        elif not base.passed:
            raise PipelineStopped(f"baseline gate failed: {base.reason}")
        if stopped_after("baseline", baseline=base.metrics):
            return outcome
        variants = run("prompt_optimization", prompt_optimization, c.model.base_model, **evaluation_sections,
                       options=c.prompt_optimization, seed=c.baseline.seed)
        outcome["prompt_optimization"] = {"best": variants.best_name, "verdict": variants.verdict}
        if stopped_after("prompt_optimization"):
            return outcome
        if not variants.rft_needed:
            outcome.update(outcome="rft_not_needed", decision=variants.verdict)
            close_pipeline_run(ctx, status="FINISHED", outcome=outcome)
            return outcome
        start = c.model.base_model  # where RFT starts
        if reason:
            warmed = run("warm_start", warm_start, c.model.base_model, model=c.model, grader=c.grader,
                         warm_start=c.warm_start, training=c.training, mlflow=c.mlflow,
                         demonstrations_md5=demonstrations, reason=reason, work_dir=c.work_dir)
            start = warmed.model_uri
            # The RFT stage's real starting point, gated as the base model was.
            again = run("baseline_after_warm_start", baseline.with_options(name="baseline_after_warm_start"), start,
                        **evaluation_sections, gates=c.baseline, traces=c.mlflow.traces_per_evaluation,
                        work_dir=c.work_dir, run_name="baseline_after_warm_start")
            outcome["warm_start"].update(model=start, metrics=warmed.metrics, baseline=again.metrics)
            if stopped_after("warm_start", baseline=base.metrics):
                return outcome
            if not again.passed:
                raise PipelineStopped(f"baseline gate failed after the warm start on {c.warm_start.demonstrations_file} "
                                      f"({warmed.steps} steps, model {start}): {again.reason}. More or closer "
                                      "demonstrations, more epochs or a larger learning rate (warm_start.n_epochs, "
                                      "warm_start.learning_rate_multiplier) may give it the signal RL needs")
        elif stopped_after("warm_start", baseline=base.metrics, warm_start={
                "reason": "none ran: the baseline has signal, or warm_start.demonstrations_file is not set"}):
            return outcome
        name = c.registered_model
        with model_lock(name, mode=c.promotion.concurrent_runs, timeout_s=c.promotion.lock_timeout_s,
                        log=logger.info):
            trained = run("rft_training", rft_training, start, **evaluation_sections,
                          training=c.training, mlflow=c.mlflow, variant=variants.best_variant, work_dir=c.work_dir)
            if stopped_after("rft_training", candidate=trained.candidate.model_dump(), steps=trained.steps,
                             final_metrics=trained.final_metrics):
                return outcome
            champion = _champion_to_beat(ctx.tracking_uri, name, trained.candidate.model_uri)
            evaluation = run("regression_eval", regression_eval, c.model.base_model, trained.candidate, champion,
                             **evaluation_sections, promotion=c.promotion, variant=variants.best_variant,
                             seed=c.baseline.seed, traces=c.mlflow.traces_per_evaluation, work_dir=c.work_dir)
            promoted = run("promotion", promotion, trained.candidate, evaluation, registered_model=name,
                           promotion_config=c.promotion)
    except BaseException as exc:
        reason = str(exc) if isinstance(exc, AgentRFTError) else f"{type(exc).__name__}: {exc}"
        outcome.update(outcome="stopped" if isinstance(exc, PipelineStopped) else "failed",
                       stopped_at=current, reason=reason)
        close_pipeline_run(ctx, status="FAILED", outcome=outcome)
        raise
    outcome.update(
        outcome="promoted" if promoted.champion else "not_promoted",
        decision=promoted.decision,
        registered_model=promoted.registered_model,
        version=promoted.version,
        before_after=evaluation.before_after,
        score_gain=evaluation.score_gain,
        test_readings=evaluation.readings,
        gates={name: gate.passed for name, gate in evaluation.gates.items()},
        figures={"regression": f"runs:/{evaluation.run_id}/tool_calls_before_after.png",
                 "training": f"runs:/{trained.run_id}/figures/reward_curve.png"},
    )
    close_pipeline_run(ctx, status="FINISHED", outcome=outcome)
    return outcome


def run_supervised_stages(config: PipelineConfig, refresh: list[str] | None = None) -> dict[str, Any]:
    """A supervised job (OpenAI's `method.type: supervised`, served by `agentrft api`): the
    pipeline with the RFT stages skipped. The demonstrations are checked line by line, the
    warm start trains on them (`warm_start.validation_file` its validation demonstrations),
    and `register_warm_start` registers the model as `challenger` (no grader, no regression
    gate). Refreshing `warm_start` re-runs both."""
    if not config.warm_start.enabled:
        raise ConfigError("a supervised run needs warm_start.demonstrations_file (the training demonstrations)")
    logger = get_run_logger()
    demonstrations = _demonstrations_md5(config)  # checked line by line before anything runs
    ctx = open_pipeline_run(config, data_md5=demonstrations, git_commit=git_commit())
    client = ctx.client()
    outcome: dict[str, Any] = {"parent_run_id": ctx.parent_run_id, "experiment_id": ctx.experiment_id, "stages": {},
                               "method": "supervised"}
    refreshed = bool(set(refresh or []) & {"warm_start", "promotion"})
    reason = f"a supervised job: warm-starting on the demonstrations in {config.warm_start.demonstrations_file}"

    def run(stage: str, task: Any, *args: Any, **kwargs: Any) -> Any:
        for refresh_cache in (refreshed, True):
            state = task.with_options(refresh_cache=refresh_cache)(*args, ctx=ctx, **kwargs, return_state=True)
            result, cached = state.result(), state.name == "Cached"
            if not cached or _run_in_store(client, result.run_id):  # else its run is gone: run it again
                break
        client.set_tag(ctx.parent_run_id, f"stage.{stage}.run_id", result.run_id)
        client.set_tag(ctx.parent_run_id, f"stage.{stage}.cached", str(cached).lower())
        outcome["stages"][stage] = {"run_id": result.run_id, "cached": cached}
        logger.info("%s: %s (MLflow run %s)", stage, "served from cache" if cached else "done", result.run_id)
        return result

    current = "warm_start"
    try:
        name = config.registered_model
        with model_lock(name, mode=config.promotion.concurrent_runs, timeout_s=config.promotion.lock_timeout_s,
                        log=logger.info):
            warmed = run("warm_start", warm_start, config.model.base_model, model=config.model, grader=config.grader,
                         warm_start=config.warm_start, training=config.training, mlflow=config.mlflow,
                         demonstrations_md5=demonstrations, reason=reason, work_dir=config.work_dir)
            current = "promotion"
            registered = run("promotion", register_warm_start, warmed, registered_model=name)
    except BaseException as exc:
        message = str(exc) if isinstance(exc, AgentRFTError) else f"{type(exc).__name__}: {exc}"
        outcome.update(outcome="failed", stopped_at=current, reason=message)
        close_pipeline_run(ctx, status="FAILED", outcome=outcome)
        raise
    outcome.update(outcome="not_promoted", decision=registered.decision, registered_model=registered.registered_model,
                   version=registered.version, warm_start={"model": warmed.model_uri, "metrics": warmed.metrics})
    close_pipeline_run(ctx, status="FINISHED", outcome=outcome)
    return outcome


@flow(name="agent-rft-pipeline", persist_result=True, log_prints=True)
def agent_rft_pipeline(config: PipelineConfig, refresh: list[Stage] | None = None,
                       stop_after: StopAfter | None = None,
                       method: Literal["reinforcement", "supervised"] = "reinforcement") -> dict[str, Any]:
    """Validate data, baseline, prompt variants, GRPO, regression eval, promotion (or the
    stages up to `stop_after`, which never read the test split). `method: supervised` runs
    a supervised job instead: the warm start on the demonstrations, then registration."""
    try:
        if method == "supervised":
            return run_supervised_stages(config, refresh)
        return run_stages(config, refresh, stop_after)
    except PipelineStopped as exc:
        # A gate's verdict is an outcome, not a crash: the run ends FAILED ("Stopped") with
        # the gate's reason as its message, and no traceback in the logs.
        return Failed(name="Stopped", message=str(exc))


def outcome_of(state: Any, what: str = "the pipeline") -> Any:
    """The result of a finished flow run's `state`: a gate's stop raises PipelineStopped, a
    stage's user error its AgentRFTError, anything else AgentRFTError naming `what`."""
    if state.is_failed() and state.name == "Stopped":
        raise PipelineStopped(state.message)
    try:
        return state.result()
    except AgentRFTError:
        raise
    except Exception as exc:
        raise AgentRFTError(f"{what} failed: {exc}") from None


def pipeline_parameters(config: PipelineConfig, refresh: list[str] | None = None,
                        stop_after: str | None = None) -> dict[str, Any]:
    """The flow's parameters for `config` (as a deployment or `run_deployment` takes them)."""
    if stop_after is not None and stop_after not in STOP_AFTER:
        raise ConfigError(f"--stop-after {stop_after}: not one of {', '.join(STOP_AFTER)} (the stages before the "
                          "test split is read)")
    return {"config": config.model_dump(mode="json"), "refresh": list(refresh or []), "stop_after": stop_after}


@flow(name="promote-model", persist_result=True, log_prints=True)
def promote_model(
    name: str,
    version_or_alias: str = "challenger",
    action: Literal["promote", "rollback"] = "promote",
    tracking_uri: str = "sqlite:///mlflow.db",
) -> dict[str, Any]:
    """Promote a registered version (or alias) to `champion`, or roll `champion` back
    (to `version_or_alias` when it names a version, else to the previous champion)."""
    tracking_uri = resolve_tracking_uri(tracking_uri)
    client = mlflow_client(tracking_uri)
    logger = get_run_logger()
    target = version_or_alias or ("challenger" if action == "promote" else "")
    if target and not target.isdigit():
        resolved = alias_version(client, name, target)
        if resolved is None:
            raise ConfigError(f"registered model {name!r} has no version or alias {target!r}")
        target = resolved
    if action == "promote":
        previous = set_champion(tracking_uri, name, target, reason="promoted by hand (promote-model flow)")
        result = {"action": action, "champion": target, "previous_champion": previous}
        if previous != target:
            emit_promoted(name, target, previous=previous, action=action, tracking_uri=tracking_uri)
    else:
        before, after = rollback_champion(tracking_uri, name, target if version_or_alias.isdigit() else None)
        result = {"action": action, "champion": after, "rolled_back_from": before}
        emit_promoted(name, after, previous=before, action=action, tracking_uri=tracking_uri)
    logger.info("%s: %s", name, result)
    return result
