"""Typed pipeline configuration.

One YAML file describes a whole Agent RFT job: the base model, the DVC-pinned data, the
tool endpoints, the grader, the rollout limits, the baseline gates, the prompt variants,
the training hyperparameters (named as in OpenAI's fine-tuning API, the loss options as in
TRL's GRPOConfig), the promotion gates and where MLflow lives. The model here is also the
Prefect flow's parameter, so every field carries a description: it becomes the UI form and
the CLI help. Nothing here knows an environment: the demo's tools, data and model are what
its own config file declares, like anyone's.

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
        description="The model to train: a local directory, a Hugging Face hub id or an MLflow "
        "`models:/name@alias` URI of a chat model with a tool-capable chat template."
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="Weights dtype: auto picks bfloat16 on a GPU and float32 on CPU."
    )
    device: str = Field("auto", description="'auto', 'cpu', 'cuda' or 'cuda:N'.")
    chat_format: Literal["auto", "qwen3", "qwen2.5", "llama3", "mistral", "gpt-oss", "template"] = Field(
        "auto", description="How messages become tokens and sampled tokens become tool calls: the model's "
        "family, or 'template' for any other prefix-stable chat template. auto detects the family from the "
        "tokenizer's template; every choice is checked against the template when the model loads."
    )
    enable_thinking: bool | None = Field(
        None, description="qwen3 only: think before answering (true) or not (false); unset, the template's "
        "default (Qwen3: on). Reasoning tokens are trained like any sampled token and counted apart."
    )


class DataConfig(Section):
    dvc_file: str | None = Field(
        None, description="DVC file (`dvc add` output) pinning the data; its md5 is the data version "
        "and the data must match it. None: the data version is the md5 of the dataset files."
    )
    train_file: str = Field("data/train.jsonl", description="Training items (OpenAI RFT JSONL).")
    validation_file: str = Field(
        "data/validation.jsonl", description="Validation items: in-training evaluation, checkpoint choice, "
        "prompt-variant choice and the baseline gates."
    )
    test_file: str | None = Field(
        "data/test.jsonl", description="Test items: read only by the regression evaluation and the promotion "
        "decision. None: a seeded half of the validation file is set aside as the test split (reported)."
    )
    production_traffic_file: str | None = Field(
        "data/production_traffic.jsonl", description="Production traffic log (same shape as the items, plus what "
        "production observed); the expectation suite is derived from it."
    )
    expectations_dir: str = Field(
        "expectations", description="Great Expectations file data context (great_expectations.yml, suites, "
        "checkpoints)."
    )
    expectations_suite: str | None = Field(
        "production_traffic", description="Suite in the data context the datasets are validated against; None "
        "skips the suite (leakage and gradability checks still run)."
    )
    test_ledger: str | None = Field(
        "auto", description="Ledger of every reading of the test split (regression_eval, `agentrft eval --split "
        "test`), one JSON line each; commit it with the project, since an MLflow store's count starts at zero on "
        "every clone. auto: test_readings.jsonl beside `dvc_file` (outside the pinned data), else "
        "beside the test file (the validation file without one); None: readings are tagged in MLflow only.")
    max_train_items: int | None = Field(None, ge=1, description="Use only the first N training items.")
    max_validation_items: int | None = Field(None, ge=1, description="Use only the first N validation items.")
    max_test_items: int | None = Field(None, ge=1, description="Use only the first N test items.")


class ToolsConfig(Section):
    endpoints: list[ToolEndpoint] = Field(
        default_factory=list, description="One endpoint per tool (OpenAI Agent RFT shape)."
    )
    schemas: list[dict[str, Any]] | None = Field(
        None, description="Chat Completions tool schemas; when absent each data row's `tools` is used."
    )
    timeout_s: float = Field(600.0, gt=0, description="Per-request timeout (OpenAI: 10 minutes).")
    max_retries: int = Field(3, ge=1, le=10, description="Attempts on 5xx, 429, timeouts before infra_error.")
    max_output_chars: int = Field(2000, ge=64, description="Tool outputs are cut to this length, visibly.")
    max_concurrency_per_endpoint: int = Field(32, ge=1, description="Concurrent requests per endpoint.")
    max_requests_per_second: float | None = Field(
        None, gt=0, description="Rate limit per endpoint (token bucket); None: unlimited. OpenAI asks tool "
        "servers to take about 50."
    )
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
            tool_validators(self.schemas, where="tools.schemas", endpoints=names or None)
        return self


class VllmConfig(Section):
    urls: list[str] = Field(
        default_factory=list, description="Base URLs of running vLLM OpenAI servers (replicas); rollouts are "
        "spread over them, least loaded first."
    )
    launch: bool = Field(
        False, description="Start one vLLM server on loopback from `python` for the run and stop it at the end."
    )
    python: str = Field(".venv-vllm/bin/python", description="Interpreter of the separate vLLM environment "
                        "(make vllm).")
    sync: Literal["full", "lora", "nccl"] | None = Field(
        None, description="Weight sync after each optimizer step: reload full weights from disk, swap a LoRA "
        "adapter, or NCCL transfer (GPU). Unset: lora when training.lora is set, else full."
    )
    extra_args: list[str] = Field(default_factory=list, description="Extra command-line arguments of a launched server.")
    api_key: str | None = Field(None, description="API key of the servers (may name `${VAR}`).")
    startup_timeout_s: float = Field(300.0, gt=0, description="How long a launched server may take to be ready.")
    request_timeout_s: float = Field(600.0, gt=0, description="Longest a request may take (a weight sync, a turn).")
    turn_deadline_s: float = Field(
        60.0, gt=0, description="A turn's deadline: this plus turn_deadline_per_token_s per requested token. Past "
        "it the replica's /health is asked and the turn retried (on another replica if it does not answer), so a "
        "hung server costs this, not request_timeout_s.")
    turn_deadline_per_token_s: float = Field(0.5, ge=0, description="See turn_deadline_s.")


class RolloutConfig(Section):
    system_prompt: str | None = Field(None, description="System prompt of every rollout (None: the items' own).")
    max_episode_steps: int = Field(10, ge=1, description="Tool-call budget per rollout.")
    max_turns: int = Field(12, ge=1, description="Assistant turns per rollout.")
    max_new_tokens_per_turn: int = Field(
        256, ge=1, description="Generated tokens per assistant turn at most; a turn cut here has finish_reason "
        "`length`."
    )
    max_total_tokens: int = Field(
        2048, ge=64, description="Context limit of one rollout: the prompt, the tool outputs and what the model "
        "writes. A turn gets what is left of it, up to max_new_tokens_per_turn."
    )
    temperature: float = Field(1.0, ge=0, description="Sampling temperature.")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling.")
    max_concurrent_rollouts: int = Field(64, ge=1, description="Rollouts decoding at once.")
    on_malformed_call: Literal["end", "feedback"] = Field(
        "end", description="A tool call that does not parse, names an unknown tool or fails its schema: `end` "
        "stops the rollout and grades what it has; `feedback` answers the error to the model, counts the call "
        "against max_episode_steps and charges it like a call."
    )
    backend: Literal["transformers", "vllm"] = Field(
        "transformers", description="Generation engine: the embedded transformers engine, or vLLM servers."
    )
    vllm: VllmConfig = Field(default_factory=VllmConfig, description="vLLM servers (rollout.backend: vllm).")
    overlap_sampler: Literal["auto", "thread", "process"] = Field(
        "auto", description="Under training.max_staleness: 1 on the embedded engine, where the frozen copy samples "
        "beside the update: a thread of the trainer (it shares Python's GIL with the update) or a child process "
        "(its own interpreter; the copy's weights in shared memory, which the sync after each step writes). "
        "auto: a process when the model is on the CPU and /dev/shm has room for the copy, else a thread. "
        "`process` needs a CPU model."
    )


class PenaltyConfig(Section):
    over_budget: float = Field(1.0, ge=0, description="Subtracted when a rollout exceeds max_episode_steps.")
    per_tool_call: float = Field(0.0, ge=0, description="Subtracted per tool call, malformed calls included.")
    tool_call_costs: dict[str, NonNegativeFloat] = Field(
        default_factory=dict, description="Per-tool prices that replace per_tool_call for the named tools, "
        "e.g. {calculator: 0} for a free local tool next to a paid search."
    )
    malformed_call: float = Field(
        0.0, ge=0, description="Subtracted per malformed tool call, on top of the call's price."
    )
    repeated_call: float = Field(
        0.0, ge=0, description="Subtracted per tool call that repeats an earlier call of the rollout (same tool, "
        "same arguments), on top of its price: for tools that answer the same call the same way, a repeat "
        "learns nothing. Leave at 0 for tools whose answers change (polling, queues)."
    )
    per_turn: float = Field(0.0, ge=0, description="Subtracted per assistant turn that calls tools (rewards "
                            "calling tools in parallel).")
    per_token: float = Field(0.0, ge=0, description="Subtracted per generated token.")
    overlong: float = Field(
        0.0, ge=0, description="DAPO's soft overlong penalty, at most this much: a turn longer than "
        "max_new_tokens_per_turn - overlong_buffer_tokens pays in proportion to the excess."
    )
    overlong_buffer_tokens: int = Field(64, ge=1, description="Length of the soft overlong zone.")
    correct_only: bool = Field(
        False, description="Charge calls, turns and tokens only to rollouts with score > 0, so a wrong answer is "
        "never cheaper."
    )


class BaselineConfig(Section):
    k: int = Field(4, ge=1, description="Samples per validation item.")
    max_items: int | None = Field(None, ge=1, description="Evaluate only the first N validation items.")
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
    k: int = Field(2, ge=1, description="Samples per validation item for each variant.")
    max_items: int | None = Field(None, ge=1, description="Validation items per variant check.")

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
    eval_samples: PositiveInt | Auto = Field("auto", description="Validation items per evaluation (auto: 64).")
    seed: int = Field(42, description="Seed of data order, sampling and init.")
    max_steps: int | None = Field(None, ge=1, description="Stop after this many steps.")
    loss_type: Literal["grpo", "dapo", "dr_grpo", "gspo"] = Field(
        "dapo", description="grpo: mean over each rollout's tokens, then over rollouts; dapo: mean over all "
        "tokens of an update; dr_grpo: sum over tokens / (generation budget x rollouts), a constant (the budget: "
        "rollout.max_turns x max_new_tokens_per_turn, at most max_total_tokens); gspo: one length-normalised "
        "importance ratio per rollout."
    )
    epsilon: float | None = Field(
        None, gt=0, description="Clip range below 1 (and above, unless epsilon_high). Unset: 0.2, or 3e-4 with "
        "loss_type gspo (GSPO's ratio is a per-token mean, so its paper clips at 3e-4 / 4e-4).")
    epsilon_high: float | None = Field(
        None, gt=0, description="Clip range above 1 (DAPO's clip-higher). Unset: epsilon, or 4e-4 with gspo when "
        "epsilon is unset too.")
    scale_rewards: Literal["group", "batch", "none"] = Field(
        "group", description="Divide advantages by the std of the group, of the batch, or not at all."
    )
    dynamic_sampling: bool = Field(
        False, description="Drop groups whose rewards are all equal and sample fresh items until the batch is "
        "full (DAPO), at most max_resample_batches extra rounds."
    )
    max_resample_batches: int = Field(2, ge=0, description="Cap on dynamic sampling's extra rounds per step.")
    mask_truncated: bool = Field(
        True, description="Leave rollouts with a turn cut by max_new_tokens_per_turn out of the loss."
    )
    tis_cap: float = Field(
        2.0, gt=0, description="Truncated importance sampling: per-token weight min(exp(old - sampler), cap) "
        "for the difference between the sampler's and the trainer's log-probabilities."
    )
    ppo_epochs: int = Field(1, ge=1, description="Optimisation passes over each batch of rollouts.")
    kl_coef: float = Field(0.0, ge=0, description="KL penalty against the frozen reference.")
    group_by: str | None = Field(
        None, description="Item field that groups the training items (e.g. category) for kl_coef_by_group "
        "and group_weights."
    )
    kl_coef_by_group: dict[str, NonNegativeFloat] = Field(
        default_factory=dict, description="KL coefficient per group of training items (by group_by), in place "
        "of kl_coef for that group's rollouts: hold the base model's behaviour only where a group needs it."
    )
    group_weights: dict[str, PositiveFloat] = Field(
        default_factory=dict, description="Sampling weight per group of training items (by group_by; 1 for groups "
        "not named): each epoch's order is a weighted shuffle, so a heavier group's items come earlier and a run "
        "shorter than an epoch trains on more of them; every item still comes once an epoch."
    )
    warmup_steps: int = Field(0, ge=0, description="Linear warmup steps.")
    lr_schedule: Literal["constant", "linear", "cosine"] = Field("constant", description="After warmup.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    max_grad_norm: float = Field(1.0, gt=0, description="Gradient clipping.")
    mini_batches: int = Field(
        1, ge=1, description="Optimiser updates per pass over a step's rollouts (1: one update of the whole batch)."
    )
    micro_batch_size: int = Field(8, ge=1, description="Rollouts per forward/backward.")
    logprob_chunk_tokens: int = Field(
        512, ge=16, description="Generated tokens per chunk of the output projection and log-softmax: the "
        "update holds at most two float32 [chunk, vocabulary] tensors at once (about 600 MiB at Qwen's 151,936)."
    )
    gradient_checkpointing: bool = Field(False, description="Trade compute for memory.")
    lora: LoraConfig | None = Field(None, description="Train LoRA adapters (merged at save).")
    mixed_precision: Literal["auto", "no", "bf16", "fp16"] = Field("auto", description="auto: bf16 on GPU.")
    num_processes: int = Field(1, ge=1, description="Training processes (one per GPU; on CPUs, gloo processes).")
    distributed: Literal["none", "ddp", "fsdp"] | None = Field(
        None, description="How the processes share the model: none (one process), ddp (each holds it whole), "
        "fsdp (FSDP2: parameters, gradients and optimizer state sharded). Unset: none for one process, ddp for "
        "several.")
    accelerate_config: str | None = Field(
        None, description="An accelerate config file for where the processes run (machines, GPU ids, ports); "
        "its distributed_type, if any, must not contradict training.distributed.")
    max_staleness: Literal[0, 1] = Field(
        0, description="1: sample step t+1's rollouts while step t trains (one step off-policy: the weights of "
        "step t - 1; tis_cap weighs each token for the lag). On vLLM the servers keep those weights until both "
        "are done; the embedded engine samples with a frozen copy of the model (one more copy in memory)."
    )
    checkpoint_interval: int = Field(10, ge=1, description="Steps between checkpoints.")
    keep_best_checkpoints: int = Field(3, ge=1, description="Best checkpoints kept, ranked by metric_for_best_model.")
    metric_for_best_model: Literal["reward", "score"] = Field(
        "reward", description="What ranks checkpoints on the validation split: reward (the grader's score less the "
        "configured penalties, i.e. the objective trained) or score (the grader's alone).")
    output_dir: str = Field("runs/train", description="Checkpoints, metrics and rollouts.")

    @field_validator("scale_rewards", mode="before")
    @classmethod
    def _scale_rewards_bool(cls, value: Any) -> Any:
        # TRL takes True/False as well: True is "group", False is "none".
        return {True: "group", False: "none"}.get(value, value) if isinstance(value, bool) else value

    @model_validator(mode="after")
    def _one_process_without_distribution(self) -> TrainingConfig:
        if self.distributed == "none" and self.num_processes > 1:
            raise ConfigError(
                f"training.distributed is none but training.num_processes is {self.num_processes}: set distributed "
                "to ddp or fsdp, or num_processes to 1"
            )
        return self

    @model_validator(mode="after")
    def _groups_have_a_field(self) -> TrainingConfig:
        for key in ("kl_coef_by_group", "group_weights"):
            if getattr(self, key) and not self.group_by:
                raise ConfigError(
                    f"training.{key} names groups but training.group_by is not set: name the item field "
                    "that holds the group (e.g. group_by: category)"
                )
        return self

    def group_of(self, item: dict[str, Any]) -> str | None:
        """An item's group (its group_by field as text), or None."""
        return str(item[self.group_by]) if self.group_by and self.group_by in item else None

    def weight_of(self, item: dict[str, Any]) -> float:
        """An item's sampling weight: its group's, else 1."""
        return self.group_weights.get(self.group_of(item), 1.0)

    def kl_coef_of(self, item: dict[str, Any]) -> float:
        """The KL coefficient of an item's rollouts: its group's, else kl_coef."""
        return self.kl_coef_by_group.get(self.group_of(item), self.kl_coef)

    def clip_range(self) -> tuple[float, float]:
        """(below 1, above 1): the clip of the importance ratio, defaults resolved."""
        if self.epsilon is None:
            low, high = (3e-4, 4e-4) if self.loss_type == "gspo" else (0.2, 0.2)
        else:
            low = high = self.epsilon
        return low, high if self.epsilon_high is None else self.epsilon_high

    @property
    def uses_reference(self) -> bool:
        """Whether any rollout carries a KL term (the frozen reference is needed)."""
        return self.kl_coef > 0 or any(coef > 0 for coef in self.kl_coef_by_group.values())


