"""Stage 2, baseline: the base model, k samples per validation item, and the two gates.

RL learns only from variation in reward: if the base model never solves an item (all
rewards zero) or always scores the same (no headroom), GRPO's advantages are all zero.
So the stage stops the pipeline, with a plain reason, unless a configured share of items
is solved at least once in k tries and the mean best-of-k exceeds the mean score by a
margin. Metrics are `baseline/...`; artifacts are the per-item table, the figures, the
summary, and sample rollouts as MLflow traces.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect import get_run_logger, task

from tasks.cache import stage_cache
from tasks.results import BaselineResult, Gate
from tasks.rollout_eval import evaluate_model, keep_rollouts
from tasks.tracking import RunContext, link_split, log_json, log_metrics, publish_summary, stage_run
from trainer.config.baseline import BaselineConfig
from trainer.data import split_items
from trainer.rollout.evaluate import write_outputs

STAGE = "baseline"


WARM_START_REMEDY = (
    ", or warm-start it: write demonstrations of the task (OpenAI supervised JSONL, one conversation a line: "
    "`messages` with the assistant's `tool_calls` and the `tool` results, and `tools`) and set "
    "warm_start.demonstrations_file (docs/never-calls.md)"
)


def baseline_gates(metrics: dict[str, float], gates: BaselineConfig, *, warm_started: bool = False) -> dict[str, Gate]:
    """Each gate's value, limit and verdict (from `baseline/...` metrics); the nonzero gate
    names the warm start as a remedy unless the model is already `warm_started`."""
    share = metrics["baseline/nonzero_best_share"]
    headroom = metrics["baseline/headroom"]
    return {
        "nonzero_baseline": Gate(
            value=share, limit=gates.min_nonzero_share, passed=share >= gates.min_nonzero_share,
            what=f"only {share:.0%} of items are solved at least once in {gates.k} tries (gate: "
            f"{gates.min_nonzero_share:.0%}); RL cannot learn from all-zero rewards: improve the prompt, the tools or "
            "the base model first" + ("" if warm_started else WARM_START_REMEDY),
        ),
        "headroom": Gate(
            value=headroom, limit=gates.min_headroom, passed=headroom >= gates.min_headroom,
            what=f"best-of-{gates.k} is only {headroom:.3f} above the mean score (gate: {gates.min_headroom}); with "
            "no variation between samples GRPO has nothing to learn from",
        ),
    }


@task(name=STAGE, persist_result=True, cache_policy=stage_cache(__name__))
def baseline(model_path: str, *, model: Any, data: Any, tools: Any, grader: dict[str, Any], rollout: Any,
             penalties: Any, gates: BaselineConfig, traces: int, work_dir: str, ctx: RunContext,
             run_name: str = STAGE) -> BaselineResult:
    """Evaluate the base model on validation items; the result says whether the gates passed.
    `run_name` names its MLflow run: `baseline_after_warm_start` measures the warm-started model."""
    logger = get_run_logger()
    sections = {"model": model, "data": data, "tools": tools, "grader": grader, "rollout": rollout,
                "penalties": penalties, "baseline": gates}
    with stage_run(ctx, run_name, sections) as (client, run_id):
        link_split(ctx, run_id, data, "validation")
        items = split_items(data, "validation", gates.max_items)
        summary, records = evaluate_model(
            model_path, items, tracking_uri=ctx.tracking_uri, model_section=model, tools=tools, grader=grader, rollout=rollout,
            penalties=penalties, k=gates.k, seed=gates.seed, prefix="baseline", log=logger.info,
        )
        for path in write_outputs(summary, records, Path(work_dir) / run_name / run_id).values():
            client.log_artifact(run_id, str(path))
        keep_rollouts(ctx, run_id, records, kind="baseline", n=traces, items=items)
        log_metrics(client, run_id, summary.metrics)
        result = BaselineResult(run_id=run_id, model=model_path, metrics=summary.metrics,
                                gates=baseline_gates(summary.metrics, gates, warm_started=run_name != STAGE))
        client.set_tag(run_id, "gates", "passed" if result.passed else "failed: " + result.reason[:4000])
        log_json(client, run_id, {name: gate.model_dump() for name, gate in result.gates.items()}, "gates.json")
        m = summary.metrics
        publish_summary(
            ctx, run_name, run_id,
            f"# {'Baseline' if run_name == STAGE else 'Baseline after the warm start'}\n\nModel `{model_path}`, {len(items)} validation items x {gates.k} samples.\n\n"
            "| metric | value |\n| --- | ---: |\n"
            + "".join(f"| {name} | {m[name]:.4g} |\n" for name in (
                "baseline/score_mean", "baseline/best_of_k_mean", "baseline/nonzero_best_share",
                "baseline/tool_calls_mean", "baseline/tokens_mean", "baseline/latency_s_mean"))
            + ("\nGates passed.\n" if result.passed else f"\nGates FAILED: {result.reason}\n"),
        )
    return result
