"""RFT steps per second against TRL's GRPOTrainer, side by side in one run, and the
evaluation score both reach after the same number of steps.

Same world for both (benchmarks/taught_world.py): the same taught model, items, tools
(`list` and `cat` over HTTP on the same loopback FinQA server, 256-character outputs),
grader, group size, items per step, learning rate, clipping, token-level loss (TRL's
`loss_type="dapo"`), no KL term, one optimisation pass, 8 rollouts per backward, three
assistant turns at most (TRL: `max_tool_calling_iterations=2`), temperature 1, and the
same number of torch threads. TRL calls the tools through its documented `tools=`
argument: plain Python functions that post our wire format to the tool server. TRL
batches the generation of a turn but runs each rollout's tool calls one after another
and re-encodes the whole conversation every turn; our engine keeps each sequence's KV
cache and overlaps the tool calls with decoding.

Steps per second count only the training steps (rollouts, grading, update), not the
evaluations, model loading or TRL's setup. The evaluation is the same code for both
final models (and the starting one): `--eval-k` samples per item through our engine at
temperature 1 with one fixed seed, tools at 0 ms.

    python -m benchmarks.bench_trl [--steps 4] [--latencies 0 100] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import torch

from benchmarks.taught_world import TaughtWorld, taught_world, training_config
from envs.finqa.faults import FaultConfig
from envs.finqa.local import local_tool_endpoints
from tests.taught_model import GRADER, OUTPUT_CHARS, SYSTEM, TOOLS
from trainer.evaluate import run_evaluation
from trainer.graders.dispatch import grade, sample_from_text
from trainer.grpo import train
from trainer.metrics import read_jsonl
from trainer.policy import load_policy
from trainer.rollout import RolloutSettings
from trainer.tools import ToolEndpoint


def ours(world: TaughtWorld, endpoints: list[ToolEndpoint], steps: int, seed: int, out: Path) -> dict[str, Any]:
    """Our GRPO trainer for `steps` steps; seconds of the steps without the evaluations."""
    config = training_config(world, endpoints, max_steps=steps, eval_interval=steps, n_epochs=steps, seed=seed)
    result = train(config, model_path=str(world.model), output_dir=out)
    rows = [r for r in read_jsonl(out / "metrics.jsonl") if r["step"] > 0]
    step_s = [r["timing/step_s"] - r["timing/eval_s"] for r in rows]
    return {"steps": len(rows), "seconds": sum(step_s), "step_s": step_s,
            "reward_mean": statistics.mean(r["train/reward_mean"] for r in rows),
            "tool_calls_mean": statistics.mean(r["train/tool_calls_mean"] for r in rows),
            "model": str(result.model_dir)}


def trl_tools(endpoints: list[ToolEndpoint]) -> tuple[list, httpx.Client]:
    """`list` and `cat` as the plain functions TRL's `tools=` takes (name, docstring and
    type hints become the schema, which renders exactly as TOOLS does), posting our wire
    format to the same server; a 4xx answer goes back to the model as the output."""
    urls = {e.name: e.server_url for e in endpoints}
    client = httpx.Client(timeout=30)
    counter = iter(range(1 << 62))

    def post(name: str, path: str) -> str:
        n = next(counter)
        body = {"type": "function_call", "id": f"fc_{n}", "call_id": f"call_{n}", "name": name,
                "arguments": json.dumps({"path": path}), "item": {}, "trace_id": "trace_trl"}
        response = client.post(urls[name], json=body)
        if response.status_code >= 500:
            response.raise_for_status()  # TRL turns the exception into an error output
        return response.json()["output"] if response.status_code == 200 else response.text

    def list_tool(path: str) -> str:
        """List a directory.

        Args:
            path: the directory
        """
        return post("list", path)

    def cat(path: str) -> str:
        """Read a page.

        Args:
            path: the page
        """
        return post("cat", path)

    list_tool.__name__ = "list"  # the tool's name as the model was taught it
    return [list_tool, cat], client


def trl(world: TaughtWorld, endpoints: list[ToolEndpoint], steps: int, seed: int, out: Path,
        threads: int) -> dict[str, Any]:
    """TRL's GRPOTrainer for `steps` steps at our settings; seconds of its training steps."""
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer
    from trl.chat_template_utils import qwen3_template

    config = training_config(world, endpoints, seed=seed)
    hp, rollout = config.training, config.rollout
    items = {item["id"]: item for item in world.items()}
    rewards: list[float] = []
    calls: list[int] = []

    def reward(prompts, completions, item_id, **_) -> list[float]:
        """Our grader on the final answer: the last assistant turn, if it called no tool."""
        scores = []
        for completion, key in zip(completions, item_id, strict=True):
            last = completion[-1]
            final = last.get("content") or "" if last["role"] == "assistant" and not last.get("tool_calls") else ""
            scores.append(grade(GRADER, sample_from_text(final), items[key]).reward or 0.0)
            calls.append(sum(len(m.get("tool_calls") or []) for m in completion))
        rewards.extend(scores)
        return scores

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.step_s: list[float] = []

        def on_step_begin(self, args, state, control, **kwargs):
            self.started = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            self.step_s.append(time.perf_counter() - self.started)

    tokenizer = AutoTokenizer.from_pretrained(world.model)
    # Our chat format is Qwen's (Hermes) tool format: TRL's Qwen3 response parser reads it.
    tokenizer.response_template = qwen3_template
    model = AutoModelForCausalLM.from_pretrained(world.model, dtype=torch.float32)
    group = round(8 * hp.compute_multiplier)
    args = GRPOConfig(
        output_dir=str(out), use_cpu=not torch.cuda.is_available(), bf16=False, seed=hp.seed,
        per_device_train_batch_size=hp.batch_size * group, num_generations=group, steps_per_generation=1,
        gradient_accumulation_steps=1, num_iterations=hp.ppo_epochs, max_steps=steps,
        learning_rate=hp.learning_rate, lr_scheduler_type="constant", warmup_steps=0, optim="adamw_torch",
        weight_decay=hp.weight_decay, max_grad_norm=hp.max_grad_norm, beta=hp.kl_coef, epsilon=hp.clip_eps,
        loss_type="dapo", scale_rewards="group" if hp.scale_rewards else "none",
        temperature=rollout.temperature, top_p=rollout.top_p, top_k=0,
        max_completion_length=rollout.max_total_tokens - 128, max_tool_calling_iterations=rollout.max_turns - 1,
        logging_steps=1, report_to="none", save_strategy="no", dataloader_num_workers=0, disable_tqdm=True,
    )
    dataset = Dataset.from_list([{"prompt": [{"role": "system", "content": SYSTEM}, *item["messages"]],
                                  "item_id": item["id"]} for item in items.values()])
    tools, client = trl_tools(endpoints)
    timer = StepTimer()
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=dataset,
                          processing_class=tokenizer, tools=tools, callbacks=[timer])
    torch.set_num_threads(threads)  # the Trainer may have changed it
    try:
        trainer.train()
    finally:
        client.close()
    final = out / "final"
    trainer.save_model(str(final))
    tokenizer.save_pretrained(final)
    return {"steps": len(timer.step_s), "seconds": sum(timer.step_s), "step_s": timer.step_s,
            "reward_mean": statistics.mean(rewards), "tool_calls_mean": statistics.mean(calls),
            "model": str(final)}


