"""Peak memory of one GRPO update at a real vocabulary: log-probabilities from the logits of
the completion span (before issue 30) against the fused, recomputed projection over the
generated tokens only (after).

The update is `PolicyUpdate.update` of trainer/rl/update.py on a random Qwen3 with Qwen's
vocabulary (151,936 tokens), narrow so that the vocabulary dominates (hidden 64, 2 layers),
in float32 on the CPU: one micro-batch of 2 rollouts, each a 256-token prompt and a 4,096-
position span in which the model generated four turns of 512 tokens between three tool
outputs of 512 tokens and a 512-token tail (half the span generated, as in an agent's
rollout).

- "before": the update with `_logprobs` as it was (`SpanLogitsLogprobs`, in this
  benchmark only): the model's logits for every position of the span
  (`logits_to_keep`), then a float32 log-softmax `logprob_chunk_tokens` positions at a
  time, whose autograd keeps every chunk's input, so the backward holds the span's
  [2, 4096, 151936] float32 logits and more.
- "after": the trainer as it is: the output projection and the log-softmax of the
  generated positions only, a chunk at a time, each recomputed in backward.

Each variant runs in a fresh process (peak RSS is a process-wide high-water mark): RSS
before the update, the peak through one update, and its seconds. The sampler's
log-probabilities are zeros (their values do not change the memory), so setting up the
rollouts does not itself reach the peak.

    python -m benchmarks.bench_memory [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.bench_training import peak_rss_mib, rss_mib, update_trainer
from benchmarks.taught_world import taught_world
from envs.finqa.tiny_model import tiny_config
from trainer.rl.loss import chunked_logprobs
from trainer.rl.update import PolicyUpdate
from trainer.rollout.record import RolloutRecord

VOCAB, HIDDEN, LAYERS = 151_936, 64, 2
PROMPT, SPAN, TURN = 256, 4096, 512
ROWS = 2


class SpanLogitsLogprobs(PolicyUpdate):
    """The update's log-probabilities as before issue 30 (for the "before" figure only):
    logits over the whole completion span, then the chunked float32 log-softmax."""

    def _logprobs(self, batch, *, model=None, entropy=False):
        input_ids, attention, generated, first = self._padded(batch)
        width = input_ids.size(1)
        logits = (model or self.model)(input_ids=input_ids, attention_mask=attention, use_cache=False,
                                       logits_to_keep=width - first + 1).logits
        mask = generated[:, first:]
        logprobs, ent = chunked_logprobs(logits[:, :-1], input_ids[:, first:], self.temperature,
                                         chunk=self.config.training.logprob_chunk_tokens, with_entropy=entropy,
                                         mask=mask)
        return logprobs, {"mask": mask, "first": first, "entropy": ent}


def rollouts(item_id: str) -> tuple[list[RolloutRecord], list[float]]:
    generator = torch.Generator().manual_seed(0)
    gen_mask = [0] * PROMPT
    for block in range(SPAN // TURN):
        gen_mask += [1 - block % 2] * TURN  # generated, tool output, generated, ...
    records = []
    for index in range(ROWS):
        ids = torch.randint(3, VOCAB, (len(gen_mask),), generator=generator).tolist()
        records.append(RolloutRecord(
            trace_id=f"trace_{index}", item_id=item_id, sample_index=index, messages=[], tool_calls=[], final_answer="",
            status="ok", score=float(index), reward=float(index), token_ids=ids, gen_mask=gen_mask,
            logprobs=[0.0] * len(ids)))
    return records, [1.0, -1.0]


def variant(name: str, tmp: Path) -> dict[str, Any]:
    config = tiny_config(VOCAB, hidden_size=HIDDEN, num_layers=LAYERS, num_heads=4, num_kv_heads=2,
                         intermediate_size=HIDDEN * 3, max_position_embeddings=PROMPT + SPAN + 64)
    config._attn_implementation = "sdpa"
    trainer = update_trainer(taught_world(), config, tmp / name, ROWS, "no", max_total_tokens=PROMPT + SPAN + 64)
    try:
        if name == "before":
            u = trainer.updater
            trainer.updater = SpanLogitsLogprobs(u.accelerator, u.model, u.optimizer, config=u.config,
                                                 tokenizer=u.tokenizer, reference=u.reference,
                                                 temperature=u.temperature, kl_coef_of=u.kl_coef_of)
        records, advantages = rollouts(str(trainer.train_items[0]["id"]))
        rss_before, peak_before = rss_mib(), peak_rss_mib()
        started = time.perf_counter()
        metrics = trainer.updater.update(records, advantages, 1)
        seconds = time.perf_counter() - started
        chunk = trainer.config.training.logprob_chunk_tokens
    finally:
        trainer.cleanup()
    peak = peak_rss_mib()
    return {"variant": name, "rss_before_update_mib": round(rss_before, 1), "peak_before_update_mib": round(peak_before, 1),
            "peak_rss_mib": round(peak, 1), "update_extra_mib": round(peak - rss_before, 1),
            "update_s": round(seconds, 2), "loss": metrics["train/loss"], "logprob_chunk_tokens": chunk}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variant", choices=["before", "after"], help=argparse.SUPPRESS)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.variant:  # one side, in its own process
        with tempfile.TemporaryDirectory(prefix="bench_memory_") as tmp:
            result = variant(args.variant, Path(tmp))
        args.json.write_text(json.dumps(result) + "\n")
        return result
    out: dict[str, Any] = {"vocab": VOCAB, "hidden": HIDDEN, "layers": LAYERS, "prompt": PROMPT, "span": SPAN,
                           "generated_per_row": SPAN // 2, "micro_batch_size": ROWS, "dtype": "float32",
                           "device": "cpu", "threads": torch.get_num_threads()}
    for name in ("after", "before"):
        with tempfile.NamedTemporaryFile(suffix=".json") as handle:
            subprocess.run([sys.executable, "-m", "benchmarks.bench_memory", "--variant", name, "--json", handle.name],
                           check=True, cwd=Path(__file__).resolve().parent.parent)
            out[name] = json.loads(Path(handle.name).read_text())
    out["span_logits_mib"] = ROWS * SPAN * VOCAB * 4 / 2**20  # one float32 [micro-batch, span, vocabulary] tensor
    out["extra_ratio_before_over_after"] = out["before"]["update_extra_mib"] / max(out["after"]["update_extra_mib"], 1)
    out["peak_ratio_before_over_after"] = out["before"]["peak_rss_mib"] / out["after"]["peak_rss_mib"]
    out["loss_difference"] = abs(out["before"]["loss"] - out["after"]["loss"])
    for name in ("before", "after"):
        v = out[name]
        print(f"{name:<6} peak RSS {v['peak_rss_mib']:.0f} MiB, {v['update_extra_mib']:.0f} MiB above the "
              f"{v['rss_before_update_mib']:.0f} MiB before the update; {v['update_s']} s; loss {v['loss']:.6f}")
    print(f"memory of the update, before / after: {out['extra_ratio_before_over_after']:.1f}x above the pre-update RSS, "
          f"{out['peak_ratio_before_over_after']:.1f}x in peak RSS (one float32 span logits tensor: "
          f"{out['span_logits_mib']:.0f} MiB)")
    if args.json:
        args.json.write_text(json.dumps(out, indent=2) + "\n")
    return out


if __name__ == "__main__":
    main()
