"""How the training processes share the model: `training.distributed`.

- `none`: one process holds everything (`num_processes` must be 1).
- `ddp`: every process holds the whole model, its gradients and optimizer state;
  gradients are averaged (Accelerate's DDP).
- `fsdp`: PyTorch's FSDP2 (`torch.distributed.fsdp.fully_shard`): each decoder layer and
  then the whole model are sharded, so a process holds 1/n of the parameters, gradients and
  AdamW state at rest, gathering one layer at a time in forward and backward. Full and LoRA
  training alike (FSDP2 shards frozen and trainable parameters in the same groups); in bf16
  on a GPU through its mixed-precision policy (bf16 compute, float32 master weights and
  gradient reduction).

`num_processes` says how many processes; `distributed` says how they share the model (left
unset: `none` for one process, `ddp` for several); `accelerate_config` only says where they
run (machines, GPU ids, ports), and one that sets a distributed type of its own is refused.

This module calls `fully_shard` itself rather than through Accelerate's FSDP plugin, which
runs the same calls but only on GPUs: this way the sharding that trains on GPUs is the one
that the CPU tests run with two gloo processes.

Sampling needs the whole model: every process keeps an unsharded copy (`WholeCopy`) for the
embedded engine and for vLLM weight syncs, refreshed from the shards after every optimizer
step (one all-gather per parameter; the copy holds no gradients and no optimizer state).
The KL reference without LoRA is sharded like the policy; with LoRA it is the policy with
its adapters disabled, as under DDP. Checkpoints are sharded (torch.distributed.checkpoint:
each process writes its own shards, a resumed run reads them back, on the same number of
processes or another); model directories (`best/`, `final/`, the registry) are written
whole from the gathered state.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch

from trainer.errors import ConfigError

MODEL_DIR = "model_shards"


def resolved_distributed(training: Any) -> str:
    """`training.distributed` with its default: none for one process, ddp for several."""
    if training.distributed is not None:
        return training.distributed
    return "none" if training.num_processes == 1 else "ddp"


def one_process_group(device: torch.device) -> None:
    """FSDP on one process (one GPU) still needs a process group: a world of one."""
    import torch.distributed as dist

    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules FSDP shards one by one: the model's own no-split classes (its decoder
    layers, as transformers names them in `_no_split_modules`)."""
    names: set[str] = set()
    for module in model.modules():
        names.update(getattr(module, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise ConfigError(
            f"training.distributed: fsdp found no decoder layers in {type(model).__name__} (no "
            "_no_split_modules); use ddp for this model"
        )
    return layers


def shard(model: torch.nn.Module, *, mixed_precision: str) -> torch.nn.Module:
    """Shard `model` in place over every process (FSDP2): each decoder layer, then the root
    (embeddings, final norm, output projection)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if mixed_precision == "fp16":
        raise ConfigError("training.distributed: fsdp trains in bf16 or float32; set training.mixed_precision "
                          "to bf16 (or no)")
    policy = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
              if mixed_precision == "bf16" else MixedPrecisionPolicy())
    for layer in decoder_layers(model):
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return model


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The whole state of a sharded model, on every process (a collective: every process
    calls it at the same point)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))


class WholeCopy:
    """An unsharded copy of the model that sampling reads, refreshed from the shards."""

    def __init__(self, model: torch.nn.Module):
        self.model = copy.deepcopy(model).requires_grad_(False).eval()

    def refresh(self, sharded: torch.nn.Module) -> None:
        state = full_state_dict(sharded)
        with torch.no_grad():
            own = self.model.state_dict()
            for name, tensor in state.items():
                own[name].copy_(tensor)


def save_sharded(model: torch.nn.Module, optimizer: torch.optim.Optimizer, path: Path) -> None:
    """Every process writes its shards of the model and optimizer state under `path`."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optimizer_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=str(path / MODEL_DIR))


def load_sharded(model: torch.nn.Module, optimizer: torch.optim.Optimizer, path: Path) -> None:
    """Read what `save_sharded` wrote back into the sharded model and optimizer."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_state, optimizer_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optimizer_state}
    dcp.load(state, checkpoint_id=str(path / MODEL_DIR))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])


def clip_grad_norm(parameters: list[torch.nn.Parameter], max_norm: float) -> float:
    """Clip the gradients of sharded parameters by their global norm; returns the norm."""
    from torch.distributed.tensor import DTensor

    grads = [p for p in parameters if p.grad is not None]
    norm = torch.nn.utils.clip_grad_norm_(grads, max_norm)
    return float(norm.full_tensor() if isinstance(norm, DTensor) else norm)


def resolved_mixed_precision(setting: str) -> str:
    """`auto`: bf16 on a GPU, none on CPUs; any other setting as it is."""
    import torch

    if setting != "auto":
        return setting
    return "bf16" if torch.cuda.is_available() else "no"
