"""The update with each group's prompt forwarded once (`training.shared_prefix`) against
forwarding every rollout whole, side by side in one run.

(1) SmolLM2-135M-Instruct on the units recipe (envs/units/smollm2.yaml: LoRA r16, its loss
    and sampling temperature): a group of `--group` rollouts of the recipe's real prompt
    (the first training item, its system prompt and tools, rendered by its chat format: 427
    tokens) and about `--completion` tokens each (a turn, a short tool answer that is read
    but not trained on, a final turn; random ids, since the cost does not depend on them),
    the whole group in one micro-batch.
(2) The demo model (envs/finqa/model, full fine-tuning as envs/finqa/demo.yaml) likewise, on
    its system prompt, the FinQA tools and one question.

Each arm is a fresh process (peak RSS is a process-wide high-water mark; it is reset after
the setup): one warm-up update, then `--repeats` timed ones. The arms alternate, shared then
plain, for `--rounds` rounds, so drift on a shared machine hits both sides alike; the ratio
is taken per round. Also: the tokens forwarded for the group, P + G*R against G*(P+R), whose
ratio bounds the speed-up of the parts that scale with tokens.

    python -m benchmarks.bench_prefix_update [--models smollm2 demo] [--rounds 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.taught_world import REPO

UNITS = REPO / "envs" / "units" / "smollm2.yaml"
DEMO = REPO / "envs" / "finqa" / "demo.yaml"
TOOL_ANSWER = 12  # tokens of the tool's answer inside a completion


def shape_records(chat: Any, prompt: list[int], group: int, completion: int, vocab: int) -> list[Any]:
    """`group` rollouts of `prompt` and about `completion` tokens each (a few more or fewer,
    as sampled turns differ), the tool's answer in the middle read, not trained on."""
    import random

    from trainer.rollout.record import RolloutRecord

    rng = random.Random(0)
    records = []
    for j in range(group):
        length = completion + rng.randint(-4, 4)
        first = (length - TOOL_ANSWER) // 2
        rest = [rng.randrange(3, vocab) for _ in range(length)]
        mask = [1] * first + [0] * TOOL_ANSWER + [1] * (length - first - TOOL_ANSWER)
        records.append(RolloutRecord(
            trace_id=f"trace_{j}", item_id="item", sample_index=j, messages=[], tool_calls=[], final_answer="",
            status="ok", score=0.0, reward=0.0, token_ids=prompt + rest, gen_mask=[0] * len(prompt) + mask,
            logprobs=[0.0] * (len(prompt) + length)))
    return records


def prompt_of(config: Any, chat: Any, model: str) -> list[int]:
    """The recipe's first prompt: units, its first training item; the demo, one question."""
    system = [{"role": "system", "content": config.rollout.system_prompt}] if config.rollout.system_prompt else []
    if model == "smollm2":
        from trainer.data import read_items

        item = read_items(Path(config.data.train_file), 1)[0]
        messages = system + [m for m in item["messages"] if m.get("role") != "system" or not system]
        return chat.prompt_ids(messages, item.get("tools") or config.tools.schemas or None)
    # the tools the demo's data rows carry
    from envs.finqa.tool_schemas import TOOL_SCHEMAS

    messages = system + [{"role": "user", "content": "What was the company's total revenue in 2019, in "
                          "millions? Read the annual report."}]
    return chat.prompt_ids(messages, list(TOOL_SCHEMAS))