class PromotionConfig(Section):
    registered_model: str | None = Field(None, description="MLflow registered model name (None: the job's name).")
    k: int = Field(4, ge=1, description="Samples per test item in the regression evaluation.")
    max_items: int | None = Field(None, ge=1, description="Test items in the regression evaluation.")
    min_gain_lower_bound: float = Field(
        0.0, description="Gate: lower bound of the 95% paired-bootstrap interval of the score gain."
    )
    max_tool_calls_increase: float = Field(0.10, description="Gate: allowed relative increase.")
    max_tokens_increase: float = Field(0.10, description="Gate: allowed relative increase.")
    max_latency_increase: float = Field(0.25, description="Gate: allowed relative increase of p50.")
    group_by: str | None = Field(
        None, description="Item field that groups the test items (e.g. category) for the per-group gate; None "
        "skips that gate."
    )
    max_group_drop: float = Field(0.05, ge=0, description="Gate: no group may fall more than this.")
    run_probes: bool = Field(True, description="Gate: reward-hacking probes must all score <= 0.1.")
    bootstrap_samples: int = Field(
        20000, ge=100, description="Paired bootstrap resamples (20,000: a bound's sd from one seed to another is "
        "~0.05 point of score on 250 items; at 2,000 ~0.15, enough to decide a gate sitting near a bound).")
    concurrent_runs: Literal["wait", "stop"] = Field(
        "wait", description="Another run training or promoting the same registered model: wait for it, or stop."
    )
    lock_timeout_s: float = Field(6 * 3600.0, gt=0, description="How long `wait` waits before stopping.")


