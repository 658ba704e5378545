"""run_all's verdicts: a noisy figure is "met" only when its whole range meets the goal."""

from __future__ import annotations

import pytest

from benchmarks.run_all import ranged, spread_of, trl_rows, verdict


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
    return {"steps": 5, "eval_k": 32, "eval_items": 8, "eval_split": "test", "eval_start": {"score": 0.6},
            "runs": {"0ms": {"speedups": speedups, "ours_steps_per_s": [2.0], "trl_steps_per_s": [1.0]}},
            "eval": {"seeds": list(range(len(ours))), "ours": ours, "trl": trl,
                     "ours_mean": sum(ours) / len(ours), "trl_mean": sum(trl) / len(trl),
                     "seeds_ours_not_lower": sum(a >= b for a, b in zip(ours, trl, strict=True))}}


def test_trl_score_verdict_needs_the_mean_and_six_of_eight_seeds() -> None:
    six = _trl_result([0.8] * 6 + [0.1] * 2, [0.5] * 8)
    five = _trl_result([0.9] * 5 + [0.4] * 3, [0.5] * 8)  # higher on average, lower on 3 seeds
    assert trl_rows([six])[-1]["verdict"] == "met"
    assert trl_rows([five])[-1]["verdict"] == "not met"
    assert trl_rows([six])[0]["verdict"] == "met"  # steps/s: 1.7..2.0 against >= 1.5
