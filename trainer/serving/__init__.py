"""Serving a trained model: an OpenAI-compatible chat completions server.

Owns: `model_server.py` (`agentrft serve-model`): chat requests in, the chat format's
tool calls and reasoning out, every request optionally traced to MLflow.
May import: `trainer.generation`, `trainer.chat_formats`, `trainer.config` and the
plumbing modules. Never `rl`.
"""
