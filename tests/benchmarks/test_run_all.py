"""run_all's verdicts: a noisy figure is "met" only when its whole range meets the goal."""

from __future__ import annotations

import argparse

import pytest

from benchmarks import bench_trl
from benchmarks.bench_trl import GRID_SEED, RULES, best_rate, choose_rates, paired
from benchmarks.run_all import kept_opt_in, ranged, spread_of, staleness_rows, trl_rows, verdict


@pytest.mark.parametrize(("low", "high", "at_most", "expected"), [
    (1.6, 2.4, False, "met"),
    (1.5, 2.4, False, "met"),  # the goal itself counts
    (1.2, 2.4, False, "straddles"),
    (0.9, 1.4, False, "not met"),
    (0.8, 0.95, True, "met"),
    (0.8, 1.1, True, "straddles"),
    (1.1, 1.3, True, "not met"),
])
def test_verdict_of_a_range(low: float, high: float, at_most: bool, expected: str) -> None:
    assert verdict(low, high, 1.5 if not at_most else 1.0, at_most=at_most) == expected


def test_ranged_row_reports_median_min_max_and_run_count() -> None:
    r = ranged("ratio", spread_of([2.0, 1.4, 1.8]), 1.5, "note")
    assert (r["value"], r["min"], r["max"], r["runs"], r["verdict"]) == (1.8, 1.4, 2.0, 3, "straddles")
    assert r["goal"] == ">= 1.5"


def _trl_result(ours: list[float], trl: list[float]) -> dict:
    speedups = [2.0, 1.7, 1.9]
    evaluation = {"seeds": list(range(len(ours))), "ours": ours, "trl": trl,
                  "ours_mean": sum(ours) / len(ours), "trl_mean": sum(trl) / len(trl), **paired(ours, trl)}
    grid = {"rules": RULES, "seeds": [100, 101], "eval_k": 16, "items": 4, "chosen": {"ours": 3e-4, "trl": 1e-4},
            "means": {"ours": {"0.0001": 0.8, "0.0003": 0.85}, "trl": {"0.0001": 0.82, "0.0003": 0.8}}}
    return {"steps": 5, "eval_k": 32, "eval_items": 8, "eval_split": "test",
            "eval_start": {"end": {"score": 0.6}, "feedback": {"score": 0.61}}, "grid": grid,
            "runs": {"0ms": {"speedups": speedups, "ours_steps_per_s": [2.0], "trl_steps_per_s": [1.0]}},
            "eval": {"end": evaluation, "feedback": evaluation}}


def test_trl_score_verdict_needs_the_mean_and_six_of_eight_seeds() -> None:
    six = _trl_result([0.8] * 6 + [0.1] * 2, [0.5] * 8)
    five = _trl_result([0.9] * 5 + [0.4] * 3, [0.5] * 8)  # higher on average, lower on 3 seeds
    rows = trl_rows([six])
    assert [r["verdict"] for r in rows[-2:]] == ["met", "met"]
    assert "`end` (our trainer's rule)" in rows[-2]["figure"] and "`feedback` (TRL's rule)" in rows[-1]["figure"]
    assert trl_rows([five])[-1]["verdict"] == "not met"
    assert rows[0]["verdict"] == "met"  # steps/s: 1.7..2.0 against >= 1.5
    assert rows[1]["value"] == "ours 0.0003, TRL 0.0001" and "learning rates ours 0.0003" in rows[0]["note"]


def test_trl_paired_test_and_the_grid_choice() -> None:
    p = paired([0.8, 0.9, 0.7, 0.85, 0.9, 0.8], [0.5, 0.6, 0.4, 0.55, 0.6, 0.5])  # ours higher on every seed
    assert p["seeds_ours_not_lower"] == 6 and abs(p["mean_difference"] - 0.3) < 1e-9
    assert p["wilcoxon_p"] == pytest.approx(0.03125)  # exact two-sided: 2 / 2**6
    assert paired([0.5, 0.6], [0.5, 0.6])["wilcoxon_p"] == 1.0  # no difference at all
    assert best_rate({"0.0001": 0.8, "0.0003": 0.85, "0.001": 0.2}) == 3e-4
    assert best_rate({"0.001": 0.8, "0.0001": 0.8}) == 1e-4  # a tie goes to the smaller rate


