"""Generation: token ids in, sampled token ids and log-probabilities out.

Owns: the `GenerationBackend` seam (`backend.py`), the embedded transformers engine
(`engine.py`, with its slot KV cache and per-sequence sampling), loading a model and its
chat format (`modeling.py`, `policy.py`), vLLM as a backend (`vllm_backend.py`), the
servers it talks to and launches (`vllm_servers.py`, `vllm_launch.py`, `vllm_worker.py`)
and pushing the trainer's weights to them (`weight_sync.py`, `vllm_generator.py`).
May import: `trainer.chat_formats`, `trainer.config` and the plumbing modules at the top
of `trainer/`. Never `rollout`, `rl` or `serving`: tools, graders and losses are above it.
"""
