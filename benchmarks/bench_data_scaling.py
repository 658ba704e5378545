"""How many examples it takes, and the spread over training seeds: the demo's RL stage on
10, 100, 1,000 and all 2,000 training items, three training seeds each, scored on the
validation split alone (the test split is never read: every run stops after
`rft_training`).

OpenAI's Agent RFT talk says a model improves "from as few as 10 examples", and that one
customer's 100 -> 1,000 examples "significantly boosted performance". Each arm here runs
the demo's pipeline (`agentrft demo --stop-after rft_training`) with the demo config and
the same training budget, 20 steps of 8 items (`training.max_steps` of the demo config):
the 10-item arm repeats its items 16 times, the 1,000-item arm sees a sixth of them once,
and the all-items arm with the demo's seed is the demo's own training. One more arm, 1,000
items for a full epoch (125 steps), measures what more data buys with more compute.

Every candidate (the checkpoint the stage picks on validation, as the pipeline does) is
then scored on all 250 validation items, k samples each, the same seed for every model,
against the base model on the same rollout seeds: the paired item bootstrap gives each run's
interval, and the arms' seeds give the spread between training runs.

Each arm takes 12-15 minutes on 2 CPU cores (20 GRPO steps and 1,000 validation
rollouts), the epoch arm about 70: about 3 hours for the default arms, 40 minutes more
with `--items ... all`. Finished arms are kept in `--out` (one JSON each, committed in
`benchmarks/data_scaling/`), keyed by the code that makes them: the git trees of the
trainer, tasks, envs, flows and configs, `data.dvc`, `pyproject.toml` and this script. A
run resumes them, so a change to docs or to another benchmark keeps them and a change to
that code reruns them. Each arm has its own MLflow store (under `--stores`), so arms with
disjoint `--items`/`--seeds` can run as separate processes side by side (each with its own
`PREFECT_HOME`); the base model's validation scores are kept beside the arms the same way.

    .venv/bin/python -m benchmarks.bench_data_scaling [--items 10 100 1000] [--seeds 42 43 44]
        [--epoch-items 1000] [--k 4] [--out benchmarks/data_scaling] [--json rows.json]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import pickle
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

from envs.finqa.demo import DEMO_CONFIG, ensure_data, tool_server
from flows.demo import run_demo
from tasks.evaluate import compare
from tasks.rollout_eval import evaluate_model
from trainer.config.loading import load_config
from trainer.data import split_items

REPO = Path(__file__).resolve().parent.parent


# What makes an arm's result: a change anywhere else (docs, other benchmarks, results)
# keeps the finished arms.
CODE = ("trainer", "tasks", "envs", "flows", "configs", "data.dvc", "pyproject.toml",
        "benchmarks/bench_data_scaling.py")


def _git(*args: str, repo: Path = REPO) -> str:
    return subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True, check=True).stdout.strip()


def code_key(repo: Path = REPO) -> str:
    """A hash of the committed trees of `CODE`, with "-dirty" when any of them has
    uncommitted changes (such an arm is never kept for another run)."""
    trees = "\n".join(f"{path} {_git('rev-parse', f'HEAD:{path}', repo=repo)}" for path in CODE)
    dirty = _git("status", "--porcelain", "--untracked-files=no", "--", *CODE, repo=repo)
    return hashlib.sha256(trees.encode()).hexdigest()[:16] + ("-dirty" if dirty else "")


def _kept(path: Path, key: str) -> dict[str, Any] | None:
    if not path.is_file() or key.endswith("-dirty"):
        return None
    kept = json.loads(path.read_text())
    return kept if kept.get("code") == key else None


def arm_config(items: int | None, seed: int, steps: int | None, store: Path) -> Any:
    """The demo config for one arm: `items` training items (None: all), `seed`, and
    `steps` steps (None: one epoch); its own MLflow store."""
    overrides: dict[str, Any] = {
        "data": {"max_train_items": items},
        "training": {"seed": seed, "max_steps": steps, "n_epochs": 1 if steps is None else 1000},
        "mlflow": {"tracking_uri": f"sqlite:///{store}", "experiment": "data-scaling"},
    }
    return load_config(DEMO_CONFIG, overrides)


def score(config: Any, model: str, items: list[dict], k: int, prefix: str):
    return evaluate_model(model, items, tracking_uri=config.mlflow.tracking_uri, model_section=config.model,
                          tools=config.tools, grader=config.grader, rollout=config.rollout,
                          penalties=config.penalties, k=k, seed=config.baseline.seed, prefix=prefix,
                          group_by=config.promotion.group_by)[0]


def base_scores(config: Any, validation: list[dict], k: int, out: Path, stores: Path, key: str) -> Any:
    """The base model's validation summary: kept beside the arms (its per-item scores
    pickled in `stores`, its key in `out`) and reused while the code is unchanged."""
    path, cache = out / f"base-k{k}.json", stores / f"base-k{k}.pickle"
    kept = _kept(path, key)
    if kept is not None and cache.is_file() and hashlib.sha256(cache.read_bytes()).hexdigest() == kept["sha256"]:
        print(f"base model: kept from {path}")
        return pickle.loads(cache.read_bytes())
    with tool_server(config, Path(config.data.train_file).parent / "corpus"):
        summary = score(config, config.model.base_model, validation, k, "base")
    cache.write_bytes(pickle.dumps(summary))
    path.write_text(json.dumps({"code": key, "commit": _git("rev-parse", "HEAD"), "k": k,
                                "score": summary.metrics["base/score_mean"],
                                "sha256": hashlib.sha256(cache.read_bytes()).hexdigest()}, indent=2))
    return summary


def run_arm(name: str, items: int | None, seed: int, steps: int | None, out: Path, stores: Path, k: int,
            base: Any, key: str, log: Any = print) -> dict[str, Any]:
    path = out / f"{name}.json"
    kept = _kept(path, key)
    if kept is not None:
        log(f"{name}: kept from {path}")
        return kept
    config = arm_config(items, seed, steps, stores / f"{name}.db")
    started = time.perf_counter()
    outcome = run_demo(config, [], stop_after="rft_training", log=log)
    train_s = time.perf_counter() - started
    candidate = outcome["candidate"]
    validation = split_items(config.data, "validation")
    with tool_server(config, Path(config.data.train_file).parent / "corpus"):
        summary = score(config, candidate["model_uri"], validation, k, "candidate")
    compared = compare((base["summary"], "base"), (summary, "candidate"),
                       samples=config.promotion.bootstrap_samples, seed=config.baseline.seed)
    result = {
        "arm": name, "items": items, "seed": seed, "steps": outcome["steps"],
        "code": key, "commit": _git("rev-parse", "HEAD"), "candidate": candidate, "train_s": round(train_s, 1),
        "validation": {"items": len(validation), "k": k, "score": summary.metrics["candidate/score_mean"],
                       "base_score": base["summary"].metrics["base/score_mean"]},
        "gain": compared["score_gain"],
        "changes": {name_: change for name_, change in compared["changes"].items()
                    if name_ in ("tool_calls_mean", "tokens_mean", "score_mean")},
    }
    path.write_text(json.dumps(result, indent=2))
    log(f"{name}: gain {100 * result['gain']['gain']:+.1f} points [{100 * result['gain']['low']:+.1f}, "
        f"{100 * result['gain']['high']:+.1f}], tool calls {result['changes']['tool_calls_mean']['relative']:+.1%}")
    return result


def rows_of(results: list[dict[str, Any]], arms: list[str], epoch: dict[str, Any] | None) -> list[dict[str, Any]]:
    """One row per training-set size (median, min and max over seeds) and the epoch arm."""
    rows = []
    for arm in arms:
        runs = [r for r in results if r["arm"].startswith(f"items-{arm}-seed")]
        if not runs:
            continue
        gains = [100 * r["gain"]["gain"] for r in runs]
        calls = [100 * r["changes"]["tool_calls_mean"]["relative"] for r in runs]
        tokens = [100 * r["changes"]["tokens_mean"]["relative"] for r in runs]
        intervals = [f"[{100 * r['gain']['low']:+.1f}, {100 * r['gain']['high']:+.1f}]" for r in runs]
        rows.append({
            "figure": f"validation gain (points), {arm} training items, 20 steps of 8",
            "value": round(statistics.median(gains), 1), "min": round(min(gains), 1), "max": round(max(gains), 1),
            "runs": len(runs), "goal": "> 0 (the talk: gains from as few as 10 examples)",
            "verdict": "met" if min(gains) > 0 else "not met" if max(gains) <= 0 else "straddles",
            "note": (f"seeds {', '.join(str(r['seed']) for r in runs)}: gains "
                     f"{', '.join(f'{g:+.1f}' for g in gains)}; paired item bootstrap 95% intervals "
                     f"{', '.join(intervals)}; "
                     f"tool calls {', '.join(f'{c:+.0f}%' for c in calls)}; tokens "
                     f"{', '.join(f'{t:+.0f}%' for t in tokens)} (relative change); "
                     f"validation 250 items x {runs[0]['validation']['k']}, base "
                     f"{runs[0]['validation']['base_score']:.4f}"),
        })
    if epoch is not None:
        g = epoch["gain"]
        rows.append({
            "figure": f"validation gain (points), {epoch['items']} items, one epoch ({epoch['steps']} steps of 8)",
            "value": round(100 * g["gain"], 1), "runs": 1, "goal": "more than the 20-step arm of the same items",
            "verdict": "single run",
            "note": (f"seed {epoch['seed']}, one run: 95% interval [{100 * g['low']:+.1f}, {100 * g['high']:+.1f}]; "
                     f"tool calls {100 * epoch['changes']['tool_calls_mean']['relative']:+.0f}%, tokens "
                     f"{100 * epoch['changes']['tokens_mean']['relative']:+.0f}%"),
        })
    return rows


def plot(results: list[dict[str, Any]], arms: list[str], epoch: dict[str, Any] | None, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    xs, medians = [], []
    for arm in arms:
        runs = [r for r in results if r["arm"].startswith(f"items-{arm}-seed")]
        if not runs:
            continue
        x = 2000 if arm == "all" else int(arm)
        gains = [100 * r["gain"]["gain"] for r in runs]
        ax.scatter([x] * len(gains), gains, color="tab:blue", alpha=0.6, label="one training seed" if not xs else None)
        xs.append(x)
        medians.append(statistics.median(gains))
    ax.plot(xs, medians, color="tab:blue", label="median of seeds (20 steps of 8)")
    if epoch is not None:
        ax.scatter([epoch["items"]], [100 * epoch["gain"]["gain"]], marker="*", s=160, color="tab:orange",
                   label=f"{epoch['items']} items, one epoch ({epoch['steps']} steps)")
    ax.axhline(0, color="grey", linewidth=0.8)
    ax.set_xscale("log")
    ax.set_xlabel("distinct training items")
    ax.set_ylabel("validation score gain over the base model (points)")
    ax.set_title("Sample efficiency of the demo's RL stage (validation split)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--items", nargs="+", default=["10", "100", "1000"],
                        help="training-set sizes; 'all' adds the whole train split (the demo's own training)")
    parser.add_argument("--seeds", nargs="+", type=int, default=[42, 43, 44])
    parser.add_argument("--epoch-items", type=int, default=1000, help="0: no epoch arm")
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "data_scaling",
                        help="finished arms, one JSON each (committed)")
    parser.add_argument("--stores", type=Path, default=REPO / "runs" / "data_scaling",
                        help="each arm's MLflow store and checkpoints, and the base model's scores")
    parser.add_argument("--figure", type=Path, default=REPO / "docs" / "images" / "sample-efficiency.png")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    args.out.mkdir(parents=True, exist_ok=True)
    args.stores.mkdir(parents=True, exist_ok=True)
    key = code_key()
    config = arm_config(None, args.seeds[0], None, args.stores / "base.db")
    ensure_data(config)  # a fresh clone: regenerated from the seed and checked against data.dvc
    validation = split_items(config.data, "validation")
    base = {"summary": base_scores(config, validation, args.k, args.out, args.stores, key)}
    print(f"base model: validation {base['summary'].metrics['base/score_mean']:.4f} "
          f"({len(validation)} items x {args.k})")
    results = []
    for arm in args.items:
        items = None if arm == "all" else int(arm)
        for seed in args.seeds:
            results.append(run_arm(f"items-{arm}-seed-{seed}", items, seed, 20, args.out, args.stores, args.k,
                                   base, key))
    epoch = None
    if args.epoch_items:
        steps = math.ceil(args.epoch_items / config.training.batch_size)
        epoch = run_arm(f"epoch-{args.epoch_items}-seed-{args.seeds[0]}", args.epoch_items, args.seeds[0], None,
                        args.out, args.stores, args.k, base, key)
        if epoch["steps"] != steps:
            raise SystemExit(f"the epoch arm ran {epoch['steps']} steps, not the {steps} of one epoch")
    rows = rows_of(results, args.items, epoch)
    figure = plot(results, args.items, epoch, args.figure)
    for row in rows:
        print(f"{row['figure']}: {row['value']:+.1f}" + (f" [{row['min']:+.1f}, {row['max']:+.1f}]" if "min" in row
                                                        else "") + f" ({row['note']})")
    print(f"figure: {figure}")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "runs": results, "figure": str(figure)}, indent=2))


if __name__ == "__main__":
    main()
