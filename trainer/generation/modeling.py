"""Loading the policy model: any causal chat model, from a local directory or a hub id.

`load_model_and_tokenizer` loads either through the Auto classes (HF_HUB_OFFLINE=1 keeps it
to the local cache) and insists on a chat template, since rollouts render conversations
and tool calls with it.
"""

from __future__ import annotations

import os
import threading

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from trainer.errors import ConfigError

# transformers' `from_pretrained` sets process-wide state while it builds a model (the
# default dtype, weight-init and weight-tying switches, meta-device patches), so two threads
# loading at once break each other ("Cannot copy out of meta tensor", untied heads). Two
# pipeline runs in one process (Prefect task threads) do load at once: loads take turns.
_LOADING = threading.Lock()


def load_model_and_tokenizer(
    path_or_id: str,
    *,
    device: str | torch.device | None = None,
    dtype: str | torch.dtype | None = None,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a causal chat model and its tokenizer from a local directory or a hub id.

    `device` defaults to CUDA when available, else CPU; `dtype` ("bfloat16", a torch dtype,
    "auto") defaults to what the checkpoint was saved in. The tokenizer must carry a chat
    template; a missing pad token falls back to eos (Llama-3 ships none).
    """
    if isinstance(dtype, str) and dtype != "auto":
        if not isinstance(getattr(torch, dtype, None), torch.dtype):
            raise ConfigError(f"model dtype {dtype!r} is not a torch dtype; use e.g. 'bfloat16'")
        dtype = getattr(torch, dtype)
    try:
        with _LOADING:
            tokenizer = AutoTokenizer.from_pretrained(path_or_id)
            model = AutoModelForCausalLM.from_pretrained(path_or_id, dtype=dtype or "auto")
    except (OSError, ValueError) as exc:  # missing files / not a model directory
        raise _not_loadable(path_or_id, exc) from exc
    _check_tokenizer(path_or_id, tokenizer)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    return model.to(device), tokenizer


def load_tokenizer(path_or_id: str) -> PreTrainedTokenizerBase:
    """The model's tokenizer alone (what choosing its chat format needs), no weights."""
    try:
        with _LOADING:
            tokenizer = AutoTokenizer.from_pretrained(path_or_id)
    except (OSError, ValueError) as exc:
        raise _not_loadable(path_or_id, exc) from exc
    _check_tokenizer(path_or_id, tokenizer)
    return tokenizer


def _not_loadable(path_or_id: str, exc: Exception) -> ConfigError:
    offline = os.environ.get("HF_HUB_OFFLINE", "0")
    return ConfigError(
        f"model {path_or_id!r} could not be loaded (HF_HUB_OFFLINE={offline}): it must be "
        f"a local directory with config.json and tokenizer files, or a hub id that is "
        f"reachable or already in the Hugging Face cache ({exc})"
    )


def _check_tokenizer(path_or_id: str, tokenizer: PreTrainedTokenizerBase) -> None:
    if not tokenizer.chat_template:
        raise ConfigError(
            f"model {path_or_id!r} has no chat template in its tokenizer; use a chat "
            "(instruct) model whose template renders tool calls"
        )
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
