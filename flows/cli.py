"""The `agentrft` command line: one typer app, one parser.

Each command is a thin front over `trainer/`, `tasks/`, `flows/` and the demo environment
(`envs/finqa/`). `run`, `train` and `eval` take torchtune-style overrides
(`--set training.max_steps=2`, repeated). Errors a user can cause are `AgentRFTError`s:
printed as one clear message, exit status 2, never a Python traceback. Heavy libraries
are imported inside the commands so that `agentrft --help` stays instant.
"""

from __future__ import annotations

import json
import os
import sys
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
model_app = typer.Typer(help="The demo's base model.", no_args_is_help=True)
expectations_app = typer.Typer(help="Great Expectations suites.", no_args_is_help=True)
for sub, name in ((data_app, "data"), (env_app, "env"), (grader_app, "grader"), (config_app, "config"),
                  (model_app, "model"), (expectations_app, "expectations")):
    app.add_typer(sub, name=name)

ConfigOption = Annotated[Path, typer.Option("--config", "-c", help="Pipeline config (YAML).")]
SetOption = Annotated[list[str] | None, typer.Option("--set", "-s", metavar="SECTION.KEY=VALUE",
                                                     help="Override a config value (repeatable).")]
StopAfterOption = Annotated[str | None, typer.Option(
    "--stop-after", metavar="STAGE", help="End after baseline, prompt_optimization or rft_training: the test split "
    "is not read (trying seeds, data sizes or configs on the validation split).")]
RefreshOption = Annotated[list[str] | None, typer.Option("--refresh", metavar="STAGE",
                                                         help="Re-run this stage (and the later ones) even if cached.")]


def _config(path: Path, assignments: list[str] | None) -> Any:
    from trainer.config import load_config, missing_env_vars, parse_overrides
    from trainer.quiet import silence_known_noise

    silence_known_noise()
    config = load_config(path, parse_overrides(assignments))
    missing = missing_env_vars(config)
    if missing:
        raise AgentRFTError(f"{path}: environment variables referenced by tool headers are not set: "
                            + ", ".join(missing))
    return config


# --- the pipeline ---------------------------------------------------------------------------


def _run_pipeline(config: Any, refresh: list[str], stop_after: str | None = None) -> dict[str, Any]:
    """Run the pipeline flow; a failed run's reason becomes the command's error."""
    from flows.pipeline import agent_rft_pipeline, outcome_of, pipeline_parameters

    return outcome_of(agent_rft_pipeline(**pipeline_parameters(config, refresh, stop_after), return_state=True))


def print_outcome(outcome: dict[str, Any], config: Any) -> None:
    from rich.console import Console
    from rich.table import Table

    # Lines are never wrapped: a URI or a command must stay one piece to copy (and to grep).
    console = Console(soft_wrap=True)
    before_after = outcome.get("before_after")
    if before_after:
        table = Table(title="before / after (same test items and seeds)")
        for column in ("metric", "baseline", "candidate", "relative change"):
            table.add_column(column, justify="left" if column == "metric" else "right")
        for name, values in before_after.items():
            b, a = values["baseline"], values["candidate"]
            table.add_row(name, f"{b:.4g}", f"{a:.4g}", f"{(a - b) / b:+.1%}" if b else "n/a")
        console.print(table)
        gain = outcome["score_gain"]
        console.print(f"score gain on the test split {100 * gain['gain']:+.1f} points, 95% CI "
                      f"[{100 * gain['low']:+.1f}, {100 * gain['high']:+.1f}] (paired item bootstrap, one training "
                      f"run; {outcome.get('test_split', 'test file')})")
        if outcome.get("test_readings"):
            console.print(outcome["test_readings"])
    console.print(f"outcome: {outcome['outcome']}: {outcome.get('decision', outcome.get('reason', ''))}")
    if outcome.get("stopped_after") == "rft_training":
        candidate = outcome["candidate"]
        score = "n/a" if candidate["score"] is None else f"{candidate['score']:.4f}"
        console.print(f"candidate: {candidate['model_uri']} (step {candidate['step']}, validation {score}); score it "
                      f"on the validation split: `agentrft eval --model {candidate['model_uri']}`")
    cached = [name for name, stage in outcome.get("stages", {}).items() if stage["cached"]]
    if cached:
        console.print(f"served from cache: {', '.join(cached)}")
    for name, uri in outcome.get("figures", {}).items():
        console.print(f"figure ({name}): {uri}")
    console.print(f"MLflow parent run: {outcome['parent_run_id']}")
    console.print("open the UIs: `agentrft ui` (Prefect http://127.0.0.1:4200, MLflow http://127.0.0.1:5000); "
                  f"promote or roll back: `agentrft promote --name {config.registered_model} --action rollback`")


