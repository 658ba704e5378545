"""The `agentrft` app: its command groups, the options they share and loading a config.

Heavy libraries are imported inside the commands so that `agentrft --help` stays instant.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Any

import typer

from trainer.errors import AgentRFTError

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Prefect's ephemeral server migrates a fresh database before it answers: ~25 s on a 2-core
# machine, past Prefect's own 20 s limit (`agentrft run` then fails before any stage).
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")

DEMO_CONFIG = "envs/finqa/demo.yaml"
app = typer.Typer(name="agentrft", help="Self-hosted Agent Reinforcement Fine-Tuning.", no_args_is_help=True,
                  pretty_exceptions_enable=False, add_completion=False)
data_app = typer.Typer(help="Data: generate, verify and import the demo's, count test-split readings.", no_args_is_help=True)
env_app = typer.Typer(help="Example environments.", no_args_is_help=True)
grader_app = typer.Typer(help="Validate, run and probe graders.", no_args_is_help=True)
config_app = typer.Typer(help="Pipeline configs.", no_args_is_help=True)
model_app = typer.Typer(help="Models: import a GGUF, rebuild the demo's.", no_args_is_help=True)
expectations_app = typer.Typer(help="Great Expectations suites.", no_args_is_help=True)
for sub, name in ((data_app, "data"), (env_app, "env"), (grader_app, "grader"), (config_app, "config"),
                  (model_app, "model"), (expectations_app, "expectations")):
    app.add_typer(sub, name=name)

ConfigOption = Annotated[Path, typer.Option("--config", "-c", help="Pipeline config (YAML).")]
SetOption = Annotated[list[str] | None, typer.Option("--set", "-s", metavar="SECTION.KEY=VALUE",
                                                     help="Override a config value (repeatable).")]
StopAfterOption = Annotated[str | None, typer.Option(
    "--stop-after", metavar="STAGE", help="End after baseline, prompt_optimization, warm_start (the warm-started "
    "model and its baseline) or rft_training: the test split is not read (trying seeds, data sizes or configs on the validation split).")]
RefreshOption = Annotated[list[str] | None, typer.Option("--refresh", metavar="STAGE",
                                                         help="Re-run this stage (and the later ones) even if cached.")]


def _config(path: Path, assignments: list[str] | None) -> Any:
    from trainer.config.loading import load_config, missing_env_vars, parse_overrides
    from trainer.quiet import silence_known_noise

    silence_known_noise()
    config = load_config(path, parse_overrides(assignments))
    missing = missing_env_vars(config)
    if missing:
        raise AgentRFTError(f"{path}: environment variables referenced by tool headers are not set: "
                            + ", ".join(missing))
    return config

