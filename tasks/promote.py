"""Stage 6, promotion: the MLflow model registry, `challenger` and `champion`.

The candidate (logged by the training stage as a transformers-flavour MLflow model, with
its tokenizer and chat template) becomes a new version of the configured registered
model, with alias `challenger` and tags naming the pipeline run, the data md5 and the
evaluation figures. `champion` moves to it only when every regression gate passed; the
version it replaces is recorded in the new version's `previous_champion` tag, which is
what a rollback follows. When a gate failed, `champion` stays and the reason is recorded.

The registry is never left half-updated: every change made is undone, in reverse order,
if a later one fails (a new version is deleted, aliases point back where they were). A
process killed midway cannot undo anything, so a new version is created with the tag
`registration=pending` and marked `complete` only after its aliases are set; the next
promotion deletes any version still pending (with its aliases) before it starts. Readers
of the registry see a version as registered only when it is complete.
`set_champion` is also what the hand-driven promote/rollback flow calls.
"""

from __future__ import annotations

import json
from typing import Any

from prefect import task

from tasks.tracking import RunContext, fluent_store, log_json, publish_summary, stage_run
from tasks.versioning import STAGES
from trainer.config import PipelineConfig
from trainer.errors import ConfigError

STAGE = STAGES[5]


def alias_version(client: Any, name: str, alias: str) -> str | None:
    """The version an alias points at, or None (no such model or alias)."""
    from mlflow.exceptions import MlflowException

    try:
        return str(client.get_model_version_by_alias(name, alias).version)
    except MlflowException:
        return None


def current_champion(tracking_uri: str, name: str) -> dict[str, Any] | None:
    from tasks.tracking import mlflow_client

    version = alias_version(mlflow_client(tracking_uri), name, "champion")
    return {"version": version, "uri": f"models:/{name}/{version}"} if version else None


def remove_pending(client: Any, name: str) -> list[str]:
    """Delete versions a killed promotion left half-registered (a `champion` alias it had
    already taken goes back to the version it replaced); returns their numbers."""
    removed = []
    for version in client.search_model_versions(f"name = '{name}'"):
        if version.tags.get("registration") != "pending":
            continue
        previous = version.tags.get("previous_champion")
        # search results leave `aliases` empty: read the version itself
        for alias in client.get_model_version(name, version.version).aliases or []:
            if alias == "champion" and previous:
                client.set_registered_model_alias(name, "champion", previous)
            else:
                client.delete_registered_model_alias(name, alias)
        client.delete_model_version(name, version.version)
        removed.append(str(version.version))
    return removed


class RegistryChange:
    """Registry edits that undo themselves, newest first, if the block raises."""

    def __init__(self, client: Any, name: str):
        self.client, self.name = client, name
        self._undo: list[Any] = []

    def __enter__(self) -> RegistryChange:
        return self

    def __exit__(self, kind: Any, exc: Any, tb: Any) -> None:
        if kind is None:
            return
        for undo in reversed(self._undo):
            try:
                undo()
            except Exception as undo_error:  # keep undoing the rest; report what could not be
                exc.add_note(f"registry rollback step failed: {undo_error}")

    def register(self, model_uri: str, run_id: str, tags: dict[str, str]) -> str:
        from mlflow.exceptions import MlflowException

        try:
            self.client.get_registered_model(self.name)
        except MlflowException:
            self.client.create_registered_model(self.name, description="Agent RFT models (trained by agentrft).")
            self._undo.append(lambda: self.client.delete_registered_model(self.name))
        tags = {**tags, "registration": "pending"}  # until `complete`: see the module docstring
        version = str(self.client.create_model_version(self.name, model_uri, run_id=run_id, tags=tags).version)
        self._undo.append(lambda: self.client.delete_model_version(self.name, version))
        return version

    def set_alias(self, alias: str, version: str) -> None:
        before = alias_version(self.client, self.name, alias)
        self.client.set_registered_model_alias(self.name, alias, version)
        if before is None:
            self._undo.append(lambda: self.client.delete_registered_model_alias(self.name, alias))
        else:
            self._undo.append(lambda: self.client.set_registered_model_alias(self.name, alias, before))

    def set_tag(self, version: str, key: str, value: str) -> None:
        self.client.set_model_version_tag(self.name, version, key, value)