@app.command()
def run(config: ConfigOption = Path(DEMO_CONFIG), set_: SetOption = None, refresh: RefreshOption = None,
        openai_job: Annotated[Path | None, typer.Option(help="An OpenAI fine-tuning job body (method "
                                                              "reinforcement), laid over --config.")] = None,
        model: Annotated[str | None, typer.Option(help="With --openai-job: the base model path or hub id.")] = None,
        stop_after: StopAfterOption = None,
        ) -> None:
    """Run the pipeline: validate, baseline, prompts, RFT, regression eval, promotion."""
    if openai_job is not None:
        import yaml

        from flows.openai_job import load_openai_job
        from trainer.config import merge_overrides, parse_overrides

        base = yaml.safe_load(config.read_text()) if config.is_file() else None
        pipeline_config, notes = load_openai_job(openai_job, base=merge_overrides(base or {}, parse_overrides(set_)),
                                                 model=model)
        for note in notes:
            print(f"note: {note}", file=sys.stderr)
    else:
        pipeline_config = _config(config, set_)
    print_outcome(_run_pipeline(pipeline_config, refresh or [], stop_after), pipeline_config)


@app.command()
def monitor(config: ConfigOption, set_: SetOption = None,
            version: Annotated[str | None, typer.Option(help="Registry version watched (default: champion).")] = None
            ) -> None:
    """Score the served model's latest traffic windows and check them for drift (monitor.*)."""
    from flows.monitor import monitor_model
    from flows.pipeline import outcome_of

    pipeline_config = _config(config, set_)
    result = outcome_of(monitor_model(pipeline_config, version, return_state=True), "the monitor")
    print(json.dumps({"monitor": "passed", "version": result["version"], "mlflow_run_id": result["run_id"],
                      "windows": [{k: v for k, v in w.items() if k != "failures"} for w in result["windows"]]},
                     indent=2))


@app.command()
def demo(config: ConfigOption = Path(DEMO_CONFIG), set_: SetOption = None, refresh: RefreshOption = None,
         stop_after: StopAfterOption = None) -> None:
    """The whole pipeline on the embedded FinQA-style default (what `make demo` runs)."""
    from envs.finqa.demo import run_demo

    pipeline_config = _config(config, set_)
    outcome = run_demo(pipeline_config, refresh or [], stop_after=stop_after)
    print_outcome(outcome, pipeline_config)
    print(f"demo wall time: {outcome['wall_s']:.0f} s")


@app.command()
def train(config: ConfigOption, set_: SetOption = None,
          model: Annotated[str | None, typer.Option(help="Model path or hub id (default: model.base_model).")] = None,
          output_dir: Annotated[str | None, typer.Option(help="Default: training.output_dir.")] = None,
          mlflow_run_id: Annotated[str | None, typer.Option(help="Log metrics to this MLflow run.")] = None,
          resume: Annotated[bool, typer.Option(help="Continue from the newest checkpoint.")] = False) -> None:
    """RFT training alone (GRPO); launches `accelerate` processes when the config asks for them."""
    import subprocess

    from trainer.launch import launch_command, needs_launcher, run

    pipeline_config = _config(config, set_)
    if needs_launcher(pipeline_config):
        argv = ["--config", str(config), *(f"--set={a}" for a in set_ or []), *(["--model", model] if model else []),
                *(["--output-dir", output_dir] if output_dir else []),
                *(["--mlflow-run-id", mlflow_run_id] if mlflow_run_id else []), *(["--resume"] if resume else [])]
        command, env = launch_command(pipeline_config, argv)
        raise typer.Exit(subprocess.call(command, env={**os.environ, **env}))
    run(pipeline_config, model=model, output_dir=output_dir, mlflow_run_id=mlflow_run_id, resume=resume)


