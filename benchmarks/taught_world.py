"""The small world the training benchmarks share: a few FinQA items, their corpus pages
and a tiny model taught to answer them with tools (tests/taught_model.py).

Sampled at temperature 1 the taught model mixes three scripted answers (list the year's
directory, read the page, or answer "0" at once), so rewards vary within a group and a
GRPO step has real work: multi-turn rollouts through the real tool server, grading and
an update. The world is built once (about 20 s) and cached under `.cache/bench/`.

    python -m benchmarks.taught_world    # build it (run_all does this on first use)
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from envs.finqa.local import local_tool_endpoints
from tests.taught_model import GRADER, OUTPUT_CHARS, SYSTEM, TOOLS, copy_items, teach_model
from trainer.config import PipelineConfig, config_from_dict
from trainer.data import read_items
from trainer.tools import ToolEndpoint

REPO = Path(__file__).resolve().parent.parent
DEFAULT_ROOT = REPO / ".cache" / "bench" / "taught_world"
N_ITEMS = 4  # taught, trained and evaluated on: the figures are about speed, not generalisation


@dataclass
class TaughtWorld:
    root: Path
    items_file: Path  # the taught items, used for training and evaluation alike
    corpus: Path
    model: Path

    def items(self) -> list[dict[str, Any]]:
        return read_items(self.items_file)


def taught_world(root: Path = DEFAULT_ROOT, data_dir: Path = REPO / "data") -> TaughtWorld:
    """The world under `root`, built on first use from the demo data in `data_dir`."""
    world = TaughtWorld(root=root, items_file=root / "items.jsonl", corpus=root / "corpus", model=root / "model")
    if (world.model / "config.json").is_file():
        return world
    if not (data_dir / "train.jsonl").is_file():
        from envs.finqa.generate import generate_dataset

        generate_dataset(data_dir, seed=0)
    root.mkdir(parents=True, exist_ok=True)
    copy_items(data_dir, read_items(data_dir / "train.jsonl", N_ITEMS), root, world.items_file.name)
    with local_tool_endpoints(world.corpus, max_output_chars=OUTPUT_CHARS) as endpoints:
        teach_model([world.items_file], world.corpus, endpoints, root / "model.partial")
    (root / "model.partial").rename(world.model)  # complete or absent: a killed build is redone
    return world


def training_config(world: TaughtWorld, endpoints: list[ToolEndpoint], **training: Any) -> PipelineConfig:
    """Our trainer's config for the world: three turns, 48 tokens a turn, 256-character
    tool outputs; `training` overrides the defaults below."""
    return config_from_dict({
        "data": {"train_file": str(world.items_file), "eval_file": str(world.items_file),
                 "corpus_dir": str(world.corpus)},
        "tools": {"endpoints": [e.model_dump() for e in endpoints], "schemas": TOOLS,
                  "max_output_chars": OUTPUT_CHARS, "demo_server": False, "max_retries": 2},
        "grader": GRADER,
        "rollout": {"system_prompt": SYSTEM, "max_turns": 3, "max_new_tokens_per_turn": 48,
                    "max_total_tokens": 768, "temperature": 1.0},
        "training": {"batch_size": 2, "compute_multiplier": 0.5, "learning_rate": 1e-3, "kl_coef": 0.0,
                     "ppo_epochs": 1, "micro_batch_size": 8, "eval_samples": 1, "checkpoint_interval": 1000,
                     "mixed_precision": "no", "seed": 3, **training},
    })


if __name__ == "__main__":
    built = taught_world()
    print(json.dumps({k: str(v) for k, v in vars(built).items()}))
