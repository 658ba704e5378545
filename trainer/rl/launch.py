"""Starting a training run: alone, or as the processes of `accelerate launch`.

`agentrft train --config X` runs `run()` in this process when the config asks for one
process and no accelerate config; otherwise it starts `accelerate launch` on the same
command (`launch_command`), whose processes each run `run()`. On a machine without a GPU,
several processes are started with accelerate's torchrun launcher and
`ACCELERATE_USE_CPU=true` (gloo): `accelerate launch --cpu --num_processes 2` starts a
single process in accelerate 1.x unless MPI is configured.

Past one machine (`training.nodes`), the same command runs on every node: each takes its
rank and the rendezvous endpoint from the environment a scheduler or a shell sets
(`node_topology`), and accelerate starts torchrun with a c10d rendezvous there. torchrun
assigns the global ranks; the trainer then names each node by its hostname and the rank
its environment gave it, so a node that dies is named in the error that ends the run.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from trainer.rl.sharding import resolved_mixed_precision

# Set on the processes this module launches, so they do not launch again.
LAUNCHED = "AGENTRFT_LAUNCHED"


def needs_launcher(config: Any) -> bool:
    """Whether training must go through `accelerate launch` (and was not started by it)."""
    wanted = config.training.num_processes > 1 or bool(config.training.accelerate_config)
    return wanted and not any(name in os.environ for name in (LAUNCHED, "LOCAL_RANK", "WORLD_SIZE"))


NODE_RANK_VARIABLES = ("AGENTRFT_NODE_RANK", "NODE_RANK", "SLURM_NODEID", "JOB_COMPLETION_INDEX")


def node_topology(config: Any, environ: dict[str, str] | None = None) -> tuple[int, str, int] | None:
    """(node rank, rendezvous host, port) for a run over `training.nodes` machines, read from
    the environment (Slurm, Kubernetes indexed Jobs or a shell); None for one machine."""
    from trainer.errors import ConfigError

    if config.training.nodes == 1:
        return None
    environ = dict(os.environ if environ is None else environ)
    rank_name = next((name for name in NODE_RANK_VARIABLES if environ.get(name, "").strip()), None)
    if rank_name is None:
        raise ConfigError(f"training.nodes is {config.training.nodes}: set this node's rank (0 to "
                          f"{config.training.nodes - 1}) in one of {', '.join(NODE_RANK_VARIABLES)}")
    rank = environ[rank_name].strip()
    if not rank.isdigit() or int(rank) >= config.training.nodes:
        raise ConfigError(f"{rank_name}={rank!r}: a node rank is 0 to {config.training.nodes - 1}")
    endpoint = environ.get("AGENTRFT_RDZV_ENDPOINT", "").strip()
    if not endpoint and environ.get("MASTER_ADDR"):
        endpoint = f"{environ['MASTER_ADDR']}:{environ.get('MASTER_PORT', '29500')}"
    host, _, port = endpoint.rpartition(":")
    if not host or not port.isdigit():
        raise ConfigError("training.nodes > 1: set AGENTRFT_RDZV_ENDPOINT=host:port (or MASTER_ADDR and "
                          f"MASTER_PORT), the rendezvous every node reaches; got {endpoint!r}")
    return int(rank), host, int(port)


def launch_command(config: Any, argv: Sequence[str], *, command_name: str = "train") -> tuple[list[str], dict[str, str]]:
    """The `accelerate launch` command (and the environment it adds) that runs
    `agentrft train` (or `command_name`: `warm-start`) with `argv` on the config's processes."""
    import torch

    command = [sys.executable, "-m", "accelerate.commands.launch"]
    env = {LAUNCHED: "1"}
    processes = config.training.num_processes
    topology = node_topology(config)
    if config.training.accelerate_config:
        command += ["--config_file", config.training.accelerate_config]
        if processes > 1:
            command += ["--num_processes", str(processes)]
    else:
        # Every setting accelerate would otherwise default (and warn about at each launch);
        # the trainer's Accelerator still sets its own mixed precision from the config.
        mixed = resolved_mixed_precision(config.training.mixed_precision)
        command += ["--num_processes", str(processes), "--num_machines", str(config.training.nodes),
                    "--mixed_precision", mixed, "--dynamo_backend", "no"]
    if topology is not None:
        rank, host, port = topology
        if config.training.accelerate_config:
            command += ["--num_machines", str(config.training.nodes)]
        command += ["--machine_rank", str(rank), "--main_process_ip", host, "--main_process_port", str(port),
                    "--rdzv_backend", "c10d"]
        env["AGENTRFT_NODE_RANK"] = str(rank)
    if not torch.cuda.is_available():
        if processes > 1:
            # accelerate's `--cpu` starts one process unless MPI is set up; its torchrun
            # launcher (`--multi_gpu`) starts them all, and ACCELERATE_USE_CPU makes each a
            # gloo CPU process.
            command.append("--multi_gpu")
            env["ACCELERATE_USE_CPU"] = "true"
        else:
            command.append("--cpu")
        if not config.training.accelerate_config:
            # accelerate's own default (physical cores per process), named so it does not warn
            import psutil

            per_node = processes // config.training.nodes
            threads = max(1, (psutil.cpu_count(logical=False) or 1) // per_node)
            command += ["--num_cpu_threads_per_process", str(threads)]
    return [*command, "-m", "flows.cli", command_name, *argv], env


def run(config: Any, *, model: str | None, output_dir: str | None, mlflow_run_id: str | None,
        resume: bool) -> Any:
    """Train in this process (one of the launched ones, or alone); returns the TrainResult
    (the main process prints its summary)."""
    from accelerate import PartialState
    from accelerate.utils import parse_flag_from_env

    from trainer.rl.grpo import train

    # The Accelerator reads ACCELERATE_USE_CPU itself; the state made before it must too,
    # or CPU processes started by a launcher would each run alone.
    state = PartialState(cpu=parse_flag_from_env("ACCELERATE_USE_CPU"))
    result = train(
        config,
        model_path=model or config.model.base_model,
        output_dir=Path(output_dir or config.training.output_dir),
        mlflow_run_id=mlflow_run_id,
        resume=resume,
    )
    if state.is_main_process:
        print_result(result)
    return result


def print_result(result: Any) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"GRPO: {result.steps} steps")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for name in ("train/reward_mean", "train/tool_calls_mean", "train/tokens_mean", "eval/score_mean",
                 "eval/reward_mean", "eval/tool_calls_mean", "eval/tokens_mean", "eval/latency_s_mean"):
        if result.metrics.get(name) is not None:
            table.add_row(name, f"{result.metrics[name]:.4g}")
    console = Console()
    console.print(table)
    console.print(f"final model: {result.model_dir}")
    for step, score, path in result.best_checkpoints:
        console.print(f"best: step {step}, validation metric_for_best_model {score:.4f}: {path}")
