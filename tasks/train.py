"""Stage 4, rft_training: GRPO in a subprocess started with `accelerate launch`.

The trainer (`agentrft train`) runs as its own process group under Accelerate, with the
process count, mixed precision or accelerate config file from the config, so the same
stage runs one CPU process here and DDP or FSDP2 on GPUs (`training.distributed`). The stage hands it the
MLflow run id (the trainer logs `train/...` and `eval/...` to it directly), forwards its
progress to the Prefect log, and on failure fails with the tail of its stderr. The output
folder is named by what it trains and the trainer always starts with `--resume`: a Prefect
retry, or the re-run of a killed pipeline, continues from the last checkpoint. The best
checkpoints (by validation reward or score, `training.metric_for_best_model`) are logged as
MLflow models, straight from their directories, with their step; the best one is the
candidate.
"""

from __future__ import annotations

import hashlib
import itertools
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

from tasks.cache import stage_cache
from tasks.results import Candidate, TrainingResult
from tasks.rollout_eval import apply_variant
from tasks.tracking import (
    RunContext,
    link_split,
    log_files,
    log_metrics,
    log_transformers_model,
    publish_summary,
    stage_run,
)
from trainer.config.pipeline import PipelineConfig
from trainer.config.training import resolved_hyperparameters
from trainer.data import split_items
from trainer.errors import AgentRFTError, InfraError, StorageError
from trainer.rl.launch import launch_command

STAGE = "rft_training"
_PROGRESS_EVERY_S = 10.0


def training_command(config_path: Path, config: PipelineConfig, *, model: str, out: Path,
                     run_id: str) -> tuple[list[str], dict[str, str]]:
    """The `accelerate launch` command line of the trainer and the environment it adds."""
    argv = ["--config", str(config_path), "--model", model, "--output-dir", str(out), "--mlflow-run-id", run_id,
            "--resume"]
    return launch_command(config, argv)


def _pump(stream: Any, sink: deque, on_line: Any) -> None:
    """Read a child's output line by line as it comes (a text pipe's `read(n)` waits for n
    characters, which held progress lines back); tqdm's carriage returns end lines too."""
    for raw in iter(stream.readline, ""):
        for line in raw.replace("\r", "\n").split("\n"):
            if line.strip():
                sink.append(line)
                on_line(line)


def run_training(command: list[str], env: dict[str, str], log_path: Path, logger: Any, *, stage: str = STAGE) -> None:
    """Run the trainer; forward its progress; raise with its stderr tail if it fails."""
    tail: deque[str] = deque(maxlen=30)
    last = [0.0]
    with log_path.open("w", encoding="utf-8") as log:
        def on_line(line: str) -> None:
            log.write(line + "\n")
            log.flush()
            # Progress lines: at most one every _PROGRESS_EVERY_S. Other lines do not count
            # (one just before a progress line used to hold it back for a whole period).
            if line.startswith(("GRPO", "warm start step")):
                if time.monotonic() - last[0] <= _PROGRESS_EVERY_S:
                    return
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
        try:
            code = process.wait()
        except BaseException:  # the flow was cancelled or failed around it: the trainer goes too
            process.kill()
            process.wait()
            raise
        for reader in readers:
            reader.join()
    if code == 2:  # the trainer's own report of a user error (config, data): not worth a retry
        raise AgentRFTError(f"{stage}: the trainer stopped on an error (full log: {log_path}):\n" + "\n".join(tail))
    if code != 0:
        raise InfraError(
            f"{stage}: the trainer exited with status {code}; last lines of its output "
            f"(full log: {log_path}):\n" + "\n".join(tail)
        )


def _worth_a_retry(task: Any, task_run: Any, state: Any) -> bool:
    """A killed or crashed trainer is worth a retry (it resumes from its checkpoint); a
    user's error (a bad config, exit status 2) or a full disk would only fail again."""
    try:
        state.result()
    except StorageError:
        return False
    except InfraError:
        return True
    except Exception as exc:
        return not isinstance(exc, AgentRFTError)
    return False


