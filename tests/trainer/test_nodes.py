"""Training over several machines, tested as two "nodes" on loopback: two launchers of one
gloo process each, meeting at a c10d rendezvous, started with the command `agentrft train`
builds from each node's environment (trainer/rl/launch.py).

They end with the weights of the one-node two-process run (within 1e-4), stop and resume
from the checkpoint both wrote to the folder they share, and when a node dies mid-step the
other ends the run with an error that names the dead node, its last checkpoint intact."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from tests.trainer.test_grpo import TWO_PROCESSES, assert_same_run, micro_config, two_processes
from trainer.errors import ConfigError
from trainer.rl.checkpoint import latest_checkpoint
from trainer.rl.launch import launch_command, node_topology

REPO = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_nodes(config, taught_model: Path, tmp_path: Path, out: Path, *, stop_after: int = 0,
                resume: bool = False, extra_env: dict[str, str] | None = None) -> list[subprocess.Popen]:
    """Each node: the launch command `agentrft train` makes from its environment, running the
    trainer script (which can stop after a step) in place of `-m flows.cli train`."""
    config_file = tmp_path / "nodes.yaml"
    config_file.write_text(yaml.safe_dump(config.model_dump(mode="json")))
    script = tmp_path / "node_process.py"
    script.write_text(TWO_PROCESSES)
    endpoint = f"127.0.0.1:{_free_port()}"
    nodes = []
    for rank in range(config.training.nodes):
        env = {**os.environ, "AGENTRFT_NODE_RANK": str(rank), "AGENTRFT_RDZV_ENDPOINT": endpoint,
               "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", **(extra_env or {})}
        saved = {key: os.environ.get(key) for key in ("AGENTRFT_NODE_RANK", "AGENTRFT_RDZV_ENDPOINT")}
        os.environ.update({key: env[key] for key in saved})
        try:
            command, added = launch_command(config, [])
        finally:
            for key, value in saved.items():
                os.environ.pop(key) if value is None else os.environ.__setitem__(key, value)
        launcher = command[: command.index("-m", 3)]  # `python -m accelerate.commands.launch ...`
        nodes.append(subprocess.Popen(
            [*launcher, str(script), str(config_file), str(taught_model), str(out), str(stop_after),
             "1" if resume else "0"], env={**env, **added}, cwd=REPO, start_new_session=True,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    return nodes


def wait_all(nodes: list[subprocess.Popen], timeout: float = 400) -> list[str]:
    outputs = [node.communicate(timeout=timeout)[0] for node in nodes]
    for rank, (node, output) in enumerate(zip(nodes, outputs, strict=True)):
        assert node.returncode == 0, f"node {rank}:\n{output[-3000:]}"
    return outputs


def test_the_node_rank_and_rendezvous_come_from_the_environment(world, endpoints):
    config = micro_config(world, endpoints, num_processes=2, nodes=2, distributed="ddp")
    assert node_topology(micro_config(world, endpoints), {}) is None  # one machine
    assert node_topology(config, {"SLURM_NODEID": "1", "MASTER_ADDR": "10.0.0.5", "MASTER_PORT": "29400"}) == (
        1, "10.0.0.5", 29400)
    assert node_topology(config, {"AGENTRFT_NODE_RANK": "0", "AGENTRFT_RDZV_ENDPOINT": "head:1234"}) == (0, "head", 1234)
    with pytest.raises(ConfigError, match="AGENTRFT_NODE_RANK, NODE_RANK, SLURM_NODEID"):
        node_topology(config, {"MASTER_ADDR": "head"})
    with pytest.raises(ConfigError, match="a node rank is 0 to 1"):
        node_topology(config, {"NODE_RANK": "2", "MASTER_ADDR": "head"})
    with pytest.raises(ConfigError, match="AGENTRFT_RDZV_ENDPOINT"):
        node_topology(config, {"NODE_RANK": "1"})
    with pytest.raises(ConfigError, match="multiple of training.nodes"):
        micro_config(world, endpoints, num_processes=3, nodes=2, distributed="ddp")
    os.environ.update({"NODE_RANK": "1", "MASTER_ADDR": "head", "MASTER_PORT": "29400"})
    try:
        command, env = launch_command(config, ["--config", "x.yaml"])
    finally:
        for key in ("NODE_RANK", "MASTER_ADDR", "MASTER_PORT"):
            os.environ.pop(key)
    assert command[command.index("--machine_rank") + 1] == "1" and "--rdzv_backend" in command
    assert command[command.index("--main_process_ip") + 1] == "head" and env["AGENTRFT_NODE_RANK"] == "1"


@pytest.mark.slow
def test_two_nodes_on_loopback_train_as_one_node_of_two_processes_and_resume(world, endpoints, taught_model,
                                                                             tmp_path):
    one_node = micro_config(world, endpoints, num_processes=2, distributed="ddp")
    two_processes(one_node, taught_model, tmp_path, tmp_path / "one_node")
    two_nodes = micro_config(world, endpoints, num_processes=2, nodes=2, distributed="ddp")
    out = tmp_path / "two_nodes"
    wait_all(start_nodes(two_nodes, taught_model, tmp_path, out, stop_after=1))
    assert (out / "checkpoints" / "step_1").is_dir() and not (out / "final").exists()
    outputs = wait_all(start_nodes(two_nodes, taught_model, tmp_path, out, resume=True))
    assert any("resumed from" in output for output in outputs)
    hashes = [(out / f"weights_{rank}.sha256").read_text() for rank in (0, 1)]
    assert hashes[0] == hashes[1]
    assert_same_run(tmp_path / "one_node", out)


@pytest.mark.slow
def test_a_node_that_dies_mid_step_is_named_and_the_last_checkpoint_stays(world, endpoints, taught_model,
                                                                         tmp_path):
    config = micro_config(world, endpoints, num_processes=2, nodes=2, distributed="ddp", checkpoint_interval=1,
                          max_steps=3, collective_timeout_s=60)
    out = tmp_path / "run"
    nodes = start_nodes(config, taught_model, tmp_path, out)
    deadline = time.monotonic() + 300
    while not (out / "checkpoints" / "step_1" / "trainer_state.json").is_file():
        assert time.monotonic() < deadline and all(node.poll() is None for node in nodes), "no step 1"
        time.sleep(0.2)
    time.sleep(1.0)  # into step 2
    os.killpg(nodes[1].pid, signal.SIGKILL)  # node 1, launcher and process, as a machine going away
    output = nodes[0].communicate(timeout=200)[0]
    nodes[1].wait()
    assert nodes[0].returncode != 0
    assert "node 1" in output and "stopped answering" in output and "step_1" in output, output[-3000:]
    latest = latest_checkpoint(out / "checkpoints")
    assert latest is not None and latest.name in ("step_1", "step_2")
    state = json.loads((latest / "trainer_state.json").read_text())
    assert state["step"] == int(latest.name.removeprefix("step_"))  # written whole: the state file is last
    weights = load_file(str(latest / "accelerate" / "model.safetensors"))
    assert weights and all(torch.isfinite(tensor).all() for tensor in weights.values())
