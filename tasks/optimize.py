"""Stage 3, prompt_optimization: prompt and task changes before any training.

Practitioners' advice, and the reason this stage exists: RFT is for when prompting is
exhausted. Each configured variant (system prompt, tool subset, tool descriptions,
tool-call budget) runs on the base model with k samples per item, next to the config as it
is ("current"). The best by mean score wins, ties going to fewer tool calls. If it reaches
`target_score`, the pipeline ends with "RFT not needed"; otherwise training runs with the
winner's settings. The comparison table is logged as an artifact.
"""

from __future__ import annotations

from typing import Any

from prefect import task

from tasks.rollout_eval import apply_variant, eval_items, evaluate_model
from tasks.tracking import RunContext, log_json, log_metrics, log_text, publish_summary, stage_run
from tasks.versioning import STAGES
from trainer.config import PipelineConfig

STAGE = STAGES[2]
_COLUMNS = ("score_mean", "best_of_k_mean", "tool_calls_mean", "tokens_mean", "latency_s_mean")


def pick_best(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Highest mean score; among equal scores, the fewest tool calls; then the first."""
    return min(rows, key=lambda row: (-round(row["score_mean"], 9), row["tool_calls_mean"]))


def comparison_markdown(rows: list[dict[str, Any]], best: str, target: float) -> str:
    lines = [
        "| variant | " + " | ".join(_COLUMNS) + " |",
        "| --- | " + " | ".join("---:" for _ in _COLUMNS) + " |",
    ]
    for row in rows:
        mark = " (best)" if row["variant"] == best else ""
        lines.append(f"| {row['variant']}{mark} | " + " | ".join(f"{row[c]:.4g}" for c in _COLUMNS) + " |")
    return f"Target mean score: {target}.\n\n" + "\n".join(lines) + "\n"


@task(name="prompt_optimization", persist_result=True, cache_key_fn=lambda _ctx, params: params["stage_key"])
def prompt_optimization(
    config: PipelineConfig, ctx: RunContext, stage_key: str, model_path: str
) -> dict[str, Any]:
    """Evaluate the variants; say which wins and whether RFT is still needed."""
    options = config.prompt_optimization
    with stage_run(ctx, STAGE, config) as (client, run_id):
        items = eval_items(config, options.max_items)
        candidates: list[tuple[str, dict[str, Any] | None]] = [("current", None)]
        candidates += [(v.name, v.model_dump()) for v in options.variants]
        rows = []
        for name, variant in candidates:
            summary, _ = evaluate_model(
                apply_variant(config, variant), model_path, items,
                k=options.k, seed=config.baseline.seed, prefix="variant",
            )
            row = {"variant": name, "settings": variant}
            row.update({c: summary.metrics[f"variant/{c}"] for c in _COLUMNS})
            rows.append(row)
            log_metrics(client, run_id, {f"prompt_optimization/{name}/{c}": row[c] for c in _COLUMNS})
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
            if rft_needed
            else f"RFT not needed: variant `{best['variant']}` reaches {best['score_mean']:.3f} >= target "
            f"{options.target_score}."
        )
        publish_summary(ctx, STAGE, run_id, f"# Prompt and task variants\n\n{table}\n{verdict}\n")
    return {"run_id": run_id, "best_variant": best["settings"], "best_name": best["variant"],
            "best_metrics": {c: best[c] for c in _COLUMNS}, "rft_needed": rft_needed, "verdict": verdict,
            "table": rows}