def eval_score(model_dir: str, world: TaughtWorld, endpoints: list[ToolEndpoint], k: int) -> float:
    """Mean score of `k` samples per item, through our engine with one fixed seed."""
    config = training_config(world, endpoints)
    policy = load_policy(model_dir, device="cpu", dtype="float32")
    settings = RolloutSettings.from_config(config.rollout, config.penalties)
    backend = policy.backend(max_slots=64, max_len=config.rollout.max_total_tokens, seed=1234)
    summary, _ = run_evaluation(backend, policy.tokenizer, world.items(), k=k, endpoints=endpoints, grader=GRADER,
                                settings=settings, tools=TOOLS, tool_options={"max_output_chars": OUTPUT_CHARS})
    return summary.metrics["eval/score_mean"]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=4, help="training steps of each run")
    parser.add_argument("--latencies", type=float, nargs="+", default=[0.0, 100.0],
                        help="tool latencies (ms) injected by the server, one pair of runs each")
    parser.add_argument("--seeds", type=int, default=3,
                        help="training seeds at the first latency (one at the others): a few RL steps of a tiny "
                        "model move its score by chance as much as by method, so the scores are compared on average")
    parser.add_argument("--eval-k", type=int, default=16, help="evaluation samples per item")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads of both (1: steadier on a shared machine, and faster for this model)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    world = taught_world()
    results: dict[str, Any] = {"steps": args.steps, "threads": args.threads, "runs": {}}
    with tempfile.TemporaryDirectory(prefix="bench_trl_") as tmp:
        for index, latency in enumerate(args.latencies):
            faults = FaultConfig(latency_ms=latency) if latency else None
            seeds = [3 + n for n in range(args.seeds if index == 0 else 1)]
            run: dict[str, Any] = {"seeds": seeds, "ours": [], "trl": []}
            with local_tool_endpoints(world.corpus, max_output_chars=OUTPUT_CHARS, faults=faults) as endpoints:
                for seed in seeds:
                    print(f"tool latency {latency:g} ms, seed {seed}: ours, then TRL, {args.steps} steps each",
                          flush=True)
                    out = Path(tmp) / f"{latency:g}_{seed}"
                    run["ours"].append(ours(world, endpoints, args.steps, seed, out / "ours"))
                    run["trl"].append(trl(world, endpoints, args.steps, seed, out / "trl", args.threads))
            for side in ("ours", "trl"):
                run[f"{side}_steps_per_s"] = sum(r["steps"] for r in run[side]) / sum(r["seconds"] for r in run[side])
            run["speedup"] = run["ours_steps_per_s"] / run["trl_steps_per_s"]
            results["runs"][f"{latency:g}ms"] = run
        # The same evaluation of the models after the same number of steps.
        with local_tool_endpoints(world.corpus, max_output_chars=OUTPUT_CHARS) as endpoints:
            results["eval_k"] = args.eval_k
            results["eval_start"] = eval_score(str(world.model), world, endpoints, args.eval_k)
            for run in results["runs"].values():
                for side in ("ours", "trl"):
                    for r in run[side]:
                        r["eval_score"] = eval_score(r.pop("model"), world, endpoints, args.eval_k)
                    run[f"{side}_eval_mean"] = statistics.mean(r["eval_score"] for r in run[side])

    print(f"\n{'latency':>8} {'seed':>4} {'trainer':>7} {'steps':>5} {'seconds':>8} {'steps/s':>8} {'reward':>7} "
          f"{'calls':>6} {'eval':>6}")
    for name, run in results["runs"].items():
        for seed, pair in zip(run["seeds"], zip(run["ours"], run["trl"], strict=True), strict=True):
            for side, r in zip(("ours", "trl"), pair, strict=True):
                print(f"{name:>8} {seed:>4} {side:>7} {r['steps']:>5} {r['seconds']:>8.2f} "
                      f"{r['steps'] / r['seconds']:>8.3f} {r['reward_mean']:>7.3f} {r['tool_calls_mean']:>6.2f} "
                      f"{r['eval_score']:>6.3f}")
        print(f"{name:>8} ours / TRL steps per second: {run['speedup']:.2f}x; mean eval score ours "
              f"{run['ours_eval_mean']:.3f}, TRL {run['trl_eval_mean']:.3f}")
    print(f"eval score of the starting model: {results['eval_start']:.3f} ({args.eval_k} samples per item)")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return results


if __name__ == "__main__":
    main()
