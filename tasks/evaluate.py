"""Stage 5, regression_eval: the candidate against the baseline and the champion.

All models run on the same held-out items with the same seeds and k samples, under the
winning prompt variant, so the comparison is paired item by item. The score gain gets a
paired bootstrap 95% interval (items resampled with replacement); tool calls, tokens and
latency get relative changes (p50 and p95 for latency); each category gets its gain. Gates
from `promotion`: the interval's lower bound above `min_gain_lower_bound` against the
baseline and against the champion when there is one, no more tool calls, tokens or latency
than the allowed increases, no category falling beyond its tolerance, and the grader's
reward-hacking probes all scoring at most 0.1. The report (markdown) carries every figure
plus the before/after tool-call histogram and the reward-versus-tool-calls plot.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from prefect import task

from tasks.rollout_eval import apply_variant, eval_items, evaluate_model
from tasks.tracking import RunContext, log_json, log_metrics, log_text, publish_summary, stage_run
from tasks.versioning import STAGES
from trainer.config import PipelineConfig
from trainer.evaluate import EvalSummary, write_outputs
from trainer.rollout import RolloutRecord

STAGE = STAGES[4]
_COMPARED = ("score_mean", "tool_calls_mean", "tokens_mean", "latency_s_p50", "latency_s_p95")


def paired_bootstrap(before: dict[str, float], after: dict[str, float], *, samples: int, seed: int) -> dict[str, float]:
    """Mean per-item gain (after - before) and its 95% bootstrap interval over items."""
    shared = sorted(set(before) & set(after))
    gains = np.array([after[i] - before[i] for i in shared], dtype=float)
    if not len(gains):
        return {"gain": 0.0, "low": 0.0, "high": 0.0, "items": 0}
    rng = np.random.default_rng(seed)
    means = gains[rng.integers(0, len(gains), size=(samples, len(gains)))].mean(axis=1)
    return {"gain": float(gains.mean()), "low": float(np.percentile(means, 2.5)),
            "high": float(np.percentile(means, 97.5)), "items": len(gains)}


def _per_item(summary: EvalSummary) -> dict[str, float]:
    return {item.item_id: item.mean for item in summary.items if item.scored}


def _relative(before: float, after: float) -> float:
    return (after - before) / before if before else (0.0 if after == before else float("inf"))


def compare(before: tuple[EvalSummary, str], after: tuple[EvalSummary, str], config: PipelineConfig) -> dict[str, Any]:
    """Paired comparison of two evaluations (`(summary, metric prefix)`)."""
    (b, bp), (a, ap) = before, after
    gain = paired_bootstrap(_per_item(b), _per_item(a), samples=config.promotion.bootstrap_samples,
                            seed=config.baseline.seed)
    changes = {name: {"before": b.metrics[f"{bp}/{name}"], "after": a.metrics[f"{ap}/{name}"],
                      "relative": _relative(b.metrics[f"{bp}/{name}"], a.metrics[f"{ap}/{name}"])}
               for name in _COMPARED}
    categories = {name: a.category_means.get(name, 0.0) - value for name, value in b.category_means.items()}
    return {"score_gain": gain, "changes": changes, "category_gain": categories}


def regression_gates(vs_baseline: dict[str, Any], vs_champion: dict[str, Any] | None,
                     probes: dict[str, Any] | None, config: PipelineConfig) -> dict[str, dict[str, Any]]:
    p = config.promotion
    ch = vs_baseline["changes"]
    worst_category = min(vs_baseline["category_gain"].items(), key=lambda kv: kv[1], default=("none", 0.0))
    gates = {
        "gain_vs_baseline": (vs_baseline["score_gain"]["low"], p.min_gain_lower_bound,
                             vs_baseline["score_gain"]["low"] > p.min_gain_lower_bound,
                             "lower bound of the 95% interval of the score gain over the baseline"),
        "tool_calls": (ch["tool_calls_mean"]["relative"], p.max_tool_calls_increase,
                       ch["tool_calls_mean"]["relative"] <= p.max_tool_calls_increase, "relative change of tool calls"),
        "tokens": (ch["tokens_mean"]["relative"], p.max_tokens_increase,
                   ch["tokens_mean"]["relative"] <= p.max_tokens_increase, "relative change of generated tokens"),
        "latency_p50": (ch["latency_s_p50"]["relative"], p.max_latency_increase,
                        ch["latency_s_p50"]["relative"] <= p.max_latency_increase, "relative change of latency p50"),
        "categories": (worst_category[1], -p.max_category_drop, worst_category[1] >= -p.max_category_drop,
                       f"score change of the worst category ({worst_category[0]})"),
    }
    if vs_champion is not None:
        low = vs_champion["score_gain"]["low"]
        gates["gain_vs_champion"] = (low, p.min_gain_lower_bound, low > p.min_gain_lower_bound,
                                     "lower bound of the 95% interval of the score gain over the champion")
    if probes is not None:
        gates["reward_hacking_probes"] = (float(len(probes["flagged"])), 0.0, probes["passed"],
                                          f"probes scoring above 0.1 (of {probes['tried']})")
    return {name: {"value": v, "limit": lim, "passed": bool(ok), "what": what}
            for name, (v, lim, ok, what) in gates.items()}


def _figures(records: dict[str, list[RolloutRecord]], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = [out / "tool_calls_before_after.png", out / "reward_vs_tool_calls.png"]
    fig, ax = plt.subplots(figsize=(6, 3.2))
    top = max((len(r.tool_calls) for rs in records.values() for r in rs), default=0)
    bins = np.arange(top + 2) - 0.5
    for name, rs in records.items():
        ax.hist([len(r.tool_calls) for r in rs if r.status != "infra_error"], bins=bins, alpha=0.5, label=name)
    ax.set_xlabel("tool calls per rollout")
    ax.set_ylabel("rollouts")
    ax.legend()
    fig.tight_layout()
    fig.savefig(paths[0], dpi=110)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(6, 3.2))
    rng = np.random.default_rng(0)
    for name, rs in records.items():
        scored = [r for r in rs if r.reward is not None]
        ax.scatter([len(r.tool_calls) + rng.uniform(-0.15, 0.15) for r in scored], [r.reward for r in scored],
                   s=10, alpha=0.6, label=name)
    ax.set_xlabel("tool calls")
    ax.set_ylabel("reward")
    ax.legend()
    fig.tight_layout()
    fig.savefig(paths[1], dpi=110)
    plt.close(fig)
    return paths


def report_markdown(results: dict[str, Any]) -> str:
    lines = ["# Regression evaluation", "", f"Candidate `{results['candidate']}` on {results['items']} items "
             f"x {results['k']} samples, paired with the baseline" + (" and the champion." if results["vs_champion"] else "."), ""]
    for label, comparison in (("baseline", results["vs_baseline"]), ("champion", results["vs_champion"])):
        if not comparison:
            continue
        g = comparison["score_gain"]
        lines += [f"## Against the {label}", "",
                  f"Score gain {g['gain']:+.4f}, 95% interval [{g['low']:+.4f}, {g['high']:+.4f}] over {g['items']} items.",
                  "", f"| metric | {label} | candidate | change |", "| --- | ---: | ---: | ---: |"]
        for name, c in comparison["changes"].items():
            lines.append(f"| {name} | {c['before']:.4g} | {c['after']:.4g} | {c['relative']:+.1%} |")
        lines += ["", "| category | gain |", "| --- | ---: |"]
        lines += [f"| {name} | {gain:+.4f} |" for name, gain in comparison["category_gain"].items()]
        lines.append("")
    lines += ["## Gates", "", "| gate | value | limit | passed |", "| --- | ---: | ---: | --- |"]
    for name, gate in results["gates"].items():
        lines.append(f"| {name} ({gate['what']}) | {gate['value']:.4g} | {gate['limit']:.4g} | {'yes' if gate['passed'] else 'NO'} |")
    return "\n".join(lines) + "\n"


@task(name="regression_eval", persist_result=True, cache_key_fn=lambda _ctx, params: params["stage_key"])
def regression_eval(
    config: PipelineConfig, ctx: RunContext, stage_key: str, *, base_model: str, candidate: dict[str, Any],
    variant: dict[str, Any] | None, champion: dict[str, Any] | None,
) -> dict[str, Any]:
    """Evaluate candidate, baseline and champion on the same items; apply the gates."""
    from trainer.graders.probe import run_probes

    effective = apply_variant(config, variant)
    p = config.promotion
    out = Path(config.work_dir) / STAGE / stage_key
    with stage_run(ctx, STAGE, effective) as (client, run_id):
        items = eval_items(config, p.max_items)
        runs = {"candidate": candidate["path"], "baseline": base_model}
        if champion is not None:
            runs["champion"] = champion["uri"]
        evaluated: dict[str, tuple[EvalSummary, list[RolloutRecord]]] = {}
        for name, model in runs.items():
            summary, records = evaluate_model(effective, model, items, k=p.k, seed=config.baseline.seed, prefix=name)
            evaluated[name] = (summary, records)
            log_metrics(client, run_id, summary.metrics)
            for path in write_outputs(summary, records, out / name).values():
                client.log_artifact(run_id, str(path), name)
        vs_baseline = compare((evaluated["baseline"][0], "baseline"), (evaluated["candidate"][0], "candidate"), config)
        vs_champion = (compare((evaluated["champion"][0], "champion"), (evaluated["candidate"][0], "candidate"), config)
                       if champion is not None else None)
        probes = None
        if p.run_probes:
            probes = run_probes(config.grader, items[:20], corpus_dir=Path(config.data.corpus_dir)).to_json()
            log_json(client, run_id, probes, "reward_hacking_probes.json")
        gates = regression_gates(vs_baseline, vs_champion, probes, config)
        results = {"candidate": candidate["model_uri"], "items": len(items), "k": p.k, "vs_baseline": vs_baseline,
                   "vs_champion": vs_champion, "gates": gates}
        g = vs_baseline["score_gain"]
        log_metrics(client, run_id, {"regression/gain": g["gain"], "regression/gain_low": g["low"],
                                     "regression/gain_high": g["high"],
                                     "regression/gates_passed": float(all(x["passed"] for x in gates.values()))})
        markdown = report_markdown(results)
        log_text(client, run_id, markdown, "regression_report.md")
        log_json(client, run_id, results, "regression_report.json")
        for path in _figures({name: evaluated[name][1] for name in runs}, out):
            client.log_artifact(run_id, str(path))
        publish_summary(ctx, STAGE, run_id, markdown)
    failed = [f"{name}: {gate['what']} is {gate['value']:.4g}, limit {gate['limit']:.4g}"
              for name, gate in gates.items() if not gate["passed"]]
    before_after = {name: {"baseline": c["before"], "candidate": c["after"]} for name, c in vs_baseline["changes"].items()}
    return {"run_id": run_id, "gates": gates, "passed": not failed, "reasons": failed, "score_gain": g,
            "before_after": before_after, "champion_version": champion["version"] if champion else None}
