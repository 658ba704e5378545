"""Checking what a job brings: `config validate`, `expectations derive`, `grader validate | run |
probe`."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from flows.cli.app import SetOption, _config, config_app, expectations_app, grader_app
from trainer.errors import AgentRFTError

# --- configs, expectations, graders ---------------------------------------------------------


@config_app.command("validate")
def config_validate(config: Annotated[Path, typer.Argument(help="Pipeline config (YAML).")],
                    set_: SetOption = None) -> None:
    """Validate a pipeline config (keys, types, graders, tool schemas, ${VAR} headers) and
    say which chat format the model's tokenizer gets."""
    loaded = _config(config, set_)
    print(json.dumps({"config": str(config), "valid": True, "hash": loaded.section_hash(),
                      **_chat_format_report(loaded)}))


def _chat_format_report(config: Any) -> dict[str, Any]:
    """The chat format the model gets, read from its tokenizer alone (no weights); where
    the tokenizer cannot be had here (a hub id with no hub), what will decide it."""
    from tasks.tracking import resolve_tracking_uri
    from trainer.chat_formats import describe, load_chat_format
    from trainer.generation.modeling import load_tokenizer
    from trainer.generation.policy import local_model_path

    model = config.model
    try:
        tokenizer = load_tokenizer(local_model_path(model.base_model,
                                                    tracking_uri=resolve_tracking_uri(config.mlflow.tracking_uri)))
    except AgentRFTError as exc:
        return {"chat_format": model.chat_format, "chat_format_detected": None,
                "chat_format_note": f"decided when the model loads: {exc}"}
    chat = load_chat_format(tokenizer, model.chat_format, enable_thinking=model.enable_thinking,
                            chat_template=model.chat_template)
    return {**describe(chat), "chat_format_setting": model.chat_format}


@expectations_app.command("derive")
def expectations_derive(
    traffic: Annotated[Path, typer.Option("--from", help="Production traffic log (JSONL).")],
    config: Annotated[Path | None, typer.Option("--config", "-c", help="The job: its grader's and tools' fields "
                                                "become required.")] = None,
    directory: Annotated[Path | None, typer.Option("--dir", help="GX data context (default: "
                                                   "data.expectations_dir, else expectations).")] = None,
    name: Annotated[str | None, typer.Option(help="Suite name (default: data.expectations_suite).")] = None,
    time_field: Annotated[list[str] | None, typer.Option(
        "--time-field", help="A field that moves with time (a report year): its type is checked, not its range "
        "or mix, so a test split of later periods passes (repeatable).")] = None,
) -> None:
    """Derive the expectation suite from production traffic, with its Checkpoint."""
    from tasks.expectations import derive_and_save, required_fields

    loaded = _config(config, None) if config else None
    root = directory or Path(loaded.data.expectations_dir if loaded else "expectations")
    suite = name or (loaded.data.expectations_suite if loaded else None) or "production_traffic"
    path = derive_and_save(traffic, root, name=suite, required=required_fields(loaded) if loaded else [],
                           time_fields=time_field or [])
    print(f"wrote {path} (and its checkpoint in {root})")


@grader_app.command("validate")
def grader_validate(grader: Annotated[Path, typer.Option(help="Grader JSON file.")]) -> None:
    """Validate a grader JSON file."""
    from trainer.graders import validate_grader_file

    validate_grader_file(grader)
    print(json.dumps({"grader": str(grader), "valid": True}))


@grader_app.command("run")
def grader_run(grader: Annotated[Path, typer.Option(help="Grader JSON file.")],
               item: Annotated[Path, typer.Option(help="JSON file with one data row.")],
               sample: Annotated[str | None, typer.Option(help="The model's output text.")] = None,
               sample_file: Annotated[Path | None, typer.Option(help="A file holding the output text.")] = None) -> None:
    """Score one sample against one item."""
    from trainer.graders import run_grader_cli

    if sample_file is not None:
        try:
            sample = sample_file.read_bytes().decode("utf-8")
        except OSError as exc:
            raise AgentRFTError(f"{sample_file}: cannot read the sample file ({exc.strerror})") from None
        except UnicodeDecodeError as exc:
            raise AgentRFTError(f"{sample_file}: not valid UTF-8 (byte {exc.start})") from None
    if sample is None:
        raise AgentRFTError("grader run: pass --sample TEXT or --sample-file FILE")
    result = run_grader_cli(grader, item, sample)
    print(json.dumps(result, indent=2))
    if result.get("reward") is None:  # the grader could not score it
        raise typer.Exit(1)


@grader_app.command("probe")
def grader_probe(grader: Annotated[Path, typer.Option(help="Grader JSON file.")],
                 dataset: Annotated[Path, typer.Option(help="JSONL items.")],
                 max_items: int = 20,
                 corpus: Annotated[Path | None, typer.Option(help="The folder the items' gold_pages name, to "
                                                                  "probe with a gold page and its numbers.")] = None,
                 max_error_share: Annotated[float, typer.Option(help="Grader errors allowed, as a share of the "
                                                                     "probes, before the check fails.")] = 0.25,
                 ) -> None:
    """Score reward-hacking probes on a grader, where it reads the answer; exit 1 if it pays one
    beyond its plain content (its numbers or values stated alone) or cannot grade too many of
    them, which is what `validate_data` checks on validation items before training."""
    from trainer.data import read_items
    from trainer.graders import validate_grader_file
    from trainer.graders.probe import run_probes

    report = run_probes(validate_grader_file(grader), read_items(dataset, max_items), corpus_dir=corpus,
                        max_error_share=max_error_share)
    print(json.dumps(report.to_json(), indent=2))
    print(report.summary(), file=sys.stderr)
    if not report.passed:
        raise typer.Exit(1)
