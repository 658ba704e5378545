"""Rollouts: the multi-turn agent loop over the user's tools.

Owns: the loop (`loop.py`: generate a turn, parse it with the chat format, call the tools
concurrently, append their outputs to the sampled ids, grade the final answer), the
rollout record and reward (`record.py`), the HTTP client of the tool endpoints
(`tool_client.py`, `tool_http.py`), which generator samples for the trainer
(`generators.py`), evaluations over many items (`evaluate.py`) and MLflow traces of
rollouts (`traces.py`).
May import: `trainer.generation`, `trainer.chat_formats`, `trainer.graders`,
`trainer.config` and the plumbing modules. Never `rl` or `serving`.
"""
