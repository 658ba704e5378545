"""Promotion safety on a real MLflow registry (SQLite): a failure at any write of a
promotion (its steps run in a Prefect transaction) leaves the registry as it was, a killed
promotion's half-registered version is removed by the next one, and `champion` never
points at a version that failed a gate."""

from __future__ import annotations

from pathlib import Path

import pytest
from mlflow import MlflowClient

from tasks.promote import (
    alias_version,
    register_candidate,
    remove_pending,
    rollback_champion,
    set_champion,
)
from tasks.tracking import mlflow_client

NAME = "safety-agent"
MUTATIONS = ("create_registered_model", "create_model_version", "set_registered_model_alias",
             "set_model_version_tag", "delete_registered_model_alias")


class Crash(Exception):
    pass


@pytest.fixture
def crash_at_write(monkeypatch):
    """Make the n-th registry write of the real MLflow client raise, as a failure midway
    (a store error, a killed connection) would; returns a setter and the write count."""
    plan = {"crash_at": 0, "writes": 0}
    for method in MUTATIONS:
        real = getattr(MlflowClient, method)

        def counted(self, *args, _real=real, **kwargs):
            plan["writes"] += 1
            if plan["writes"] == plan["crash_at"]:
                raise Crash(f"write {plan['writes']}")
            return _real(self, *args, **kwargs)

        monkeypatch.setattr(MlflowClient, method, counted)

    def arm(n: int) -> dict:
        plan.update(crash_at=n, writes=0)
        return plan

    return arm


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


def _register(uri, source, *, passed: bool):
    return register_candidate(uri, NAME, source, None, {"data_md5": "abc"}, passed=passed,
                              reasons=[] if passed else ["gain_vs_champion: too low"])


@pytest.mark.parametrize(("passed", "writes"), [(True, 6), (False, 4)])
def test_a_failure_at_any_write_leaves_the_registry_as_it_was(harness, store, crash_at_write, passed, writes):
    uri, source = store
    client = mlflow_client(uri)
    _register(uri, source, passed=True)  # version 1, champion
    before = _state(client)
    crash_at = 1
    while True:
        plan = crash_at_write(crash_at)
        try:
            version, _, _ = _register(uri, source, passed=passed)
        except Crash:
            after = _state(client)
            assert after == before, f"crash at write {crash_at} left {after}"
            crash_at += 1
            continue
        break
    # Every write of a whole promotion (version, challenger, tags, champion, complete) was
    # tried as the failing one; the last try crashed nowhere.
    assert crash_at == writes + 1 and plan["writes"] == writes
    state = _state(client)
    assert state[version][1]["registration"] == "complete"
    assert alias_version(client, NAME, "challenger") == version
    assert alias_version(client, NAME, "champion") == (version if passed else "1")


def test_a_failed_first_registration_leaves_no_model(harness, store, crash_at_write):
    uri, source = store
    client = mlflow_client(uri)
    for crash_at in range(1, 7):  # model, version, challenger, champion_reason tag, champion, complete
        crash_at_write(crash_at)
        with pytest.raises(Crash):
            _register(uri, source, passed=True)
        assert client.search_registered_models(f"name = '{NAME}'") == [], f"crash at write {crash_at}"
    plan = crash_at_write(7)
    version, previous, decision = _register(uri, source, passed=True)
    assert plan["writes"] == 6 and (version, previous) == ("1", None)
    assert decision == "promoted: version 1 is champion (first champion)"


def test_a_killed_promotion_is_cleaned_up_by_the_next(harness, store):
    uri, source = store
    client = mlflow_client(uri)
    _register(uri, source, passed=True)  # version 1, champion
    # What a process killed right after moving `champion` leaves: a pending version 2.
    pending = client.create_model_version(NAME, source, tags={"registration": "pending", "previous_champion": "1"})
    client.set_registered_model_alias(NAME, "challenger", pending.version)
    client.set_registered_model_alias(NAME, "champion", pending.version)
    assert remove_pending(client, NAME) == [str(pending.version)]
    assert set(_state(client)) == {"1"}
    assert alias_version(client, NAME, "champion") == "1"
    assert alias_version(client, NAME, "challenger") is None
    version, previous, decision = _register(uri, source, passed=False)
    assert alias_version(client, NAME, "champion") == "1" and decision.startswith("not promoted")


def test_rollback_follows_previous_champion(harness, store):
    uri, source = store
    client = mlflow_client(uri)
    _register(uri, source, passed=True)
    second, previous, _ = _register(uri, source, passed=True)
    assert previous == "1" and alias_version(client, NAME, "champion") == second
    assert rollback_champion(uri, NAME) == (second, "1")
    assert alias_version(client, NAME, "champion") == "1"
    assert client.get_model_version(NAME, second).tags["rolled_back_to"] == "1"


def test_a_failed_hand_promotion_or_rollback_changes_nothing(harness, store, crash_at_write):
    uri, source = store
    client = mlflow_client(uri)
    _register(uri, source, passed=True)
    second, _, _ = _register(uri, source, passed=False)  # challenger, not champion
    before = _state(client)
    for crash_at in (1, 2, 3):  # previous_champion tag, champion_reason tag, the alias
        crash_at_write(crash_at)
        with pytest.raises(Crash):
            set_champion(uri, NAME, second, reason="by hand")
        assert _state(client) == before, f"crash at write {crash_at}"
    crash_at_write(0)
    assert set_champion(uri, NAME, second, reason="by hand") == "1"
    assert alias_version(client, NAME, "champion") == second
    promoted = _state(client)
    for crash_at in (1, 2):  # rolled_back_to tag, the alias
        crash_at_write(crash_at)
        with pytest.raises(Crash):
            rollback_champion(uri, NAME)
        assert _state(client) == promoted, f"crash at write {crash_at}"
    crash_at_write(0)
    assert rollback_champion(uri, NAME) == (second, "1")
