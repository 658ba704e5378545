"""Typed pipeline configuration.

One YAML file describes a whole Agent RFT job: the base model, the DVC-pinned data, the
tool endpoints, the grader, the rollout limits, the baseline gates, the prompt variants,
the training hyperparameters (named as in OpenAI's fine-tuning API), the promotion gates
and where MLflow lives. The models here are also the Prefect flow's parameters, so every
field carries a description (it becomes the UI form and the CLI help) and sections stay one
level deep.

Unknown keys, keys written twice, wrong types, NaN or infinite numbers, missing files and
tool sections that contradict themselves (two endpoints for one tool, a host outside
`allowed_hosts`, a schema that does not compile) are `ConfigError`s that name the file, the
key path and what was expected, when the file loads: before any model or server starts.
Header values keep their `${VAR}` templates: secrets are resolved only when a tool client
is built and never appear in the config text, its hash, MLflow params or logs.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlparse

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    NonNegativeFloat,
    PositiveFloat,
    PositiveInt,
    ValidationError,
    field_validator,
    model_validator,
)

from trainer.errors import ConfigError
from trainer.tools import ToolEndpoint, tool_validators

_ENV_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")


class Section(BaseModel):
    """Base of every config section: unknown keys are errors, and so are NaN and infinity
    (`.inf` passes `gt=0`, and a NaN threshold passes every comparison)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


class ModelConfig(Section):
    base_model: str = Field(
        "demo",
        description="'demo' builds the small demo model locally (agentrft model bootstrap); "
        "otherwise a Hugging Face hub id, a local path or an MLflow models:/ URI of a chat "
        "model with a tool-capable chat template.",
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="Weights dtype: auto picks bfloat16 on a GPU and float32 on CPU."
    )
    device: str = Field("auto", description="'auto', 'cpu', 'cuda' or 'cuda:N'.")
    cache_dir: str = Field(
        ".cache/models", description="Where the bootstrapped demo model is cached (by data md5 "
        "and bootstrap settings)."
    )
    bootstrap_minutes: float = Field(
        120.0, gt=0, description="Time limit of the demo model's supervised warm start, a safety "
        "net: a limit that stops the warm start before bootstrap_tokens makes the model depend on "
        "the machine's speed."
    )
    bootstrap_tokens: int = Field(
        20_000_000, ge=10_000, description="Tokens of the demo model's supervised warm start: "
        "20M take ~45 min on 2 idle CPU cores. Copying numbers out of the context (and so the "
        "baseline score) switches on between 6M and 20M tokens: held-out copy accuracy 62% at "
        "1.5M, 78% at 6M, 98% at 20M."
    )
    bootstrap_seed: int = Field(0, description="Seed of the demo model's tokenizer, init and warm start.")


class DataConfig(Section):
    data_dir: str = Field("data", description="Directory pinned by the DVC file.")
    dvc_file: str | None = Field(
        "data.dvc", description="DVC pin of data_dir; its md5 is the data version. None: the data "
        "version is the md5 of the train and eval files (data not under DVC, e.g. an OpenAI job)."
    )
    train_file: str = Field("data/train.jsonl", description="Training items (OpenAI RFT JSONL).")
    eval_file: str = Field("data/eval.jsonl", description="Held-out evaluation items.")
    production_traffic_file: str = Field(
        "data/production_traffic.jsonl", description="Production traffic log the expectations derive from."
    )
    corpus_dir: str = Field("data/corpus", description="Corpus the demo tool server reads.")
    generator_seed: int = Field(0, description="Seed of the demo data generator (must match data.dvc).")
    max_train_items: int | None = Field(None, ge=1, description="Use only the first N training items.")
    max_eval_items: int | None = Field(None, ge=1, description="Use only the first N evaluation items.")
    expectations_suite: str | None = Field(
        "expectations/production_traffic.json",
        description="Great Expectations suite (JSON); None skips it (leakage and reference checks still run).",
    )


