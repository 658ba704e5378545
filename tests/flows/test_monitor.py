"""The monitor (flows/monitor.py, tasks/monitor.py) on real traffic logs, a real GX suite
derived from earlier traffic, the job's grader and an MLflow SQLite store; promotion as a
Prefect event that starts the served monitor deployment (a real Prefect server)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from envs.finqa.generate import generate_dataset
from tasks.expectations import derive_and_save
from tasks.tracking import mlflow_client
from tests.pipeline_world import micro
from trainer.data import read_jsonl

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]


def _traffic(root: Path, *, drift: bool, n: int, seed: int = 0) -> list[dict]:
    generate_dataset(root, seed=seed, drift=drift, n_train=10, n_validation=10, n_test=10, n_traffic=n)
    return read_jsonl(root / "production_traffic.jsonl")


def _answered(rows: list[dict], *, right: bool = True) -> list[dict]:
    """Rows as a serving log holds them: the request and what the model answered."""
    return [{**row, "response": {"role": "assistant",
                                 "content": f"Answer: {row['reference_answer'] if right else '-999'}"}}
            for row in rows]


def _write(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def suite_dir(world: Path) -> Path:
    """The suite, derived from earlier production traffic."""
    earlier = world / "monitor-earlier"
    _traffic(earlier, drift=False, n=1000, seed=0)
    root = world / "monitor-expectations"
    derive_and_save(earlier / "production_traffic.jsonl", root, name="traffic", required=["reference_answer"])
    return root


def _config(world, endpoints, taught_model, suite_dir, traffic: Path, store: str, **monitor):
    return micro(world, endpoints, taught_model, mlflow={"tracking_uri": store, "experiment": "monitor"},
                 data={"expectations_dir": str(suite_dir), "expectations_suite": "traffic"},
                 monitor={"traffic_file": str(traffic), "window_rows": 200, "windows": 2, **monitor})


def test_monitor_passes_on_steady_traffic_and_fails_on_a_score_drop(harness, world, endpoints, taught_model,
                                                                     suite_dir, tmp_path):
    from flows.monitor import monitor_model

    steady = _answered(_traffic(tmp_path / "now", drift=False, n=600, seed=1))
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    log = _write(tmp_path / "traffic.jsonl", steady[:400])
    config = _config(world, endpoints, taught_model, suite_dir, log, store)
    state = monitor_model(config, "3", return_state=True)
    assert state.is_completed(), state.message
    result = state.result()
    client = mlflow_client(store)
    run = client.get_run(result["run_id"])
    assert run.data.tags["version"] == "3" and run.data.tags["verdict"] == "passed"
    scores = client.get_metric_history(result["run_id"], "monitor/score_mean")
    assert sorted((m.step, m.value) for m in scores) == [(1, 1.0), (2, 1.0)]
    failed = client.get_metric_history(result["run_id"], "monitor/failed_expectations")
    assert sorted((m.step, m.value) for m in failed) == [(1, 0.0), (2, 0.0)]
    artifacts = {a.path for a in client.list_artifacts(result["run_id"])}
    assert {"windows.png", "windows.json", "monitor_report.md"} <= artifacts

    # the next 200 requests: half the answers wrong, the window's score 0.5 below the last
    wrong = _answered(steady[400:500], right=False) + steady[500:600]
    _write(log, steady[:400] + wrong)
    state = monitor_model(config, "3", return_state=True)
    assert state.is_failed() and state.name == "Stopped"
    assert "window 2 scores 0.500, 0.500 below the reference 1.000" in state.message


def test_monitor_fails_on_drifted_traffic_naming_the_field(harness, world, endpoints, taught_model, suite_dir,
                                                          tmp_path):
    from flows.monitor import monitor_model

    steady = _answered(_traffic(tmp_path / "now", drift=False, n=200, seed=1))
    drifted = _answered(_traffic(tmp_path / "drifted", drift=True, n=200, seed=1))
    log = _write(tmp_path / "traffic.jsonl", steady + drifted)
    config = _config(world, endpoints, taught_model, suite_dir, log, f"sqlite:///{tmp_path / 'mlflow.db'}")
    state = monitor_model(config, return_state=True)
    assert state.is_failed() and state.name == "Stopped"
    assert "window 2 fails" in state.message and "drifted fields category" in state.message, state.message


def test_serve_registers_the_monitor_and_a_promotion_starts_it_for_that_version(harness, world, endpoints,
                                                                                taught_model, suite_dir, tmp_path):
    """`agentrft serve` serves the monitor on its cron with a trigger on the promotion event;
    promoting a version by hand (the promote-model flow) emits `agentrft.model.promoted` and
    the trigger runs the monitor with that version."""
    import os

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterName, FlowRunFilter
    from prefect.settings import PREFECT_API_URL, PREFECT_LOCAL_STORAGE_PATH

    from flows.pipeline import promote_model
    from tasks.promote import create_version, move_alias

    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    log = _write(tmp_path / "traffic.jsonl", _answered(_traffic(tmp_path / "now", drift=False, n=400, seed=1)))
    config = _config(world, endpoints, taught_model, suite_dir, log, store)
    # two registered versions of the model (its files: the taught model, logged as a run artifact)
    client = mlflow_client(store)
    run_id = client.create_run(client.create_experiment("monitor")).info.run_id
    client.log_artifacts(run_id, str(taught_model), "model")
    for _ in range(2):
        version = create_version(store, config.registered_model, f"runs:/{run_id}/model", run_id, {})
    move_alias(store, config.registered_model, "champion", "1")

    config_file = tmp_path / "job.yaml"
    config_file.write_text(yaml.safe_dump(config.model_dump(mode="json")))
    env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value(),
           "PREFECT_LOCAL_STORAGE_PATH": str(PREFECT_LOCAL_STORAGE_PATH.value())}
    server = subprocess.Popen([sys.executable, "-m", "flows.cli", "serve", "--config", str(config_file)],
                              cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        with get_client(sync_client=True) as prefect:
            deadline = time.monotonic() + 180
            while True:
                # this serve's deployment (another test's serve may have registered one of that name)
                found = [d for d in prefect.read_deployments(deployment_filter=DeploymentFilter(
                    name=DeploymentFilterName(any_=["monitor"])))
                    if d.parameters["config"]["monitor"]["traffic_file"] == str(log)]
                if found or time.monotonic() > deadline:
                    break
                assert server.poll() is None, server.stderr.read().decode()[-3000:]
                time.sleep(1)
            [deployment] = found
            assert [s.schedule.cron for s in deployment.schedules] == ["15 * * * *"]
            outcome = promote_model(config.registered_model, version, "promote", store)
            assert outcome["champion"] == version == "2"
            deadline = time.monotonic() + 240
            while time.monotonic() < deadline:
                # the trigger's run, not the runs the scheduler service books ahead for the cron
                runs = [r for r in prefect.read_flow_runs(flow_run_filter=FlowRunFilter(
                    deployment_id={"any_": [deployment.id]})) if not r.auto_scheduled]
                if runs and runs[0].state and runs[0].state.is_final():
                    break
                time.sleep(2)
            assert runs, "the promotion event started no monitor run"
            [run] = runs
            assert run.parameters["version"] == "2" and run.state.is_completed(), run.state
    finally:
        server.terminate()
        server.wait(timeout=60)
    [monitored] = mlflow_client(store).search_runs(
        [mlflow_client(store).get_experiment_by_name("monitor").experiment_id],
        filter_string="attributes.run_name = 'monitor' and tags.version = '2'")
    assert monitored.data.tags["version"] == "2" and monitored.data.tags["verdict"] == "passed"
