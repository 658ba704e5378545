"""Overlapping runs: one pipeline at a time trains and promotes a registered model.

A nightly cron run and a run someone starts from the UI can overlap. Through the real
Prefect API (the test harness: a Prefect server, so the lock is a Prefect global
concurrency limit) and one SQLite MLflow store: two pipeline runs started at the same
moment both finish (`wait`) and the registry holds what one run alone would have left;
with `stop`, a run that finds the model held stops with a message naming it and changes
nothing. Repeated five times. The file lock of Prefect's ephemeral mode waits, stops, and
is released when its holder is killed.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tasks.locks import ModelBusy, model_lock
from tasks.tracking import mlflow_client
from tests.pipeline_world import micro

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]


def _registry(client, name: str) -> tuple[list[tuple[str, str]], str | None, str | None]:
    versions = sorted((str(v.version), v.tags.get("registration", "")) for v in client.search_model_versions(
        f"name = '{name}'"))
    aliases = {alias: None for alias in ("champion", "challenger")}
    for alias in aliases:
        try:
            aliases[alias] = str(client.get_model_version_by_alias(name, alias).version)
        except Exception:  # noqa: BLE001 - MLflow raises its own type for a missing alias
            pass
    return versions, aliases["champion"], aliases["challenger"]


def test_two_runs_at_once_leave_the_registry_as_one_run_would(harness, world, endpoints, taught_model):
    from flows.pipeline import agent_rft_pipeline, pipeline_parameters

    store = {"tracking_uri": f"sqlite:///{world / 'concurrent.db'}", "experiment": "concurrent"}
    client = mlflow_client(store["tracking_uri"])
    for repetition in range(5):
        name = f"concurrent-{repetition}"
        mode = "wait" if repetition % 2 == 0 else "stop"
        config = micro(world, endpoints, taught_model, mlflow=store,
                       training={"max_steps": 2, "n_epochs": 2, "eval_interval": 2, "checkpoint_interval": 2},
                       promotion={"registered_model": name, "concurrent_runs": mode, "lock_timeout_s": 900})
        barrier = threading.Barrier(2)

        def one_run(config=config, barrier=barrier) -> str:
            barrier.wait()  # both start at the same moment
            state = agent_rft_pipeline(**pipeline_parameters(config), return_state=True)
            try:
                return state.result()["outcome"]
            except ModelBusy:
                return "busy"
            except Exception as exc:  # noqa: BLE001 - the flow wraps it: look at the message
                return "busy" if "another pipeline run" in str(exc) else f"failed: {type(exc).__name__}: {exc}"

        with ThreadPoolExecutor(2) as pool:
            outcomes = sorted(pool.map(lambda _: one_run(), range(2)))
        versions, champion, challenger = _registry(client, name)
        if mode == "wait":
            assert all(o in ("promoted", "not_promoted") for o in outcomes), (repetition, outcomes)
        else:
            assert outcomes.count("busy") <= 1 and all(o in ("promoted", "not_promoted", "busy") for o in outcomes), \
                (repetition, outcomes)
        # what one run alone leaves: one complete version, challenger on it, champion only if promoted
        assert versions == [("1", "complete")], (repetition, versions)
        assert challenger == "1" and champion in ("1", None)


def test_a_run_that_finds_the_model_held_stops_with_a_clear_message_and_changes_nothing(harness, world, endpoints,
                                                                                          taught_model):
    from flows.pipeline import agent_rft_pipeline, pipeline_parameters

    name = "held-elsewhere"
    store = {"tracking_uri": f"sqlite:///{world / 'held.db'}", "experiment": "held"}
    config = micro(world, endpoints, taught_model, mlflow=store,
                   promotion={"registered_model": name, "concurrent_runs": "stop"})
    with model_lock(name, mode="stop"):  # another run holds it
        state = agent_rft_pipeline(**pipeline_parameters(config), return_state=True)
    with pytest.raises(Exception, match=f"another pipeline run is training or promoting it .*'{name}'"):
        state.result()
    client = mlflow_client(store["tracking_uri"])
    assert client.search_model_versions(f"name = '{name}'") == []


def test_file_lock_waits_stops_and_dies_with_its_holder(tmp_path, monkeypatch):
    import tasks.locks as locks

    monkeypatch.setattr(locks, "LOCK_DIR", tmp_path)
    monkeypatch.setenv("AGENTRFT_LOCK_DIR", str(tmp_path))
    holder = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent("""
            import sys, time
            from tasks.locks import _file_lock
            with _file_lock("m", wait=False, timeout_s=1, log=print):
                print("held", flush=True)
                time.sleep(600)
        """)],
        cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=subprocess.PIPE, text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(ModelBusy, match="another pipeline run"):
            with locks._file_lock("m", wait=False, timeout_s=1, log=print):
                pass
        started = time.monotonic()
        with pytest.raises(ModelBusy, match="still held it after"):
            with locks._file_lock("m", wait=True, timeout_s=2, log=print):
                pass
        assert time.monotonic() - started >= 2
        holder.kill()  # a crash: the OS drops the lock with the process
        holder.wait(timeout=10)
        with locks._file_lock("m", wait=False, timeout_s=1, log=print):
            pass
    finally:
        holder.kill()