def set_champion(client: Any, name: str, version: str, *, reason: str) -> str | None:
    """Point `champion` at `version`, recording the one it replaces; returns that one."""
    with RegistryChange(client, name) as change:
        previous = alias_version(client, name, "champion")
        if previous == version:
            return previous
        if previous is not None:
            change.set_tag(version, "previous_champion", previous)
        change.set_tag(version, "champion_reason", reason)
        change.set_alias("champion", version)
        return previous


def rollback_champion(client: Any, name: str, to_version: str | None = None) -> tuple[str, str]:
    """Move `champion` back: to `to_version`, or to the current champion's
    `previous_champion`. Returns (from, to)."""
    current = alias_version(client, name, "champion")
    if current is None:
        raise ConfigError(f"registered model {name!r} has no champion to roll back")
    target = to_version or client.get_model_version(name, current).tags.get("previous_champion")
    if not target:
        raise ConfigError(
            f"{name} version {current} records no previous champion; name the version to roll back to"
        )
    with RegistryChange(client, name) as change:
        change.set_tag(current, "rolled_back_to", target)
        change.set_alias("champion", target)
    return current, target


def register_candidate(
    client: Any, name: str, model_uri: str, run_id: str, tags: dict[str, str], *, passed: bool, reasons: list[str]
) -> tuple[str, str | None, str]:
    """New version (alias `challenger`), `champion` when the gates passed; all or nothing.
    Returns the version, the champion it replaced (if any) and the decision in words."""
    with RegistryChange(client, name) as change:
        version = change.register(model_uri, run_id, tags)
        change.set_alias("challenger", version)
        previous = None
        if passed:
            previous = alias_version(client, name, "champion")
            if previous is not None:
                change.set_tag(version, "previous_champion", previous)
            change.set_tag(version, "champion_reason", "every regression gate passed")
            change.set_alias("champion", version)
            decision = f"promoted: version {version} is champion" + (
                f" (was version {previous})" if previous else " (first champion)")
        else:
            reason = "; ".join(reasons)
            change.set_tag(version, "not_promoted_reason", reason[:5000])
            decision = f"not promoted: version {version} stays challenger; {reason}"
        change.set_tag(version, "registration", "complete")
    return version, previous, decision


@task(name="promotion", persist_result=True, cache_key_fn=lambda _ctx, params: params["stage_key"])
def promotion(
    config: PipelineConfig, ctx: RunContext, stage_key: str, *, candidate: dict[str, Any], evaluation: dict[str, Any]
) -> dict[str, Any]:
    """Register the candidate as `challenger`; make it `champion` if every gate passed."""
    name = config.promotion.registered_model
    with stage_run(ctx, STAGE, config) as (client, run_id):
        removed = remove_pending(client, name)
        if removed:
            client.set_tag(run_id, "removed_pending_versions", ",".join(removed))
        gain = evaluation["score_gain"]
        tags = {
            "pipeline_run_id": ctx.parent_run_id,
            "data_md5": ctx.data_md5,
            "git_commit": ctx.git_commit,
            "training_step": str(candidate["step"]),
            "eval_score_gain": f"{gain['gain']:.4f}",
            "eval_score_gain_ci95": f"[{gain['low']:.4f}, {gain['high']:.4f}]",
            "gates_passed": str(evaluation["passed"]).lower(),
        }
        # MLflow resolves a `models:/m-...` source through the fluent store, not the client's.
        with fluent_store(ctx.tracking_uri):
            version, previous, decision = register_candidate(
                client, name, candidate["model_uri"], run_id, tags, passed=evaluation["passed"],
                reasons=evaluation["reasons"],
            )
        client.set_tag(run_id, "decision", decision[:5000])
        client.set_tag(run_id, "registered_version", version)
        result = {"run_id": run_id, "registered_model": name, "version": version,
                  "champion": bool(evaluation["passed"]), "previous_champion": previous, "decision": decision}
        log_json(client, run_id, result, "promotion.json")
        publish_summary(ctx, STAGE, run_id, f"# Promotion\n\n{decision}\n\n```json\n{json.dumps(tags, indent=2)}\n```\n")
    return result