class ToolsConfig(Section):
    endpoints: list[ToolEndpoint] = Field(
        default_factory=list, description="One endpoint per tool (OpenAI Agent RFT shape)."
    )
    schemas: list[dict[str, Any]] | None = Field(
        None, description="Chat Completions tool schemas; when absent each data row's `tools` is used."
    )
    demo_server: bool = Field(
        True, description="Start the demo FinQA tool server on loopback and point endpoints at it."
    )
    demo_server_port: int = Field(0, ge=0, le=65535, description="Port of the demo server (0: any free port).")
    timeout_s: float = Field(600.0, gt=0, description="Per-request timeout (OpenAI: 10 minutes).")
    max_retries: int = Field(3, ge=1, le=10, description="Attempts on 5xx/timeouts before infra_error.")
    max_output_chars: int = Field(2000, ge=64, description="Tool outputs are cut to this length, visibly.")
    max_concurrency_per_endpoint: int = Field(32, ge=1, description="Concurrent requests per endpoint.")
    allowed_hosts: list[str] | None = Field(
        None, description="Allowlist of tool hosts; None allows only the configured endpoints."
    )

    @model_validator(mode="after")
    def _endpoints_and_schemas_agree(self) -> ToolsConfig:
        # Checked at load time so that a bad tool section fails `config validate` and every
        # stage before any model is loaded, not at the first rollout.
        names: set[str] = set()
        for index, endpoint in enumerate(self.endpoints):
            where = f"tools.endpoints[{index}]"
            if endpoint.name in names:
                raise ConfigError(f"{where}: tool {endpoint.name!r} has two endpoints; keep one")
            names.add(endpoint.name)
            host = urlparse(endpoint.server_url).hostname
            if self.allowed_hosts is not None and host not in self.allowed_hosts:
                raise ConfigError(
                    f"{where}.server_url: host {host!r} of tool {endpoint.name!r} is not in "
                    f"tools.allowed_hosts {self.allowed_hosts}; add it there or fix the URL"
                )
        if self.schemas is not None:
            # The demo server's endpoints exist only once it runs: then the client checks names.
            tool_validators(self.schemas, where="tools.schemas", endpoints=names or None)
        return self


class RolloutConfig(Section):
    system_prompt: str = Field(
        "You are a financial analyst. Use the tools to find the figures in the reports, "
        "then give the final answer as a number.",
        description="System prompt of every rollout.",
    )
    max_episode_steps: int = Field(10, ge=1, description="Tool-call budget per rollout.")
    max_turns: int = Field(12, ge=1, description="Assistant turns per rollout.")
    max_new_tokens_per_turn: int = Field(
        256, ge=1, description="Generated tokens per assistant turn at most (a turn of several "
        "parallel tool calls needs room for all of them)."
    )
    max_total_tokens: int = Field(
        2048, ge=64, description="Context limit of one rollout: the prompt, the tool outputs and "
        "what the model writes. A turn gets what is left of it, up to max_new_tokens_per_turn."
    )
    temperature: float = Field(1.0, ge=0, description="Sampling temperature.")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling.")
    max_concurrent_rollouts: int = Field(64, ge=1, description="Rollouts decoding at once.")


class PenaltyConfig(Section):
    over_budget: float = Field(1.0, ge=0, description="Subtracted when a rollout exceeds max_episode_steps.")
    per_tool_call: float = Field(0.0, ge=0, description="Subtracted per tool call.")
    tool_call_costs: dict[str, NonNegativeFloat] = Field(
        default_factory=dict, description="Per-tool penalties that replace per_tool_call for the "
        "named tools, for tools whose costs differ, e.g. {calculator: 0} for a free local tool "
        "next to a paid search."
    )
    per_token: float = Field(0.0, ge=0, description="Subtracted per generated token.")
    correct_only: bool = Field(
        False, description="Apply per-call and per-token penalties only to rollouts with score > 0."
    )


class BaselineConfig(Section):
    k: int = Field(4, ge=1, description="Samples per evaluation item.")
    max_items: int | None = Field(None, ge=1, description="Evaluate only the first N items.")
    min_nonzero_share: float = Field(
        0.1, ge=0, le=1, description="Gate: share of items whose best-of-k is above zero."
    )
    min_headroom: float = Field(
        0.05, ge=0, le=1, description="Gate: mean best-of-k must exceed the mean score by this."
    )
    seed: int = Field(1234, description="Sampling seed of evaluation rollouts.")


class PromptVariant(Section):
    name: str = Field(description="Variant name.")
    system_prompt: str | None = Field(None, description="Replaces the system prompt.")
    tools: list[str] | None = Field(None, description="Subset of tools offered to the model.")
    tool_descriptions: dict[str, str] | None = Field(None, description="Replaces tool descriptions.")
    max_episode_steps: int | None = Field(None, ge=1, description="Replaces the tool-call budget.")


