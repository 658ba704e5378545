"""`make demo`: the whole pipeline on the FinQA-style environment, on one machine.

An entry point like `agentrft run`: it checks the demo's data against its DVC pin and its
model against its pin, serves the environment's tools on loopback (envs/finqa/demo.py),
runs the pipeline flow on the demo's config and hands back the outcome with its wall time.
`agentrft demo-shift` runs a shift evaluation of the demo the same way, and `agentrft
demo-real` (`make demo-real`) the real-model recipe: SmolLM2-135M-Instruct imported from the
package index, on the units environment (envs/units/).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from envs.finqa.demo import DEMO_CONFIG, corpus_for, ensure_data, tool_server

# What the demo is held against: the published FinQA case of Agent RFT (reward +11 points, tool
# calls 6.9 -> 4.2, reasoning tokens 2,500 -> 1,500), rounded down to goals.
GOALS = (("score gain", "points", 10.0), ("tool_calls_mean", "relative", -0.30), ("tokens_mean", "relative", -0.20))


def against_goals(outcome: dict[str, Any]) -> list[str]:
    """Each goal of the FinQA case, met or not met, by the test split's figures."""
    lines = []
    for name, kind, goal in GOALS:
        if kind == "points":
            value = 100 * outcome["score_gain"]["gain"]
            lines.append(f"{name} {value:+.1f} points (goal >= {goal:+.0f}): {'met' if value >= goal else 'not met'}")
        else:
            values = outcome["before_after"][name]
            change = (values["candidate"] - values["baseline"]) / values["baseline"]
            lines.append(f"{name} {change:+.1%} (goal <= {goal:+.0%}): {'met' if change <= goal else 'not met'}")
    return lines


def run_demo(config: Any, refresh: list[str], *, stop_after: str | None = None, log: Any = print) -> dict[str, Any]:
    """Check the data and the model, serve the tools, run the pipeline (up to `stop_after`)."""
    from envs.finqa.demo_model import verify_model_pin
    from flows.pipeline import agent_rft_pipeline, outcome_of, pipeline_parameters

    started = time.perf_counter()
    if Path(config.model.base_model).resolve() == DEMO_CONFIG.parent / "model":
        pin = verify_model_pin()
        log(f"demo model: envs/finqa/model matches its pin (md5 {pin['md5']})")
    ensure_data(config, log=log)
    with tool_server(config, corpus_for(config.data.train_file)) as base_url:
        log(f"FinQA tool server: {base_url}")
        state = agent_rft_pipeline(**pipeline_parameters(config, refresh, stop_after), return_state=True)
    outcome = outcome_of(state)
    outcome["wall_s"] = time.perf_counter() - started
    outcome["demo"] = True
    return outcome


def run_demo_shift(config: Any, name: str, model: str, *, variant: str | None = None, log: Any = print
                   ) -> dict[str, Any]:
    """A shift evaluation of the demo (`tasks/shift.py`) with the tool server on the corpus
    beside the split's items (the new companies' reports), else the demo's own."""
    from tasks.shift import shift_evaluation, shift_split

    ensure_data(config, log=log)
    corpus = corpus_for(shift_split(config, name).file)
    with tool_server(config, corpus) as base_url:
        log(f"FinQA tool server: {base_url} on {corpus}")
        return shift_evaluation(config, name, model, variant=variant, log=log)


def run_real_demo(config: Any, refresh: list[str], *, stop_after: str | None = None, log: Any = print
                  ) -> dict[str, Any]:
    """Import the model, check the data, serve the units tools, run the pipeline."""
    from envs.units.demo import ensure_data as ensure_units_data
    from envs.units.demo import ensure_model
    from envs.units.demo import tool_server as units_tool_server
    from flows.pipeline import agent_rft_pipeline, outcome_of, pipeline_parameters

    started = time.perf_counter()
    ensure_model(config, log=log)
    ensure_units_data(config, log=log)
    with units_tool_server(config) as base_url:
        log(f"units tool server: {base_url}")
        state = agent_rft_pipeline(**pipeline_parameters(config, refresh, stop_after), return_state=True)
    outcome = outcome_of(state)
    outcome["wall_s"] = time.perf_counter() - started
    return outcome