class MlflowConfig(Section):
    tracking_uri: str = Field("sqlite:///mlflow.db", description="MLflow tracking URI (SQLite or a server).")
    experiment: str = Field("agent-rft", description="Experiment name.")
    unavailable_timeout_s: float = Field(
        300.0, gt=0, description="How long logging keeps retrying an unreachable tracking server."
    )
    traces_per_evaluation: int = Field(
        8, ge=0, description="Rollouts of each evaluation (and of each training step) kept as MLflow traces."
    )


class ScheduleConfig(Section):
    cron: str = Field("0 2 * * *", description="Cron of the served pipeline deployment (default nightly).")
    timezone: str = Field("UTC", description="Timezone of the cron.")


class MonitorConfig(Section):
    """`agentrft monitor`: the served model's recent traffic against the expectation suite
    and the grader, window by window."""

    traffic_file: str | None = Field(
        None, description="JSONL log of production requests the serving side appends to: rows shaped as the "
        "items (messages, tools, reference fields where known, timestamp) plus `response`, what the model "
        "answered (an OpenAI message, a chat completion or text). None: read traces_experiment.")
    traces_experiment: str | None = Field(
        "agentrft-served", description="MLflow experiment (in mlflow.tracking_uri) of `serve-model --trace-to` "
        "traces, read when traffic_file is None; reference fields come from each trace's `item` expectation.")
    window_rows: int = Field(200, ge=1, description="Requests per window (the suite's distribution checks need "
                             "200 rows, the derivation's distribution_min_rows).")
    windows: int = Field(3, ge=1, description="The most recent windows read at each run.")
    expectations_suite: str | None = Field(
        None, description="Suite the windows are checked against (None: data.expectations_suite, the one derived "
        "from earlier traffic); none at all: no drift check.")
    max_failed_expectations: int = Field(
        0, ge=0, description="Failed expectations allowed in the latest window before the run fails (drift).")
    max_score_drop: float = Field(
        0.1, ge=0, description="Largest fall of the latest window's mean score below the reference before the run "
        "fails.")
    reference_score: float | None = Field(
        None, description="The score windows are compared to (None: the oldest window read).")
    min_scored_rows: int = Field(
        20, ge=1, description="Graded answers a window needs for its score to count (rows with reference fields, "
        "or a grader that needs none).")
    cron: str = Field("15 * * * *", description="Cron of the served monitor deployment (default hourly).")