class PromptOptimizationConfig(Section):
    variants: list[PromptVariant] = Field(default_factory=list, description="Variants to try before training.")
    target_score: float = Field(
        0.9, ge=0, le=1, description="If the best variant reaches this mean score, RFT is not needed."
    )
    k: int = Field(2, ge=1, description="Samples per item for each variant.")
    max_items: int | None = Field(None, ge=1, description="Items per variant check.")

    @field_validator("variants")
    @classmethod
    def _names_are_unique(cls, variants: list[PromptVariant]) -> list[PromptVariant]:
        # A variant's name keys its metrics and the stage's choice.
        seen = set()
        for index, variant in enumerate(variants):
            if variant.name in seen:
                raise ConfigError(
                    f"prompt_optimization.variants[{index}].name: {variant.name!r} is used twice; "
                    "give every variant its own name"
                )
            seen.add(variant.name)
        return variants


class LoraConfig(Section):
    r: int = Field(16, ge=1, description="LoRA rank.")
    alpha: int = Field(32, ge=1, description="LoRA alpha.")
    dropout: float = Field(0.0, ge=0, lt=1, description="LoRA dropout.")
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"], description="Modules to adapt."
    )


Auto = Literal["auto"]


class TrainingConfig(Section):
    n_epochs: PositiveInt | Auto = Field("auto", description="Passes over the training items (auto: 1).")
    batch_size: PositiveInt | Auto = Field("auto", description="Items per step (auto: 8).")
    learning_rate_multiplier: PositiveFloat | Auto = Field(
        "auto", description="Times the base learning rate of 1e-5 (auto: 1.0)."
    )
    learning_rate: float | None = Field(None, gt=0, description="Absolute learning rate; overrides the multiplier.")
    compute_multiplier: PositiveFloat | Auto = Field(
        "auto", description="Scales rollouts per item: group size = round(8 x multiplier), min 2 (auto: 1.0)."
    )
    eval_interval: PositiveInt | Auto = Field("auto", description="Steps between evaluations (auto: 10).")
    eval_samples: PositiveInt | Auto = Field("auto", description="Held-out items per evaluation (auto: 64).")
    seed: int = Field(42, description="Seed of data order, sampling and init.")
    max_steps: int | None = Field(None, ge=1, description="Stop after this many steps.")
    ppo_epochs: int = Field(1, ge=1, description="Optimisation passes over each batch of rollouts.")
    clip_eps: float = Field(0.2, gt=0, description="PPO clip range.")
    kl_coef: float = Field(0.0, ge=0, description="KL penalty against the frozen reference.")
    scale_rewards: bool = Field(True, description="Divide advantages by the group std (False: Dr. GRPO).")
    warmup_steps: int = Field(0, ge=0, description="Linear warmup steps.")
    lr_schedule: Literal["constant", "linear", "cosine"] = Field("constant", description="After warmup.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    max_grad_norm: float = Field(1.0, gt=0, description="Gradient clipping.")
    mini_batches: int = Field(
        1, ge=1, description="Optimiser updates per pass over a step's rollouts (PPO's mini-batches): "
        "1, as in OpenAI's and TRL's default, makes one update of the whole batch; more take "
        "smaller, more off-policy steps."
    )
    gradient_accumulation_steps: int | None = Field(
        None, ge=1, description="Micro-batches per optimiser update; fixes the update size instead "
        "of mini_batches."
    )
    micro_batch_size: int = Field(8, ge=1, description="Rollouts per forward/backward.")
    gradient_checkpointing: bool = Field(False, description="Trade compute for memory.")
    lora: LoraConfig | None = Field(None, description="Train LoRA adapters (merged at save).")
    mixed_precision: Literal["auto", "no", "bf16", "fp16"] = Field("auto", description="auto: bf16 on GPU.")
    num_processes: int = Field(1, ge=1, description="Processes for accelerate launch.")
    accelerate_config: str | None = Field(None, description="An accelerate config file (DDP/FSDP/DeepSpeed).")
    checkpoint_interval: int = Field(10, ge=1, description="Steps between checkpoints.")
    keep_best_checkpoints: int = Field(3, ge=1, description="Best checkpoints kept by eval score.")
    output_dir: str = Field("runs/train", description="Checkpoints, metrics and rollouts.")


class PromotionConfig(Section):
    registered_model: str = Field("finqa-agent", description="MLflow registered model name.")
    k: int = Field(4, ge=1, description="Samples per item in the regression evaluation.")
    max_items: int | None = Field(None, ge=1, description="Items in the regression evaluation.")
    min_gain_lower_bound: float = Field(
        0.0, description="Gate: lower bound of the 95% paired-bootstrap interval of the score gain."
    )
    max_tool_calls_increase: float = Field(0.10, description="Gate: allowed relative increase.")
    max_tokens_increase: float = Field(0.10, description="Gate: allowed relative increase.")
    max_latency_increase: float = Field(0.25, description="Gate: allowed relative increase of p50.")
    max_category_drop: float = Field(0.05, ge=0, description="Gate: no category may fall more than this.")
    run_probes: bool = Field(True, description="Gate: reward-hacking probes must all score <= 0.1.")
    bootstrap_samples: int = Field(2000, ge=100, description="Paired bootstrap resamples.")


class MlflowConfig(Section):
    tracking_uri: str = Field("sqlite:///mlflow.db", description="MLflow tracking URI (SQLite or a server).")
    experiment: str = Field("agent-rft", description="Experiment name.")


class ScheduleConfig(Section):
    cron: str = Field("0 2 * * *", description="Cron of the served pipeline deployment (default nightly).")
    timezone: str = Field("UTC", description="Timezone of the cron.")


class PipelineConfig(Section):
    name: str = Field("finqa-demo", description="Job name.")
    work_dir: str = Field(
        "runs", description="Where pipeline stages write outputs (rollouts, reports, checkpoints), "
        "one folder per stage and cache key."
    )
    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    tools: ToolsConfig = Field(default_factory=ToolsConfig)
    grader: dict[str, Any] = Field(
        default_factory=lambda: {
            "type": "numeric",
            "name": "answer",
            "input": "{{sample.output_text}}",
            "reference": "{{item.reference_answer}}",
        },
        description="OpenAI-compatible grader object (string_check, text_similarity, score_model, "
        "label_model, python, multi, endpoint, numeric, f1).",
    )
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    penalties: PenaltyConfig = Field(default_factory=PenaltyConfig)
    baseline: BaselineConfig = Field(default_factory=BaselineConfig)
    prompt_optimization: PromptOptimizationConfig = Field(default_factory=PromptOptimizationConfig)
    training: TrainingConfig = Field(default_factory=TrainingConfig)
    promotion: PromotionConfig = Field(default_factory=PromotionConfig)
    mlflow: MlflowConfig = Field(default_factory=MlflowConfig)
    schedule: ScheduleConfig = Field(default_factory=ScheduleConfig)

    @field_validator("grader")
    @classmethod
    def _grader_is_valid(cls, value: dict[str, Any]) -> dict[str, Any]:
        from trainer.graders import validate_grader

        validate_grader(value, where="grader")
        return value

    def section_hash(self, *sections: str) -> str:
        """Stable hash of the named sections (all when none): a stage's cache key part."""
        dumped = self.model_dump(mode="json")
        chosen = {name: dumped[name] for name in (sections or tuple(dumped))}
        text = json.dumps(chosen, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def flat_params(self) -> dict[str, str]:
        """The config flattened as `section.key` strings (MLflow params). Headers keep their
        templates, so secrets never leave the environment."""
        flat: dict[str, str] = {}

        def walk(prefix: str, value: Any) -> None:
            if isinstance(value, dict):
                for key, sub in value.items():
                    walk(f"{prefix}.{key}" if prefix else str(key), sub)
            else:
                flat[prefix] = json.dumps(value) if isinstance(value, list) else str(value)

        walk("", self.model_dump(mode="json"))
        return flat


# --- resolving "auto" hyperparameters -------------------------------------------------

BASE_LEARNING_RATE = 1e-5
AUTO_DEFAULTS = {
    "n_epochs": 1,
    "batch_size": 8,
    "learning_rate_multiplier": 1.0,
    "compute_multiplier": 1.0,
    "eval_interval": 10,
    "eval_samples": 64,
}


def resolved_hyperparameters(training: TrainingConfig) -> dict[str, Any]:
    """OpenAI-named hyperparameters with "auto" replaced by the documented defaults, plus
    the learning rate and group size they map to."""
    values = {
        name: (AUTO_DEFAULTS[name] if getattr(training, name) == "auto" else getattr(training, name))
        for name in AUTO_DEFAULTS
    }
    values["learning_rate"] = training.learning_rate or BASE_LEARNING_RATE * values[
        "learning_rate_multiplier"
    ]
    values["group_size"] = max(2, round(8 * values["compute_multiplier"]))
    values["seed"] = training.seed
    return values


# --- loading --------------------------------------------------------------------------


# Steps pydantic adds to an error's location for each member of a union (`int | "auto"`
# fails as `constrained-int` and as `literal['auto']`): not keys the user wrote.
_UNION_STEP = re.compile(
    r"^(?:constrained-\w+|literal\[.*\]|function-[\w-]+\[.*\]|int|float|str|bool|none"
    r"|(?:list|dict|tuple)\[.*\])$"
)


def _describe_errors(errors: list[Any]) -> list[str]:
    """One line per bad key path; the complaints of a union's members are joined by "or"."""
    problems: dict[str, tuple[list[str], str]] = {}
    for error in errors:
        steps = [p for p in error["loc"] if not (isinstance(p, str) and _UNION_STEP.match(p))]
        path = ".".join(str(step) for step in steps) or "(top level)"
        kind = error["type"]
        shown = ""
        if kind == "extra_forbidden":
            text = "unknown key; check the spelling against the documented keys"
        elif kind == "missing":
            text = "required key is missing"
        else:
            text = error["msg"]
            shown = repr(error.get("input"))
            shown = f" (got {shown[:77] + '...' if len(shown) > 80 else shown})"
        texts, _ = problems.setdefault(path, ([], shown))
        if text not in texts:
            texts.append(text)
    return [f"{path}: {' or '.join(texts)}{shown}" for path, (texts, shown) in problems.items()]


def config_from_dict(raw: Any, *, source: str = "<config>") -> PipelineConfig:
    """Validate a parsed config mapping; errors name `source` and every bad key path."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: the config must be a mapping of sections, got {type(raw).__name__}")
    try:
        return PipelineConfig.model_validate(raw)
    except ValidationError as exc:
        lines = _describe_errors(exc.errors())
        raise ConfigError(f"{source}: invalid config:\n  " + "\n  ".join(lines)) from None
    except ConfigError as exc:  # the grader validator raises our own type
        raise ConfigError(f"{source}: {exc}") from None


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key written twice in one mapping: PyYAML would keep the
    last one silently, so a repeated section or key would drop the first one's settings."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen = set()
        for key_node, _ in node.value:
            if not isinstance(key_node, yaml.ScalarNode) or key_node.tag.endswith(":merge"):
                continue  # `<<: *anchor` merges may repeat; complex keys are PyYAML's to judge
            if key_node.value in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key_node.value!r} appears twice in one mapping; keep one",
                    key_node.start_mark,
                )
            seen.add(key_node.value)
        return super().construct_mapping(node, deep=deep)


def load_config(path: str | Path, overrides: dict[str, Any] | None = None) -> PipelineConfig:
    """Load a YAML pipeline config; `overrides` are merged section by section on top."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: config file not found; pass a YAML file such as configs/demo.yaml")
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not valid UTF-8 (byte {exc.start}); save the file as UTF-8") from None
    try:
        raw = yaml.load(text, Loader=_UniqueKeyLoader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError(f"{path}: invalid YAML{where}: {getattr(exc, 'problem', exc)}") from None
    if overrides:
        raw = merge_overrides(raw or {}, overrides)
    return config_from_dict(raw, source=str(path))


def merge_overrides(raw: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """Deep-merge `overrides` into `raw` (dicts merge, everything else replaces)."""
    merged = dict(raw)
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = merge_overrides(merged[key], value)
        else:
            merged[key] = value
    return merged


def missing_env_vars(config: PipelineConfig) -> list[str]:
    """Names of `${VAR}` references in tool headers that the environment lacks."""
    missing = []
    for index, endpoint in enumerate(config.tools.endpoints):
        for header, value in endpoint.headers.items():
            for name in _ENV_REF.findall(value):
                if name not in os.environ:
                    missing.append(f"{name} (tools.endpoints[{index}].headers.{header})")
    return missing
