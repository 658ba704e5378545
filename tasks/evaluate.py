"""Stage 5, regression_eval: the candidate against the baseline and the champion, on test.

This stage, and the promotion decision it feeds, are the only readers of the test split:
every choice before it (the prompt variant, the checkpoint) was made on validation items.
All models run on the same test items with the same seeds and k samples, under the
winning prompt variant, so the comparison is paired item by item. The score gain gets a
paired bootstrap 95% interval (items resampled with replacement); tool calls, tokens and
latency get relative changes (p50 and p95 for latency); with `promotion.group_by`, each
group of items gets its gain. Gates from `promotion`: the interval's lower bound above
`min_gain_lower_bound` against the baseline and against the champion when there is one,
no more tool calls, tokens or latency than the allowed increases (from a base below its
floor, `tool_calls_floor` and the like, where a relative change measures little, the rise
in absolute terms against the allowed increase of the floor), at most `max_tool_calls_mean`,
`max_tokens_mean` and `max_latency_s_p50` where they are set, no group falling beyond
`max_group_drop` (skipped, and said so, without `group_by`), and the candidate no more of its paid rollouts hacked than the base model's, beyond
`max_hack_share_increase`: a rollout counts where its answer has a hack's shape (several
numbers, text addressed to the grader, the question echoed) and the grader pays that shape,
stated alone, beyond its plain content (the probe criterion, trainer/graders/probe.py). The
grader's own hackability is measured before training, on validation items (validate_data). The report (markdown) carries every figure
plus the before/after tool-call histogram and the reward-versus-tool-calls plot; sample
rollouts of each model are MLflow traces, and the candidate's metrics are linked to its
logged model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from prefect import get_run_logger, task

from tasks.cache import stage_cache
from tasks.ledger import ledger_path, record_reading, tag_run
from tasks.results import Candidate, Gate, RegressionResult
from tasks.rollout_eval import apply_variant, evaluate_model, keep_rollouts
from tasks.tracking import (
    RunContext,
    link_split,
    log_json,
    log_metrics,
    log_text,
    publish_summary,
    stage_run,
)
from trainer.config.promotion import PromotionConfig
from trainer.data import split_items
from trainer.plots import plot_reward_vs_tool_calls, plot_tool_calls
from trainer.rollout.evaluate import EvalSummary, write_outputs

STAGE = "regression_eval"
COMPARED = ("score_mean", "tool_calls_mean", "tokens_mean", "latency_s_p50", "latency_s_p95")


_BOOTSTRAP_DRAWS_AT_ONCE = 4_000_000  # item indices drawn per chunk (32 MB)


def paired_bootstrap(before: dict[str, float], after: dict[str, float], *, samples: int, seed: int) -> dict[str, float]:
    """Mean per-item gain (after - before) over the items both scored, and its 95%
    percentile-bootstrap interval (items resampled with replacement)."""
    shared = sorted(set(before) & set(after))
    gains = np.array([after[i] - before[i] for i in shared], dtype=float)
    if not len(gains):
        return {"gain": 0.0, "low": 0.0, "high": 0.0, "items": 0}
    rng = np.random.default_rng(seed)
    means = np.empty(samples)
    per_chunk = max(1, _BOOTSTRAP_DRAWS_AT_ONCE // len(gains))  # bounded memory on a large test split
    for start in range(0, samples, per_chunk):
        size = min(per_chunk, samples - start)
        means[start : start + size] = gains[rng.integers(0, len(gains), size=(size, len(gains)))].mean(axis=1)
    return {"gain": float(gains.mean()), "low": float(np.percentile(means, 2.5)),
            "high": float(np.percentile(means, 97.5)), "items": len(gains)}


def _per_item(summary: EvalSummary) -> dict[str, float]:
    return {item.item_id: item.mean for item in summary.items if item.scored}


def relative_change(before: float, after: float) -> float:
    return (after - before) / before if before else (0.0 if after == before else float("inf"))


def compare(before: tuple[EvalSummary, str], after: tuple[EvalSummary, str], *, samples: int,
            seed: int) -> dict[str, Any]:
    """Paired comparison of two evaluations (`(summary, metric prefix)`)."""
    (b, bp), (a, ap) = before, after
    gain = paired_bootstrap(_per_item(b), _per_item(a), samples=samples, seed=seed)
    changes = {name: {"before": b.metrics[f"{bp}/{name}"], "after": a.metrics[f"{ap}/{name}"],
                      "absolute": a.metrics[f"{ap}/{name}"] - b.metrics[f"{bp}/{name}"],
                      "relative": relative_change(b.metrics[f"{bp}/{name}"], a.metrics[f"{ap}/{name}"])}
               for name in COMPARED}
    groups = {name: a.group_means.get(name, 0.0) - value for name, value in b.group_means.items()}
    return {"score_gain": gain, "changes": changes, "group_gain": groups}


# The relative gates: the compared metric, its allowed relative increase, the floor of its base
# and the absolute gate beside it (PromotionConfig's field names), and its unit.
COST_GATES = {
    "tool_calls": ("tool_calls_mean", "max_tool_calls_increase", "tool_calls_floor", "max_tool_calls_mean",
                   "tool calls per rollout"),
    "tokens": ("tokens_mean", "max_tokens_increase", "tokens_floor", "max_tokens_mean",
               "generated tokens per rollout"),
    "latency_p50": ("latency_s_p50", "max_latency_increase", "latency_floor_s", "max_latency_s_p50",
                    "seconds of latency p50"),
}


def cost_gate(change: dict[str, float], max_increase: float, floor: float, unit: str, increase_key: str,
              floor_key: str) -> Gate:
    """A cost's relative change against its allowed increase; from a base below `floor` (where a
    relative change measures little: +900% for one call a question over 24 calls in 240
    rollouts, infinite over none) its absolute rise against `max_increase` x `floor`."""
    before, after = change["before"], change["after"]
    if before >= floor:
        return Gate(value=change["relative"], limit=max_increase, passed=change["relative"] <= max_increase,
                    what=f"relative change of {unit} ({before:.4g} -> {after:.4g})")
    rise, allowed = after - before, max_increase * floor
    return Gate(value=rise, limit=allowed, passed=rise <= allowed + 1e-12,
                what=f"rise of {unit}, in absolute terms: the base model's {before:.4g} is below promotion."
                     f"{floor_key} ({floor:g}), where a relative change measures little, so the rise "
                     f"({before:.4g} -> {after:.4g}) is held to {increase_key} x {floor_key}")


def regression_gates(vs_baseline: dict[str, Any], vs_champion: dict[str, Any] | None,
                     hacks: dict[str, Any] | None, p: PromotionConfig) -> dict[str, Gate]:
    ch = vs_baseline["changes"]
    low = vs_baseline["score_gain"]["low"]
    gates = {
        "gain_vs_baseline": Gate(value=low, limit=p.min_gain_lower_bound, passed=low > p.min_gain_lower_bound,
                                 what="lower bound of the 95% interval of the score gain over the baseline"),
    }
    for name, (metric, increase, floor, _, unit) in COST_GATES.items():
        gates[name] = cost_gate(ch[metric], getattr(p, increase), getattr(p, floor), unit, increase, floor)
    for name, (metric, _, _, absolute, unit) in COST_GATES.items():
        ceiling = getattr(p, absolute)
        if ceiling is not None:
            after = ch[metric]["after"]
            gates[f"{name}_absolute"] = Gate(value=after, limit=ceiling, passed=after <= ceiling,
                                             what=f"the candidate's {unit} (promotion.{absolute})")
    if p.group_by:
        worst, drop = min(vs_baseline["group_gain"].items(), key=lambda kv: kv[1], default=("none", 0.0))
        gates["groups"] = Gate(value=drop, limit=-p.max_group_drop, passed=drop >= -p.max_group_drop,
                               what=f"score change of the worst {p.group_by} ({worst})")
    if vs_champion is not None:
        low = vs_champion["score_gain"]["low"]
        gates["gain_vs_champion"] = Gate(value=low, limit=p.min_gain_lower_bound, passed=low > p.min_gain_lower_bound,
                                         what="lower bound of the 95% interval of the score gain over the champion")
    if hacks is not None:
        rise = hacks["candidate"]["share"] - hacks["baseline"]["share"]
        gates["hack_patterns"] = Gate(
            value=rise, limit=p.max_hack_share_increase, passed=rise <= p.max_hack_share_increase,
            what=f"rise of the hack-shaped share of paid rollouts ({hacks['candidate']['share']:.1%} of "
                 f"{hacks['candidate']['paid']} against the base model's {hacks['baseline']['share']:.1%} of "
                 f"{hacks['baseline']['paid']})")
    return gates


def report_markdown(results: dict[str, Any], gates: dict[str, Gate], group_by: str | None) -> str:
    lines = ["# Regression evaluation", "", f"Candidate `{results['candidate']}` on {results['items']} test items "
             f"x {results['k']} samples, paired with the baseline"
             + (" and the champion." if results["vs_champion"] else "."), ""]
    for label, comparison in (("baseline", results["vs_baseline"]), ("champion", results["vs_champion"])):
        if not comparison:
            continue
        g = comparison["score_gain"]
        lines += [f"## Against the {label}", "",
                  f"Score gain {g['gain']:+.4f}, 95% interval [{g['low']:+.4f}, {g['high']:+.4f}] over {g['items']} items.",
                  "", f"| metric | {label} | candidate | change |", "| --- | ---: | ---: | ---: |"]
        lines += [f"| {name} | {c['before']:.4g} | {c['after']:.4g} | {c['relative']:+.1%} ({c['after'] - c['before']:+.4g}) |"
                  for name, c in comparison["changes"].items()]
        if group_by:
            lines += ["", f"| {group_by} | gain |", "| --- | ---: |"]
            lines += [f"| {name} | {gain:+.4f} |" for name, gain in comparison["group_gain"].items()]
        lines.append("")
    if not group_by:
        lines += ["The per-group gate is skipped: `promotion.group_by` names no field.", ""]
    lines += ["## Gates", "", "| gate | value | limit | passed |", "| --- | ---: | ---: | --- |"]
    lines += [f"| {name} ({gate.what}) | {gate.value:.4g} | {gate.limit:.4g} | {'yes' if gate.passed else 'NO'} |"
              for name, gate in gates.items()]
    return "\n".join(lines) + "\n"


@task(name=STAGE, persist_result=True, cache_policy=stage_cache(__name__))
def regression_eval(base_model: str, candidate: Candidate, champion: dict[str, Any] | None, *, model: Any,
                    data: Any, tools: Any, grader: dict[str, Any], rollout: Any, penalties: Any,
                    promotion: PromotionConfig, variant: dict[str, Any] | None, seed: int, traces: int,
                    work_dir: str, ctx: RunContext) -> RegressionResult:
    """Evaluate candidate, baseline and champion on the same test items; apply the gates."""
    from trainer.graders.probe import hack_share

    logger = get_run_logger()
    p = promotion
    items = split_items(data, "test", p.max_items)
    rollout, tools = apply_variant(rollout, tools, variant, items)
    sections = {"model": model, "data": data, "tools": tools, "grader": grader, "rollout": rollout,
                "penalties": penalties, "promotion": promotion}
    with stage_run(ctx, STAGE, sections) as (client, run_id):
        link_split(ctx, run_id, data, "test")
        out = Path(work_dir) / STAGE / run_id
        runs = {"candidate": candidate.path if Path(candidate.path).exists() else candidate.model_uri,
                "baseline": base_model}
        if champion is not None:
            runs["champion"] = champion["uri"]
        evaluated: dict[str, tuple[EvalSummary, list[Any]]] = {}
        for name, path in runs.items():
            logger.info("regression_eval: %s on %d test items x %d", name, len(items), p.k)
            summary, records = evaluate_model(
                path, items, tracking_uri=ctx.tracking_uri, model_section=model, tools=tools, grader=grader, rollout=rollout,
                penalties=penalties, k=p.k, seed=seed, prefix=name, group_by=p.group_by, log=logger.info,
            )
            evaluated[name] = (summary, records)
            log_metrics(client, run_id, summary.metrics, model_id=candidate.model_id if name == "candidate" else None)
            for artifact in write_outputs(summary, records, out / name).values():
                client.log_artifact(run_id, str(artifact), name)
            keep_rollouts(ctx, run_id, records, kind=name, n=traces, items=items)
        bootstrap = {"samples": p.bootstrap_samples, "seed": seed}
        vs_baseline = compare((evaluated["baseline"][0], "baseline"), (evaluated["candidate"][0], "candidate"),
                              **bootstrap)
        vs_champion = (compare((evaluated["champion"][0], "champion"), (evaluated["candidate"][0], "candidate"),
                               **bootstrap) if champion is not None else None)
        hacks = None
        if p.check_hack_patterns:
            by_id = {str(item["id"]): item for item in items}
            hacks = {name: hack_share(evaluated[name][1], by_id, grader) for name in ("candidate", "baseline")}
            log_json(client, run_id, hacks, "hack_patterns.json")
        gates = regression_gates(vs_baseline, vs_champion, hacks, p)
        results = {"candidate": candidate.model_uri, "items": len(items), "k": p.k, "vs_baseline": vs_baseline,
                   "vs_champion": vs_champion, "gates": {name: gate.model_dump() for name, gate in gates.items()}}
        g = vs_baseline["score_gain"]
        log_metrics(client, run_id, {"regression/gain": g["gain"], "regression/gain_low": g["low"],
                                     "regression/gain_high": g["high"],
                                     "regression/gates_passed": float(all(x.passed for x in gates.values()))},
                    model_id=candidate.model_id)
        logger.info("regression_eval: the report and its figures")
        # The config's name, as every other reader records it (not the MLflow experiment's)
        name = ctx.config_name or client.get_run(ctx.parent_run_id).info.run_name
        found = record_reading(data, command="regression_eval", config=name, config_hash=ctx.config_hash,
                               config_written_hash=ctx.config_written_hash, model=candidate.model_uri, git_commit=ctx.git_commit, mlflow_run_id=run_id)
        tag_run(client, run_id, found)
        markdown = report_markdown(results, gates, p.group_by)
        if found is not None:
            markdown += f"\n{found.sentence()} Ledger: {ledger_path(data)}.\n"
            logger.info("regression_eval: %s", found.sentence())
        log_text(client, run_id, markdown, "regression_report.md")
        log_json(client, run_id, results, "regression_report.json")
        figures = {name: evaluated[name][1] for name in runs}
        for figure in (plot_tool_calls(figures, out / "tool_calls_before_after.png"),
                       plot_reward_vs_tool_calls(figures, out / "reward_vs_tool_calls.png")):
            client.log_artifact(run_id, str(figure))
        publish_summary(ctx, STAGE, run_id, markdown)
    before_after = {name: {"baseline": c["before"], "candidate": c["after"]} for name, c in vs_baseline["changes"].items()}
    return RegressionResult(run_id=run_id, gates=gates, score_gain=g, before_after=before_after,
                            champion_version=champion["version"] if champion else None,
                            readings=found.sentence() if found is not None else None)
