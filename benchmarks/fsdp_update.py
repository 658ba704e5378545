"""One GRPO update under FSDP2 (`training.distributed: fsdp`) at the memory figure's size:
a random Qwen3 with Qwen's vocabulary (151,936), two rollouts of a 256-token prompt and a
4,096-position span of which half was generated (bench_memory.py's rollouts), one
micro-batch. Prints the update's seconds, its peak memory (the GPU allocator's peak on a
GPU, RSS on a CPU) and the loss, as JSON.

On a GPU (benchmarks/gpu_check.sh) the model has Qwen3-0.6B's shape and trains in bf16
through FSDP's mixed-precision policy; on a CPU `--small` checks the same path in seconds.

    python -m benchmarks.fsdp_update [--small] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.bench_memory import PROMPT, SPAN, rollouts
from benchmarks.bench_training import NO_TOOLS, peak_rss_mib
from benchmarks.taught_world import taught_world, training_config
from envs.finqa.tiny_model import build_model, tiny_config
from trainer.rl.grpo import GRPOTrainer

VOCAB = 151_936


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--small", action="store_true", help="hidden 64, 2 layers (a CPU check of the path)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    gpu = torch.cuda.is_available()
    shape = (dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=192) if args.small
             else dict(hidden_size=1024, num_layers=28, num_heads=16, num_kv_heads=8, intermediate_size=3072))
    config = tiny_config(VOCAB, max_position_embeddings=PROMPT + SPAN + 64, tie_word_embeddings=True, **shape)
    if not args.small:
        config.head_dim = 128
    config._attn_implementation = "sdpa"
    world = taught_world()
    with tempfile.TemporaryDirectory(prefix="fsdp_update_") as tmp:
        model_dir = Path(tmp) / "model"
        build_model(config, seed=0).save_pretrained(model_dir)
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(world.model).save_pretrained(model_dir)
        job = training_config(world, [], rollout={"max_total_tokens": PROMPT + SPAN + 64}, micro_batch_size=2,
                              distributed="fsdp", mixed_precision="bf16" if gpu else "no",
                              gradient_checkpointing=True)
        trainer = GRPOTrainer(job, model_path=str(model_dir), output_dir=Path(tmp) / "run", endpoints=NO_TOOLS)
        trainer.setup()
        try:
            records, advantages = rollouts(str(trainer.train_items[0]["id"]))
            if gpu:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            started = time.perf_counter()
            metrics = trainer.updater.update(records, advantages, 1)
            if gpu:
                torch.cuda.synchronize()
            seconds = time.perf_counter() - started
            params = sum(p.numel() for p in trainer.sampling_model().parameters())
        finally:
            trainer.cleanup()
    figures = {
        "device": torch.cuda.get_device_name() if gpu else "cpu", "params": params, "vocab": VOCAB,
        "rollouts": len(records), "tokens_per_rollout": len(records[0].token_ids), "update_s": round(seconds, 2),
        "peak_memory_mib": round(torch.cuda.max_memory_allocated() / 2**20 if gpu else peak_rss_mib(), 1),
        "loss": metrics["train/loss"], "grad_norm": metrics["train/grad_norm"],
    }
    print(json.dumps(figures, indent=2))
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2) + "\n")
    return figures


if __name__ == "__main__":
    main()
