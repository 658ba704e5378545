"""Before/after table of the demo's training, in the terms of OpenAI's Agent RFT talk.

The base model and a trained one run on the same validation items (`--split test`: the
test items, a reading of the test split that is appended to the job's ledger like any
other, tasks/ledger.py) with the same seed and k samples each, under the demo
config's rollout settings, penalties, grader and tools (the FinQA tool server is started on
the port its endpoints name); printed side by side: mean score (with the paired bootstrap
95% interval of the gain, as the regression stage computes it), best-of-k, tool calls per
rollout, generated tokens per rollout, latency p50, and the relative change of each.

    .venv/bin/python -m benchmarks.demo_before_after [--config envs/finqa/demo.yaml]
        [--after models:/finqa-agent@challenger] [--items 128] [--k 4] [--split validation] [--json out.json]

`--after` takes a path or a registry URI (default: the registered `challenger`, the newest
model the pipeline trained). 128 items x 4 samples = 512 rollouts per model: about +-4
points of noise on the mean score, which the interval shows.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from envs.finqa.demo import DEMO_CONFIG, tool_server
from tasks.evaluate import compare
from trainer.config.loading import load_config
from trainer.data import split_items
from trainer.generation.policy import load_policy, local_model_path
from trainer.rollout.evaluate import EvalSummary, run_evaluation
from trainer.rollout.record import RolloutSettings
from trainer.rollout.tool_client import ToolClient

ROWS = (("score_mean", "score"), ("best_of_k_mean", "best-of-k"), ("tool_calls_mean", "tool calls / rollout"),
        ("tokens_mean", "generated tokens / rollout"), ("latency_s_p50", "latency p50 (s)"))


def evaluate(config, model: str, items: list[dict], k: int, prefix: str) -> EvalSummary:
    """k rollouts per item of `model` through the embedded engine, the job's way."""
    tracking_uri = os.environ.get("MLFLOW_TRACKING_URI") or config.mlflow.tracking_uri
    policy = load_policy(local_model_path(model, tracking_uri=tracking_uri), device=config.model.device,
                         dtype=config.model.dtype)
    seed = config.baseline.seed
    backend = policy.backend(max_slots=config.rollout.max_concurrent_rollouts,
                             max_len=config.rollout.max_total_tokens, seed=seed)
    summary, _ = run_evaluation(
        backend, policy.chat, items, k=k, tool_client=ToolClient.from_config(config.tools, seed=seed),
        grader=config.grader, settings=RolloutSettings.from_config(config.rollout, config.penalties),
        tools=config.tools.schemas, max_concurrent=config.rollout.max_concurrent_rollouts, prefix=prefix,
    )
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default=str(DEMO_CONFIG))
    parser.add_argument("--before", default=None, help="Default: the config's base model.")
    parser.add_argument("--after", default=None, help="Default: models:/<registered model>@challenger.")
    parser.add_argument("--items", type=int, default=128, help="items of the split")
    parser.add_argument("--split", choices=("validation", "test"), default="validation",
                        help="test: a reading of the test split, recorded in the ledger")
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    config = load_config(args.config)
    before = args.before or config.model.base_model
    after = args.after or f"models:/{config.registered_model}@challenger"
    items = split_items(config.data, args.split, args.items)
    if args.split == "test":
        from tasks.ledger import record_reading

        found = record_reading(config.data, command="benchmarks/demo_before_after.py --split test",
                               config=config.name, config_hash=config.section_hash(), model=after)
        if found is not None:
            print(found.sentence())
    summaries = {}
    with tool_server(config, Path(config.data.train_file).parent / "corpus"):
        for label, model in (("before", before), ("after", after)):
            started = time.perf_counter()
            summaries[label] = evaluate(config, model, items, args.k, label)
            print(f"{label}: {model}: {len(items)} items x {args.k} in {time.perf_counter() - started:.0f}s")
    gain = compare((summaries["before"], "before"), (summaries["after"], "after"),
                   samples=config.promotion.bootstrap_samples, seed=config.baseline.seed)["score_gain"]

    table = Table(title=f"before / after: {len(items)} {args.split} items x {args.k} samples, same seed")
    for column in ("figure", "before", "after", "change"):
        table.add_column(column, justify="left" if column == "figure" else "right")
    rows = {}
    for key, label in ROWS:
        b, a = summaries["before"].metrics[f"before/{key}"], summaries["after"].metrics[f"after/{key}"]
        rows[key] = {"before": b, "after": a, "relative": (a - b) / b if b else None}
        table.add_row(label, f"{b:.4g}", f"{a:.4g}", f"{(a - b) / b:+.1%}" if b else "n/a")
    console = Console()
    console.print(table)
    console.print(f"score gain {gain['gain'] * 100:+.1f} points, 95% CI [{gain['low'] * 100:+.1f}, "
                  f"{gain['high'] * 100:+.1f}] (paired bootstrap over items)")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"before": before, "after": after, "items": len(items), "k": args.k, "rows": rows,
                       "score_gain": gain}, handle, indent=2)


if __name__ == "__main__":
    main()
