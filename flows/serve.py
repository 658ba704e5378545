"""Serving the pipeline: scheduled deployments, work pools, and the two UIs.

- `serve_deployments(config)`: the pipeline as a deployment with the config's cron
  (default nightly) and its parameters as defaults, plus the hand-driven promote/rollback
  flow and the monitor (flows/monitor.py: on `monitor.cron`, and triggered by every
  `agentrft.model.promoted` event of the job's model for the promoted version), served
  from this process (`agentrft serve`). All carry typed parameters, so the
  Prefect UI's "Run > Custom run" shows the config as a form.
- `deploy_to_work_pool(config, pool)`: the same deployments registered on a Prefect work
  pool (`agentrft deploy --work-pool NAME`), for workers on other machines; the flow code is
  loaded from this checkout's directory (`flow.from_source`), so process workers that share
  it (or a Docker/Kubernetes image that contains it) run the same code. With a training
  pool (`--training-pool gpu`) the training stage is a deployment of its own on that pool
  (flows/training.py) and the pipeline's runs send their training there.
- `start_uis()`: a Prefect server and the MLflow UI on loopback with SQLite stores
  (`agentrft ui`), printing both URLs.
"""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path
from typing import Any

from flows.pipeline import agent_rft_pipeline, pipeline_parameters, promote_model
from tasks.tracking import resolve_tracking_uri
from trainer.config.pipeline import PipelineConfig

ROOT = Path(__file__).resolve().parents[1]
PIPELINE_DEPLOYMENT = "scheduled"
PROMOTE_DEPLOYMENT = "by-hand"
MONITOR_DEPLOYMENT = "monitor"


def _schedules(config: PipelineConfig) -> list[Any]:
    from prefect.schedules import Cron

    return [Cron(config.schedule.cron, timezone=config.schedule.timezone)]


def _parameters(config: PipelineConfig) -> dict[str, Any]:
    params = pipeline_parameters(config)
    params["config"]["mlflow"]["tracking_uri"] = resolve_tracking_uri(config.mlflow.tracking_uri)
    return params


def promotion_trigger(config: PipelineConfig) -> Any:
    """Run the monitor for the version just promoted: on `agentrft.model.promoted` of the
    job's registered model, with that version as the `version` parameter."""
    from prefect.events import DeploymentEventTrigger

    from tasks.events import EVENT, resource_id

    return DeploymentEventTrigger(
        name=f"monitor {config.registered_model} after promotion",
        expect={EVENT}, match={"prefect.resource.id": resource_id(config.registered_model)},
        parameters={"version": "{{ event.resource['agentrft.model.version'] }}"},
    )


def build_deployments(config: PipelineConfig, *, schedule: bool = True) -> list[Any]:
    """The pipeline deployment (cron from the config), the promote/rollback deployment and
    the monitor (its own cron, and a run for every new champion)."""
    from prefect.schedules import Cron

    from flows.monitor import monitor_model

    pipeline = agent_rft_pipeline.to_deployment(
        name=PIPELINE_DEPLOYMENT,
        parameters=_parameters(config),
        schedules=_schedules(config) if schedule else None,
        description=f"Agent RFT pipeline for {config.name}; cron {config.schedule.cron} ({config.schedule.timezone}).",
        tags=["agent-rft"],
    )
    promote = promote_model.to_deployment(
        name=PROMOTE_DEPLOYMENT,
        parameters={"name": config.registered_model,
                    "tracking_uri": resolve_tracking_uri(config.mlflow.tracking_uri)},
        description="Promote a registered model version to champion, or roll champion back.",
        tags=["agent-rft"],
    )
    monitor = monitor_model.to_deployment(
        name=MONITOR_DEPLOYMENT,
        parameters={"config": _parameters(config)["config"]},
        schedules=[Cron(config.monitor.cron, timezone=config.schedule.timezone)] if schedule else None,
        triggers=[promotion_trigger(config)],
        description=f"Live traffic of {config.registered_model}'s champion against the suite and the grader; "
        f"cron {config.monitor.cron}, and after every promotion.",
        tags=["agent-rft"],
    )
    return [pipeline, promote, monitor]


