"""Known-harmless noise is silenced, and nothing else from the same loggers is."""

from __future__ import annotations

import logging

import pytest

from trainer.quiet import silence_known_noise


def test_hub_lookup_warnings_of_local_checkpoints_are_dropped_and_others_kept(caplog: pytest.LogCaptureFixture):
    silence_known_noise()
    silence_known_noise()  # idempotent: one filter, however often the CLI starts
    hub = logging.getLogger("mlflow.transformers")
    with caplog.at_level(logging.WARNING, logger="mlflow.transformers"):
        hub.warning("The model card could not be retrieved from the hub due to Repo id must be in the form ...")
        hub.warning("Unable to find license information for this model. Please verify permissible usage ...")
        hub.warning("Could not save the tokenizer")
    assert [r.getMessage() for r in caplog.records] == ["Could not save the tokenizer"]
    assert len([f for f in hub.filters if type(f).__name__ == "_NoHubLookups"]) == 1
