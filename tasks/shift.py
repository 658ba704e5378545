"""Shift evaluations: a trained model against the base model on a split that asks another
question than the test split (later periods, new customers).

The test split answers "is the candidate better at the task it was trained on?"; a shift
split answers "does the gain carry to data unlike the training data?". Both deserve an
answer, under their own names: each shift split is declared in `data.shift_evaluations`
with what it measures, read only by `agentrft shift NAME` (never by a stage), and every
reading is counted in the test ledger beside the test split's. The evaluation is the
regression stage's, run the same way: both models on the same items with the same seeds
and k samples, under the prompt variant the pipeline chose, the score gain with its paired
item-bootstrap interval, tool calls and tokens as relative changes. It decides nothing:
promotion is the test split's.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from tasks.evaluate import compare
from tasks.ledger import ledger_path, record_reading, tag_run
from tasks.rollout_eval import apply_variant, evaluate_model
from tasks.tracking import mlflow_client, resolve_tracking_uri
from trainer.data import read_items
from trainer.errors import ConfigError


def shift_split(config: Any, name: str) -> Any:
    """The declared shift evaluation `name`; an error lists the declared ones."""
    declared = config.data.shift_evaluations
    if name not in declared:
        raise ConfigError(f"data.shift_evaluations has no {name!r}; declared: {', '.join(sorted(declared)) or 'none'}")
    return declared[name]


def shift_evaluation(config: Any, name: str, model: str, *, variant: str | None = None, log: Any = print
                     ) -> dict[str, Any]:
    """`model` and the base model on shift split `name`, paired; the reading is recorded."""
    from mlflow.entities import Metric

    split = shift_split(config, name)
    chosen = None
    if variant not in (None, "current"):  # "current": the config's own prompt, as the prompt stage names it
        chosen = next((v for v in config.prompt_optimization.variants if v.name == variant), None)
        if chosen is None:
            known = ", ".join(v.name for v in config.prompt_optimization.variants) or "none"
            raise ConfigError(f"--variant {variant!r} is not among prompt_optimization.variants ({known}) "
                              "nor `current` (the config's prompt)")
    p = config.promotion
    items = read_items(Path(split.file), p.max_items)
    rollout, tools = apply_variant(config.rollout, config.tools, chosen, items)
    tracking_uri = resolve_tracking_uri(config.mlflow.tracking_uri)
    summaries = {}
    for role, path in (("baseline", config.model.base_model), ("candidate", model)):
        log(f"shift {name}: {role} on {len(items)} items x {p.k}")
        summaries[role], _ = evaluate_model(
            path, items, tracking_uri=tracking_uri, model_section=config.model, tools=tools, grader=config.grader,
            rollout=rollout, penalties=config.penalties, k=p.k, seed=config.baseline.seed, prefix=role,
            group_by=p.group_by, log=log)
    comparison = compare((summaries["baseline"], "baseline"), (summaries["candidate"], "candidate"),
                         samples=p.bootstrap_samples, seed=config.baseline.seed)
    client = mlflow_client(tracking_uri)
    experiment = client.get_experiment_by_name(config.mlflow.experiment)
    run_id = client.create_run(
        experiment.experiment_id if experiment else client.create_experiment(config.mlflow.experiment),
        run_name=f"shift: {name}", tags={"stage": "shift_evaluation", "shift.name": name, "shift.measures":
                                         split.measures[:5000], "candidate": model}).info.run_id
    gain = comparison["score_gain"]
    metrics = {**summaries["baseline"].metrics, **summaries["candidate"].metrics, "shift/gain": gain["gain"],
               "shift/gain_low": gain["low"], "shift/gain_high": gain["high"]}
    client.log_batch(run_id, metrics=[Metric(key, float(value), int(time.time() * 1000), 0)
                                      for key, value in metrics.items()])
    found = record_reading(config.data, command=f"agentrft shift {name}", config=config.name,
                           config_hash=config.section_hash(), config_written_hash=config.written_hash(), model=model,
                           mlflow_run_id=run_id, split_file=split.file)
    tag_run(client, run_id, found)
    client.set_terminated(run_id)
    return {"name": name, "measures": split.measures, "file": split.file, "items": len(items), "k": p.k,
            "variant": variant, "comparison": comparison, "mlflow_run_id": run_id,
            "readings": found.sentence() if found is not None else None,
            "ledger": str(ledger_path(config.data)) if found is not None else None}
