"""The monitor flow: the champion's live traffic scored and checked for drift (tasks/monitor.py).

    agentrft monitor --config job.yaml [--version 7]

`agentrft serve` serves it as the `monitor` deployment, on `monitor.cron` and on every
`agentrft.model.promoted` event of the job's registered model (tasks/events.py), with the
promoted version as its `version` parameter. A run whose latest window drifted or lost
score ends Failed, named "Stopped", with the reason as its message (no traceback: it is a
verdict), which is what an automation matches to roll back, page or retrain.
"""

from __future__ import annotations

from typing import Any

from prefect import flow, get_run_logger
from prefect.states import Failed

from tasks.monitor import monitor_traffic
from tasks.tracking import resolve_tracking_uri
from trainer.config.pipeline import PipelineConfig


@flow(name="agent-rft-monitor", persist_result=True, log_prints=True)
def monitor_model(config: PipelineConfig, version: str | None = None) -> Any:
    """Read the latest traffic windows, score them and check them against the suite."""
    logger = get_run_logger()
    tracking_uri = resolve_tracking_uri(config.mlflow.tracking_uri)
    result = monitor_traffic(config, version=version, tracking_uri=tracking_uri, work_dir=config.work_dir)
    for window in result.windows:
        logger.info("window %s: %s", window["window"], {k.removeprefix("monitor/"): round(v, 4)
                                                        for k, v in window.items() if k.startswith("monitor/")})
    if not result.passed:
        return Failed(name="Stopped", message=f"monitor of {config.registered_model} version {result.version}: "
                      + "; ".join(result.reasons) + f" (MLflow run {result.run_id})")
    logger.info("monitor of %s version %s passed (MLflow run %s)", config.registered_model, result.version,
                result.run_id)
    return {"run_id": result.run_id, "version": result.version, "windows": result.windows}
