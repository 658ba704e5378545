"""The small world the training benchmarks share: FinQA items in three splits, their
corpus pages and a tiny model taught to answer all of them with tools (tests/taught_model.py).

Sampled at temperature 1 the taught model mixes five scripted answers (right after listing
the year's directory, right after reading the page, right at once, "0" at once, "0" after
a listing), so rewards vary within a group and a GRPO step has real work: multi-turn
rollouts through the real tool server, grading and an update.

The splits follow the pipeline's rules (issue 18): `train` (4 items, what GRPO steps on),
`validation` (4 items, the trainer's in-training evaluation) and `test` (8 items, read only
by the benchmarks' final evaluations), taken from the demo data's own fact-disjoint
splits. The model is taught every split, as the pipeline tests' model is: a score on the
test items after RL measures what the training changed in how the model answers items it
knows but never trained on, not what it memorised during RL. Speed figures use the
training items.

The world is built once (2 to 6 minutes on two cores) and cached under `.cache/bench/taught_world/`,
keyed by the items and by tests/taught_model.py: regenerated data or new scripts rebuild it.

    python -m benchmarks.taught_world    # build it (run_all does this on first use)
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from envs.finqa.local import local_tool_endpoints
from tests.taught_model import (
    GRADER,
    OUTPUT_CHARS,
    SYSTEM,
    TOOLS,
    conversation,
    copy_items,
    fit_tiny_model,
    scripts,
)
from trainer.config.loading import config_from_dict
from trainer.config.pipeline import PipelineConfig
from trainer.config.tools import ToolEndpoint
from trainer.data import read_items

REPO = Path(__file__).resolve().parent.parent
DEFAULT_ROOT = REPO / ".cache" / "bench" / "taught_world"
SPLITS = {"train": 4, "validation": 4, "test": 8}  # items taken from the head of each demo split
# teach_model's 80 epochs fit 4 items; 16 items need 240 for the same mix (measured: a mean
# score of 0.04 after 80 epochs, 0.63-0.69 on each split after 240)
EPOCHS = 240


@dataclass
class TaughtWorld:
    root: Path
    train_file: Path
    validation_file: Path
    test_file: Path
    corpus: Path  # the pages of every split's items
    model: Path

    @property
    def items_file(self) -> Path:
        """The training items (what the speed figures roll out)."""
        return self.train_file

    def items(self, split: str = "train") -> list[dict[str, Any]]:
        return read_items({"train": self.train_file, "validation": self.validation_file,
                           "test": self.test_file}[split])


def _fingerprint(chosen: dict[str, list[dict[str, Any]]]) -> str:
    """What the cached world was built from: the items and the teaching scripts."""
    digest = hashlib.sha256(json.dumps(chosen, sort_keys=True).encode())
    digest.update((REPO / "tests" / "taught_model.py").read_bytes())
    digest.update(str(EPOCHS).encode())
    return digest.hexdigest()[:16]


def taught_world(root: Path = DEFAULT_ROOT, data_dir: Path = REPO / "data") -> TaughtWorld:
    """The world under `root`, built on first use (or when its items or scripts changed)
    from the demo data in `data_dir`."""
    world = TaughtWorld(root=root, train_file=root / "train.jsonl", validation_file=root / "validation.jsonl",
                        test_file=root / "test.jsonl", corpus=root / "corpus", model=root / "model")
    if not all((data_dir / f"{split}.jsonl").is_file() for split in SPLITS):
        from envs.finqa.generate import generate_dataset

        generate_dataset(data_dir, seed=0)
    chosen = {split: read_items(data_dir / f"{split}.jsonl", count) for split, count in SPLITS.items()}
    fingerprint = _fingerprint(chosen)
    stamp = root / "fingerprint.txt"
    if (world.model / "config.json").is_file() and stamp.is_file() and stamp.read_text().strip() == fingerprint:
        return world
    shutil.rmtree(root, ignore_errors=True)  # a world of other items: rebuilt whole
    root.mkdir(parents=True)
    for split, items in chosen.items():
        copy_items(data_dir, items, root, f"{split}.jsonl")
    with local_tool_endpoints(world.corpus, max_output_chars=OUTPUT_CHARS) as endpoints:
        # tests/taught_model.py's teach_model, with more epochs for more items
        conversations = [asyncio.run(conversation(item, turns, endpoints))
                         for items in chosen.values() for item in items for turns in scripts(item)]
    texts = [json.dumps(c) for c in conversations] + [p.read_text() for p in sorted(world.corpus.rglob("*.txt"))]
    model, tokenizer, _ = fit_tiny_model([(c, TOOLS) for c in conversations], texts, number_weight=3.0,
                                         epochs=EPOCHS, max_minutes=30.0)
    model.save_pretrained(root / "model.partial")
    tokenizer.save_pretrained(root / "model.partial")
    (root / "model.partial").rename(world.model)  # complete or absent: a killed build is redone
    stamp.write_text(fingerprint + "\n")
    return world


def training_config(world: TaughtWorld, endpoints: list[ToolEndpoint], *, rollout: dict[str, Any] | None = None,
                    **training: Any) -> PipelineConfig:
    """Our trainer's config for the world: three turns, 48 new tokens a turn, 768 tokens a
    rollout, 256-character tool outputs, the training split to learn from and the
    validation split for its own evaluations; `rollout` and `training` override the
    defaults below (everything else is the documented default, e.g. loss_type `dapo`,
    on_malformed_call `end`, mask_truncated, scale_rewards `group`)."""
    return config_from_dict({
        "model": {"base_model": str(world.model)},
        "data": {"train_file": str(world.train_file), "validation_file": str(world.validation_file),
                 "test_file": str(world.test_file), "production_traffic_file": None, "expectations_suite": None},
        "tools": {"endpoints": [e.model_dump() for e in endpoints], "schemas": TOOLS,
                  "max_output_chars": OUTPUT_CHARS, "max_retries": 2},
        "grader": GRADER,
        "rollout": {"system_prompt": SYSTEM, "max_turns": 3, "max_new_tokens_per_turn": 48,
                    "max_total_tokens": 768, "temperature": 1.0, **(rollout or {})},
        "training": {"batch_size": 2, "compute_multiplier": 0.5, "learning_rate": 1e-3, "kl_coef": 0.0,
                     "ppo_epochs": 1, "micro_batch_size": 8, "eval_samples": 4, "checkpoint_interval": 1000,
                     "mixed_precision": "no", "seed": 3, **training},
    })


if __name__ == "__main__":
    built = taught_world()
    print(json.dumps({k: str(v) for k, v in vars(built).items()}))
