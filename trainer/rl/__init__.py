"""The RL update: GRPO on Accelerate.

Owns: the training run (`grpo.py`), building its model, optimizer and processes
(`setup.py`), batches and dynamic sampling (`batches.py`), the policy update
(`update.py`) and its losses (`loss.py`), sharding and precision (`sharding.py`),
checkpoints (`checkpoint.py`), metrics sent to MLflow (`metrics.py`) and starting the
processes (`launch.py`, which calls the trainer; the trainer never calls it).
May import: `trainer.rollout`, `trainer.generation`, `trainer.chat_formats`,
`trainer.graders`, `trainer.config` and the plumbing modules. Nothing in `trainer/`
imports it.
"""
