"""The `agentrft` command line.

Each subcommand is a thin front over `trainer/`, `envs/` and `flows/`. Errors a user can
cause are `AgentRFTError`s: they are printed as one clear message and the command exits
with status 2, never with a Python traceback. Heavy libraries are imported inside the
subcommands so that `agentrft --help` stays instant.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from trainer.errors import AgentRFTError

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _data_generate(args: argparse.Namespace) -> int:
    from envs.finqa.generate import generate_dataset

    counts = generate_dataset(Path(args.out), seed=args.seed, drift=args.drift)
    print(json.dumps(counts, indent=2))
    return 0


def _data_verify(args: argparse.Namespace) -> int:
    from envs.finqa.dvc_pin import verify_data

    result = verify_data(Path(args.data_dir), Path(args.dvc_file), seed=args.seed)
    print(result.message)
    return 0 if result.ok else 1


def _data_import_finqa(args: argparse.Namespace) -> int:
    from envs.finqa.finqa_format import load_finqa_json

    count = load_finqa_json(Path(args.json_file), Path(args.out), split_name=args.split)
    print(f"wrote {count} items to {Path(args.out) / (args.split + '.jsonl')}")
    return 0


def _env_serve(args: argparse.Namespace) -> int:
    from envs.finqa.faults import FaultConfig
    from envs.finqa.server import serve

    faults = FaultConfig(
        error_rate=args.error_rate,
        timeout_rate=args.timeout_rate,
        drop_rate=args.drop_rate,
        latency_ms=args.latency_ms,
    )
    serve(Path(args.corpus), host=args.host, port=args.port, faults=faults)
    return 0


def _load_json_file(path: str, what: str) -> dict:
    file = Path(path)
    if not file.is_file():
        raise AgentRFTError(f"{file}: {what} file not found")
    try:
        return json.loads(file.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise AgentRFTError(f"{file}: not valid UTF-8 (byte {exc.start})") from None
    except json.JSONDecodeError as exc:
        raise AgentRFTError(f"{file}: invalid JSON at line {exc.lineno}, column {exc.colno}: {exc.msg}") from None


def _grader_validate(args: argparse.Namespace) -> int:
    from trainer.graders import validate_grader_file

    validate_grader_file(Path(args.grader))
    print(json.dumps({"grader": args.grader, "valid": True}))
    return 0


def _grader_run(args: argparse.Namespace) -> int:
    from trainer.graders import run_grader_cli

    sample = args.sample
    if args.sample_file:
        try:
            sample = Path(args.sample_file).read_bytes().decode("utf-8")
        except OSError as exc:
            raise AgentRFTError(f"{args.sample_file}: cannot read the sample file ({exc.strerror})") from None
        except UnicodeDecodeError as exc:
            raise AgentRFTError(f"{args.sample_file}: not valid UTF-8 (byte {exc.start})") from None
    if sample is None:
        raise AgentRFTError("grader run: pass --sample TEXT or --sample-file FILE")
    result = run_grader_cli(Path(args.grader), Path(args.item), sample)
    print(json.dumps(result, indent=2))
    return 0 if result.get("reward") is not None else 1  # the grader could not score it


def _config_validate(args: argparse.Namespace) -> int:
    from trainer.config import load_config, missing_env_vars

    config = load_config(args.config)
    missing = missing_env_vars(config)
    if missing:
        raise AgentRFTError(
            f"{args.config}: environment variables referenced by tool headers are not set: "
            + ", ".join(missing)
        )
    print(json.dumps({"config": args.config, "valid": True, "hash": config.section_hash()}))
    return 0


def _model_bootstrap(args: argparse.Namespace) -> int:
    from trainer.bootstrap import resolve_base_model
    from trainer.config import load_config

    config = load_config(args.config)
    if config.model.base_model != "demo":
        raise AgentRFTError(f"{args.config}: model.base_model is {config.model.base_model!r}; bootstrap builds only 'demo'")
    print(resolve_base_model(config))
    return 0


def _eval(args: argparse.Namespace) -> int:
    from tasks.rollout_eval import eval_items, evaluate_model
    from trainer.bootstrap import resolve_base_model
    from trainer.config import load_config
    from trainer.evaluate import write_outputs

    config = load_config(args.config)
    model = args.model or resolve_base_model(config)
    items = eval_items(config, args.max_items or config.baseline.max_items)
    summary, records = evaluate_model(config, model, items, k=args.k or config.baseline.k,
                                      seed=config.baseline.seed, prefix="eval")
    paths = write_outputs(summary, records, Path(args.out))
    _print_summary(summary)
    print(f"wrote {', '.join(str(p) for p in paths.values())}")
    return 0


def _print_summary(summary) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="evaluation")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for name, value in summary.metrics.items():
        table.add_row(name, f"{value:.4g}")
    table.add_row("status", json.dumps(summary.status_counts))
    table.add_row("grader errors", json.dumps(summary.grader_errors))
    Console().print(table)


def _serve_model(args: argparse.Namespace) -> int:
    from trainer.model_server import serve_model

    serve_model(args.model, host=args.host, port=args.port, device=args.device, max_len=args.max_len)
    return 0


def _expectations_derive(args: argparse.Namespace) -> int:
    from tasks.validate import derive_suite_cli

    path = derive_suite_cli(Path(args.traffic), Path(args.out))
    print(f"wrote {path}")
    return 0


def _grader_probe(args: argparse.Namespace) -> int:
    from tasks.validate import read_rows
    from trainer.graders import validate_grader_file
    from trainer.graders.probe import run_probes

    grader = validate_grader_file(Path(args.grader))
    items = [row for _, row in read_rows(Path(args.dataset))][: args.max_items]
    report = run_probes(grader, items, corpus_dir=Path(args.corpus) if args.corpus else None)
    print(json.dumps(report.to_json(), indent=2))
    if report.flagged:
        print(f"{len(report.flagged)} of {report.tried} probes scored above 0.1: the grader can be gamed",
              file=sys.stderr)
    return 0 if report.passed else 1


def _pipeline_config(args: argparse.Namespace):
    from trainer.config import load_config, missing_env_vars

    if getattr(args, "openai_job", None):
        import yaml

        from flows.openai_job import load_openai_job

        base = yaml.safe_load(Path(args.config).read_text()) if args.config else None
        config, notes = load_openai_job(Path(args.openai_job), base=base, model=args.model)
        for note in notes:
            print(f"note: {note}", file=sys.stderr)
    else:
        config = load_config(args.config or "configs/demo.yaml")
    missing = missing_env_vars(config)
    if missing:
        raise AgentRFTError("environment variables referenced by tool headers are not set: " + ", ".join(missing))
    return config


def _run_pipeline(config, refresh: list[str]) -> dict:
    """Run the pipeline flow; a failed run's reason becomes the command's error."""
    from flows.pipeline import agent_rft_pipeline, pipeline_parameters

    state = agent_rft_pipeline(**pipeline_parameters(config, refresh), return_state=True)
    if not state.is_completed():
        try:
            state.result()
        except AgentRFTError:
            raise
        except Exception as exc:
            raise AgentRFTError(f"the pipeline failed: {exc}") from None
    return state.result()


def _print_outcome(outcome: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    before_after = outcome.get("before_after")
    if before_after:
        table = Table(title="before / after (same held-out items and seeds)")
        for column in ("metric", "baseline", "candidate", "change"):
            table.add_column(column, justify="left" if column == "metric" else "right")
        for name, values in before_after.items():
            b, a = values["baseline"], values["candidate"]
            change = f"{(a - b) / b:+.1%}" if b else "n/a"
            table.add_row(name, f"{b:.4g}", f"{a:.4g}", change)
        console.print(table)
        gain = outcome["score_gain"]
        console.print(f"score gain {gain['gain']:+.4f}, 95% CI [{gain['low']:+.4f}, {gain['high']:+.4f}]")
    console.print(f"outcome: {outcome['outcome']}: {outcome.get('decision', '')}")
    cached = [name for name, stage in outcome.get("stages", {}).items() if stage["cached"]]
    if cached:
        console.print(f"served from cache: {', '.join(cached)}")
    console.print(f"MLflow parent run: {outcome['parent_run_id']}")


def _run(args: argparse.Namespace) -> int:
    config = _pipeline_config(args)
    outcome = _run_pipeline(config, args.refresh or [])
    _print_outcome(outcome)
    return 0


def _demo(args: argparse.Namespace) -> int:
    import time

    from envs.finqa.dvc_pin import dir_md5, pinned_md5
    from envs.finqa.generate import generate_dataset
    from trainer.config import load_config

    started = time.perf_counter()
    config = load_config(args.config)
    data_dir, pinned = Path(config.data.data_dir), pinned_md5(Path(config.data.dvc_file))
    if not data_dir.is_dir() or dir_md5(data_dir) != pinned:
        print(f"regenerating {data_dir} (pinned md5 {pinned})")
        generate_dataset(data_dir, seed=config.data.generator_seed)
        if dir_md5(data_dir) != pinned:
            raise AgentRFTError(f"{data_dir}: regenerated data does not match {config.data.dvc_file}; "
                                "run `agentrft data verify` for the first differing file")
    outcome = _run_pipeline(config, args.refresh or [])
    _print_outcome(outcome)
    print(f"demo wall time: {time.perf_counter() - started:.0f} s")
    print("open the UIs: `agentrft ui` (Prefect http://127.0.0.1:4200, MLflow http://127.0.0.1:5000); "
          "promote or roll back: `agentrft promote --name "
          f"{config.promotion.registered_model} --action rollback`")
    return 0


def _promote(args: argparse.Namespace) -> int:
    from flows.pipeline import promote_model

    state = promote_model(name=args.name, version_or_alias=args.version or "", action=args.action,
                          tracking_uri=args.tracking_uri, return_state=True)
    try:
        print(json.dumps(state.result(), indent=2))
    except AgentRFTError:
        raise
    except Exception as exc:
        raise AgentRFTError(f"promote-model failed: {exc}") from None
    return 0


def _serve(args: argparse.Namespace) -> int:
    from flows.serve import serve_deployments
    from trainer.config import load_config

    serve_deployments(load_config(args.config))
    return 0


def _deploy(args: argparse.Namespace) -> int:
    from flows.serve import deploy_to_work_pool
    from trainer.config import load_config

    ids = deploy_to_work_pool(load_config(args.config), args.work_pool, schedule=not args.no_schedule)
    print(json.dumps({"work_pool": args.work_pool, "deployments": ids}, indent=2))
    print(f"start a worker: prefect worker start --pool {args.work_pool}")
    return 0


def _ui(args: argparse.Namespace) -> int:
    from flows.serve import start_uis

    start_uis(args.tracking_uri, prefect_port=args.prefect_port, mlflow_port=args.mlflow_port)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="agentrft", description="Self-hosted Agent RFT.")
    sub = parser.add_subparsers(dest="command", required=True)

    def command(parent, name: str, func: Callable[[argparse.Namespace], int], help_: str):
        p = parent.add_parser(name, help=help_, description=help_)
        p.set_defaults(func=func)
        return p

    data = sub.add_parser("data", help="Generate, verify or import datasets.").add_subparsers(
        dest="data_command", required=True
    )
    p = command(data, "generate", _data_generate, "Generate the FinQA-style demo data.")
    p.add_argument("--out", default="data")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--drift", action="store_true", help="Produce a deliberately drifted dataset.")
    p = command(data, "verify", _data_verify, "Regenerate the demo data and compare with data.dvc.")
    p.add_argument("--data-dir", default="data")
    p.add_argument("--dvc-file", default="data.dvc")
    p.add_argument("--seed", type=int, default=0)
    p = command(data, "import-finqa", _data_import_finqa, "Build corpus and items from FinQA JSON.")
    p.add_argument("json_file")
    p.add_argument("--out", default="data-finqa")
    p.add_argument("--split", default="train")

    env = sub.add_parser("env", help="Example environments.").add_subparsers(dest="env_command", required=True)
    serve_p = env.add_parser("serve", help="Serve an environment's tools.").add_subparsers(
        dest="env_name", required=True
    )
    p = command(serve_p, "finqa", _env_serve, "Serve the FinQA-style tools and grader.")
    p.add_argument("--corpus", default="data/corpus")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8765)
    p.add_argument("--error-rate", type=float, default=0.0, help="Share of 5xx answers.")
    p.add_argument("--timeout-rate", type=float, default=0.0, help="Share of answers that hang.")
    p.add_argument("--drop-rate", type=float, default=0.0, help="Share of dropped connections.")
    p.add_argument("--latency-ms", type=float, default=0.0, help="Added latency per call.")

    grader = sub.add_parser("grader", help="Validate and run graders.").add_subparsers(
        dest="grader_command", required=True
    )
    p = command(grader, "validate", _grader_validate, "Validate a grader JSON file.")
    p.add_argument("--grader", required=True)
    p = command(grader, "run", _grader_run, "Score one sample against one item.")
    p.add_argument("--grader", required=True)
    p.add_argument("--item", required=True, help="JSON file with one data row.")
    p.add_argument("--sample", help="The model's output text.")
    p.add_argument("--sample-file", help="A file holding the model's output text.")
    p = command(grader, "probe", _grader_probe, "Score reward-hacking probes; exit 1 if any scores above 0.1.")
    p.add_argument("--grader", required=True)
    p.add_argument("--dataset", required=True, help="JSONL items (reference answers, gold pages).")
    p.add_argument("--max-items", type=int, default=20)
    p.add_argument("--corpus", default=None, help="Corpus root, to probe with the gold page's numbers.")

    config = sub.add_parser("config", help="Pipeline configs.").add_subparsers(
        dest="config_command", required=True
    )
    p = command(config, "validate", _config_validate, "Validate a pipeline config.")
    p.add_argument("config")

    model = sub.add_parser("model", help="Base models.").add_subparsers(dest="model_command", required=True)
    p = command(model, "bootstrap", _model_bootstrap, "Build (or reuse) the demo base model.")
    p.add_argument("--config", default="configs/demo.yaml")

    p = command(sub, "eval", _eval, "Evaluate a model: k rollouts per held-out item.")
    p.add_argument("--config", default="configs/demo.yaml")
    p.add_argument("--model", help="Path, hub id or models:/ URI (default: the config's base model).")
    p.add_argument("--k", type=int, help="Samples per item (default: baseline.k).")
    p.add_argument("--max-items", type=int)
    p.add_argument("--out", default="runs/eval")

    p = command(sub, "serve-model", _serve_model, "Serve a model with an OpenAI-compatible chat API.")
    p.add_argument("--model", required=True, help="Local path, hub id or models:/name@alias.")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--device", default="auto")
    p.add_argument("--max-len", type=int, default=4096, help="Context length served.")

    exp = sub.add_parser("expectations", help="Great Expectations suites.").add_subparsers(
        dest="expectations_command", required=True
    )
    p = command(exp, "derive", _expectations_derive, "Derive a suite from production traffic.")
    p.add_argument("--from", dest="traffic", default="data/production_traffic.jsonl")
    p.add_argument("--out", default="expectations/production_traffic.json")

    sub.add_parser("train", help="RFT training (GRPO); see `agentrft train --help`.", add_help=False)

    p = command(sub, "run", _run, "Run the pipeline (validate, baseline, prompts, RFT, eval, promotion).")
    p.add_argument("--config", default=None, help="Pipeline config (default configs/demo.yaml); with "
                   "--openai-job, the base the job is laid over.")
    p.add_argument("--openai-job", default=None, help="An OpenAI fine-tuning job body (method reinforcement).")
    p.add_argument("--model", default=None, help="With --openai-job: the base model path or hub id.")
    p.add_argument("--refresh", nargs="*", metavar="STAGE", help="Re-run these stages even if cached.")

    p = command(sub, "demo", _demo, "Run the whole pipeline on the embedded default.")
    p.add_argument("--config", default="configs/demo.yaml")
    p.add_argument("--refresh", nargs="*", metavar="STAGE", help="Re-run these stages even if cached.")

    p = command(sub, "promote", _promote, "Promote a registered version to champion, or roll back.")
    p.add_argument("--name", required=True, help="Registered model name.")
    p.add_argument("--version", default="", help="Version or alias (promote: default challenger).")
    p.add_argument("--action", choices=["promote", "rollback"], default="promote")
    p.add_argument("--tracking-uri", default="sqlite:///mlflow.db")

    p = command(sub, "serve", _serve, "Serve the pipeline (cron) and promotion deployments.")
    p.add_argument("--config", default="configs/demo.yaml")
    p = command(sub, "deploy", _deploy, "Register the deployments on a Prefect work pool.")
    p.add_argument("--config", default="configs/demo.yaml")
    p.add_argument("--work-pool", required=True)
    p.add_argument("--no-schedule", action="store_true", help="Register without the cron schedule.")
    p = command(sub, "ui", _ui, "Start the Prefect and MLflow UIs on loopback.")
    p.add_argument("--tracking-uri", default="sqlite:///mlflow.db")
    p.add_argument("--prefect-port", type=int, default=4200)
    p.add_argument("--mlflow-port", type=int, default=5000)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["train"]:  # the trainer owns its arguments (it also runs under accelerate launch)
        from trainer.train_cli import main as train_main

        return train_main(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except AgentRFTError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
