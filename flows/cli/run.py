"""The pipeline's commands: `run`, `demo`, `train`, `eval`, `promote`."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from flows.cli.app import (
    DEMO_CONFIG,
    ConfigOption,
    RefreshOption,
    SetOption,
    StopAfterOption,
    _config,
    app,
)
from trainer.errors import AgentRFTError

# --- the pipeline ---------------------------------------------------------------------------


def _run_pipeline(config: Any, refresh: list[str], stop_after: str | None = None) -> dict[str, Any]:
    """Run the pipeline flow; a failed run's reason becomes the command's error."""
    from flows.pipeline import agent_rft_pipeline, outcome_of, pipeline_parameters

    return outcome_of(agent_rft_pipeline(**pipeline_parameters(config, refresh, stop_after), return_state=True))


def print_before_after(console: Any, before_after: dict[str, dict[str, float]], title: str) -> None:
    from rich.table import Table

    table = Table(title=title)
    for column in ("metric", "baseline", "candidate", "relative change"):
        table.add_column(column, justify="left" if column == "metric" else "right")
    for name, values in before_after.items():
        b, a = values["baseline"], values["candidate"]
        table.add_row(name, f"{b:.4g}", f"{a:.4g}", f"{(a - b) / b:+.1%}" if b else "n/a")
    console.print(table)


def print_outcome(outcome: dict[str, Any], config: Any) -> None:
    from rich.console import Console

    # Lines are never wrapped: a URI or a command must stay one piece to copy (and to grep).
    console = Console(soft_wrap=True)
    before_after = outcome.get("before_after")
    if before_after:
        print_before_after(console, before_after, "before / after (same test items and seeds)")
        gain = outcome["score_gain"]
        console.print(f"score gain on the test split {100 * gain['gain']:+.1f} points, 95% CI "
                      f"[{100 * gain['low']:+.1f}, {100 * gain['high']:+.1f}] (paired item bootstrap, one training "
                      f"run; {outcome.get('test_split', 'test file')})")
        if outcome.get("test_readings"):
            console.print(outcome["test_readings"])
        if outcome.get("demo"):
            from flows.demo import against_goals

            console.print("against the published FinQA case: " + "; ".join(against_goals(outcome)))
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
    if outcome.get("version") and config.data.shift_evaluations:
        variant = (outcome.get("prompt_optimization") or {}).get("best")
        flag = f" --variant {variant}" if variant else ""
        shift = "demo-shift" if outcome.get("demo") else "shift"
        for name, split in config.data.shift_evaluations.items():
            console.print(f"shift evaluation ({split.measures}): `agentrft {shift} {name} --model "
                          f"models:/{outcome['registered_model']}/{outcome['version']}{flag}`")
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

        from flows.openai_api.job_body import load_openai_job
        from trainer.config.loading import merge_overrides, parse_overrides

        base = yaml.safe_load(config.read_text()) if config.is_file() else None
        pipeline_config, notes = load_openai_job(openai_job, base=merge_overrides(base or {}, parse_overrides(set_)),
                                                 model=model)
        for note in notes:
            print(f"note: {note}", file=sys.stderr)
    else:
        pipeline_config = _config(config, set_)
    print_outcome(_run_pipeline(pipeline_config, refresh or [], stop_after), pipeline_config)



@app.command()
def demo(config: ConfigOption = Path(DEMO_CONFIG), set_: SetOption = None, refresh: RefreshOption = None,
         stop_after: StopAfterOption = None) -> None:
    """The whole pipeline on the embedded FinQA-style default (what `make demo` runs)."""
    from flows.demo import run_demo

    pipeline_config = _config(config, set_)
    outcome = run_demo(pipeline_config, refresh or [], stop_after=stop_after)
    print_outcome(outcome, pipeline_config)
    print(f"demo wall time: {outcome['wall_s']:.0f} s")


@app.command(name="demo-real")
def demo_real(config: ConfigOption = Path("envs/units/smollm2.yaml"), set_: SetOption = None,
              refresh: RefreshOption = None, stop_after: StopAfterOption = None) -> None:
    """The real-model recipe (what `make demo-real` runs): SmolLM2-135M-Instruct imported from the
    package index, trained with its tools on the units environment, evaluated, promoted."""
    from flows.demo import run_real_demo

    pipeline_config = _config(config, set_)
    outcome = run_real_demo(pipeline_config, refresh or [], stop_after=stop_after)
    print_outcome(outcome, pipeline_config)
    print(f"demo-real wall time: {outcome['wall_s']:.0f} s")


def print_shift(result: dict[str, Any]) -> None:
    from rich.console import Console

    console = Console(soft_wrap=True)
    comparison = result["comparison"]
    before_after = {name: {"baseline": c["before"], "candidate": c["after"]}
                    for name, c in comparison["changes"].items()}
    print_before_after(console, before_after, f"shift evaluation {result['name']}: {result['items']} items x "
                                               f"{result['k']} (same items and seeds)")
    gain = comparison["score_gain"]
    console.print(f"score gain on {result['name']} {100 * gain['gain']:+.1f} points, 95% CI [{100 * gain['low']:+.1f}, "
                  f"{100 * gain['high']:+.1f}] (paired item bootstrap, one training run)")
    console.print(f"what it measures: {result['measures']}")
    if result["readings"]:
        console.print(f"{result['readings']} Ledger: {result['ledger']}; MLflow run {result['mlflow_run_id']}.")


ShiftModel = Annotated[str, typer.Option("--model", help="The trained model: a path or models:/ URI.")]
ShiftVariant = Annotated[str | None, typer.Option(help="The prompt variant the pipeline chose (its outcome names it).")]


@app.command()
def shift(name: Annotated[str, typer.Argument(help="A split of data.shift_evaluations.")], model: ShiftModel,
          config: ConfigOption = Path(DEMO_CONFIG), set_: SetOption = None, variant: ShiftVariant = None) -> None:
    """A shift evaluation: the model against the base model on a split of another question than the
    test split's; paired, counted in the test ledger, deciding nothing."""
    from tasks.shift import shift_evaluation

    print_shift(shift_evaluation(_config(config, set_), name, model, variant=variant))


