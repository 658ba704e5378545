"""Evaluating a model under a config, as the baseline, prompt and regression stages do.

`evaluate_model` loads the model (a path, a hub id or a `models:/` URI), starts the
config's tool endpoints (the demo server on loopback, or the user's), runs k seeded
rollouts per item through `trainer.evaluate.run_evaluation` and returns the summary and
the records. `apply_variant` turns a prompt/task variant (system prompt, tool subset,
tool descriptions, tool-call budget) into the config the model then runs under, so the
variant the prompt stage picks is exactly what training and the regression stage use.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

from trainer.config import PipelineConfig, PromptVariant
from trainer.errors import ConfigError
from trainer.evaluate import EvalSummary, run_evaluation
from trainer.rollout import RolloutRecord, RolloutSettings
from trainer.tools import ToolEndpoint


@contextmanager
def tool_endpoints(config: PipelineConfig) -> Iterator[list[ToolEndpoint]]:
    """The demo tool server on loopback, or the endpoints the config declares."""
    from envs.finqa.local import local_tool_endpoints

    tools = config.tools
    if tools.endpoints:
        context = nullcontext(list(tools.endpoints))
    elif tools.demo_server:
        context = local_tool_endpoints(
            Path(config.data.corpus_dir), port=tools.demo_server_port, max_output_chars=tools.max_output_chars
        )
    else:
        raise ConfigError("tools.endpoints is empty and tools.demo_server is false: declare the tool endpoints")
    with context as endpoints:
        yield endpoints


def read_items(path: str | Path, limit: int | None) -> list[dict[str, Any]]:
    from trainer.bootstrap import read_items as read

    return read(Path(path), limit)


def _smallest(*limits: int | None) -> int | None:
    given = [limit for limit in limits if limit is not None]
    return min(given) if given else None


def eval_items(config: PipelineConfig, limit: int | None) -> list[dict[str, Any]]:
    """The held-out items a stage evaluates: the first `limit` (and data.max_eval_items)."""
    return read_items(config.data.eval_file, _smallest(limit, config.data.max_eval_items))


def apply_variant(config: PipelineConfig, variant: PromptVariant | dict[str, Any] | None) -> PipelineConfig:
    """The config with a prompt/task variant applied (None: the config as it is)."""
    if variant is None:
        return config
    variant = PromptVariant.model_validate(variant)
    raw = config.model_dump(mode="json")
    if variant.system_prompt is not None:
        raw["rollout"]["system_prompt"] = variant.system_prompt
    if variant.max_episode_steps is not None:
        raw["rollout"]["max_episode_steps"] = variant.max_episode_steps
    if variant.tools is not None or variant.tool_descriptions is not None:
        schemas = raw["tools"]["schemas"] or read_items(config.data.train_file, 1)[0].get("tools", [])
        known = {s["function"]["name"] for s in schemas}
        unknown = sorted(set(variant.tools or []) - known) + sorted(set(variant.tool_descriptions or {}) - known)
        if unknown:
            raise ConfigError(
                f"prompt_optimization.variants[{variant.name}]: unknown tools {unknown}; the tools are {sorted(known)}"
            )
        if variant.tools is not None:
            schemas = [s for s in schemas if s["function"]["name"] in variant.tools]
        for schema in schemas:
            new = (variant.tool_descriptions or {}).get(schema["function"]["name"])
            if new is not None:
                schema["function"]["description"] = new
        raw["tools"]["schemas"] = schemas
    return PipelineConfig.model_validate(raw)


def evaluate_model(
    config: PipelineConfig, model: str, items: list[dict[str, Any]], *, k: int, seed: int, prefix: str
) -> tuple[EvalSummary, list[RolloutRecord]]:
    """k rollouts per item of `model` under `config`, graded and summarised (`prefix/...`)."""
    from tasks.tracking import resolve_tracking_uri
    from trainer.model_server import resolve_model_uri
    from trainer.policy import load_policy

    local = resolve_model_uri(model, tracking_uri=resolve_tracking_uri(config.mlflow.tracking_uri))
    policy = load_policy(local, device=config.model.device, dtype=config.model.dtype)
    backend = policy.backend(
        max_slots=config.rollout.max_concurrent_rollouts, max_len=config.rollout.max_total_tokens, seed=seed
    )
    tool_options = {
        "timeout_s": config.tools.timeout_s,
        "max_retries": config.tools.max_retries,
        "max_output_chars": config.tools.max_output_chars,
        "max_concurrency_per_endpoint": config.tools.max_concurrency_per_endpoint,
        "allowed_hosts": config.tools.allowed_hosts,
    }
    with tool_endpoints(config) as endpoints:
        return run_evaluation(
            backend, policy.tokenizer, items, k=k, endpoints=endpoints, grader=config.grader,
            settings=RolloutSettings.from_config(config.rollout, config.penalties),
            tools=config.tools.schemas, tool_options=tool_options,
            max_concurrent=config.rollout.max_concurrent_rollouts, prefix=prefix,
        )


def sample_rollouts(records: list[RolloutRecord], n: int = 20) -> list[dict[str, Any]]:
    """A few rollouts to keep as an artifact: the best and the worst of each item, first items."""
    by_item: dict[str, list[RolloutRecord]] = {}
    for record in records:
        by_item.setdefault(record.item_id, []).append(record)
    chosen = []
    for group in by_item.values():
        scored = sorted(group, key=lambda r: (r.score is None, -(r.score or 0.0)))
        chosen += [scored[0]] + ([scored[-1]] if len(scored) > 1 else [])
        if len(chosen) >= n:
            break
    return [json.loads(json.dumps(r.to_json(), default=str)) for r in chosen[:n]]
