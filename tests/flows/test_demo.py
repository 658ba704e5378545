"""`agentrft demo` on a micro preset, and the progress a long evaluation prints.

The demo entry does what a user would before `agentrft run`: it checks the data against its
DVC pin, starts the FinQA tool server on the port the config's endpoints name, and runs the
pipeline; it ends with the before/after table, the decision, the figures and the commands
that open the UIs. Progress: an evaluation that outlasts the reporting interval prints
done/total, the rate and the ETA as it goes (a bar in a terminal, lines in a log).
"""

from __future__ import annotations

import socket

import pytest
import yaml

from flows.cli import main
from tests.pipeline_world import micro

pytestmark = pytest.mark.integration


def test_demo_command_on_a_micro_preset(harness, world, endpoints, taught_model, capsys):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # free: the demo starts the FinQA server there itself
    served = [{"name": e.name, "server_url": f"http://127.0.0.1:{port}/tools/{e.name}"} for e in endpoints]
    config = micro(world, endpoints, taught_model, tools={"endpoints": served},
                   mlflow={"tracking_uri": f"sqlite:///{world / 'demo.db'}", "experiment": "demo"},
                   training={"max_steps": 2, "n_epochs": 2, "eval_interval": 2, "checkpoint_interval": 2})
    path = world / "demo-micro.yaml"
    path.write_text(yaml.safe_dump(config.model_dump(mode="json")))
    assert main(["demo", "--config", str(path), "--set", "promotion.k=2"]) == 0
    printed = capsys.readouterr().out
    assert "before / after (same test items and seeds)" in printed
    assert "score gain on the test split" in printed and "outcome: " in printed
    assert "relative change" in printed and "(paired item bootstrap, one training run;" in printed
    assert "This test split (sha256 " in printed and "has been read " in printed  # the ledger's count
    assert "figure (regression): runs:/" in printed and "agentrft ui" in printed and "demo wall time" in printed


def test_a_long_evaluation_prints_progress_lines(world, endpoints, taught_model, monkeypatch):
    import trainer.progress as progress
    from trainer.data import read_items
    from trainer.generation.policy import load_policy
    from trainer.rollout.evaluate import run_evaluation
    from trainer.rollout.record import RolloutSettings
    from trainer.rollout.tool_client import ToolClient

    monkeypatch.setattr(progress, "EVERY_S", 0.2)  # "long": longer than the reporting interval
    config = micro(world, endpoints, taught_model)
    policy = load_policy(str(taught_model))
    lines: list[str] = []
    items = read_items(world / "data" / "test.jsonl")
    run_evaluation(policy.backend(max_slots=2, max_len=768, seed=0), policy.chat, items, k=8,
                   tool_client=ToolClient.from_config(config.tools), grader=config.grader,
                   settings=RolloutSettings.from_config(config.rollout, config.penalties), tools=config.tools.schemas,
                   max_concurrent=2, prefix="eval", log=lines.append)
    assert len(lines) >= 2, lines
    assert all("eval rollouts: " in line and "/48 rollouts" in line and "ETA" in line for line in lines)
    assert lines[-1].startswith("eval rollouts: 48/48")