@app.command(name="eval")
def evaluate(config: ConfigOption = Path(DEMO_CONFIG), set_: SetOption = None,
             model: Annotated[str | None, typer.Option(help="Path, hub id or models:/ URI.")] = None,
             k: Annotated[int | None, typer.Option(help="Samples per item (default baseline.k).")] = None,
             max_items: Annotated[int | None, typer.Option(help="Items to evaluate.")] = None,
             split: Annotated[str, typer.Option(help="validation or test.")] = "validation",
             out: Annotated[Path, typer.Option(help="Output folder.")] = Path("runs/eval")) -> None:
    """Evaluate a model: k rollouts per item of a split, with progress and a summary table."""
    import time

    from mlflow.entities import Metric
    from rich.console import Console
    from rich.table import Table

    from tasks.rollout_eval import evaluate_model
    from tasks.tracking import resolve_tracking_uri
    from trainer.data import split_items
    from trainer.evaluate import write_outputs

    c = _config(config, set_)
    if split not in ("validation", "test"):
        raise AgentRFTError(f"--split must be validation or test, got {split!r}")
    items = split_items(c.data, split, max_items or c.baseline.max_items)
    # What the stages call: `rollout.backend` (vLLM included) and every rollout setting mean the same here.
    summary, records = evaluate_model(
        model or c.model.base_model, items, tracking_uri=resolve_tracking_uri(c.mlflow.tracking_uri),
        model_section=c.model, tools=c.tools, grader=c.grader, rollout=c.rollout, penalties=c.penalties,
        k=k or c.baseline.k, seed=c.baseline.seed, prefix="eval", group_by=c.promotion.group_by,
    )
    paths = write_outputs(summary, records, out)
    if split == "test":  # a reading of the test split: counted in the ledger and in MLflow
        from tasks.ledger import ledger_path, record_reading, tag_run
        from tasks.tracking import mlflow_client

        store = resolve_tracking_uri(c.mlflow.tracking_uri)
        client = mlflow_client(store)
        experiment = client.get_experiment_by_name(c.mlflow.experiment)
        run_id = client.create_run(experiment.experiment_id if experiment else client.create_experiment(
            c.mlflow.experiment), run_name="eval (test split)", tags={"command": "agentrft eval --split test"}
        ).info.run_id
        client.log_batch(run_id, metrics=[Metric(key, float(value), int(time.time() * 1000), 0)
                                          for key, value in summary.metrics.items()])
        found = record_reading(c.data, command="agentrft eval --split test", config=c.name,
                               config_hash=c.section_hash(), model=model or c.model.base_model, mlflow_run_id=run_id)
        tag_run(client, run_id, found)
        client.set_terminated(run_id)
        if found is not None:
            print(f"{found.sentence()} Ledger: {ledger_path(c.data)}; MLflow run {run_id}.")
    table = Table(title="evaluation")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for name, value in summary.metrics.items():
        table.add_row(name, f"{value:.4g}")
    table.add_row("status", json.dumps(summary.status_counts))
    table.add_row("grader errors", json.dumps(summary.grader_errors))
    for group, mean in summary.group_means.items():
        table.add_row(f"{c.promotion.group_by}: {group}", f"{mean:.4g}")
    Console().print(table)
    print(f"wrote {', '.join(str(p) for p in paths.values())}")


@app.command()
def promote(name: Annotated[str, typer.Option(help="Registered model name.")],
            version: Annotated[str, typer.Option(help="Version or alias (promote: default challenger).")] = "",
            action: Annotated[str, typer.Option(help="promote or rollback.")] = "promote",
            tracking_uri: Annotated[str, typer.Option(help="MLflow store.")] = "sqlite:///mlflow.db") -> None:
    """Promote a registered version to champion, or roll champion back (a Prefect flow)."""
    from flows.pipeline import outcome_of, promote_model

    if action not in ("promote", "rollback"):
        raise AgentRFTError(f"--action must be promote or rollback, got {action!r}")
    state = promote_model(name=name, version_or_alias=version, action=action, tracking_uri=tracking_uri,
                          return_state=True)
    print(json.dumps(outcome_of(state, "promote-model"), indent=2))