def arm(args: argparse.Namespace) -> dict[str, Any]:
    """One arm in this (fresh) process."""
    import torch
    from accelerate import Accelerator

    from benchmarks.bench_real_model import peak_since_reset_mib, reset_peak
    from benchmarks.bench_training import rss_mib
    from trainer.config.loading import load_config
    from trainer.generation.policy import load_config_policy
    from trainer.memory import release_memory
    from trainer.rl.setup import build_model
    from trainer.rl.update import PolicyUpdate

    shared = args.arm == "shared"
    recipe = UNITS if args.model == "smollm2" else DEMO
    config = load_config(recipe, {"model": {"base_model": str(args.model_dir)},
                                  "training": {"micro_batch_size": args.group, "shared_prefix": shared}})
    policy = load_config_policy(config.model, str(args.model_dir), device="cpu", dtype="float32")
    acc = Accelerator(cpu=True)
    model, optimizer, reference, _ = build_model(policy.model, acc, config.training, distributed="none",
                                                 mixed_precision="no", learning_rate=1e-6)
    training = config.training
    update = PolicyUpdate(acc, model, optimizer, config=config, tokenizer=policy.tokenizer, reference=reference,
                          temperature=config.rollout.temperature, kl_coef_of=lambda record: training.kl_coef)
    prompt = prompt_of(config, policy.chat, args.model)
    records = shape_records(policy.chat, prompt, args.group, args.completion, policy.model.config.vocab_size)
    advantages = [(-1.0) ** j * (0.5 + j / 10) for j in range(args.group)]
    release_memory()
    rss_before = rss_mib()
    reset_peak()  # the setup's own peak is not the update's
    times = []
    for step in range(args.repeats + 1):  # the first warms up (and runs the first use's check)
        started = time.perf_counter()
        update.update(records, advantages, step + 1)
        times.append(time.perf_counter() - started)
    own = [len(r.token_ids) - len(prompt) for r in records]
    return {"model": args.model, "arm": args.arm, "shared": bool(update.shared), "off_reason": update.shared_off_reason,
            "threads": torch.get_num_threads(), "lora": training.lora is not None, "prompt": len(prompt),
            "group": args.group, "completion_mean": statistics.mean(own),
            "tokens_forwarded": len(prompt) + sum(own) if update.shared else sum(len(r.token_ids) for r in records),
            "tokens_unshared": sum(len(r.token_ids) for r in records), "tokens_shared": len(prompt) + sum(own),
            "update_s": [round(t, 3) for t in times[1:]], "warmup_s": round(times[0], 3),
            "update_s_median": statistics.median(times[1:]), "rss_before_update_mib": round(rss_before),
            "peak_rss_mib": round(peak_since_reset_mib()), "update_extra_mib": round(peak_since_reset_mib() - rss_before)}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["smollm2", "demo"], choices=["smollm2", "demo"])
    parser.add_argument("--group", type=int, default=8, help="rollouts of the group (one micro-batch)")
    parser.add_argument("--completion", type=int, default=60, help="tokens after the prompt, about")
    parser.add_argument("--repeats", type=int, default=2, help="timed updates per arm, after one warm-up")
    parser.add_argument("--rounds", type=int, default=2, help="shared, then plain, this many times")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--arm", choices=["shared", "plain"], default=None, help=argparse.SUPPRESS)
    parser.add_argument("--model", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.arm:
        result = arm(args)
        args.json.write_text(json.dumps(result, indent=2))
        return result

    results: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items() if k != "json"}}
    for model in args.models:
        if model == "smollm2":
            from envs.units.demo import MODEL_PACKAGE, ensure_data
            from trainer.config.loading import load_config
            from trainer.generation.model_import import import_model

            model_dir = import_model(package=MODEL_PACKAGE, log=lambda _: None)
            ensure_data(load_config(UNITS, {"model": {"base_model": str(model_dir)}}), log=lambda _: None)
        else:
            model_dir = REPO / "envs" / "finqa" / "model"
        runs: dict[str, list[dict[str, Any]]] = {"shared": [], "plain": []}
        with tempfile.TemporaryDirectory(prefix="bench_prefix_update_") as tmp:
            for round_ in range(args.rounds):
                for side in ("shared", "plain"):
                    out = Path(tmp) / f"{model}_{side}_{round_}.json"
                    subprocess.run([sys.executable, "-m", "benchmarks.bench_prefix_update", "--arm", side,
                                    "--model", model, "--model-dir", str(model_dir), "--group", str(args.group),
                                    "--completion", str(args.completion), "--repeats", str(args.repeats),
                                    "--json", str(out)], check=True, cwd=REPO)
                    runs[side].append(json.loads(out.read_text()))
                    print(f"{model} {side} round {round_ + 1}: {out.read_text()}", flush=True)
        speedups = [p["update_s_median"] / s["update_s_median"] for s, p in zip(runs["shared"], runs["plain"],
                                                                                   strict=True)]
        shared, plain = runs["shared"][0], runs["plain"][0]
        results[model] = {
            "runs": runs, "speedups": speedups,
            "token_bound": plain["tokens_unshared"] / plain["tokens_shared"],
            "peak_rss_mib": {"shared": max(r["peak_rss_mib"] for r in runs["shared"]),
                             "plain": max(r["peak_rss_mib"] for r in runs["plain"])},
            "update_extra_mib": {"shared": max(r["update_extra_mib"] for r in runs["shared"]),
                                 "plain": max(r["update_extra_mib"] for r in runs["plain"])},
            "prompt": shared["prompt"], "group": shared["group"], "completion_mean": shared["completion_mean"],
            "lora": shared["lora"], "shared_applied": all(r["shared"] for r in runs["shared"]),
            "threads": shared["threads"],
        }
    report(results)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return results


def report(r: dict[str, Any]) -> None:
    for model in ("smollm2", "demo"):
        m = r.get(model)
        if not m:
            continue
        s = [x["update_s_median"] for x in m["runs"]["shared"]]
        p = [x["update_s_median"] for x in m["runs"]["plain"]]
        print(f"\n{model}: a group of {m['group']} x ({m['prompt']} prompt + {m['completion_mean']:.0f}), "
              f"{'LoRA' if m['lora'] else 'full'}, {m['threads']} threads")
        print(f"  update seconds shared {', '.join(f'{x:.2f}' for x in s)}; plain {', '.join(f'{x:.2f}' for x in p)}")
        print(f"  speed-up per round {', '.join(f'{x:.2f}' for x in m['speedups'])} (token bound {m['token_bound']:.2f})")
        print(f"  peak RSS shared {m['peak_rss_mib']['shared']} MiB, plain {m['peak_rss_mib']['plain']} MiB; above the "
              f"pre-update RSS {m['update_extra_mib']['shared']} vs {m['update_extra_mib']['plain']} MiB")


if __name__ == "__main__":
    main()