@app.command(name="demo-shift")
def demo_shift(name: Annotated[str, typer.Argument(help="later_years or new_companies.")], model: ShiftModel,
               config: ConfigOption = Path(DEMO_CONFIG), set_: SetOption = None, variant: ShiftVariant = None) -> None:
    """`agentrft shift` on the demo, with its tool server on the split's own corpus."""
    from flows.demo import run_demo_shift

    print_shift(run_demo_shift(_config(config, set_), name, model, variant=variant))


@app.command()
def train(config: ConfigOption, set_: SetOption = None,
          model: Annotated[str | None, typer.Option(help="Model path or hub id (default: model.base_model).")] = None,
          output_dir: Annotated[str | None, typer.Option(help="Default: training.output_dir.")] = None,
          mlflow_run_id: Annotated[str | None, typer.Option(help="Log metrics to this MLflow run.")] = None,
          resume: Annotated[bool, typer.Option(help="Continue from the newest checkpoint.")] = False) -> None:
    """RFT training alone (GRPO); launches `accelerate` processes when the config asks for them."""
    import subprocess

    from trainer.rl.launch import launch_command, needs_launcher, run

    pipeline_config = _config(config, set_)
    if needs_launcher(pipeline_config):
        argv = ["--config", str(config), *(f"--set={a}" for a in set_ or []), *(["--model", model] if model else []),
                *(["--output-dir", output_dir] if output_dir else []),
                *(["--mlflow-run-id", mlflow_run_id] if mlflow_run_id else []), *(["--resume"] if resume else [])]
        command, env = launch_command(pipeline_config, argv)
        raise typer.Exit(subprocess.call(command, env={**os.environ, **env}))
    run(pipeline_config, model=model, output_dir=output_dir, mlflow_run_id=mlflow_run_id, resume=resume)


@app.command(name="warm-start")
def warm_start(config: ConfigOption, set_: SetOption = None,
               model: Annotated[str | None, typer.Option(help="Model path or hub id (default: model.base_model).")] = None,
               output_dir: Annotated[str | None, typer.Option(help="Default: warm_start.output_dir.")] = None,
               mlflow_run_id: Annotated[str | None, typer.Option(help="Log metrics to this MLflow run.")] = None,
               resume: Annotated[bool, typer.Option(help="Continue from the newest checkpoint.")] = False) -> None:
    """The warm start alone: supervised fine-tuning on `warm_start.demonstrations_file`; launches
    `accelerate` processes when the config asks for them."""
    import subprocess

    from trainer.rl.launch import launch_command, needs_launcher
    from trainer.rl.warm_start import warm_start as fit

    pipeline_config = _config(config, set_)
    if needs_launcher(pipeline_config):
        argv = ["--config", str(config), *(f"--set={a}" for a in set_ or []), *(["--model", model] if model else []),
                *(["--output-dir", output_dir] if output_dir else []),
                *(["--mlflow-run-id", mlflow_run_id] if mlflow_run_id else []), *(["--resume"] if resume else [])]
        command, env = launch_command(pipeline_config, argv, command_name="warm-start")
        raise typer.Exit(subprocess.call(command, env={**os.environ, **env}))
    from accelerate import PartialState
    from accelerate.utils import parse_flag_from_env

    state = PartialState(cpu=parse_flag_from_env("ACCELERATE_USE_CPU"))
    result = fit(pipeline_config, model_path=model or pipeline_config.model.base_model,
                 output_dir=Path(output_dir or pipeline_config.warm_start.output_dir), mlflow_run_id=mlflow_run_id,
                 resume=resume)
    if state.is_main_process:
        print(f"warm start: {result.steps} steps; " + ", ".join(
            f"{k} {v:.4g}" for k, v in result.metrics.items() if k.startswith("warm_start/") and v is not None))
        print(f"final model: {result.model_dir}")