@app.command()
def serve(config: ConfigOption = Path(DEMO_CONFIG), set_: SetOption = None) -> None:
    """Serve the pipeline (its cron) and the promotion flow as Prefect deployments."""
    from flows.serve import serve_deployments

    serve_deployments(_config(config, set_))


@app.command()
def deploy(work_pool: Annotated[str, typer.Option(help="Prefect work pool.")],
           config: ConfigOption = Path(DEMO_CONFIG), set_: SetOption = None,
           no_schedule: Annotated[bool, typer.Option(help="Register without the cron.")] = False) -> None:
    """Register the deployments on a Prefect work pool (workers on other machines)."""
    from flows.serve import deploy_to_work_pool

    ids = deploy_to_work_pool(_config(config, set_), work_pool, schedule=not no_schedule)
    print(json.dumps({"work_pool": work_pool, "deployments": ids}, indent=2))
    print(f"start a worker: prefect worker start --pool {work_pool}")


@app.command()
def api(config: ConfigOption = Path(DEMO_CONFIG), set_: SetOption = None,
        host: Annotated[str, typer.Option(help="Bind address (loopback by default).")] = "127.0.0.1",
        port: int = 8100,
        api_key: Annotated[str | None, typer.Option(help="Require this bearer key on every route (or ${VAR}).")]
        = None,
        prefect_port: Annotated[int, typer.Option(help="Port of the Prefect server started when PREFECT_API_URL "
                                                       "is not set.")] = 4200) -> None:
    """Serve OpenAI's fine-tuning API (files, jobs, events, checkpoints, graders, models,
    chat completions): jobs are runs of the pipeline deployment, laid over --config."""
    from flows.api_server import serve_api
    from trainer.api_key import resolve_api_key

    serve_api(config, set_ or [], _config(config, set_), host=host, port=port, api_key=resolve_api_key(api_key),
              prefect_port=prefect_port)


@app.command()
def ui(tracking_uri: Annotated[str, typer.Option(help="MLflow store.")] = "sqlite:///mlflow.db",
       prefect_port: int = 4200, mlflow_port: int = 5000) -> None:
    """Start the Prefect and MLflow UIs on loopback."""
    from flows.serve import start_uis

    start_uis(tracking_uri, prefect_port=prefect_port, mlflow_port=mlflow_port)


@app.command(name="serve-model")
def serve_model(model: Annotated[str, typer.Option(help="Local path, hub id or models:/name@alias.")],
                host: str = "127.0.0.1", port: int = 8000, device: str = "auto",
                max_len: Annotated[int, typer.Option(help="Context length served.")] = 4096,
                api_key: Annotated[str | None, typer.Option(help="Require this key (or ${VAR}).")] = None,
                tracking_uri: Annotated[str, typer.Option(help="MLflow store for models:/ URIs.")] =
                "sqlite:///mlflow.db",
                chat_format: Annotated[str, typer.Option(help="auto, qwen3, qwen2.5, llama3, mistral, gpt-oss or "
                                                              "template (as model.chat_format).")] = "auto",
                enable_thinking: Annotated[bool | None, typer.Option(
                    "--enable-thinking/--disable-thinking", help="qwen3: think before answering (default: "
                    "the template's).")] = None,
                trace_to: Annotated[str | None, typer.Option(
                    help="Write every answered request as an MLflow trace to this store (what `agentrft monitor` "
                    "reads).")] = None,
                trace_experiment: Annotated[str, typer.Option(help="The MLflow experiment of those traces.")] =
                "agentrft-served") -> None:
    """Serve a model with an OpenAI-compatible chat API (/v1/chat/completions, tool calls)."""
    from tasks.tracking import resolve_tracking_uri
    from trainer.model_server import serve_model as serve_chat

    serve_chat(model, host=host, port=port, device=device, max_len=max_len, api_key=api_key,
               tracking_uri=resolve_tracking_uri(tracking_uri), chat_format=chat_format,
               enable_thinking=enable_thinking, trace_to=resolve_tracking_uri(trace_to) if trace_to else None,
               trace_experiment=trace_experiment)


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
    from trainer.modeling import load_tokenizer
    from trainer.policy import local_model_path

    model = config.model
    try:
        tokenizer = load_tokenizer(local_model_path(model.base_model,
                                                    tracking_uri=resolve_tracking_uri(config.mlflow.tracking_uri)))
    except AgentRFTError as exc:
        return {"chat_format": model.chat_format, "chat_format_detected": None,
                "chat_format_note": f"decided when the model loads: {exc}"}
    chat = load_chat_format(tokenizer, model.chat_format, enable_thinking=model.enable_thinking)
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
                 corpus: Annotated[Path | None, typer.Option(help="FinQA corpus root, to probe with the gold "
                                                                  "page's numbers.")] = None) -> None:
    """Score reward-hacking probes; exit 1 if any scores above 0.1."""
    from trainer.data import read_items
    from trainer.graders import validate_grader_file
    from trainer.graders.probe import run_probes

    report = run_probes(validate_grader_file(grader), read_items(dataset, max_items), corpus_dir=corpus)
    print(json.dumps(report.to_json(), indent=2))
    if report.flagged:
        print(f"{len(report.flagged)} of {report.tried} probes scored above 0.1: the grader can be gamed",
              file=sys.stderr)
    if not report.passed:
        raise typer.Exit(1)


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
def data_readings(config: ConfigOption = Path(DEMO_CONFIG), set_: SetOption = None) -> None:
    """How many times the config's test split has been read, and by which configs (data.test_ledger)."""
    from tasks.ledger import ledger_path, readings, split_digest

    c = _config(config, set_)
    ledger = ledger_path(c.data)
    if ledger is None:
        raise AgentRFTError("data.test_ledger is null: readings are tagged in MLflow only (test_split.readings)")
    split, items = split_digest(c.data)
    found = readings(ledger, split)
    print(json.dumps({"ledger": str(ledger), "test_split_sha256": split, "items": items,
                      "readings": found.count, "configs": found.configs}, indent=2))


