"""A secret planted in a tool header (`${AGENTRFT_PLANTED}` from the environment) runs a
whole pipeline and then is searched for everywhere the pipeline writes: the MLflow store
(params, tags, metrics, artifacts, registry: the SQLite file and every artifact byte), the
Prefect API (flow and task run parameters, logs, artifacts) and the stage output folders.
It must appear in none of them, while the tool server did receive it."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from tasks.tracking import mlflow_client
from tests.pipeline_world import micro

pytestmark = pytest.mark.integration


def test_planted_header_secret_appears_nowhere(harness, world, endpoints, taught_model, monkeypatch, tmp_path):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        FlowRunFilter,
        FlowRunFilterId,
        LogFilter,
        LogFilterFlowRunId,
    )

    from flows.pipeline import agent_rft_pipeline, pipeline_parameters

    secret = f"planted-{uuid.uuid4().hex}"
    monkeypatch.setenv("AGENTRFT_PLANTED", secret)
    declared = [{"name": e.name, "server_url": e.server_url, "headers": {"Authorization": "Bearer ${AGENTRFT_PLANTED}"}}
                for e in endpoints]
    work = world / "secret-runs"
    config = micro(world, endpoints, taught_model, name="secret-scan", work_dir=str(work), tools={"endpoints": declared},
                   training={"learning_rate": 1e-6},
                   # a store of its own: no stage may come from another test's cache
                   mlflow={"tracking_uri": f"sqlite:///{world / 'secret-scan.db'}"})
    outcome = agent_rft_pipeline(**pipeline_parameters(config))
    assert outcome["outcome"] in ("promoted", "not_promoted")
    needle = secret.encode()

    # MLflow: the store file holds params, tags, metrics, inputs and the registry
    store = Path(config.mlflow.tracking_uri.removeprefix("sqlite:///"))
    assert needle not in store.read_bytes()
    client = mlflow_client(config.mlflow.tracking_uri)
    parent = client.get_run(outcome["parent_run_id"])
    runs = [parent] + client.search_runs([parent.info.experiment_id],
                                         filter_string=f"tags.mlflow.parentRunId = '{parent.info.run_id}'")
    assert len(runs) == 7
    scanned = 0
    for run in runs:
        assert secret not in str(run.data.params) + str(run.data.tags)
        local = Path(client.download_artifacts(run.info.run_id, "", str(tmp_path / run.info.run_id)))
        for file in (p for p in local.rglob("*") if p.is_file()):
            assert needle not in file.read_bytes(), file
            scanned += 1
    assert scanned > 20  # reports, rollouts, figures, the logged models
    assert parent.data.params["tools.endpoints"].count("${AGENTRFT_PLANTED}") == len(declared)

    # Prefect: the flow run, its task runs, their logs and artifacts
    flow_run_id = parent.data.tags["prefect_flow_run_id"]
    with get_client(sync_client=True) as prefect:
        run = prefect.read_flow_run(flow_run_id)
        assert secret not in str(run.parameters)
        tasks = prefect.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[run.id])))
        names = {t.name.rsplit("-", 1)[0] for t in tasks}
        # the six stages, and the registry steps of the promotion's transaction
        assert {"validate_data", "baseline", "prompt_optimization", "rft_training", "regression_eval",
                "promotion"} <= names
        assert {"registry: create version", "registry: move alias", "registry: tag version"} <= names
        assert all(secret not in str(t.task_inputs) for t in tasks)
        logs = prefect.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run.id])))
        assert logs and all(secret not in log.message for log in logs)
        artifacts = prefect.read_artifacts()
        assert artifacts and all(secret not in str(a.data) for a in artifacts)

    # the stages' own folders: configs, training log, rollouts
    files = [p for p in work.rglob("*") if p.is_file()]
    assert any(p.name == "config.yaml" for p in files) and any(p.name == "train.log" for p in files)
    for file in files:
        assert needle not in file.read_bytes(), file
