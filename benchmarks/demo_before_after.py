"""Before/after table of the demo's training, in the terms of OpenAI's Agent RFT talk.

The base model and a trained one run on the same held-out items with the same seeds and
k samples each, under the same settings; printed side by side: mean score (with the
paired bootstrap 95% interval of the gain), best-of-k, tool calls per rollout, generated
tokens per rollout, latency p50, and the relative change of each.

    .venv/bin/python benchmarks/demo_before_after.py [--config configs/demo.yaml]
        [--after models:/finqa-agent@challenger] [--items 128] [--k 4] [--json out.json]

`--after` takes a path or a registry URI (default: the registered `challenger`, the
newest model the pipeline trained). 128 items x 4 samples = 512 rollouts per model: about
+-4 points of noise on the mean score, which the interval shows.
"""

from __future__ import annotations

import argparse
import json
import time

from rich.console import Console
from rich.table import Table

from envs.finqa.demo_model import resolve_base_model
from tasks.evaluate import compare
from tasks.rollout_eval import eval_items, evaluate_model
from trainer.config import load_config

ROWS = (("score_mean", "score"), ("best_of_k_mean", "best-of-k"), ("tool_calls_mean", "tool calls / rollout"),
        ("tokens_mean", "generated tokens / rollout"), ("latency_s_p50", "latency p50 (s)"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="configs/demo.yaml")
    parser.add_argument("--before", default=None, help="Default: the config's base model.")
    parser.add_argument("--after", default=None, help="Default: models:/<registered model>@challenger.")
    parser.add_argument("--items", type=int, default=128)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    config = load_config(args.config)
    before = args.before or resolve_base_model(config)
    after = args.after or f"models:/{config.promotion.registered_model}@challenger"
    items = eval_items(config, args.items)
    summaries = {}
    for label, model in (("before", before), ("after", after)):
        started = time.perf_counter()
        summary, _ = evaluate_model(config, model, items, k=args.k, seed=config.baseline.seed, prefix=label)
        summaries[label] = summary
        print(f"{label}: {model}: {len(items)} items x {args.k} in {time.perf_counter() - started:.0f}s")
    gain = compare((summaries["before"], "before"), (summaries["after"], "after"), config)["score_gain"]

    table = Table(title=f"before / after: {len(items)} held-out items x {args.k} samples, same seeds")
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
