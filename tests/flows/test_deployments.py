"""Deployments against a real Prefect server (the test harness): the served pipeline is
started with `run_deployment` and custom parameters, as the UI's "Custom run" does, and a
process worker on a work pool picks up and completes a run."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.pipeline_world import micro

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]


def _env(world: Path) -> dict[str, str]:
    from prefect.settings import PREFECT_API_URL, PREFECT_LOCAL_STORAGE_PATH

    return {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value(),
            "PREFECT_LOCAL_STORAGE_PATH": str(PREFECT_LOCAL_STORAGE_PATH.value())}


def _wait_for_deployment(name: str, process: subprocess.Popen, timeout: float = 180):
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    deadline = time.monotonic() + timeout
    with get_client(sync_client=True) as client:
        while time.monotonic() < deadline:
            assert process.poll() is None, "the serving process exited"
            try:
                return client.read_deployment_by_name(name)
            except ObjectNotFound:
                time.sleep(1)
    raise AssertionError(f"deployment {name} did not appear")


def _custom_parameters(deployment, **sections) -> dict:
    """The deployment's parameters with some config fields changed, as the form sends them."""
    config = dict(deployment.parameters["config"])
    for section, values in sections.items():
        config[section] = {**config[section], **values}
    return {**deployment.parameters, "config": config}


def test_served_deployment_runs_with_custom_parameters(harness, world, endpoints, taught_model):
    from prefect.deployments import run_deployment

    config_file = world / "served.yaml"
    config_file.write_text(yaml.safe_dump(micro(world, endpoints, taught_model).model_dump(mode="json")))
    server = subprocess.Popen([sys.executable, "-m", "flows.cli", "serve", "--config", str(config_file)],
                              cwd=REPO, env=_env(world), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deployment = _wait_for_deployment("agent-rft-pipeline/scheduled", server)
        assert [s.schedule.cron for s in deployment.schedules] == ["0 2 * * *"]
        # The form: the whole config as typed fields, with their descriptions, the stages to
        # refresh and the stage to stop after (none: the whole pipeline).
        schema = deployment.parameter_openapi_schema
        assert set(schema["properties"]) == {"config", "refresh", "stop_after", "method"} and schema["required"] == ["config"]
        form = schema["definitions"]
        assert "prompt_optimization" in form["PipelineConfig"]["properties"]
        target = form["PromptOptimizationConfig"]["properties"]["target_score"]
        assert (target["type"], target["minimum"], target["maximum"]) == ("number", 0, 1) and target["description"]
        assert deployment.parameters["config"]["name"] == "micro" and deployment.parameters["refresh"] == []
        # A custom run from the form: a target the base model already reaches ends the run
        # before training ("RFT not needed").
        params = _custom_parameters(deployment, prompt_optimization={"target_score": 0.0})
        run = run_deployment("agent-rft-pipeline/scheduled", parameters=params, timeout=900)
        assert run.state.is_completed(), run.state
        outcome = run.state.result()
        assert outcome["outcome"] == "rft_not_needed" and set(outcome["stages"]) == {
            "validate_data", "baseline", "prompt_optimization"}
        _wait_for_deployment("promote-model/by-hand", server)
    finally:
        server.terminate()
        server.wait(timeout=60)
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        result = client.read_flow_run(run.id)
    assert result.parameters["config"]["prompt_optimization"]["target_score"] == 0.0


def test_training_runs_on_its_own_work_pool_and_the_other_stages_on_theirs(harness, world, endpoints,
                                                                          taught_model):
    """Two process work pools and a worker each: the pipeline's flow run on `cpu-pool`, its
    training stage as a deployment of its own on `gpu-pool` (a subflow, its result read back),
    both in Prefect's records; the training's MLflow run is a child of the pipeline's."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterParentFlowRunId
    from prefect.deployments import run_deployment

    from flows.serve import deploy_to_work_pool
    from tasks.tracking import mlflow_client

    with get_client(sync_client=True) as client:
        for pool in ("cpu-pool", "gpu-pool"):
            client.create_work_pool(WorkPoolCreate(name=pool, type="process"))
    config = micro(world, endpoints, taught_model)
    ids = deploy_to_work_pool(config, "cpu-pool", schedule=False, training_pool="gpu-pool")
    assert len(ids) == 4
    workers = [subprocess.Popen([sys.executable, "-m", "prefect", "worker", "start", "--pool", pool, "--type",
                                 "process", "--name", f"{pool}-worker"], cwd=REPO, env=_env(world),
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE) for pool in ("cpu-pool", "gpu-pool")]
    try:
        run = run_deployment("agent-rft-pipeline/scheduled", parameters={"stop_after": "rft_training"}, timeout=900)
        assert run.state.is_completed(), run.state
        outcome = run.state.result()
        assert outcome["outcome"] == "stopped_after" and outcome["candidate"]["model_uri"]
        with get_client(sync_client=True) as client:
            pipeline = client.read_flow_run(run.id)
            children = client.read_flow_runs(flow_run_filter=FlowRunFilter(
                parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[run.id])))
            training = [r for r in children if r.deployment_id is not None]
            assert pipeline.work_pool_name == "cpu-pool"
            assert len(training) == 1 and training[0].work_pool_name == "gpu-pool"
            assert training[0].state.is_completed()
            assert {w.name for w in client.read_workers_for_work_pool("gpu-pool")} == {"gpu-pool-worker"}
        stage = mlflow_client(config.mlflow.tracking_uri).get_run(outcome["stages"]["rft_training"]["run_id"])
        assert stage.data.tags["mlflow.parentRunId"] == outcome["parent_run_id"]
    finally:
        for worker in workers:
            worker.terminate()
        for worker in workers:
            try:
                worker.wait(timeout=60)
            except subprocess.TimeoutExpired:  # a worker slow to shut down on a loaded machine
                worker.kill()
                worker.wait(timeout=30)
