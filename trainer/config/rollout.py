"""`rollout` and `penalties`: how rollouts are sampled (limits, backend, vLLM servers) and
what is subtracted from a score to give the reward."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, NonNegativeFloat

from trainer.config.section import Section


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
    weight_source: Literal["path", "http"] = Field(
        "path", description="How servers get the weights of full and LoRA syncs: path (they read the trainer's "
        "folder: loopback, or a filesystem both sides mount), or http (the trainer serves the files and each server "
        "downloads them into a folder of its own: servers on other hosts, no shared disk).")
    weight_server_host: str = Field(
        "127.0.0.1", description="With weight_source http: the address the trainer's weight server binds to and the "
        "servers fetch from (this machine's address on their network; its port is chosen free).")
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
    prefix_cache_tokens: int = Field(
        8192, ge=0, description="Embedded engine: tokens of prompt-prefix keys and values kept for a new rollout to "
        "start from (the system prompt, tools and demonstrations every item shares; a group's whole prompt), so a "
        "shared prefix is pre-filled once. Least recently used blocks of 16 tokens go first. Memory: this times "
        "2 x layers x kv_heads x head_dim x dtype bytes (46 KB a token for SmolLM2-135M in float32). 0: off."
    )
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