@app.command(name="eval")
def evaluate(config: ConfigOption = Path(DEMO_CONFIG), set_: SetOption = None,
             model: Annotated[str | None, typer.Option(help="Path, hub id or models:/ URI.")] = None,
             k: Annotated[int | None, typer.Option(help="Samples per item (default baseline.k).")] = None,
             max_items: Annotated[int | None, typer.Option(help="Items to evaluate.")] = None,
             split: Annotated[str, typer.Option(help="validation or test; with --benchmark also all.")] = "validation",
             out: Annotated[Path, typer.Option(help="Output folder.")] = Path("runs/eval"),
             benchmark: Annotated[str | None, typer.Option(
                 help="bfcl: BFCL v4's single-turn categories, scored by BFCL's own checker (config "
                      "envs/bfcl/benchmark.yaml unless --config; --split all is the leaderboard's set).")] = None,
             ) -> None:
    """Evaluate a model: k rollouts per item of a split, with progress and a summary table."""
    import time
    from contextlib import ExitStack

    from mlflow.entities import Metric
    from rich.console import Console
    from rich.table import Table

    from tasks.rollout_eval import evaluate_model
    from tasks.tracking import resolve_tracking_uri
    from trainer.data import split_items
    from trainer.rollout.evaluate import write_outputs

    if benchmark not in (None, "bfcl"):
        raise AgentRFTError(f"--benchmark must be bfcl, got {benchmark!r}")
    if benchmark and config == Path(DEMO_CONFIG):
        from envs.bfcl.benchmark import BENCHMARK_CONFIG

        config = BENCHMARK_CONFIG
    c = _config(config, set_)
    if split not in ("validation", "test", *(["all"] if benchmark else [])):
        raise AgentRFTError(f"--split must be validation or test{', or all' if benchmark else ''}, got {split!r}")
    with ExitStack() as stack:
        if benchmark:  # the rows checked against their pin, BFCL's grader and the tool server up
            from envs.bfcl.benchmark import all_items
            from envs.bfcl.environment import servers

            stack.enter_context(servers(c))
        limit = max_items or c.baseline.max_items
        items = all_items(limit) if split == "all" else split_items(c.data, split, limit)
        # What the stages call: `rollout.backend` (vLLM included) and every rollout setting mean the same here.
        summary, records = evaluate_model(
            model or c.model.base_model, items, tracking_uri=resolve_tracking_uri(c.mlflow.tracking_uri),
            model_section=c.model, tools=c.tools, grader=c.grader, rollout=c.rollout, penalties=c.penalties,
            k=k or c.baseline.k, seed=c.baseline.seed, prefix="eval",
            group_by="category" if benchmark else c.promotion.group_by,
        )
    paths = write_outputs(summary, records, out)
    if split in ("test", "all"):  # a reading of the test split (BFCL's whole set holds it): ledger and MLflow
        from tasks.ledger import ledger_path, record_reading, tag_run
        from tasks.tracking import mlflow_client

        store = resolve_tracking_uri(c.mlflow.tracking_uri)
        client = mlflow_client(store)
        experiment = client.get_experiment_by_name(c.mlflow.experiment)
        run_id = client.create_run(experiment.experiment_id if experiment else client.create_experiment(
            c.mlflow.experiment), run_name=f"eval ({split} split)", tags={"command": f"agentrft eval --split {split}"}
        ).info.run_id
        client.log_batch(run_id, metrics=[Metric(key, float(value), int(time.time() * 1000), 0)
                                          for key, value in summary.metrics.items()])
        whole, split_file = split == "all", None
        if whole:
            from envs.bfcl.benchmark import ALL_FILE

            split_file = str(ALL_FILE)
        found = record_reading(c.data, command=f"agentrft eval --split {split}", config=c.name,
                               config_hash=c.section_hash(), config_written_hash=c.written_hash(),
                               model=model or c.model.base_model, mlflow_run_id=run_id,
                               split_file=split_file,
                               note="BFCL's whole set, the test split's entries among them" if whole else "")
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
    if benchmark:
        from envs.bfcl.benchmark import accuracy_by_category, accuracy_table

        by_category = accuracy_by_category(items, records)
        (out / "bfcl_accuracy.json").write_text(json.dumps(by_category, indent=1) + "\n")
        Console().print(table)
        Console().print(accuracy_table(by_category, title=f"BFCL v4 accuracy by its own checker: {model or c.model.base_model} "
                                                          f"({split}, {len(items)} entries x {k or c.baseline.k})"))
    else:
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
