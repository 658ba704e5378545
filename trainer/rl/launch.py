"""Starting a training run: alone, or as the processes of `accelerate launch`.

`agentrft train --config X` runs `run()` in this process when the config asks for one
process and no accelerate config; otherwise it starts `accelerate launch` on the same
command (`launch_command`), whose processes each run `run()`. On a machine without a GPU,
several processes are started with accelerate's torchrun launcher and
`ACCELERATE_USE_CPU=true` (gloo): `accelerate launch --cpu --num_processes 2` starts a
single process in accelerate 1.x unless MPI is configured.
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


def launch_command(config: Any, argv: Sequence[str]) -> tuple[list[str], dict[str, str]]:
    """The `accelerate launch` command (and the environment it adds) that runs
    `agentrft train` with `argv` on the config's processes."""
    import torch

    command = [sys.executable, "-m", "accelerate.commands.launch"]
    env = {LAUNCHED: "1"}
    processes = config.training.num_processes
    if config.training.accelerate_config:
        command += ["--config_file", config.training.accelerate_config]
        if processes > 1:
            command += ["--num_processes", str(processes)]
    else:
        # Every setting accelerate would otherwise default (and warn about at each launch);
        # the trainer's Accelerator still sets its own mixed precision from the config.
        mixed = resolved_mixed_precision(config.training.mixed_precision)
        command += ["--num_processes", str(processes), "--num_machines", "1", "--mixed_precision", mixed,
                    "--dynamo_backend", "no"]
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

            threads = max(1, (psutil.cpu_count(logical=False) or 1) // processes)
            command += ["--num_cpu_threads_per_process", str(threads)]
    return [*command, "-m", "flows.cli", "train", *argv], env


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
