"""The second environment: order support, nothing like FinQA, through config alone.

Items carry only OpenAI RFT fields and the job's own references (`expected_decision`,
`expected_amount`); the tools are served by `tests/order_env/server.py` in a process of its
own; the grader is a `multi` of a `string_check` on the decision and a `numeric` check of
the amount, read from the model's JSON answer. `write_world` writes the datasets, the
production traffic log (plus a drifted one), the orders the server reads and the job's
YAML; `teach` fits a tiny model that sometimes looks the order up and answers right, and
sometimes denies at once.
"""

from __future__ import annotations

import asyncio
import json
import random
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import yaml

SERVER = Path(__file__).with_name("server.py")
SYSTEM = 'Look the order up, then answer with JSON: {"decision": "approve|partial|deny", "amount": number}.'
TOOLS = [
    {"type": "function", "function": {"name": "lookup_order", "description": "Look an order up by its id.",
                                      "parameters": {"type": "object", "properties": {"order_id": {"type": "string"}},
                                                     "required": ["order_id"]}}},
    {"type": "function", "function": {"name": "refund_policy", "description": "The refund policy.",
                                      "parameters": {"type": "object", "properties": {}}}},
]
GRADER = {
    "type": "multi", "name": "refund",
    "graders": {
        "decision": {"type": "string_check", "name": "decision", "input": "{{sample.output_json.decision}}",
                     "reference": "{{item.expected_decision}}", "operation": "eq"},
        "amount": {"type": "numeric", "name": "amount", "input": "{{sample.output_json.amount}}",
                   "reference": "{{item.expected_amount}}"},
    },
    "calculate_output": "0.5 * decision + 0.5 * amount",
}
ITEMS = ("kettle", "lamp", "backpack", "headphones", "blender", "jacket", "monitor", "chair")
CONDITIONS = ("unopened", "opened", "damaged")


def decide(order: dict) -> tuple[str, float]:
    """The policy the tool server states."""
    if order["condition"] == "damaged" or (order["condition"] == "unopened" and order["days_since_delivery"] <= 30):
        return "approve", order["price"]
    if order["condition"] == "opened" and order["days_since_delivery"] <= 14:
        return "partial", round(order["price"] / 2, 2)
    return "deny", 0.0


def _orders(rng: random.Random, n: int) -> dict[str, dict]:
    return {f"O-{1000 + i}": {"item": rng.choice(ITEMS), "price": float(rng.choice(range(10, 200, 10))),
                              "days_since_delivery": rng.randint(1, 60), "condition": rng.choice(CONDITIONS)}
            for i in range(n)}


def _row(order_id: str, order: dict, *, verbose: bool = False) -> dict:
    decision, amount = decide(order)
    ask = f"A customer wants a refund for order {order_id}. What do we do?"
    if verbose:
        ask = ("Hello, I am writing on behalf of a long-standing customer who is quite upset, and I would like a "
               f"careful answer. {ask} Please explain your reasoning at length before deciding.")
    return {"messages": [{"role": "user", "content": ask}], "tools": TOOLS,
            "expected_decision": decision, "expected_amount": amount}


