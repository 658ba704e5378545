"""The pipeline config: one typed model per section, loaded from one YAML file.

Owns: every section's fields and defaults (`model`, `data`, `tools`, `rollout`,
`penalties`, `baseline`, `prompt_optimization`, `warm_start`, `training`, `promotion`, `mlflow`,
`schedule`, `monitor`), each in the module named after it, `PipelineConfig` that holds
them (`pipeline.py`) and loading with overrides (`loading.py`).
May import: `trainer.errors`, `trainer.wire` and `trainer.graders` (to check a grader when
the file loads). Every other package reads it; it reads none of them.
"""
