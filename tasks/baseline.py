"""Stage 2, baseline: the base model, k samples per held-out item, and the two gates.

RL learns only from variation in reward: if the base model never solves an item (all
rewards zero) or always scores the same (no headroom), GRPO's advantages are all zero.
So the stage stops the pipeline, with a plain reason, unless a configured share of items
is solved at least once in k tries and the mean best-of-k exceeds the mean score by a
margin. Metrics are `baseline/...`; artifacts are the per-item table, the figures, the
summary and sample rollouts.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect import task

from tasks.rollout_eval import eval_items, evaluate_model, sample_rollouts
from tasks.tracking import RunContext, log_json, log_metrics, publish_summary, stage_run
from tasks.versioning import STAGES
from trainer.config import PipelineConfig
from trainer.evaluate import write_outputs

STAGE = STAGES[1]


def baseline_gates(metrics: dict[str, float], config: PipelineConfig) -> dict[str, dict[str, Any]]:
    """Each gate's value, limit and verdict (from `baseline/...` metrics)."""
    share = metrics["baseline/nonzero_best_share"]
    headroom = metrics["baseline/headroom"]
    gates = config.baseline
    return {
        "nonzero_baseline": {
            "value": share, "limit": gates.min_nonzero_share, "passed": share >= gates.min_nonzero_share,
            "reason": f"only {share:.0%} of items are solved at least once in {gates.k} tries "
            f"(gate: {gates.min_nonzero_share:.0%}); RL cannot learn from all-zero rewards: "
            "improve the prompt, the tools or the base model first",
        },
        "headroom": {
            "value": headroom, "limit": gates.min_headroom, "passed": headroom >= gates.min_headroom,
            "reason": f"best-of-{gates.k} is only {headroom:.3f} above the mean score "
            f"(gate: {gates.min_headroom}); with no variation between samples GRPO has nothing to learn from",
        },
    }


@task(name="baseline", persist_result=True, cache_key_fn=lambda _ctx, params: params["stage_key"])
def baseline(config: PipelineConfig, ctx: RunContext, stage_key: str, model_path: str) -> dict[str, Any]:
    """Evaluate the base model; the result says whether the gates passed and why not."""
    with stage_run(ctx, STAGE, config) as (client, run_id):
        items = eval_items(config, config.baseline.max_items)
        summary, records = evaluate_model(
            config, model_path, items, k=config.baseline.k, seed=config.baseline.seed, prefix="baseline"
        )
        out = Path(config.work_dir) / STAGE / stage_key
        for path in write_outputs(summary, records, out).values():
            client.log_artifact(run_id, str(path))
        log_json(client, run_id, sample_rollouts(records), "sample_rollouts.json")
        log_metrics(client, run_id, summary.metrics)
        gates = baseline_gates(summary.metrics, config)
        failed = [gate["reason"] for gate in gates.values() if not gate["passed"]]
        client.set_tag(run_id, "gates", "passed" if not failed else "failed: " + "; ".join(failed)[:4000])
        log_json(client, run_id, gates, "gates.json")
        m = summary.metrics
        publish_summary(
            ctx, STAGE, run_id,
            f"# Baseline\n\nModel `{model_path}`, {len(items)} items x {config.baseline.k} samples.\n\n"
            f"| metric | value |\n| --- | ---: |\n"
            + "".join(f"| {name} | {m[name]:.4g} |\n" for name in (
                "baseline/score_mean", "baseline/best_of_k_mean", "baseline/nonzero_best_share",
                "baseline/tool_calls_mean", "baseline/tokens_mean", "baseline/latency_s_mean"))
            + ("\nGates passed.\n" if not failed else "\nGates FAILED:\n\n" + "".join(f"- {r}\n" for r in failed)),
        )
    return {"run_id": run_id, "model": model_path, "metrics": summary.metrics, "gates": gates,
            "passed": not failed, "reason": "; ".join(failed)}
