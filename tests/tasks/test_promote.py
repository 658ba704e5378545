"""Promotion safety on a real MLflow registry (SQLite): a failure at any point of a
promotion leaves the registry as it was, a killed promotion's half-registered version is
removed by the next one, and `champion` never points at a version that failed a gate."""

from __future__ import annotations

from pathlib import Path

import pytest
from mlflow import MlflowClient

from tasks.promote import alias_version, register_candidate, remove_pending, rollback_champion
from tasks.tracking import mlflow_client

NAME = "safety-agent"
MUTATIONS = ("create_registered_model", "create_model_version", "set_registered_model_alias",
             "set_model_version_tag", "delete_registered_model_alias")


class Crash(Exception):
    pass


class CrashingClient(MlflowClient):
    """A real client whose n-th registry write raises (as a failure midway would)."""

    def __init__(self, tracking_uri: str, crash_at: int):
        super().__init__(tracking_uri=tracking_uri, registry_uri=tracking_uri)
        self.crash_at, self.writes = crash_at, 0
        for method in MUTATIONS:
            real = getattr(self, method)
            setattr(self, method, self._counted(real))

    def _counted(self, real):
        def call(*args, **kwargs):
            self.writes += 1
            if self.writes == self.crash_at:
                raise Crash(f"write {self.writes}")
            return real(*args, **kwargs)
        return call


def _state(client: MlflowClient) -> dict:
    versions = client.search_model_versions(f"name = '{NAME}'")
    return {str(v.version): (sorted(v.aliases or []), dict(sorted(v.tags.items()))) for v in versions}


@pytest.fixture
def store(tmp_path: Path) -> tuple[str, str]:
    uri = f"sqlite:///{tmp_path / 'registry.db'}"
    source = tmp_path / "model"
    source.mkdir()
    (source / "config.json").write_text("{}")
    return uri, str(source)


def _register(client, source, *, passed: bool):
    return register_candidate(client, NAME, source, None, {"data_md5": "abc"}, passed=passed,
                              reasons=[] if passed else ["gain_vs_champion: too low"])


@pytest.mark.parametrize("passed", [True, False])
def test_a_failure_at_any_write_leaves_the_registry_as_it_was(store, passed):
    uri, source = store
    client = mlflow_client(uri)
    _register(client, source, passed=True)  # version 1, champion
    before = _state(client)
    crash_at = 1
    while True:
        crashing = CrashingClient(uri, crash_at)
        try:
            version, _, _ = _register(crashing, source, passed=passed)
        except Crash:
            after = _state(client)
            assert after == before, f"crash at write {crash_at} left {after}"
            crash_at += 1
            continue
        break
    assert crash_at > 4  # every write of a full promotion was tried as the failing one
    state = _state(client)
    assert state[version][1]["registration"] == "complete"
    assert alias_version(client, NAME, "challenger") == version
    assert alias_version(client, NAME, "champion") == (version if passed else "1")


def test_a_killed_promotion_is_cleaned_up_by_the_next(store):
    uri, source = store
    client = mlflow_client(uri)
    _register(client, source, passed=True)  # version 1, champion
    # What a process killed right after moving `champion` leaves: a pending version 2.
    pending = client.create_model_version(NAME, source, tags={"registration": "pending", "previous_champion": "1"})
    client.set_registered_model_alias(NAME, "challenger", pending.version)
    client.set_registered_model_alias(NAME, "champion", pending.version)
    assert remove_pending(client, NAME) == [str(pending.version)]
    assert set(_state(client)) == {"1"}
    assert alias_version(client, NAME, "champion") == "1"
    assert alias_version(client, NAME, "challenger") is None
    version, previous, decision = _register(client, source, passed=False)
    assert alias_version(client, NAME, "champion") == "1" and decision.startswith("not promoted")


def test_rollback_follows_previous_champion(store):
    uri, source = store
    client = mlflow_client(uri)
    _register(client, source, passed=True)
    second, previous, _ = _register(client, source, passed=True)
    assert previous == "1" and alias_version(client, NAME, "champion") == second
    assert rollback_champion(client, NAME) == (second, "1")
    assert alias_version(client, NAME, "champion") == "1"