def write_world(root: Path, *, seed: int = 0) -> dict[str, Path]:
    """Datasets (train 8, validation 6, test 6: disjoint orders), traffic (300 rows, with
    production's own fields), a drifted traffic log, the orders table and the job YAML."""
    rng = random.Random(seed)
    orders = _orders(rng, 640)
    ids = list(orders)
    data = root / "data"
    data.mkdir(parents=True, exist_ok=True)
    splits = {"train": ids[:8], "validation": ids[8:14], "test": ids[14:20]}
    for name, chosen in splits.items():
        rows = [{"id": f"{name}-{oid}", **_row(oid, orders[oid])} for oid in chosen]
        (data / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    for name, verbose, channels in (("traffic", False, ("chat", "email", "phone")),
                                    ("drifted_traffic", True, ("fax",))):
        rows = [{**_row(oid, orders[oid], verbose=verbose), "channel": rng.choice(channels),
                 "received_at": f"2025-03-{1 + i % 28:02d}T10:00:00Z"} for i, oid in enumerate(ids[20:320])]
        (data / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / "orders.json").write_text(json.dumps(orders))
    return {"data": data, "orders": root / "orders.json"}


def job_yaml(root: Path, base_url: str, model: Path, **overrides) -> Path:
    """The whole job in one YAML file, as a user would write it."""
    data = root / "data"
    job = {
        "name": "order-support",
        "work_dir": str(root / "runs"),
        "model": {"base_model": str(model)},
        "data": {"train_file": str(data / "train.jsonl"), "validation_file": str(data / "validation.jsonl"),
                 "test_file": str(data / "test.jsonl"), "production_traffic_file": str(data / "traffic.jsonl"),
                 "expectations_dir": str(root / "expectations"), "expectations_suite": "orders"},
        "tools": {"endpoints": [{"name": t["function"]["name"], "server_url": f"{base_url}/tools/{t['function']['name']}",
                                 "headers": {"Authorization": "Bearer ${ORDER_TOKEN}"}} for t in TOOLS]},
        "grader": GRADER,
        "rollout": {"system_prompt": SYSTEM, "max_turns": 4, "max_new_tokens_per_turn": 64, "max_total_tokens": 768},
        "baseline": {"k": 2, "min_nonzero_share": 0.1, "min_headroom": 0.0},
        "prompt_optimization": {"k": 1, "target_score": 1.0, "variants": [{"name": "budget-1", "max_episode_steps": 1}]},
        "training": {"batch_size": 2, "compute_multiplier": 0.5, "max_steps": 2, "eval_interval": 2, "eval_samples": 2,
                     "learning_rate": 1e-3, "checkpoint_interval": 1},
        "promotion": {"k": 2, "bootstrap_samples": 200, "min_gain_lower_bound": -1.0, "max_tool_calls_increase": 10,
                      "max_tokens_increase": 10, "max_latency_increase": 100, "check_hack_patterns": False},
        "mlflow": {"tracking_uri": f"sqlite:///{root / 'mlflow.db'}", "experiment": "order-support"},
    }
    for key, value in overrides.items():
        job[key] = {**job.get(key, {}), **value} if isinstance(value, dict) else value
    path = root / "job.yaml"
    path.write_text(yaml.safe_dump(job, sort_keys=False))
    return path


@contextmanager
def order_server(orders: Path) -> Iterator[str]:
    """The tool server in a process of its own, on a free loopback port."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    process = subprocess.Popen([sys.executable, str(SERVER), "--orders", str(orders), "--port", str(port)],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                if time.monotonic() > deadline or process.poll() is not None:
                    raise RuntimeError(f"order server did not start: {process.stdout.read()[-500:]!r}") from None
                time.sleep(0.1)
        yield base
    finally:
        process.terminate()
        process.wait(timeout=10)


def teach(data: Path, base_url: str, out: Path) -> Path:
    """A tiny model that, per item, looks the order up and answers right, reads the policy
    too and answers right, or denies at once (wrong unless the rule says deny)."""
    from tests.taught_model import fit_tiny_model
    from trainer.config.tools import ToolEndpoint
    from trainer.data import read_items
    from trainer.rollout.tool_client import ToolClient

    endpoints = [ToolEndpoint(name=t["function"]["name"], server_url=f"{base_url}/tools/{t['function']['name']}")
                 for t in TOOLS]

    async def conversation(item: dict, calls: list[tuple[str, dict]], answer: dict) -> list[dict]:
        messages = [{"role": "system", "content": SYSTEM}, *item["messages"]]
        async with ToolClient(endpoints, TOOLS) as client:
            for index, (name, arguments) in enumerate(calls):
                call = {"id": f"call_{index}", "type": "function",
                        "function": {"name": name, "arguments": json.dumps(arguments, separators=(",", ":"))}}
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
                result = await client.call(name, call["function"]["arguments"], item=item, trace_id="trace_teach",
                                           call_id=call["id"])
                messages.append({"role": "tool", "tool_call_id": call["id"], "content": result.output})
        messages.append({"role": "assistant", "content": json.dumps(answer)})
        return messages

    conversations = []
    for split in ("train", "validation", "test"):
        for item in read_items(data / f"{split}.jsonl"):
            order_id = item["messages"][0]["content"].split("order ")[1].split(".")[0]
            right = {"decision": item["expected_decision"], "amount": item["expected_amount"]}
            for calls, answer in (([("lookup_order", {"order_id": order_id})], right),
                                  ([("lookup_order", {"order_id": order_id}), ("refund_policy", {})], right),
                                  ([], {"decision": "deny", "amount": 0.0})):
                conversations.append(asyncio.run(conversation(item, calls, answer)))
    texts = [json.dumps(c) for c in conversations]
    model, tokenizer, _ = fit_tiny_model([(c, TOOLS) for c in conversations], texts, extra_tokens=[],
                                         number_weight=3.0)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out
