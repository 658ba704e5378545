"""How much of a pipeline run is bookkeeping: Prefect, MLflow and everything else that is
not rollouts, training or evaluation, as a share of the run's wall time.

The pipeline (flows/pipeline.py) runs once on the micro preset of the pipeline tests
(tests/pipeline_world.py: two training, two validation and six test items under a DVC pin,
baseline k = 2, three GRPO steps, promotion k = 4, the default promotion gates) with the taught model of
benchmarks/taught_world.py (which knows all of these items), Prefect in its ephemeral
mode under a fresh PREFECT_HOME (as `make demo` runs it) and MLflow on a SQLite file.
Compute is the time inside `run_evaluation` (every baseline, prompt-variant and
regression rollout goes through it) plus the training steps as the trainer timed them
(`timing/step_s` of its metrics: rollouts, update, in-training evaluation). The rest,
bookkeeping, includes starting Prefect's server, MLflow runs, params, tags, artifacts and
the registry, data validation, model loading, and the training subprocess's start.
Those are mostly fixed costs (~30 s here), so the share falls as the job grows: the micro
preset has seconds of compute, the demo has twenty minutes (its stage times are in the
README).

    python -m benchmarks.bench_pipeline [--json out.json]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.taught_world import REPO, TaughtWorld, taught_world
from envs.finqa.local import local_tool_endpoints
from tasks.data_version import add, init
from tests.pipeline_world import micro
from tests.taught_model import OUTPUT_CHARS, copy_items
from trainer.data import read_jsonl

SPLITS = {"train": 2, "validation": 2, "test": 6}  # the pipeline tests' layout


def pipeline_world(root: Path, world: TaughtWorld) -> Path:
    """The micro preset's data layout, from the taught world's splits, pinned by DVC."""
    data = root / "data"
    data.mkdir(parents=True)
    for split, count in SPLITS.items():
        copy_items(REPO / "data", world.items(split)[:count], data, f"{split}.jsonl")
    init(root)
    add(data)
    return root


def stage_seconds(tracking_uri: str, parent_run_id: str) -> dict[str, float]:
    """Wall seconds of each stage's MLflow run."""
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri)
    experiment = client.get_run(parent_run_id).info.experiment_id
    runs = client.search_runs([experiment], filter_string=f"tags.mlflow.parentRunId = '{parent_run_id}'")
    return {run.info.run_name: (run.info.end_time - run.info.start_time) / 1000 for run in runs}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)

    world = taught_world()  # the model knows every item of the micro preset
    with tempfile.TemporaryDirectory(prefix="bench_pipeline_") as tmp_dir:
        tmp = Path(tmp_dir)
        os.environ["PREFECT_HOME"] = str(tmp / "prefect-home")  # before Prefect is imported
        os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
        # Prefect's 20 s default is too short for its ephemeral server on two busy cores; the
        # wait counts as bookkeeping either way.
        os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
        import tasks.rollout_eval
        from flows.pipeline import agent_rft_pipeline, pipeline_parameters

        # Count the time every evaluation spends in its rollouts.
        rollout_s: list[float] = []
        evaluation = tasks.rollout_eval.run_evaluation

        @functools.wraps(evaluation)
        def timed_evaluation(*a: Any, **kw: Any) -> Any:
            started = time.perf_counter()
            try:
                return evaluation(*a, **kw)
            finally:
                rollout_s.append(time.perf_counter() - started)

        tasks.rollout_eval.run_evaluation = timed_evaluation
        root = pipeline_world(tmp / "world", world)
        with local_tool_endpoints(root / "data" / "corpus", max_output_chars=OUTPUT_CHARS) as endpoints:
            config = micro(root, endpoints, world.model)
            started = time.perf_counter()
            outcome = agent_rft_pipeline(**pipeline_parameters(config))
            wall_s = time.perf_counter() - started
        tasks.rollout_eval.run_evaluation = evaluation

        steps = [row for path in (root / "runs").rglob("metrics.jsonl") for row in read_jsonl(path)]
        training_s = sum(row.get("timing/step_s") or row.get("timing/eval_s") or 0.0 for row in steps)
        stages = stage_seconds(config.mlflow.tracking_uri, outcome["parent_run_id"])

    compute_s = sum(rollout_s) + training_s
    results = {
        "outcome": outcome["outcome"], "wall_s": wall_s, "rollouts_and_eval_s": sum(rollout_s),
        "evaluations": len(rollout_s), "training_steps_s": training_s, "compute_s": compute_s,
        "bookkeeping_s": wall_s - compute_s, "bookkeeping_share": (wall_s - compute_s) / wall_s,
        "stage_s": stages,
    }
    print(f"\npipeline on the micro preset: {results['outcome']} in {wall_s:.1f} s")
    print(f"  rollouts and evaluation {sum(rollout_s):.1f} s ({len(rollout_s)} evaluations), training steps "
          f"{training_s:.1f} s; bookkeeping {results['bookkeeping_s']:.1f} s = "
          f"{results['bookkeeping_share']:.1%} of the wall time (goal <= 5%)")
    print("  stage runs (s): " + ", ".join(f"{k} {v:.1f}" for k, v in stages.items()))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return results


if __name__ == "__main__":
    main()
