"""The trainer's command line: `python -m trainer.train_cli --config X`.

    python -m trainer.train_cli --config configs/demo.yaml [--resume] [--mlflow-run-id ID]
        [--output-dir DIR] [--model PATH]
    accelerate launch --num_processes 2 -m trainer.train_cli --config configs/gpu.yaml

It runs as it is started: alone, or as one process of `accelerate launch`. When the config
asks for several processes (`training.num_processes` > 1) or names an accelerate config
file and it was not started by a launcher, it starts `accelerate launch` on itself. On a
machine without a GPU, several processes are started with accelerate's torchrun launcher
and `ACCELERATE_USE_CPU=true` (gloo): `accelerate launch --cpu --num_processes 2` starts a
single process in accelerate 1.x unless MPI is configured. The base model is resolved once, by the main process
first ('demo' builds the demo model on the first run), while the others wait. Errors a user
can fix are printed as one message, exit status 2; `agentrft train` calls `main(argv)`.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from trainer.errors import AgentRFTError

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# Set on the processes this CLI launches, so they do not launch again.
_LAUNCHED = "AGENTRFT_LAUNCHED"


def build_parser(prog: str = "python -m trainer.train_cli") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description="Train a tool-using agent with GRPO.")
    parser.add_argument("--config", required=True, help="Pipeline config (YAML), e.g. configs/demo.yaml.")
    parser.add_argument("--resume", action="store_true", help="Continue from the newest checkpoint in the output dir.")
    parser.add_argument("--mlflow-run-id", default=None, help="Log metrics to this MLflow run (default: $MLFLOW_RUN_ID).")
    parser.add_argument("--output-dir", default=None, help="Checkpoints, metrics, rollouts (default: training.output_dir).")
    parser.add_argument("--model", default=None, help="Model path or hub id (default: the config's model.base_model).")
    return parser


def launch_command(config, argv: Sequence[str]) -> tuple[list[str], dict[str, str]]:
    """The `accelerate launch` command (and the environment it adds) that runs this CLI
    with `argv` on the config's processes."""
    import torch

    command = [sys.executable, "-m", "accelerate.commands.launch"]
    env = {_LAUNCHED: "1"}
    processes = config.training.num_processes
    if config.training.accelerate_config:
        command += ["--config_file", config.training.accelerate_config]
    if processes > 1:
        command += ["--num_processes", str(processes)]
    if not torch.cuda.is_available():
        if processes > 1:
            # accelerate's `--cpu` starts one process unless MPI is set up; its torchrun
            # launcher (`--multi_gpu`) starts them all, and ACCELERATE_USE_CPU makes each a
            # gloo CPU process.
            command.append("--multi_gpu")
            env["ACCELERATE_USE_CPU"] = "true"
        else:
            command.append("--cpu")
    return [*command, "-m", "trainer.train_cli", *argv], env


def _launched() -> bool:
    return any(name in os.environ for name in (_LAUNCHED, "LOCAL_RANK", "WORLD_SIZE"))


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    try:
        from trainer.config import load_config

        config = load_config(args.config)
        training = config.training
        if (training.num_processes > 1 or training.accelerate_config) and not _launched():
            command, env = launch_command(config, argv)
            return subprocess.call(command, env={**os.environ, **env})
        return _run(config, args)
    except AgentRFTError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted; continue with --resume", file=sys.stderr)
        return 130


def _run(config, args: argparse.Namespace) -> int:
    from accelerate import PartialState
    from accelerate.utils import parse_flag_from_env

    from trainer.bootstrap import resolve_base_model
    from trainer.grpo import train

    # The Accelerator reads ACCELERATE_USE_CPU itself; the state made before it must too,
    # or CPU processes started by a launcher would each run alone.
    state = PartialState(cpu=parse_flag_from_env("ACCELERATE_USE_CPU"))
    with state.main_process_first():
        model_path = args.model or resolve_base_model(config, log=print if state.is_main_process else _quiet)
    result = train(
        config,
        model_path=model_path,
        output_dir=Path(args.output_dir or config.training.output_dir),
        mlflow_run_id=args.mlflow_run_id,
        resume=args.resume,
    )
    if state.is_main_process:
        _print_result(result)
    return 0


def _quiet(_: str) -> None:
    """Log sink of the processes that are not the main one."""


def _print_result(result) -> None:
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
        console.print(f"best: step {step}, eval score {score:.4f}: {path}")


if __name__ == "__main__":
    sys.exit(main())
