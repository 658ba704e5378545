"""Checkpoints: resumable training state, and the best models by evaluation score.

A resumable checkpoint is a directory `checkpoints/step_N/` holding
`accelerate/` (what `Accelerator.save_state` writes: model, optimizer, per-process RNG) and
`trainer_state.json` (the step, the data order and position, the epoch, the metrics so far,
the best-checkpoint list and every process's python/numpy/torch RNG state). The JSON is
written last and the directory is renamed into place only then, so a directory named
`step_N` with a state file is always complete; older ones are removed, and `--resume`
takes the newest. With the per-step sampling seeds of the trainer this is enough for a
resumed CPU run to reproduce an uninterrupted one.

Separately, the `keep` best models by eval score are kept as plain model directories
(`best/step_N/`, `save_pretrained` plus the tokenizer, LoRA adapters merged), which is
what OpenAI's fine-tuning keeps and what the evaluation and promotion stages load.
"""

from __future__ import annotations

import base64
import copy
import json
import random
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

STATE_FILE = "trainer_state.json"
ACCELERATE_DIR = "accelerate"


# --- RNG state as JSON ------------------------------------------------------------------


def _bytes(tensor: torch.Tensor) -> str:
    return base64.b64encode(tensor.numpy().tobytes()).decode("ascii")


def _tensor(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)


def rng_state() -> dict[str, Any]:
    """This process's python, numpy and torch (CPU and CUDA) RNG states, JSON-serialisable."""
    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "python": [version, list(internal), gauss],
        "numpy": [kind, keys.tolist(), int(pos), int(has_gauss), float(cached)],
        "torch": _bytes(torch.get_rng_state()),
    }
    if torch.cuda.is_available():
        state["cuda"] = [_bytes(s) for s in torch.cuda.get_rng_state_all()]
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what `rng_state` returned."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(_tensor(state["torch"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([_tensor(s) for s in state["cuda"]])


# --- resumable checkpoints --------------------------------------------------------------


def _step_of(path: Path) -> int | None:
    name = path.name
    return int(name[5:]) if name.startswith("step_") and name[5:].isdigit() else None


def latest_checkpoint(checkpoints_dir: Path) -> Path | None:
    """The newest complete checkpoint under `checkpoints_dir`, or None."""
    if not checkpoints_dir.is_dir():
        return None
    complete = [p for p in checkpoints_dir.iterdir() if _step_of(p) is not None and (p / STATE_FILE).is_file()]
    return max(complete, key=_step_of, default=None)


def save_checkpoint(accelerator: Any, checkpoints_dir: Path, step: int, state: dict[str, Any]) -> Path:
    """Write `checkpoints_dir/step_<step>` and remove the older ones. Every process must
    call it (FSDP and DeepSpeed save shards from each rank); the main process writes the
    JSON `state` plus every process's RNG state."""
    from accelerate.utils import gather_object

    final = checkpoints_dir / f"step_{step}"
    partial = checkpoints_dir / f"step_{step}.partial"
    if accelerator.is_main_process:
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(partial / ACCELERATE_DIR))
    rngs = gather_object([rng_state()])
    if accelerator.is_main_process:
        record = {**state, "step": step, "rng": rngs}
        (partial / STATE_FILE).write_text(json.dumps(record))
        shutil.rmtree(final, ignore_errors=True)
        partial.rename(final)
        for other in checkpoints_dir.iterdir():
            if other != final and other.name.startswith("step_"):
                shutil.rmtree(other, ignore_errors=True)
    accelerator.wait_for_everyone()
    return final


def load_checkpoint(accelerator: Any, path: Path) -> dict[str, Any]:
    """Restore model, optimizer and RNG states from `path` (after `accelerator.prepare`)
    and return its JSON state."""
    accelerator.load_state(str(path / ACCELERATE_DIR))
    state = json.loads((path / STATE_FILE).read_text())
    rngs = state["rng"]
    # A run resumed on another number of processes takes the main process's streams.
    mine = rngs[accelerator.process_index] if len(rngs) == accelerator.num_processes else rngs[0]
    set_rng_state(mine)
    return state


# --- model directories ------------------------------------------------------------------


def save_model(accelerator: Any, model: torch.nn.Module, tokenizer: Any, path: Path) -> None:
    """Write a directory that `AutoModelForCausalLM.from_pretrained` loads: the weights
    (LoRA adapters merged into them) and the tokenizer. Every process must call it (FSDP
    and DeepSpeed gather the full weights); the main process writes."""
    from peft import PeftModel

    unwrapped = accelerator.unwrap_model(model)
    is_lora = isinstance(unwrapped, PeftModel)
    state_dict = None if is_lora else accelerator.get_state_dict(model)
    if accelerator.is_main_process:
        shutil.rmtree(path, ignore_errors=True)
        if is_lora:
            # Merge a copy: the training model keeps its separate adapters.
            copy.deepcopy(unwrapped).merge_and_unload().save_pretrained(path)
        else:
            unwrapped.save_pretrained(path, state_dict=state_dict)
        tokenizer.save_pretrained(path)
    accelerator.wait_for_everyone()


@dataclass
class BestCheckpoint:
    step: int
    score: float
    path: str


class BestCheckpoints:
    """The `keep` best steps by eval score, each saved under `root/step_N`. A tie keeps
    the earlier step (the later one has no evidence of being better)."""

    def __init__(self, root: Path, keep: int, entries: list[dict[str, Any]] | None = None):
        self.root = root
        self.keep = keep
        self.entries = [BestCheckpoint(**e) for e in entries or []]

    def ranked(self) -> list[BestCheckpoint]:
        return sorted(self.entries, key=lambda e: (-e.score, e.step))

    def admits(self, score: float) -> bool:
        """Whether a model with this eval score belongs among the best."""
        return len(self.entries) < self.keep or score > self.ranked()[-1].score

    def add(self, step: int, score: float) -> tuple[Path, list[Path]]:
        """Record `step` (call only when `admits`); returns the directory to save it in
        and the directories of the steps it pushed out, to delete."""
        path = self.root / f"step_{step}"
        self.entries = [e for e in self.entries if e.step != step]
        self.entries.append(BestCheckpoint(step, score, str(path)))
        ranked = self.ranked()
        self.entries = ranked[: self.keep]
        return path, [Path(e.path) for e in ranked[self.keep :]]

    def stale_dirs(self) -> list[Path]:
        """Directories under `root` that no entry names: saved after the checkpoint a
        resumed run started from."""
        if not self.root.is_dir():
            return []
        kept = {Path(e.path).name for e in self.entries}
        return [p for p in self.root.iterdir() if p.is_dir() and p.name not in kept]

    def to_json(self) -> list[dict[str, Any]]:
        return [asdict(e) for e in self.ranked()]
