"""Stage 3, prompt_optimization: prompt and task changes before any training.

Practitioners' advice, and the reason this stage exists: RFT is for when prompting is
exhausted. Each configured variant (system prompt, tool subset, tool descriptions,
tool-call budget) runs on the base model with k samples per validation item, next to the
config as it is ("current"). The best by mean score wins, ties going to fewer tool calls.
If it reaches `target_score`, the pipeline ends with "RFT not needed"; otherwise training
runs with the winner's settings. The comparison table is logged as an artifact.
"""

from __future__ import annotations

from typing import Any

from prefect import get_run_logger, task

from tasks.cache import stage_cache
from tasks.results import PromptResult
from tasks.rollout_eval import apply_variant, evaluate_model
from tasks.tracking import (
    RunContext,
    link_split,
    log_json,
    log_metrics,
    log_text,
    publish_summary,
    stage_run,
)
from trainer.config.baseline import PromptOptimizationConfig
from trainer.data import split_items

STAGE = "prompt_optimization"
COLUMNS = ("score_mean", "best_of_k_mean", "tool_calls_mean", "tokens_mean", "latency_s_mean")


def pick_best(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Highest mean score; among equal scores, the fewest tool calls; then the first."""
    return min(rows, key=lambda row: (-round(row["score_mean"], 9), row["tool_calls_mean"]))


def comparison_markdown(rows: list[dict[str, Any]], best: str, target: float) -> str:
    lines = ["| variant | " + " | ".join(COLUMNS) + " |", "| --- | " + " | ".join("---:" for _ in COLUMNS) + " |"]
    for row in rows:
        mark = " (best)" if row["variant"] == best else ""
        lines.append(f"| {row['variant']}{mark} | " + " | ".join(f"{row[c]:.4g}" for c in COLUMNS) + " |")
    return f"Target mean score: {target}.\n\n" + "\n".join(lines) + "\n"


@task(name=STAGE, persist_result=True, cache_policy=stage_cache(__name__))
def prompt_optimization(model_path: str, *, model: Any, data: Any, tools: Any, grader: dict[str, Any],
                        rollout: Any, penalties: Any, options: PromptOptimizationConfig, seed: int,
                        ctx: RunContext) -> PromptResult:
    """Evaluate the variants on validation items; say which wins and whether RFT is needed."""
    logger = get_run_logger()
    sections = {"model": model, "data": data, "tools": tools, "grader": grader, "rollout": rollout,
                "penalties": penalties, "prompt_optimization": options}
    with stage_run(ctx, STAGE, sections) as (client, run_id):
        link_split(ctx, run_id, data, "validation")
        items = split_items(data, "validation", options.max_items)
        candidates: list[tuple[str, dict[str, Any] | None]] = [("current", None)]
        candidates += [(v.name, v.model_dump()) for v in options.variants]
        rows = []
        for name, variant in candidates:
            varied_rollout, varied_tools = apply_variant(rollout, tools, variant, items)
            summary, _ = evaluate_model(
                model_path, items, tracking_uri=ctx.tracking_uri, model_section=model, tools=varied_tools, grader=grader,
                rollout=varied_rollout, penalties=penalties, k=options.k, seed=seed, prefix="variant",
                log=logger.info,
            )
            row = {"variant": name, "settings": variant, **{c: summary.metrics[f"variant/{c}"] for c in COLUMNS}}
            rows.append(row)
            log_metrics(client, run_id, {f"prompt_optimization/{name}/{c}": row[c] for c in COLUMNS})
        best = pick_best(rows)
        rft_needed = best["score_mean"] < options.target_score
        log_metrics(client, run_id, {
            "prompt_optimization/best_score_mean": best["score_mean"],
            "prompt_optimization/best_tool_calls_mean": best["tool_calls_mean"],
            "prompt_optimization/rft_needed": float(rft_needed),
        })
        client.set_tag(run_id, "best_variant", best["variant"])
        table = comparison_markdown(rows, best["variant"], options.target_score)
        log_text(client, run_id, table, "variants.md")
        log_json(client, run_id, rows, "variants.json")
        verdict = (
            f"RFT needed: the best variant scores {best['score_mean']:.3f} < target {options.target_score}."
            if rft_needed else
            f"RFT not needed: variant `{best['variant']}` reaches {best['score_mean']:.3f} >= target "
            f"{options.target_score}."
        )
        publish_summary(ctx, STAGE, run_id, f"# Prompt and task variants\n\n{table}\n{verdict}\n")
    return PromptResult(run_id=run_id, best_variant=best["settings"], best_name=best["variant"],
                        best_metrics={c: best[c] for c in COLUMNS}, rft_needed=rft_needed, verdict=verdict,
                        table=rows)
