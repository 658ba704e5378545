"""The demo environment's data and tools: `data generate | verify | readings | import-finqa`,
`env serve`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from flows.cli.app import DEMO_CONFIG, ConfigOption, SetOption, _config, data_app, env_app
from trainer.errors import AgentRFTError

# --- the demo environment -------------------------------------------------------------------


@data_app.command("generate")
def data_generate(out: Path = Path("data"), seed: int = 0,
                  drift: Annotated[bool, typer.Option(help="A deliberately drifted dataset.")] = False) -> None:
    """Generate the FinQA-style demo data (then `dvc add` pins it)."""
    from envs.finqa.generate import generate_dataset

    print(json.dumps(generate_dataset(out, seed=seed, drift=drift), indent=2))


@data_app.command("verify")
def data_verify(config: ConfigOption = Path(DEMO_CONFIG), seed: int = 0) -> None:
    """Regenerate the demo data where it differs and let DVC check it against data.dvc."""
    from envs.finqa.demo import ensure_data

    md5 = ensure_data(_config(config, None), seed=seed)
    print(f"data matches its DVC pin (md5 {md5})")


@data_app.command("readings")
def data_readings(
    config: ConfigOption = Path(DEMO_CONFIG), set_: SetOption = None,
    rename: Annotated[list[str] | None, typer.Option(
        help="Give the ledger's rows recorded under this name (an MLflow experiment's, a label) the config's "
             "`name`, keeping the old one as `recorded_as`; repeatable.")] = None,
) -> None:
    """How many times each split was read, and by which configs (data.test_ledger): the
    config's test split, its shift splits, and the splits it no longer reads."""
    from tasks.ledger import ledger_path, rename_config, split_readings

    c = _config(config, set_)
    ledger = ledger_path(c.data)
    if ledger is None:
        raise AgentRFTError("data.test_ledger is null: readings are tagged in MLflow only (test_split.readings)")
    renamed = rename_config(ledger, c.name, set(rename)) if rename else None
    splits = split_readings(c.data, ledger, {name: s.file for name, s in c.data.shift_evaluations.items()})
    print(json.dumps({"ledger": str(ledger), "config": c.name, **({"renamed": renamed} if rename else {}),
                      "splits": splits}, indent=2))


@data_app.command("import-finqa")
def data_import_finqa(json_file: Annotated[Path, typer.Argument(help="FinQA JSON (train.json, dev.json, ...).")],
                      out: Path = Path("data-finqa"), split: str = "train") -> None:
    """Build a corpus and items from the real FinQA JSON format."""
    from envs.finqa.finqa_format import load_finqa_json

    count = load_finqa_json(json_file, out, split_name=split)
    print(f"wrote {count} items to {out / (split + '.jsonl')}")


@env_app.command("serve")
def env_serve(name: Annotated[str, typer.Argument(help="The environment: finqa or units.")] = "finqa",
              corpus: Path = Path("data/corpus"), host: str = "127.0.0.1", port: int = 8765,
              api_key: Annotated[str | None, typer.Option(help="Require this key (or ${VAR}).")] = None,
              error_rate: Annotated[float, typer.Option(help="Share of 5xx answers.")] = 0.0,
              timeout_rate: Annotated[float, typer.Option(help="Share of answers that hang.")] = 0.0,
              drop_rate: Annotated[float, typer.Option(help="Share of dropped connections.")] = 0.0,
              latency_ms: Annotated[float, typer.Option(help="Added latency per call.")] = 0.0) -> None:
    """Serve an environment's tools (and its endpoint grader) over HTTP."""
    from envs.finqa.faults import FaultConfig
    from trainer.api_key import resolve_api_key

    faults = FaultConfig(error_rate=error_rate, timeout_rate=timeout_rate, drop_rate=drop_rate, latency_ms=latency_ms)
    if name == "finqa":
        from envs.finqa.server import serve as serve_tools

        serve_tools(corpus, host=host, port=port, faults=faults, api_key=resolve_api_key(api_key))
    elif name == "units":  # no corpus: a units table and a calculator
        from envs.units.server import serve as serve_units

        serve_units(host=host, port=port, faults=faults, api_key=resolve_api_key(api_key))
    else:
        raise AgentRFTError(f"unknown environment {name!r}; the project ships `finqa` and `units`")