def _output_dir(work_dir: Path, effective: PipelineConfig, model_path: str) -> Path:
    """The trainer's folder, named by what it trains (model and effective config): a Prefect
    retry, or a re-run of a killed pipeline, finds its checkpoints and resumes. A finished
    training there (a refreshed stage) is kept and the new one starts in a fresh folder."""
    key = hashlib.sha256(json.dumps([model_path, effective.model_dump(mode="json")], sort_keys=True).encode())
    name = key.hexdigest()[:16]
    folders = (work_dir.resolve() / STAGE / (name if n == 1 else f"{name}-{n}") for n in itertools.count(1))
    return next(folder for folder in folders if not (folder / "train_result.json").exists())


@task(name=STAGE, persist_result=True, retries=1, retry_delay_seconds=2, retry_condition_fn=_worth_a_retry,
      cache_policy=stage_cache(__name__))
def rft_training(model_path: str, *, model: Any, data: Any, tools: Any, grader: dict[str, Any], rollout: Any,
                 penalties: Any, training: Any, mlflow: Any, variant: dict[str, Any] | None, work_dir: str,
                 ctx: RunContext) -> TrainingResult:
    """Train with GRPO from `model_path` under the winning variant's settings."""
    logger = get_run_logger()
    items = split_items(data, "validation", 1)
    rollout, tools = apply_variant(rollout, tools, variant, items)
    effective = PipelineConfig(name=STAGE, work_dir=work_dir, model=model, data=data, tools=tools, grader=grader,
                               rollout=rollout, penalties=penalties, training=training,
                               mlflow=mlflow.model_copy(update={"tracking_uri": ctx.tracking_uri}))
    sections = {"model": model, "data": data, "tools": tools, "grader": grader, "rollout": rollout,
                "penalties": penalties, "training": training}
    with stage_run(ctx, STAGE, sections) as (client, run_id):
        link_split(ctx, run_id, data, "validation")  # its evaluations and checkpoint ranking
        out = _output_dir(Path(work_dir), effective, model_path)
        out.mkdir(parents=True, exist_ok=True)
        config_path = out / "config.yaml"
        config_path.write_text(yaml.safe_dump(effective.model_dump(mode="json"), sort_keys=False))
        log_metrics(client, run_id, {f"hp/{k}": float(v) for k, v in resolved_hyperparameters(training).items()})
        command, env = training_command(config_path, effective, model=model_path, out=out, run_id=run_id)
        env["MLFLOW_TRACKING_URI"] = ctx.tracking_uri
        client.set_tag(run_id, "command", " ".join(command))
        logger.info("training: %s", " ".join(command))
        run_training(command, env, out / "train.log", logger)
        result = json.loads((out / "train_result.json").read_text())
        client.set_tag(run_id, "chat_format", json.dumps(result["chat_format"]))
        models = []
        for rank, entry in enumerate(result["best_checkpoints"]):
            uri, model_id = log_transformers_model(ctx, run_id, Path(entry["path"]), f"checkpoint-step-{entry['step']}",
                                                   step=entry["step"])
            models.append(Candidate(step=entry["step"], score=entry["score"], path=entry["path"], model_uri=uri,
                                    model_id=model_id))
            client.set_tag(run_id, f"checkpoint_rank_{rank + 1}", uri)
        if models:
            candidate = models[0]
        else:  # no evaluation ran (eval_samples 0): the final model is the candidate
            uri, model_id = log_transformers_model(ctx, run_id, Path(result["model_dir"]), "final", step=result["steps"])
            candidate = Candidate(step=result["steps"], score=None, path=result["model_dir"], model_uri=uri,
                                  model_id=model_id)
        log_files(client, run_id, [config_path, out / "train.log", out / "train_result.json"], "")
        client.set_tag(run_id, "candidate", candidate.model_uri)
        final = {k: float(v) for k, v in result["metrics"].items() if isinstance(v, int | float)}
        publish_summary(
            ctx, STAGE, run_id,
            f"# RFT training\n\n{result['steps']} steps. Candidate: step {candidate.step} (validation "
            f"{training.metric_for_best_model} {candidate.score}), `{candidate.model_uri}`.\n\n| metric | last step |\n| --- | ---: |\n"
            + "".join(f"| {k} | {v:.4g} |\n" for k, v in final.items() if k.startswith(("train/", "eval/"))),
        )
    return TrainingResult(run_id=run_id, steps=result["steps"], candidate=candidate, checkpoints=models,
                          final_metrics=final)
