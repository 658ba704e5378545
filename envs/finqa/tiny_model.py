"""A tiny Qwen3 for the demo (and the tests' taught models), built here from a seed.

The demo cannot download a model, so it builds one: a Qwen3 decoder of about a million
parameters, sized so that rollouts and GRPO steps run on a 2-core CPU, with the demo
tokenizer's vocabulary (`envs.finqa.tokenizer.build_tokenizer`). Supervised warm-starting
happens in `envs.finqa.demo_model`; here the weights are a seeded random init. Qwen3 rather
than Qwen2 because transformers 5 swaps Qwen's own tokenizer in for `model_type: qwen2`,
and the demo's tokenizer must stay the one it was saved with.
"""

from __future__ import annotations

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from trainer.errors import ConfigError


def tiny_config(
    vocab_size: int,
    *,
    hidden_size: int = 128,
    num_layers: int = 4,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 384,
    max_position_embeddings: int = 2048,
    tie_word_embeddings: bool = True,
    pad_token_id: int = 0,
    eos_token_id: int = 2,
) -> Qwen3Config:
    """A small Qwen3 config. The token ids default to `build_tokenizer`'s layout
    (`<|endoftext|>` = 0 is pad, `<|im_end|>` = 2 is eos)."""
    if hidden_size % num_heads or num_heads % num_kv_heads:
        raise ConfigError(
            f"tiny model: hidden_size={hidden_size} must be a multiple of num_heads={num_heads}, "
            f"and num_heads a multiple of num_kv_heads={num_kv_heads}"
        )
    return Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        # Qwen3's default head_dim is 128 whatever the width; a tiny model needs its own.
        head_dim=hidden_size // num_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        pad_token_id=pad_token_id,
        eos_token_id=eos_token_id,
    )


def build_model(config: Qwen3Config, seed: int) -> Qwen3ForCausalLM:
    """A randomly initialised model; the same config and seed give the same weights."""
    # fork_rng: seeding here must not move the caller's global random stream.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3ForCausalLM(config)
    model.generation_config.pad_token_id = config.pad_token_id
    model.generation_config.eos_token_id = config.eos_token_id
    return model


def count_parameters(model: torch.nn.Module, *, trainable_only: bool = False) -> int:
    """Number of parameters; tied weights (embedding and LM head) count once."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)
