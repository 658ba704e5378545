"""Stage 4, rft_training: GRPO in a subprocess started with `accelerate launch`.

The trainer (`trainer.train_cli`) runs as its own process group under Accelerate, with the
process count, mixed precision or accelerate config file from the config, so the same
stage runs one CPU process here and DDP/FSDP/DeepSpeed on GPUs. The stage hands it the
MLflow run id (the trainer logs `train/...` and `eval/...` to it directly), forwards its
progress to the Prefect log, and on failure fails with the tail of its stderr. The output
folder is keyed by the stage's cache key and the trainer always starts with `--resume`: a
Prefect retry of a killed run continues from the last checkpoint. The best checkpoints
are logged as MLflow models with their step; the best one is the candidate.
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any

import yaml
from prefect import get_run_logger, task

from tasks.rollout_eval import apply_variant
from tasks.tracking import (
    RunContext,
    log_files,
    log_metrics,
    log_transformers_model,
    publish_summary,
    stage_run,
)
from tasks.versioning import STAGES
from trainer.config import PipelineConfig, resolved_hyperparameters
from trainer.errors import InfraError

STAGE = STAGES[3]
_PROGRESS_EVERY_S = 10.0


def training_command(config_path: Path, config: PipelineConfig, *, model: str, out: Path, run_id: str) -> tuple[list[str], dict[str, str]]:
    """The `accelerate launch` command line of the trainer and the environment it adds."""
    from trainer.train_cli import launch_command

    argv = ["--config", str(config_path), "--model", model, "--output-dir", str(out),
            "--mlflow-run-id", run_id, "--resume"]
    return launch_command(config, argv)


def _pump(stream: Any, sink: deque, on_line: Any) -> None:
    """Read a child's output; tqdm's carriage returns count as line ends."""
    buffer = ""
    for chunk in iter(lambda: stream.read(256), ""):
        buffer += chunk
        *lines, buffer = buffer.replace("\r", "\n").split("\n")
        for line in lines:
            if line.strip():
                sink.append(line)
                on_line(line)
    if buffer.strip():
        sink.append(buffer)
        on_line(buffer)


def run_training(command: list[str], env: dict[str, str], log_path: Path, logger: Any) -> None:
    """Run the trainer; forward its progress; raise with its stderr tail if it fails."""
    tail: deque[str] = deque(maxlen=30)
    last = [0.0]
    with log_path.open("w", encoding="utf-8") as log:
        def on_line(line: str) -> None:
            log.write(line + "\n")
            log.flush()
            progress = line.startswith("GRPO")
            if not progress or time.monotonic() - last[0] > _PROGRESS_EVERY_S:
                last[0] = time.monotonic()
                logger.info(line)

        process = subprocess.Popen(
            command, env={**os.environ, **env}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True, errors="replace",
        )
        readers = [threading.Thread(target=_pump, args=(s, tail, on_line), daemon=True)
                   for s in (process.stdout, process.stderr)]
        for reader in readers:
            reader.start()
        code = process.wait()
        for reader in readers:
            reader.join()
    if code != 0:
        raise InfraError(
            f"rft_training: the trainer exited with status {code}; last lines of its output "
            f"(full log: {log_path}):\n" + "\n".join(tail)
        )


@task(name="rft_training", persist_result=True, retries=1, retry_delay_seconds=2,
      cache_key_fn=lambda _ctx, params: params["stage_key"])
def rft_training(
    config: PipelineConfig, ctx: RunContext, stage_key: str, model_path: str, variant: dict[str, Any] | None
) -> dict[str, Any]:
    """Train with GRPO from `model_path` under the winning variant's settings."""
    logger = get_run_logger()
    effective = apply_variant(config, variant)
    out = (Path(config.work_dir) / STAGE / stage_key).resolve()
    out.mkdir(parents=True, exist_ok=True)
    config_path = out / "config.yaml"
    config_path.write_text(yaml.safe_dump(effective.model_dump(mode="json"), sort_keys=False))
    with stage_run(ctx, STAGE, effective) as (client, run_id):
        log_metrics(client, run_id, {f"hp/{k}": float(v) for k, v in resolved_hyperparameters(effective.training).items()})
        command, env = training_command(config_path, effective, model=model_path, out=out, run_id=run_id)
        env["MLFLOW_TRACKING_URI"] = ctx.tracking_uri
        client.set_tag(run_id, "command", " ".join(command))
        logger.info("training: %s", " ".join(command))
        run_training(command, env, out / "train.log", logger)
        result = json.loads((out / "train_result.json").read_text())
        best = result["best_checkpoints"]
        models = []
        for rank, entry in enumerate(best):
            uri = log_transformers_model(ctx, run_id, Path(entry["path"]), f"checkpoint-step-{entry['step']}",
                                         step=entry["step"])
            models.append({**entry, "model_uri": uri, "rank": rank + 1})
        if best:
            candidate = models[0]
        else:  # no evaluation ran (eval_samples 0): the final model is the candidate
            uri = log_transformers_model(ctx, run_id, Path(result["model_dir"]), "final", step=result["steps"])
            candidate = {"step": result["steps"], "score": None, "path": result["model_dir"], "model_uri": uri}
        log_files(client, run_id, [config_path, out / "train.log", out / "train_result.json"], "")
        client.set_tag(run_id, "candidate", candidate["model_uri"])
        final = result["metrics"]
        publish_summary(
            ctx, STAGE, run_id,
            f"# RFT training\n\n{result['steps']} steps. Candidate: step {candidate['step']} "
            f"(eval score {candidate['score']}), `{candidate['model_uri']}`.\n\n| metric | last step |\n"
            "| --- | ---: |\n" + "".join(
                f"| {k} | {v:.4g} |\n" for k, v in final.items() if isinstance(v, float) and k.startswith(("train/", "eval/"))
            ),
        )
    return {"run_id": run_id, "steps": result["steps"], "candidate": candidate, "checkpoints": models,
            "final_metrics": {k: v for k, v in final.items() if isinstance(v, int | float)}}
