"""The `agentrft` command line: one typer app, one parser.

Each command is a thin front over `trainer/`, `tasks/`, `flows/` and the example
environments. `run`, `train` and `eval` take torchtune-style overrides
(`--set training.max_steps=2`, repeated). Errors a user can cause are `AgentRFTError`s:
printed as one clear message, exit status 2, never a Python traceback.

The commands live by group: `run.py` (the pipeline), `serving.py` (deployments, the
OpenAI API, model serving, the monitor), `checks.py` (configs, expectations, graders),
`data.py` (the demo's data and tools) and `models.py`; `app.py` holds the app itself.
"""

from __future__ import annotations

import sys

import typer

from flows.cli import checks, data, models, run, serving  # noqa: F401  (each registers its commands)
from flows.cli.app import app
from trainer.errors import AgentRFTError

__all__ = ["app", "main"]


def main(argv: list[str] | None = None) -> int:
    """Entry point (`agentrft`): user errors as one line and status 2."""
    try:
        # Without standalone mode click hands back ctx.exit()'s status (typer.Exit) as the
        # return value rather than raising it.
        status = app(args=argv, standalone_mode=False)
    except AgentRFTError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except typer.Exit as exc:
        return exc.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # click's usage errors (typer vendors its own click)
        from typer._click import exceptions as typer_click

        if isinstance(exc, typer_click.ClickException):
            exc.show()
            return exc.exit_code
        if isinstance(exc, typer.Abort):  # Ctrl-C inside click
            print("interrupted", file=sys.stderr)
            return 130
        raise
    return status if isinstance(status, int) else 0

