"""Promotion as an event: `agentrft.model.promoted` on Prefect's event bus.

Emitted whenever `champion` moves (the pipeline's promotion, `promote-model`, a rollback),
with the registered model and version as the resource and the previous champion, the
action and the gains as payload:

    event:    agentrft.model.promoted
    resource: {"prefect.resource.id": "agentrft.model.<name>",
               "agentrft.model.name": <name>, "agentrft.model.version": <version>}
    payload:  {"previous_champion", "action": promote | rollback, "gains", "tracking_uri"}

`agentrft serve` serves the monitor deployment with a trigger on it, so the monitor runs
for the new champion at once; an automation (Prefect UI > Automations) can match the same
event to notify, or to run a canary evaluation. Where the MLflow store is a tracking
server, its registry webhooks see the alias move as well (`model_version_alias.created`);
the SQLite default has none.
"""

from __future__ import annotations

from typing import Any

EVENT = "agentrft.model.promoted"


def resource_id(name: str) -> str:
    return f"agentrft.model.{name}"


def emit_promoted(name: str, version: str, *, previous: str | None, action: str, tracking_uri: str,
                  gains: dict[str, Any] | None = None) -> Any:
    """Emit the event (to the Prefect API the process talks to); returns it, or None when
    events are off (no API)."""
    from prefect.events import emit_event

    return emit_event(
        event=EVENT,
        resource={"prefect.resource.id": resource_id(name), "prefect.resource.name": name,
                  "agentrft.model.name": name, "agentrft.model.version": str(version)},
        payload={"previous_champion": previous, "action": action, "gains": gains or {},
                 "tracking_uri": tracking_uri},
    )
