"""Training when tools fail, and training that is killed.

1. Against a tool server answering 40% of calls with 503 and timing out 5%, rollouts are
   retried, the ones that still fail are `infra_error` with no score (never 0), they are
   left out of the loss and counted, and two GRPO steps complete.
2. The trainer process is killed with SIGKILL after its first checkpoint; `--resume`
   continues it, and it ends with the metrics of an uninterrupted run of the same seed,
   while the MLflow run holds one value per step (nothing logged twice).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from envs.finqa.faults import FaultConfig
from envs.finqa.local import local_tool_endpoints
from tasks.tracking import mlflow_client
from tests.pipeline_world import micro
from tests.taught_model import OUTPUT_CHARS
from trainer.data import read_items, read_jsonl

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]
# A call fails both of its attempts about 20% of the time: with the taught model's few calls
# per rollout, enough rollouts meet such a call.
FAULTS = FaultConfig(error_rate=0.4, timeout_rate=0.05, timeout_s=2.0, seed=5)


@pytest.fixture(scope="module")
def faulty_endpoints(world: Path):
    with local_tool_endpoints(world / "data" / "corpus", max_output_chars=OUTPUT_CHARS, faults=FAULTS) as served:
        yield served


def test_infrastructure_failures_are_retried_counted_and_never_scored(world, faulty_endpoints, taught_model):
    from trainer.generation.policy import load_policy
    from trainer.rollout.evaluate import run_evaluation
    from trainer.rollout.record import RolloutSettings
    from trainer.rollout.tool_client import ToolClient

    config = micro(world, faulty_endpoints, taught_model, tools={"timeout_s": 0.5, "max_retries": 2},
                   rollout={"max_turns": 3, "max_concurrent_rollouts": 8}, training={"max_steps": 2})
    assert config.tools.max_output_chars == OUTPUT_CHARS
    policy = load_policy(str(taught_model))
    items = [item for split in ("train", "validation", "test") for item in read_items(world / "data" / f"{split}.jsonl")]
    summary, records = run_evaluation(
        policy.backend(max_slots=8, max_len=768, seed=0), policy.chat, items, k=16,
        tool_client=ToolClient.from_config(config.tools), grader=config.grader,
        settings=RolloutSettings.from_config(config.rollout, config.penalties), tools=config.tools.schemas,
    )
    failed = [r for r in records if r.status == "infra_error"]
    calls = sum(len(r.tool_calls) for r in records)
    assert calls >= 30, f"only {calls} tool calls: too few to meet the faults"
    assert failed, f"with {calls} calls each failing twice about 20% of the time, some rollout should fail"
    for record in failed:
        assert record.score is None and record.reward is None and not record.trainable
    for record in records:
        if record.status != "infra_error":
            assert record.score is not None
    assert summary.metrics["eval/infra_error_rate"] == pytest.approx(len(failed) / len(records))

    out = world / "faulty-train"
    from trainer.rl.grpo import train

    result = train(config, model_path=str(taught_model), output_dir=out)
    assert result.steps == 2
    rows = read_jsonl(out / "metrics.jsonl")
    assert all(0 <= row["train/infra_error_rate"] <= 1 for row in rows[1:])
    kept = [json.loads(line) for path in sorted((out / "rollouts").glob("step_*.jsonl")) for line in path.open()]
    assert all(r["score"] is None for r in kept if r["status"] == "infra_error")


def _comparable(row: dict) -> dict:
    return {k: v for k, v in row.items() if not (k.startswith(("timing/", "memory/")) or "latency" in k or k.endswith("_per_s"))}


def _train_command(config_file: Path, model: Path, out: Path, run_id: str, *extra: str) -> list[str]:
    """`agentrft train` as a user (or the pipeline's training stage) runs it."""
    return [sys.executable, "-m", "flows.cli", "train", "--config", str(config_file), "--model", str(model),
            "--output-dir", str(out), "--mlflow-run-id", run_id, *extra]


def test_sigkilled_training_resumes_to_the_same_metrics(world, endpoints, taught_model):
    config = micro(world, endpoints, taught_model, rollout={"max_concurrent_rollouts": 1},  # exact: one at a time
                   training={"n_epochs": 3, "max_steps": 3, "learning_rate": 1e-3, "checkpoint_interval": 1,
                             "eval_interval": 3})
    config_file = world / "resume.yaml"
    config_file.write_text(yaml.safe_dump(config.model_dump(mode="json")))
    client = mlflow_client(config.mlflow.tracking_uri)
    experiment = client.create_experiment("resume-test")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}

    reference_run = client.create_run(experiment).info.run_id
    subprocess.run(_train_command(config_file, taught_model, world / "uninterrupted", reference_run),
                   cwd=REPO, env=env, check=True, capture_output=True)

    killed_run = client.create_run(experiment).info.run_id
    out = world / "killed"
    process = subprocess.Popen(_train_command(config_file, taught_model, out, killed_run), cwd=REPO, env=env,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while not (out / "checkpoints" / "step_1").is_dir():
        assert process.poll() is None, "the trainer ended before its first checkpoint"
        assert time.monotonic() < deadline
        time.sleep(0.2)
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert not (out / "final").exists()

    resumed = subprocess.run(_train_command(config_file, taught_model, out, killed_run, "--resume"), cwd=REPO,
                             env=env, capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resumed from" in resumed.stdout

    want = [_comparable(r) for r in read_jsonl(world / "uninterrupted" / "metrics.jsonl")]
    got = [_comparable(r) for r in read_jsonl(out / "metrics.jsonl")]
    assert [r["step"] for r in got] == [0, 1, 2, 3]
    for a, b in zip(want, got, strict=True):
        assert a.keys() == b.keys()
        for key in a:
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-8), key
    for key in ("train/reward_mean", "train/loss", "timing/step_s"):
        steps = [m.step for m in client.get_metric_history(killed_run, key)]
        assert sorted(steps) == [1, 2, 3], (key, steps)  # one value per step, none twice
    reference = {m.step: m.value for m in client.get_metric_history(reference_run, "train/reward_mean")}
    assert {m.step: m.value for m in client.get_metric_history(killed_run, "train/reward_mean")} == pytest.approx(reference)


def test_a_killed_flow_rerun_skips_finished_stages(harness, world, endpoints, taught_model):
    """`agentrft run` killed (with its trainer) during training; the re-run serves the
    stages before training from cache and the trainer resumes from its checkpoint."""
    from prefect.settings import PREFECT_LOCAL_STORAGE_PATH

    from flows.pipeline import agent_rft_pipeline, pipeline_parameters

    config = micro(world, endpoints, taught_model, name="killed-flow", work_dir=str(world / "killed-flow"),
                   training={"n_epochs": 3, "max_steps": 3, "learning_rate": 1e-12, "checkpoint_interval": 1})
    config_file = world / "killed-flow.yaml"
    config_file.write_text(yaml.safe_dump(config.model_dump(mode="json")))
    # `agentrft run` as a user starts it on one machine: Prefect's ephemeral mode, whose
    # model lock is a file lock the OS drops with the killed process (a Prefect server's
    # lease would hold the model for its 300 s first). The results, and so the cache,
    # live where the re-run below reads them.
    env = {key: value for key, value in os.environ.items() if key != "PREFECT_API_URL"}
    env.update(PREFECT_HOME=str(world / "killed-flow-prefect"), AGENTRFT_LOCK_DIR=str(world / "killed-flow-locks"),
               PREFECT_LOCAL_STORAGE_PATH=str(PREFECT_LOCAL_STORAGE_PATH.value()))
    log = world / "killed-flow.log"
    with log.open("w") as sink:
        process = subprocess.Popen([sys.executable, "-m", "flows.cli", "run", "--config", str(config_file)],
                                   cwd=REPO, env=env, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)
    training = world / "killed-flow" / "rft_training"
    deadline = time.monotonic() + 600
    while not list(training.glob("*/checkpoints/step_1")):
        assert process.poll() is None, f"the pipeline ended before training checkpointed:\n{log.read_text()[-4000:]}"
        assert time.monotonic() < deadline
        time.sleep(0.2)
    os.killpg(process.pid, signal.SIGKILL)  # the flow and its trainer subprocess
    process.wait()

    again = agent_rft_pipeline(**pipeline_parameters(config))
    assert {k for k, v in again["stages"].items() if v["cached"]} == {
        "validate_data", "baseline", "prompt_optimization"}
    [run_dir] = list(training.iterdir())
    assert "resumed from" in (run_dir / "train.log").read_text()
    assert again["outcome"] in ("promoted", "not_promoted")
