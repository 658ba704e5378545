"""The MLflow tracking server restarting during training.

A real `mlflow server` on loopback (SQLite backend) records a training run. It is killed
after the first step's metrics arrive and restarted on the same port a few seconds later:
the trainer's logging retries with backoff, and the run ends with one value per step of
every metric. When the server does not come back within `mlflow.unavailable_timeout_s`,
training stops with an error that names MLflow and the limit.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.pipeline_world import micro
from trainer.data import read_jsonl
from trainer.errors import InfraError

pytestmark = pytest.mark.integration


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _start(store: Path, port: int) -> subprocess.Popen:
    process = subprocess.Popen(
        [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", f"sqlite:///{store}", "--host", "127.0.0.1",
         "--port", str(port), "--workers", "1", "--default-artifact-root", str(store.parent / "artifacts")],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return process
        except httpx.HTTPError:
            time.sleep(0.5)
    process.kill()
    raise RuntimeError("mlflow server did not start")


def _stop(process: subprocess.Popen) -> None:
    os.killpg(process.pid, 9)
    process.wait(timeout=30)


def _train(world: Path, endpoints, model: Path, port: int, out: Path, timeout_s: float) -> tuple[str, object]:
    from mlflow import MlflowClient

    from trainer.rl.grpo import train

    uri = f"http://127.0.0.1:{port}"
    client = MlflowClient(tracking_uri=uri)
    run_id = client.create_run(client.create_experiment(f"restart-{out.name}")).info.run_id
    config = micro(world, endpoints, model, mlflow={"tracking_uri": uri, "unavailable_timeout_s": timeout_s},
                   training={"max_steps": 3, "n_epochs": 3, "eval_interval": 3, "checkpoint_interval": 3})
    os.environ["MLFLOW_TRACKING_URI"] = uri
    try:
        return run_id, train(config, model_path=str(model), output_dir=out, mlflow_run_id=run_id)
    finally:
        del os.environ["MLFLOW_TRACKING_URI"]


def _kill_after_first_step(process: subprocess.Popen, metrics: Path, then: callable) -> threading.Thread:
    def watch() -> None:
        while not any(row.get("step") == 1 for row in read_jsonl(metrics, missing_ok=True)):
            time.sleep(0.2)
        _stop(process)
        then()

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def test_metrics_arrive_complete_after_the_server_restarts(world, endpoints, taught_model, tmp_path):
    from mlflow import MlflowClient

    store, port, out = tmp_path / "mlflow.db", _free_port(), tmp_path / "run"
    servers = [_start(store, port)]

    def restart() -> None:
        time.sleep(8)  # down for a while: steps 2 and 3 try to log meanwhile
        servers.append(_start(store, port))

    watcher = _kill_after_first_step(servers[0], out / "metrics.jsonl", restart)
    try:
        run_id, result = _train(world, endpoints, taught_model, port, out, timeout_s=300)
        watcher.join(timeout=300)
        client = MlflowClient(tracking_uri=f"http://127.0.0.1:{port}")
        for key in ("train/reward_mean", "train/loss", "timing/step_s"):
            assert sorted(m.step for m in client.get_metric_history(run_id, key)) == [1, 2, 3], key
        assert sorted(m.step for m in client.get_metric_history(run_id, "eval/score_mean")) == [0, 3]
        assert result.steps == 3
    finally:
        for server in servers:
            if server.poll() is None:
                _stop(server)


def test_a_server_that_stays_down_stops_training_with_a_clear_error(world, endpoints, taught_model, tmp_path):
    store, port, out = tmp_path / "mlflow.db", _free_port(), tmp_path / "run"
    server = _start(store, port)
    watcher = _kill_after_first_step(server, out / "metrics.jsonl", lambda: None)
    started = time.monotonic()
    try:
        with pytest.raises(InfraError, match=r"MLflow: .* failed for 15 s .*mlflow.unavailable_timeout_s"):
            _train(world, endpoints, taught_model, port, out, timeout_s=15)
        watcher.join(timeout=60)
        assert time.monotonic() - started < 300
        # the local record is complete up to the failed step
        assert [row["step"] for row in read_jsonl(out / "metrics.jsonl")][:2] == [0, 1]
    finally:
        if server.poll() is None:
            _stop(server)