@data_app.command("import-finqa")
def data_import_finqa(json_file: Annotated[Path, typer.Argument(help="FinQA JSON (train.json, dev.json, ...).")],
                      out: Path = Path("data-finqa"), split: str = "train") -> None:
    """Build a corpus and items from the real FinQA JSON format."""
    from envs.finqa.finqa_format import load_finqa_json

    count = load_finqa_json(json_file, out, split_name=split)
    print(f"wrote {count} items to {out / (split + '.jsonl')}")


@env_app.command("serve")
def env_serve(name: Annotated[str, typer.Argument(help="The environment: finqa.")] = "finqa",
              corpus: Path = Path("data/corpus"), host: str = "127.0.0.1", port: int = 8765,
              api_key: Annotated[str | None, typer.Option(help="Require this key (or ${VAR}).")] = None,
              error_rate: Annotated[float, typer.Option(help="Share of 5xx answers.")] = 0.0,
              timeout_rate: Annotated[float, typer.Option(help="Share of answers that hang.")] = 0.0,
              drop_rate: Annotated[float, typer.Option(help="Share of dropped connections.")] = 0.0,
              latency_ms: Annotated[float, typer.Option(help="Added latency per call.")] = 0.0) -> None:
    """Serve an environment's tools (and its endpoint grader) over HTTP."""
    from envs.finqa.faults import FaultConfig
    from envs.finqa.server import serve as serve_tools
    from trainer.api_key import resolve_api_key

    if name != "finqa":
        raise AgentRFTError(f"unknown environment {name!r}; the project ships `finqa`")
    faults = FaultConfig(error_rate=error_rate, timeout_rate=timeout_rate, drop_rate=drop_rate, latency_ms=latency_ms)
    serve_tools(corpus, host=host, port=port, faults=faults, api_key=resolve_api_key(api_key))


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
    from trainer.config import load_config

    config = load_config(DEMO_CONFIG)
    settings = BootstrapSettings(seed=seed, train_tokens=tokens, max_minutes=24 * 60)
    path = bootstrap_demo_model(data_dir, out, settings=settings, system_prompt=config.rollout.system_prompt)
    if pin and out.resolve() == PIN_FILE.parent.resolve() / "model":
        write_model_pin(out, PIN_FILE)
    print(path)


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


if __name__ == "__main__":
    sys.exit(main())
