"""`training`: GRPO's hyperparameters (named as in OpenAI's fine-tuning API, the loss
options as in TRL's GRPOConfig), LoRA, distribution, and how OpenAI's "auto" values
resolve."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import (
    Field,
    NonNegativeFloat,
    PositiveFloat,
    PositiveInt,
    field_validator,
    model_validator,
)

from trainer.config.section import Auto, Section
from trainer.errors import ConfigError


class LoraConfig(Section):
    r: int = Field(16, ge=1, description="LoRA rank.")
    alpha: int = Field(32, ge=1, description="LoRA alpha.")
    dropout: float = Field(0.0, ge=0, lt=1, description="LoRA dropout.")
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"], description="Modules to adapt."
    )


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
    shared_prefix: bool = Field(
        True, description="Forward a group's shared prompt once per micro-batch, its rollouts packed after it under a "
        "shared-prefix mask (micro-batches hold whole groups): the same log-probabilities and gradients as forwarding "
        "each rollout whole, in P + G*R tokens instead of G*(P+R). Checked against the plain forward on the first "
        "micro-batch; a model it does not hold for (attention other than sdpa or eager, linear-attention layers) "
        "trains without it, and the log says why."
    )
    logprob_chunk_tokens: int = Field(
        512, ge=16, description="Generated tokens per chunk of the output projection and log-softmax: the "
        "update holds at most two float32 [chunk, vocabulary] tensors at once (about 600 MiB at Qwen's 151,936)."
    )
    gradient_checkpointing: bool = Field(False, description="Trade compute for memory.")
    lora: LoraConfig | None = Field(None, description="Train LoRA adapters (merged at save).")
    mixed_precision: Literal["auto", "no", "bf16", "fp16"] = Field("auto", description="auto: bf16 on GPU.")
    num_processes: int = Field(1, ge=1, description="Training processes in all, over every node (one per GPU; on "
                               "CPUs, gloo processes); a multiple of `nodes`.")
    nodes: int = Field(
        1, ge=1, description="Machines the processes run on. Past one, each node runs `agentrft train` with its rank "
        "and the rendezvous endpoint in its environment (AGENTRFT_NODE_RANK or NODE_RANK or SLURM_NODEID; "
        "AGENTRFT_RDZV_ENDPOINT or MASTER_ADDR:MASTER_PORT), and output_dir must be a folder every node sees.")
    collective_timeout_s: float = Field(
        1800.0, gt=0, description="How long a process waits in a collective (a gradient all-reduce, a gather) for "
        "the others: past it a node that died is named and the run ends, from the last checkpoint.")
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
    deployment: str | None = Field(
        None, description="Run the pipeline's training stage as this Prefect deployment (`rft-training/training`, "
        "which `agentrft deploy --training-pool POOL` registers on its own work pool, e.g. the GPU machines'), "
        "its result read back; None: in the pipeline's own process.")

    @field_validator("scale_rewards", mode="before")
    @classmethod
    def _scale_rewards_bool(cls, value: Any) -> Any:
        # TRL takes True/False as well: True is "group", False is "none".
        return {True: "group", False: "none"}.get(value, value) if isinstance(value, bool) else value

    @model_validator(mode="after")
    def _processes_fill_the_nodes(self) -> TrainingConfig:
        if self.num_processes % self.nodes:
            raise ConfigError(f"training.num_processes ({self.num_processes}) must be a multiple of training.nodes "
                              f"({self.nodes}): every node runs as many processes")
        return self

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
