"""The policy: a chat model, its tokenizer, its chat format and a generation backend over them.

`load_policy` takes a local path or a hub id (the demo's bootstrapped model is a local
path), puts the model on the GPU when there is one (bf16 there, float32 on CPU unless the
config says otherwise), checks its chat format against its template, and builds the
KV-cache-keeping generation engine for rollouts.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from trainer.chat_formats import ChatFormat, load_chat_format
from trainer.errors import ConfigError
from trainer.generation.engine import TransformersBackend
from trainer.generation.modeling import load_model_and_tokenizer


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
    chat: ChatFormat | None = None  # None: the family `auto` detects from the tokenizer

    def __post_init__(self) -> None:
        if self.chat is None:
            self.chat = load_chat_format(self.tokenizer)

    @property
    def stop_token_ids(self) -> list[int]:
        """The chat format's end-of-turn tokens and the model's own eos ids."""
        ids = {self.tokenizer.eos_token_id, *self.chat.stop_token_ids}
        generation_config = getattr(self.model, "generation_config", None)
        extra = getattr(generation_config, "eos_token_id", None)
        if isinstance(extra, int):
            ids.add(extra)
        elif extra:
            ids.update(extra)
        return sorted(i for i in ids if i is not None)

    def backend(self, *, max_slots: int = 64, max_len: int = 2048, seed: int = 0,
                prefix_cache_tokens: int = 8192) -> TransformersBackend:
        self.model.eval()
        return TransformersBackend(
            self.model, stop_token_ids=self.stop_token_ids, max_slots=max_slots, max_len=max_len, seed=seed,
            prefix_cache_tokens=prefix_cache_tokens,
        )


def load_policy(path_or_id: str, *, device: str = "auto", dtype: str = "auto", chat_format: str = "auto",
                enable_thinking: bool | None = None, chat_template: str | None = None) -> Policy:
    target = pick_device(device)
    model, tokenizer = load_model_and_tokenizer(str(path_or_id), device=target, dtype=pick_dtype(dtype, target))
    if getattr(model.config, "_attn_implementation", None) not in ("sdpa", "eager"):
        model.config._attn_implementation = "sdpa"
    chat = load_chat_format(tokenizer, chat_format, enable_thinking=enable_thinking, chat_template=chat_template)
    return Policy(model=model, tokenizer=tokenizer, path=str(path_or_id), chat=chat)


def load_config_policy(model_section: Any, path_or_id: str | None = None, *, device: str | None = None,
                       dtype: str | None = None) -> Policy:
    """The policy a config's `model` section describes (another path, device or dtype may
    stand in for the section's)."""
    return load_policy(path_or_id or model_section.base_model, device=device or model_section.device,
                       dtype=dtype or model_section.dtype, chat_format=model_section.chat_format,
                       enable_thinking=model_section.enable_thinking, chat_template=model_section.chat_template)


def use_mlflow_store(tracking_uri: str) -> None:
    """Point MLflow's process-wide tracking and registry URIs at one store (MLflow's
    fluent calls, model logging, traces and `models:/` downloads all read them)."""
    import mlflow

    mlflow.set_tracking_uri(tracking_uri)
    mlflow.set_registry_uri(tracking_uri)


def local_model_path(uri: str, *, tracking_uri: str | None = None, cache_dir: Path | None = None) -> str:
    """A local directory for a `models:/...` URI (downloaded from the MLflow registry);
    other values are returned as they are (a path or a hub id)."""
    if not uri.startswith("models:/"):
        return uri
    import hashlib
    import shutil

    import mlflow

    if tracking_uri:
        use_mlflow_store(tracking_uri)
    store = mlflow.get_tracking_uri()
    # Aliases move and registries differ: one folder per (store, uri), fetched afresh.
    key = hashlib.sha256(f"{store}|{uri}".encode()).hexdigest()[:16]
    target = Path(cache_dir or Path.home() / ".cache/agentrft/models") / key
    shutil.rmtree(target, ignore_errors=True)
    try:
        local = Path(mlflow.artifacts.download_artifacts(artifact_uri=uri, dst_path=str(target)))
    except Exception as exc:  # MLflow raises its own exception types for unknown models
        raise ConfigError(f"model {uri!r} could not be downloaded from the MLflow registry: {exc}") from exc
    configs = sorted(local.rglob("config.json"), key=lambda p: len(p.parts))
    if not configs:
        raise ConfigError(f"model {uri!r} holds no transformers model (no config.json under {local})")
    return str(configs[0].parent)


def load_registered_policy(uri: str, *, tracking_uri: str | None = None, device: str = "auto",
                           chat_format: str = "auto", enable_thinking: bool | None = None) -> Policy:
    """A registered model loaded through MLflow's transformers flavour."""
    import mlflow

    if tracking_uri:
        use_mlflow_store(tracking_uri)
    try:
        components = mlflow.transformers.load_model(uri, return_type="components", device=None)
    except Exception as exc:
        raise ConfigError(f"model {uri!r} could not be loaded from the MLflow registry: {exc}") from exc
    model, tokenizer = components["model"], components["tokenizer"]
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    chat = load_chat_format(tokenizer, chat_format, enable_thinking=enable_thinking)
    return Policy(model=model.to(pick_device(device)).eval(), tokenizer=tokenizer, path=uri, chat=chat)
