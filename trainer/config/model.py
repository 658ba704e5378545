"""`model`: which model to train and how to load it (dtype, chat format, template)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from trainer.config.section import Section


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
    chat_template: str | None = Field(
        None, description="A chat template in place of the tokenizer's: a Jinja file, or one the project ships "
        "(chatml-tools: ChatML with the tools in the system turn and Hermes <tool_call> blocks, for ChatML models "
        "whose template shows no tools). Checked at load like the tokenizer's own: it must show the tools and write "
        "calls the chat format reads back.")
    enable_thinking: bool | None = Field(
        None, description="qwen3 only: think before answering (true) or not (false); unset, the template's "
        "default (Qwen3: on). Reasoning tokens are trained like any sampled token and counted apart."
    )
