"""Evaluating a model inside the pipeline: k rollouts per item, the way every stage does.

The baseline, the prompt variants and the regression evaluation all call `evaluate_model`
with the config sections they read, so a model is measured the same way everywhere: the
rollout settings, the penalties, the grader and the tool endpoints of the job. Models are
local directories, hub ids or `models:/` URIs of the MLflow registry.
"""

from __future__ import annotations

import json
from typing import Any

from tasks.tracking import RunContext
from trainer.config.baseline import PromptVariant
from trainer.config.rollout import RolloutConfig
from trainer.config.tools import ToolsConfig
from trainer.errors import ConfigError
from trainer.memory import release_memory
from trainer.rollout.evaluate import EvalSummary, run_evaluation
from trainer.rollout.record import RolloutRecord, RolloutSettings
from trainer.rollout.tool_client import ToolClient


def apply_variant(
    rollout: RolloutConfig, tools: ToolsConfig, variant: PromptVariant | dict[str, Any] | None,
    items: list[dict[str, Any]],
) -> tuple[RolloutConfig, ToolsConfig]:
    """The rollout and tools sections with a prompt/task variant applied (None: as they
    are). Tool subsets and descriptions need the schemas: the config's, or the items'."""
    if variant is None:
        return rollout, tools
    variant = PromptVariant.model_validate(variant)
    rollout = rollout.model_copy(update={
        key: value for key, value in (("system_prompt", variant.system_prompt),
                                      ("max_episode_steps", variant.max_episode_steps)) if value is not None
    })
    if variant.tools is None and variant.tool_descriptions is None:
        return rollout, tools
    schemas = json.loads(json.dumps(tools.schemas or (items[0].get("tools", []) if items else [])))
    known = {s["function"]["name"] for s in schemas}
    unknown = sorted(set(variant.tools or []) - known) + sorted(set(variant.tool_descriptions or {}) - known)
    if unknown:
        raise ConfigError(f"prompt_optimization.variants[{variant.name}]: unknown tools {unknown}; the tools are "
                          f"{sorted(known)}")
    if variant.tools is not None:
        schemas = [s for s in schemas if s["function"]["name"] in variant.tools]
    for schema in schemas:
        new = (variant.tool_descriptions or {}).get(schema["function"]["name"])
        if new is not None:
            schema["function"]["description"] = new
    return rollout, tools.model_copy(update={"schemas": schemas})


def evaluate_model(
    model: str, items: list[dict[str, Any]], *, tracking_uri: str | None, model_section: Any, tools: ToolsConfig,
    grader: dict[str, Any], rollout: RolloutConfig, penalties: Any, k: int, seed: int, prefix: str,
    group_by: str | None = None, log: Any = None,
) -> tuple[EvalSummary, list[RolloutRecord]]:
    """k rollouts per item of `model`, graded and summarised (`prefix/...`), on the
    embedded engine or on vLLM servers (`rollout.backend`). The stages and `agentrft eval`
    all call this; `tracking_uri` resolves `models:/` URIs."""
    from contextlib import ExitStack

    from trainer.generation.policy import load_config_policy, local_model_path

    local = local_model_path(model, tracking_uri=tracking_uri)
    policy = load_config_policy(model_section, local)
    with ExitStack() as stack:
        if rollout.backend == "vllm":
            from trainer.generation.vllm_backend import vllm_eval_backend

            backend = stack.enter_context(vllm_eval_backend(
                rollout.vllm, local, rollout=rollout, tokenizer=policy.tokenizer,
                stop_token_ids=policy.stop_token_ids, seed=seed))
        else:
            backend = policy.backend(max_slots=rollout.max_concurrent_rollouts, max_len=rollout.max_total_tokens,
                                     seed=seed, prefix_cache_tokens=rollout.prefix_cache_tokens)
        result = run_evaluation(
            backend, policy.chat, items, k=k, tool_client=ToolClient.from_config(tools, seed=seed),
            grader=grader, settings=RolloutSettings.from_config(rollout, penalties), tools=tools.schemas,
            max_concurrent=rollout.max_concurrent_rollouts, prefix=prefix, group_by=group_by, log=log,
        )
    del backend, policy
    release_memory()  # the engine's cycles and freed heap: 3.4-4.5 GB -> 0.49 GB after 64 SmolLM2 rollouts
    return result


def sample_rollouts(records: list[RolloutRecord], n: int = 20) -> list[RolloutRecord]:
    """A few rollouts to keep: the best and the worst of each item, first items first."""
    by_item: dict[str, list[RolloutRecord]] = {}
    for record in records:
        by_item.setdefault(record.item_id, []).append(record)
    chosen: list[RolloutRecord] = []
    for group in by_item.values():
        scored = sorted(group, key=lambda r: (r.score is None, -(r.score or 0.0)))
        chosen += [scored[0]] + ([scored[-1]] if len(scored) > 1 else [])
        if len(chosen) >= n:
            break
    return chosen[:n]


def keep_rollouts(ctx: RunContext, run_id: str, records: list[RolloutRecord], *, kind: str, n: int,
                  items: list[dict[str, Any]] | None = None) -> None:
    """Sample rollouts as MLflow traces of the stage's run, with their grades as assessments
    and their items' reference fields as the expectation `item` (tasks/scoring.py)."""
    from trainer.rollout.traces import log_rollout_traces

    if n:
        by_id = {str(item.get("id")): item for item in items or []}
        log_rollout_traces(sample_rollouts(records, n), experiment_id=ctx.experiment_id, run_id=run_id, step=0,
                           kind=kind, tracking_uri=ctx.tracking_uri, items=by_id)
