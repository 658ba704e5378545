"""The training stage as a flow of its own, so it can run on another work pool.

A pipeline whose `training.deployment` names this flow's deployment runs its training
stage there (`run_deployment`, as a subflow of the pipeline's flow run): on the workers of
the pool the deployment is registered on (`agentrft deploy --work-pool cpu --training-pool
gpu`), while the cheap stages run wherever the pipeline runs. The flow calls the same task
as the pipeline would (`tasks/train.py`), so its cache is the stage cache, and it logs into
the same MLflow parent run (the `RunContext` it is given). Its result comes back through
Prefect's result storage: a path every worker reaches (`PREFECT_LOCAL_STORAGE_PATH` on a
shared mount) or a remote storage block.
"""

from __future__ import annotations

from typing import Any

from prefect import flow

from tasks.results import TrainingResult
from tasks.tracking import RunContext
from tasks.train import rft_training
from trainer.config.data import DataConfig
from trainer.config.model import ModelConfig
from trainer.config.operations import MlflowConfig
from trainer.config.rollout import PenaltyConfig, RolloutConfig
from trainer.config.tools import ToolsConfig
from trainer.config.training import TrainingConfig

FLOW = "rft-training"
DEPLOYMENT = "training"


@flow(name=FLOW, persist_result=True, log_prints=True)
def rft_training_flow(model_path: str, model: ModelConfig, data: DataConfig, tools: ToolsConfig,
                      grader: dict[str, Any], rollout: RolloutConfig, penalties: PenaltyConfig,
                      training: TrainingConfig, mlflow: MlflowConfig, variant: dict[str, Any] | None, work_dir: str,
                      ctx: RunContext, refresh: bool = False) -> dict[str, Any]:
    """The training stage (tasks/train.py) on this flow run's worker: its result, and
    whether the stage cache served it."""
    state = rft_training.with_options(refresh_cache=refresh)(
        model_path, model=model, data=data, tools=tools, grader=grader, rollout=rollout, penalties=penalties,
        training=training, mlflow=mlflow, variant=variant, work_dir=work_dir, ctx=ctx, return_state=True)
    result: TrainingResult = state.result()
    return {"result": result.model_dump(mode="json"), "cached": state.name == "Cached"}


def run_training_deployment(name: str, *args: Any, refresh: bool, ctx: RunContext, **sections: Any
                            ) -> tuple[TrainingResult, bool]:
    """Run the training stage as deployment `name` (a subflow of the calling flow run) and read
    its result back; a failed run raises with its state's message."""
    from prefect.deployments import run_deployment

    from trainer.errors import InfraError

    (model_path,) = args
    parameters = {"model_path": model_path, **{key: _jsonable(value) for key, value in sections.items()},
                  "ctx": ctx.model_dump(mode="json"), "refresh": refresh}
    run = run_deployment(name, parameters=parameters, timeout=None, as_subflow=True)
    if not run.state.is_completed():
        raise InfraError(f"the training deployment {name} ended {run.state.name}: {run.state.message}")
    answer = run.state.result()
    return TrainingResult.model_validate(answer["result"]), bool(answer["cached"])


def _jsonable(value: Any) -> Any:
    return value.model_dump(mode="json") if hasattr(value, "model_dump") else value
