"""Stage 6, promotion: the MLflow model registry, `challenger` and `champion`.

The candidate (logged by the training stage as a transformers-flavour MLflow model, with
its tokenizer and chat template) becomes a new version of the registered model, with alias
`challenger` and tags naming the pipeline run, the data md5 and the evaluation figures.
`champion` moves to it only when every regression gate passed; the version it replaces is
recorded in the new version's `previous_champion` tag, which is what a rollback follows.
When a gate failed, `champion` stays and the reason is recorded.

The registry is never left half-updated. The steps run inside a Prefect transaction:
if one fails, the finished ones are undone by their rollback hooks, newest first (a new
version is deleted, aliases and tags go back to what they were). A process killed midway
cannot undo anything, so a new version is created with the tag `registration=pending`
and marked `complete` only at the end; the next promotion deletes any version still
pending (with its aliases) before it starts. Readers of the registry see a version as
registered only when it is complete. `set_champion` and `rollback_champion` are also
what the hand-driven promote/rollback flow calls.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.transactions import get_transaction, transaction

from tasks.cache import stage_cache
from tasks.events import emit_promoted
from tasks.results import Candidate, PromotionResult, RegressionResult
from tasks.tracking import RunContext, log_json, publish_summary, stage_run
from trainer.errors import ConfigError

STAGE = "promotion"


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


# --- registry steps: Prefect tasks whose rollback hooks undo them -----------------------
#
# A promotion runs its steps inside one Prefect `transaction()`: if a later step fails
# (or the block raises), the transaction rolls back and each finished step's
# `on_rollback` hook undoes it, newest first. Each step records what its undo needs in
# its own transaction record (`get_transaction().set`).


def _client(tracking_uri: str) -> Any:
    from tasks.tracking import mlflow_client

    return mlflow_client(tracking_uri)


@task(name="registry: create version", cache_policy=NO_CACHE)
def create_version(tracking_uri: str, name: str, model_uri: str, run_id: str, tags: dict[str, str]) -> str:
    """A new version of `name` (the registered model too, on first use), tagged pending."""
    from mlflow.exceptions import MlflowException

    client, txn = _client(tracking_uri), get_transaction()
    try:
        client.get_registered_model(name)
        created = False
    except MlflowException:
        client.create_registered_model(name, description="Agent RFT models (trained by agentrft).")
        created = True
    txn.set("created_model", created)
    tags = {**tags, "registration": "pending"}  # until `complete`: see the module docstring
    try:
        version = str(client.create_model_version(name, model_uri, run_id=run_id, tags=tags).version)
    except BaseException:
        # A step that fails is never staged, so its rollback hook does not run: undo here.
        if created:
            client.delete_registered_model(name)
        raise
    txn.set("version", version)
    return version


@create_version.on_rollback
def _delete_version(txn: Any) -> None:
    tracking_uri, name = txn.get("tracking_uri"), txn.get("name")
    client = _client(tracking_uri)
    client.delete_model_version(name, txn.get("version"))
    if txn.get("created_model"):
        client.delete_registered_model(name)


@task(name="registry: move alias", cache_policy=NO_CACHE)
def move_alias(tracking_uri: str, name: str, alias: str, version: str) -> str | None:
    """Point `alias` at `version`; returns the version it pointed at before."""
    client, txn = _client(tracking_uri), get_transaction()
    before = alias_version(client, name, alias)
    client.set_registered_model_alias(name, alias, version)
    txn.set("alias", alias)
    txn.set("before", before)
    return before


@move_alias.on_rollback
def _restore_alias(txn: Any) -> None:
    client, name, alias, before = _client(txn.get("tracking_uri")), txn.get("name"), txn.get("alias"), txn.get("before")
    if before is None:
        client.delete_registered_model_alias(name, alias)
    else:
        client.set_registered_model_alias(name, alias, before)


def _put_tags(client: Any, name: str, version: str, values: dict[str, str | None]) -> None:
    """Set each tag to its value; None deletes it."""
    for key, value in values.items():
        if value is None:
            client.delete_model_version_tag(name, version, key)
        else:
            client.set_model_version_tag(name, version, key, value)


@task(name="registry: tag version", cache_policy=NO_CACHE)
def tag_version(tracking_uri: str, name: str, version: str, tags: dict[str, str]) -> None:
    """Set tags on a version; the values they replace come back on rollback."""
    client, txn = _client(tracking_uri), get_transaction()
    current = client.get_model_version(name, version).tags
    previous = {key: current.get(key) for key in tags}
    txn.set("version", version)
    txn.set("previous_tags", previous)
    done: list[str] = []
    try:
        for key, value in tags.items():
            client.set_model_version_tag(name, version, key, value)
            done.append(key)
    except BaseException:
        # A step that fails is never staged, so its rollback hook does not run: put back
        # the tags it had already set before failing.
        _put_tags(client, name, version, {key: previous[key] for key in done})
        raise


@tag_version.on_rollback
def _restore_tags(txn: Any) -> None:
    _put_tags(_client(txn.get("tracking_uri")), txn.get("name"), txn.get("version"), txn.get("previous_tags"))


@contextmanager
def registry_transaction(tracking_uri: str, name: str) -> Iterator[Any]:
    """The transaction a registry change runs in; its steps' undo hooks read the store and
    the model name from it."""
    with transaction() as txn:
        txn.set("tracking_uri", tracking_uri)
        txn.set("name", name)
        yield txn


def set_champion(tracking_uri: str, name: str, version: str, *, reason: str) -> str | None:
    """Point `champion` at `version`, recording the one it replaces; returns that one."""
    client = _client(tracking_uri)
    previous = alias_version(client, name, "champion")
    if previous == version:
        return previous
    with registry_transaction(tracking_uri, name):
        tags = {"champion_reason": reason} | ({"previous_champion": previous} if previous else {})
        tag_version(tracking_uri, name, version, tags)
        move_alias(tracking_uri, name, "champion", version)
    return previous


def rollback_champion(tracking_uri: str, name: str, to_version: str | None = None) -> tuple[str, str]:
    """Move `champion` back: to `to_version`, or to the current champion's
    `previous_champion`. Returns (from, to)."""
    client = _client(tracking_uri)
    current = alias_version(client, name, "champion")
    if current is None:
        raise ConfigError(f"registered model {name!r} has no champion to roll back")
    target = to_version or client.get_model_version(name, current).tags.get("previous_champion")
    if not target:
        raise ConfigError(f"{name} version {current} records no previous champion; name the version to roll back to")
    with registry_transaction(tracking_uri, name):
        tag_version(tracking_uri, name, current, {"rolled_back_to": target})
        move_alias(tracking_uri, name, "champion", target)
    return current, target


def register_candidate(
    tracking_uri: str, name: str, model_uri: str, run_id: str, tags: dict[str, str], *, passed: bool,
    reasons: list[str],
) -> tuple[str, str | None, str]:
    """New version (alias `challenger`), `champion` when the gates passed; all or nothing.
    Returns the version, the champion it replaced (if any) and the decision in words."""
    previous = alias_version(_client(tracking_uri), name, "champion") if passed else None
    with registry_transaction(tracking_uri, name):
        version = create_version(tracking_uri, name, model_uri, run_id, tags)
        move_alias(tracking_uri, name, "challenger", version)
        if passed:
            tag_version(tracking_uri, name, version, {"champion_reason": "every regression gate passed"}
                        | ({"previous_champion": previous} if previous else {}))
            move_alias(tracking_uri, name, "champion", version)
            decision = f"promoted: version {version} is champion" + (
                f" (was version {previous})" if previous else " (first champion)")
        else:
            reason = "; ".join(reasons)
            tag_version(tracking_uri, name, version, {"not_promoted_reason": reason[:5000]})
            decision = f"not promoted: version {version} stays challenger; {reason}"
        tag_version(tracking_uri, name, version, {"registration": "complete"})
    return version, previous, decision


@task(name=STAGE, persist_result=True, cache_policy=stage_cache(__name__))
def promotion(candidate: Candidate, evaluation: RegressionResult, *, registered_model: str,
              promotion_config: Any, ctx: RunContext) -> PromotionResult:
    """Register the candidate as `challenger`; make it `champion` if every gate passed."""
    name = registered_model
    with stage_run(ctx, STAGE, {"promotion": promotion_config, "registered_model": name}) as (client, run_id):
        removed = remove_pending(client, name)
        if removed:
            client.set_tag(run_id, "removed_pending_versions", ",".join(removed))
        gain = evaluation.score_gain
        tags = {
            "pipeline_run_id": ctx.parent_run_id,
            "data_md5": ctx.data_md5,
            "git_commit": ctx.git_commit,
            "training_step": str(candidate.step),
            "eval_score_gain": f"{gain['gain']:.4f}",
            "eval_score_gain_ci95": f"[{gain['low']:.4f}, {gain['high']:.4f}]",
            "gates_passed": str(evaluation.passed).lower(),
        }
        version, previous, decision = register_candidate(
            ctx.tracking_uri, name, candidate.model_uri, run_id, tags, passed=evaluation.passed,
            reasons=evaluation.reasons,
        )
        if evaluation.passed:
            emit_promoted(name, version, previous=previous, action="promote", tracking_uri=ctx.tracking_uri,
                          gains={"score": gain})
        client.set_tag(run_id, "decision", decision[:5000])
        client.set_tag(run_id, "registered_version", version)
        result = PromotionResult(run_id=run_id, registered_model=name, version=version, champion=evaluation.passed,
                                 previous_champion=previous, decision=decision)
        log_json(client, run_id, result.model_dump(), "promotion.json")
        publish_summary(ctx, STAGE, run_id, f"# Promotion\n\n{decision}\n\n```json\n{json.dumps(tags, indent=2)}\n```\n")
    return result
