"""The policy: a chat model, its tokenizer and a generation backend over them.

`load_policy` takes a local path or a hub id (the demo's bootstrapped model is a local
path), puts the model on the GPU when there is one (bf16 there, float32 on CPU unless the
config says otherwise), and builds the KV-cache-keeping generation engine for rollouts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from trainer.engine import TransformersBackend
from trainer.modeling import load_model_and_tokenizer


def pick_device(device: str = "auto") -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def pick_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, dtype)


@dataclass
class Policy:
    model: Any
    tokenizer: Any
    path: str

    @property
    def stop_token_ids(self) -> list[int]:
        ids = {self.tokenizer.eos_token_id}
        generation_config = getattr(self.model, "generation_config", None)
        extra = getattr(generation_config, "eos_token_id", None)
        if isinstance(extra, int):
            ids.add(extra)
        elif extra:
            ids.update(extra)
        return sorted(i for i in ids if i is not None)

    def backend(self, *, max_slots: int = 64, max_len: int = 2048, seed: int = 0) -> TransformersBackend:
        self.model.eval()
        return TransformersBackend(
            self.model, stop_token_ids=self.stop_token_ids, max_slots=max_slots, max_len=max_len, seed=seed
        )


def load_policy(path_or_id: str, *, device: str = "auto", dtype: str = "auto") -> Policy:
    target = pick_device(device)
    model, tokenizer = load_model_and_tokenizer(str(path_or_id), device=target, dtype=pick_dtype(dtype, target))
    if getattr(model.config, "_attn_implementation", None) not in ("sdpa", "eager"):
        model.config._attn_implementation = "sdpa"
    return Policy(model=model, tokenizer=tokenizer, path=str(path_or_id))