def test_the_grid_chooses_each_trainers_rate_on_validation_items_alone(monkeypatch, tmp_path) -> None:
    """`choose_rates` with its training and scoring stood in for by fakes that remember what
    they were asked: every model is scored on the validation split, by its trainer's rule,
    and each trainer gets the rate where its own mean is best."""
    best = {"ours": 3e-4, "trl": 1e-4}
    scored: list[tuple[str, str, str]] = []

    def fake_pair(world, endpoints, steps, seed, out, args, trl_first, rates):
        return tuple({"model": f"{side}@{rates[side]:g}@{seed}"} for side in ("ours", "trl"))

    def fake_eval_score(model, world, endpoints, k, split="test", rule="end"):
        side, rate, seed = model.split("@")
        scored.append((side, split, rule))
        return {"score": 0.9 - abs(float(rate) - best[side]) * 100 + int(seed) * 1e-6}

    class World:
        def items(self, split):
            return [{"id": f"{split}-{i}"} for i in range(7)]

    monkeypatch.setattr(bench_trl, "pair", fake_pair)
    monkeypatch.setattr(bench_trl, "eval_score", fake_eval_score)
    args = argparse.Namespace(grid=[1e-4, 3e-4, 1e-3], grid_seeds=2, steps=1, grid_eval_k=2)
    result = choose_rates(World(), [], args, tmp_path)
    assert result["chosen"] == best  # one rate each, not one shared
    assert {split for _, split, _ in scored} == {"validation"} and result["items"] == 7
    assert {(side, rule) for side, _, rule in scored} == set(RULES.items())
    assert result["seeds"] == [GRID_SEED, GRID_SEED + 1] and len(scored) == 3 * 2 * 2


def test_a_full_run_keeps_the_opt_in_rows_and_the_run_that_made_them() -> None:
    previous = {"rows": [{"figure": "old trl", "benchmark": "trl"}, {"figure": "gain, 10 items", "benchmark": "data_scaling"}],
                "benchmark_seconds": {"trl": 200.0, "data_scaling": 14000.0},
                "partial_runs": [{"commit": "a", "benchmarks": ["data_scaling"]}, {"commit": "b", "benchmarks": ["trl"]}]}
    full = {"commit": "c", "rows": [{"figure": "new trl", "benchmark": "trl"}], "benchmark_seconds": {"trl": 210.0}}
    kept = kept_opt_in(previous, full)
    assert [r["figure"] for r in kept["rows"]] == ["new trl", "gain, 10 items"]
    assert kept["partial_runs"] == [{"commit": "a", "benchmarks": ["data_scaling"]}]
    assert kept["benchmark_seconds"] == {"trl": 210.0, "data_scaling": 14000.0} and kept["commit"] == "c"
    assert "partial_runs" not in kept_opt_in({"rows": []}, full)


def _staleness_result(sync: list[float], off: list[float], **over: object) -> dict:
    runs = {str(arm): [{"sampling_s": 0.6, "training_s": 0.4}] * 3 for arm in (0, 1)}
    return {"runs": runs, "backend": "transformers", "sampler": "process", "steps": 12, "batch_size": 4,
            "group_size": 8, "ppo_epochs": 4, "learning_rate": 1e-4, "latency_ms": 300.0, "seeds": [3, 4, 5],
            "overlap_bounds": [1.67, 1.67, 1.67], "speedups": [1.49, 1.53, 1.59], "eval_k": 16,
            "score_sync": sync, "score_off_policy": off, "score_sync_mean": sum(sync) / 3,
            "score_off_policy_mean": sum(off) / 3, **over}


def test_staleness_rows_name_the_sampler_and_judge_the_score_by_the_sync_seeds_range() -> None:
    speed, score = staleness_rows([_staleness_result([0.89, 0.67, 0.83], [0.66, 0.89, 0.90])])
    assert speed["figure"] == "steps/s, max_staleness 1 / 0, 300 ms tools, transformers process, ppo_epochs 4"
    assert (speed["value"], speed["min"], speed["max"], speed["verdict"]) == (1.53, 1.49, 1.59, "straddles")
    assert score["value"] == "0.817 vs 0.797" and score["verdict"] == "met"
    assert "steady state" not in speed["note"]
    speed, _ = staleness_rows([_staleness_result([0.8] * 3, [0.8] * 3, steady_speedups=[1.6, 1.7, 1.5])])
    assert "steady state (median step of steps 2 to 11): 1.60, 1.70, 1.50, median 1.60" in speed["note"]
    _, lower = staleness_rows([_staleness_result([0.78, 0.72, 0.90], [0.77, 0.70, 0.55])])
    assert lower["verdict"] == "not met"  # 0.673 is below every synchronous seed
    speed, _ = staleness_rows([_staleness_result([0.8] * 3, [0.8] * 3, backend="vllm", sampler=None)])
    assert speed["figure"].endswith("vllm, ppo_epochs 4") and "one vLLM server" in speed["note"]