class PipelineConfig(Section):
    name: str = Field("agent-rft", description="Job name.")
    work_dir: str = Field(
        "runs", description="Where pipeline stages write outputs (rollouts, reports, checkpoints), one folder per "
        "stage and cache key."
    )
    model: ModelConfig
    data: DataConfig = Field(default_factory=DataConfig)
    tools: ToolsConfig = Field(default_factory=ToolsConfig)
    grader: dict[str, Any] = Field(
        description="OpenAI-compatible grader object (string_check, text_similarity, score_model, "
        "label_model, python, multi, endpoint, numeric, f1)."
    )
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    penalties: PenaltyConfig = Field(default_factory=PenaltyConfig)
    baseline: BaselineConfig = Field(default_factory=BaselineConfig)
    prompt_optimization: PromptOptimizationConfig = Field(default_factory=PromptOptimizationConfig)
    training: TrainingConfig = Field(default_factory=TrainingConfig)
    promotion: PromotionConfig = Field(default_factory=PromotionConfig)
    mlflow: MlflowConfig = Field(default_factory=MlflowConfig)
    schedule: ScheduleConfig = Field(default_factory=ScheduleConfig)
    monitor: MonitorConfig = Field(default_factory=MonitorConfig)

    @field_validator("grader")
    @classmethod
    def _grader_is_valid(cls, value: dict[str, Any]) -> dict[str, Any]:
        from trainer.graders import validate_grader

        validate_grader(value, where="grader")
        return value

    @property
    def registered_model(self) -> str:
        """The registry name: `promotion.registered_model`, else the job's name."""
        return self.promotion.registered_model or self.name

    def section_hash(self, *sections: str) -> str:
        """Stable hash of the named sections (all when none)."""
        dumped = self.model_dump(mode="json")
        chosen = {name: dumped[name] for name in (sections or tuple(dumped))}
        text = json.dumps(chosen, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()[:16]


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
        raise ConfigError(f"{path}: config file not found; pass a YAML file such as envs/finqa/demo.yaml or configs/job.yaml")
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


def parse_overrides(assignments: list[str] | None) -> dict[str, Any]:
    """`section.key=value` assignments (torchtune-style `--set`) as a nested mapping; each
    value is read as YAML (`2`, `true`, `[a, b]`, `null`), so types follow the config's."""
    overrides: dict[str, Any] = {}
    for assignment in assignments or []:
        path, sep, text = assignment.partition("=")
        keys = path.strip().split(".")
        if not sep or not all(keys):
            raise ConfigError(f"--set {assignment!r}: expected section.key=value, e.g. training.max_steps=2")
        try:
            value = yaml.safe_load(text) if text.strip() else ""
        except yaml.YAMLError as exc:
            raise ConfigError(f"--set {assignment!r}: the value is not valid YAML ({exc})") from None
        node = overrides
        for key in keys[:-1]:
            node = node.setdefault(key, {})
            if not isinstance(node, dict):
                raise ConfigError(f"--set {assignment!r}: {key} was already set to a value")
        node[keys[-1]] = value
    return overrides


def missing_env_vars(config: PipelineConfig) -> list[str]:
    """Names of `${VAR}` references in tool headers that the environment lacks."""
    missing = []
    for index, endpoint in enumerate(config.tools.endpoints):
        for header, value in endpoint.headers.items():
            for name in _ENV_REF.findall(value):
                if name not in os.environ:
                    missing.append(f"{name} (tools.endpoints[{index}].headers.{header})")
    return missing