def serve_deployments(config: PipelineConfig) -> None:
    """Serve the three deployments from this process until interrupted."""
    from prefect import serve

    serve(*build_deployments(config))


def deploy_to_work_pool(config: PipelineConfig, pool: str, *, schedule: bool = True,
                        training_pool: str | None = None) -> list[str]:
    """Register the three deployments on `pool`; returns their ids. With `training_pool`, the
    training stage is a deployment of its own there (flows/training.py), which the pipeline
    runs its training through."""
    from prefect import flow
    from prefect.schedules import Cron

    from flows.training import DEPLOYMENT, FLOW

    ids = []
    if training_pool is not None:
        remote = flow.from_source(source=str(ROOT), entrypoint="flows/training.py:rft_training_flow")
        ids.append(str(remote.deploy(name=DEPLOYMENT, work_pool_name=training_pool, tags=["agent-rft"], build=False,
                                     push=False, print_next_steps=False)))
        config = config.model_copy(update={"training": config.training.model_copy(
            update={"deployment": f"{FLOW}/{DEPLOYMENT}"})})
    for entrypoint, name, params, schedules, triggers in (
        ("flows/pipeline.py:agent_rft_pipeline", PIPELINE_DEPLOYMENT, _parameters(config),
         _schedules(config) if schedule else None, None),
        ("flows/pipeline.py:promote_model", PROMOTE_DEPLOYMENT,
         {"name": config.registered_model, "tracking_uri": resolve_tracking_uri(config.mlflow.tracking_uri)},
         None, None),
        ("flows/monitor.py:monitor_model", MONITOR_DEPLOYMENT, {"config": _parameters(config)["config"]},
         [Cron(config.monitor.cron, timezone=config.schedule.timezone)] if schedule else None,
         [promotion_trigger(config)]),
    ):
        remote = flow.from_source(source=str(ROOT), entrypoint=entrypoint)
        ids.append(str(remote.deploy(name=name, work_pool_name=pool, parameters=params, schedules=schedules,
                                     triggers=triggers, tags=["agent-rft"], build=False, push=False,
                                     print_next_steps=False)))
    return ids


def start_uis(tracking_uri: str, *, prefect_port: int = 4200, mlflow_port: int = 5000) -> None:
    """Start the Prefect server and the MLflow UI on loopback; wait until interrupted (Ctrl-C,
    SIGTERM or SIGHUP), then stop both with every process they started, freeing their ports.
    Each runs under a guard (trainer/lifeline.py): killed, this process takes them with it."""
    import trainer.lifeline as lifeline

    def stop(signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt(signal.Signals(signum).name)

    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, stop)
    processes = [
        lifeline.start([sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1",
                        "--port", str(prefect_port)], grace=2.0),
        lifeline.start([sys.executable, "-m", "mlflow", "server", "--backend-store-uri",
                        resolve_tracking_uri(tracking_uri), "--host", "127.0.0.1", "--port", str(mlflow_port),
                        "--workers", "1"], grace=2.0),
    ]
    print(f"Prefect UI: http://127.0.0.1:{prefect_port}  (point runs at it: "
          f"export PREFECT_API_URL=http://127.0.0.1:{prefect_port}/api)", flush=True)
    print(f"MLflow UI:  http://127.0.0.1:{mlflow_port}", flush=True)
    try:
        while all(p.poll() is None for p in processes):
            time.sleep(1)
    except KeyboardInterrupt:
        pass
    finally:
        for signum in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
            signal.signal(signum, signal.SIG_IGN)
        for p in processes:  # both signalled first, then waited for: their graces overlap
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in processes:
            lifeline.stop(p)
