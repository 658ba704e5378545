"""Building a training run's parts: the processes Accelerate may run, the model (LoRA,
gradient checkpointing, FSDP2), its reference copy and the optimizer."""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

import torch

from trainer.errors import ConfigError
from trainer.rl.sharding import WholeCopy, one_process_group, shard


def refuse_sharded_launch(accelerate_config: str | None) -> None:
    """An accelerate config that asks Accelerate for FSDP or DeepSpeed is refused before
    Accelerate starts them: sharding is `training.distributed` (trainer/rl/sharding.py), one
    way to say it. DeepSpeed is not offered: its engine runs its own gradient accumulation
    and clipping, which would override the trainer's, and it does not run on the CPU
    machines the tests use; FSDP2 shards what ZeRO-3 does."""
    if not accelerate_config:
        return
    import yaml

    path = Path(accelerate_config)
    try:
        settings = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"training.accelerate_config: cannot read {path} ({exc})") from None
    kind = str(settings.get("distributed_type", "")).upper()
    if kind in ("DEEPSPEED", "FSDP") or settings.get("deepspeed_config") or settings.get("fsdp_config"):
        raise sharded_error(f"training.accelerate_config {path}: {kind or 'DeepSpeed/FSDP'}")


def sharded_error(what: str) -> ConfigError:
    return ConfigError(f"{what}: the trainer shards the model itself; set training.distributed: fsdp (FSDP2, "
                       "what DeepSpeed ZeRO-3 does) or ddp, and keep the accelerate config to where the processes "
                       "run (machines, GPU ids)")


def check_processes(acc: Any, distributed: str) -> None:
    """The processes Accelerate runs are the ones that were started, and they agree with
    `training.distributed`; under FSDP this process's group is set up."""
    from accelerate.utils import DistributedType

    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if launched != acc.num_processes:
        raise ConfigError(
            f"started as one of {launched} processes (WORLD_SIZE) but Accelerate runs this one alone, "
            "so they would overwrite each other's outputs; on a machine without a GPU set "
            "ACCELERATE_USE_CPU=true, or start `agentrft train` and let it launch them"
        )
    if acc.distributed_type in (DistributedType.FSDP, DistributedType.DEEPSPEED):  # set by the environment
        raise sharded_error(f"{acc.distributed_type.value} (from the ACCELERATE_* environment)")
    if distributed == "none" and acc.num_processes > 1:
        raise ConfigError(f"training.distributed is none but {acc.num_processes} processes were started: "
                          "set training.distributed to ddp or fsdp")
    if distributed == "fsdp":
        one_process_group(acc.device)


def build_model(model: torch.nn.Module, acc: Any, training: Any, *, distributed: str, mixed_precision: str,
                learning_rate: float) -> tuple[Any, Any, torch.nn.Module | None, WholeCopy | None]:
    """The trained model and its optimizer (prepared by Accelerate, or sharded with FSDP2),
    the frozen reference for the KL term (full fine-tuning only: with LoRA the base model
    with its adapters off is the reference) and, under FSDP, the unsharded copy that samples."""
    reference = None
    if training.uses_reference and training.lora is None:
        reference = copy.deepcopy(model).eval().requires_grad_(False)
        if distributed == "fsdp":
            shard(reference, mixed_precision=mixed_precision)
    if training.lora is not None:
        from peft import LoraConfig as PeftLoraConfig
        from peft import get_peft_model

        model = get_peft_model(model, PeftLoraConfig(
            r=training.lora.r, lora_alpha=training.lora.alpha, lora_dropout=training.lora.dropout,
            target_modules=list(training.lora.target_modules), task_type="CAUSAL_LM",
        ))
    if training.gradient_checkpointing:
        enable = getattr(model, "activation_checkpointing_enable", None)
        if enable is not None:
            enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:  # transformers before activation_checkpointing_enable (5.17 has only this name)
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    whole = None
    if distributed == "fsdp":
        whole = WholeCopy(model)
        shard(model, mixed_precision=mixed_precision)
    optimizer = torch.optim.AdamW(  # after sharding: FSDP replaces the parameters
        [p for p in model.parameters() if p.requires_grad], lr=learning_rate, weight_decay=training.weight_decay,
    )
    if distributed == "fsdp":
        return model, optimizer, reference, whole  # sharded here, not wrapped by Accelerate
    model, optimizer = acc.prepare(model, optimizer)
    return model, optimizer, reference, whole
