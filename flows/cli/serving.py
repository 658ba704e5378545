"""Serving and scheduling: `serve` (the deployments), `deploy`, `api` (OpenAI's fine-tuning API),
`ui`, `serve-model` and `monitor`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from flows.cli.app import DEMO_CONFIG, ConfigOption, SetOption, _config, app


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
def serve(config: ConfigOption = Path(DEMO_CONFIG), set_: SetOption = None) -> None:
    """Serve the pipeline (its cron) and the promotion flow as Prefect deployments."""
    from flows.serve import serve_deployments

    serve_deployments(_config(config, set_))


@app.command()
def deploy(work_pool: Annotated[str, typer.Option(help="Prefect work pool.")],
           config: ConfigOption = Path(DEMO_CONFIG), set_: SetOption = None,
           no_schedule: Annotated[bool, typer.Option(help="Register without the cron.")] = False,
           training_pool: Annotated[str | None, typer.Option(
               help="Run the training stage on this work pool's workers (e.g. the GPU machines'), the other "
               "stages on --work-pool's.")] = None) -> None:
    """Register the deployments on a Prefect work pool (workers on other machines)."""
    from flows.serve import deploy_to_work_pool

    ids = deploy_to_work_pool(_config(config, set_), work_pool, schedule=not no_schedule, training_pool=training_pool)
    print(json.dumps({"work_pool": work_pool, "training_pool": training_pool, "deployments": ids}, indent=2))
    for pool in dict.fromkeys(filter(None, (work_pool, training_pool))):
        print(f"start a worker: prefect worker start --pool {pool}")


@app.command()
def api(config: ConfigOption = Path(DEMO_CONFIG), set_: SetOption = None,
        host: Annotated[str, typer.Option(help="Bind address (loopback by default).")] = "127.0.0.1",
        port: int = 8100,
        api_key: Annotated[str | None, typer.Option(help="Require this bearer key on every route (or ${VAR}).")]
        = None,
        prefect_port: Annotated[int, typer.Option(help="Port of the Prefect server started when PREFECT_API_URL "
                                                       "is not set.")] = 4200,
        max_file_bytes: Annotated[int | None, typer.Option(help="Largest upload (default api.max_file_bytes, "
                                                                "OpenAI's 512 MB); larger ones get a 413.")] = None,
        allow_unfenced_python_graders: Annotated[bool, typer.Option(
            help="Run python graders sent to the API where the kernel offers no Landlock fence (they could read "
            "and write this server's files); off: refused with the reason.")] = False,
        allow_any_host: Annotated[bool, typer.Option(
            help="Let jobs' tools and graders call any host this machine reaches (internal services, the cloud "
            "metadata address); off: api.allowed_hosts, by default loopback and the hosts --config names.")]
        = False) -> None:
    """Serve OpenAI's fine-tuning API (files, jobs, events, checkpoints, graders, models,
    chat completions): jobs are runs of the pipeline deployment, laid over --config."""
    from flows.openai_api.server import serve_api
    from trainer.api_key import resolve_api_key

    overrides = [*(set_ or []), *([f"api.max_file_bytes={max_file_bytes}"] if max_file_bytes else []),
                 *(["api.allow_unfenced_python_graders=true"] if allow_unfenced_python_graders else []),
                 *(["api.allow_any_host=true"] if allow_any_host else [])]
    serve_api(config, overrides, _config(config, overrides), host=host, port=port,
              api_key=resolve_api_key(api_key), prefect_port=prefect_port)


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
                max_queue: Annotated[int, typer.Option(help="Requests waiting beyond the engine's slots; more get a "
                                                            "429 with Retry-After.")] = 64,
                max_json_bytes: Annotated[int, typer.Option(min=1, help="Largest chat completion request body; "
                                                                 "larger ones get a 413 before they are read.")]
                = 1024 * 1024,
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
    from trainer.serving.model_server import serve_model as serve_chat

    serve_chat(model, host=host, port=port, device=device, max_len=max_len, api_key=api_key, max_queue=max_queue,
               max_json_bytes=max_json_bytes,
               tracking_uri=resolve_tracking_uri(tracking_uri), chat_format=chat_format,
               enable_thinking=enable_thinking, trace_to=resolve_tracking_uri(trace_to) if trace_to else None,
               trace_experiment=trace_experiment)
