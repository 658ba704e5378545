"""Checkpoints: resumable training state, and the best models by evaluation score.

A resumable checkpoint is a directory `checkpoints/step_N/` holding
`accelerate/` (what `Accelerator.save_state` writes: model, optimizer, per-process RNG) and
`trainer_state.json` (the step, the data order and position, the epoch, the metrics so far,
the best-checkpoint list and every process's python/numpy/torch RNG state). With the
per-step sampling seeds of the trainer this is enough for a resumed CPU run to reproduce
an uninterrupted one.

Separately, the `keep` best models by eval score are kept as plain model directories
(`best/step_N/`, `save_pretrained` plus the tokenizer, LoRA adapters merged), which is
what OpenAI's fine-tuning keeps and what the evaluation and promotion stages load.

Every directory is written the same way, so that a full disk or a crash can never leave
a half-written one where a complete one was: the files go to `<name>.partial` beside the
target, are flushed to disk (`fsync`: some filesystems report a full disk only then),
and the directory is renamed into place; what it replaces is removed only after that,
and older checkpoints only after the new one is in place. A failed write (ENOSPC or any
other OSError) removes the partial directory and raises `StorageError` naming the path,
the space the write needed and what is free, with the previous checkpoint or model
intact: `--resume` continues from the last checkpoint once space is freed.
"""

from __future__ import annotations

import base64
import copy
import errno
import json
import os
import random
import shutil
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from trainer.errors import StorageError

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


def save_checkpoint(accelerator: Any, checkpoints_dir: Path, step: int, state: dict[str, Any], *,
                    sharded: tuple[Any, Any] | None = None) -> Path:
    """Write `checkpoints_dir/step_<step>` and remove the older ones. Every process must
    call it (every rank its RNG state; with `sharded`, an FSDP model and its optimizer,
    every rank its shards under `model_shards/`);
    the main process writes the JSON `state` plus every process's RNG state. A failed
    write raises StorageError on every process and leaves the previous checkpoint as it was."""
    from accelerate.utils import gather_object

    final = checkpoints_dir / f"step_{step}"
    partial = _partial(final)
    previous = latest_checkpoint(checkpoints_dir)
    main = accelerator.is_main_process
    # Each stage ends with every rank learning whether any rank failed (gather_object is
    # also the barrier), so no rank writes into a directory that is gone or waits for
    # one that stopped.
    failure = _attempt(_fresh_dir, partial) if main else None
    failure = _first(gather_object([failure]))
    if failure is None:
        failure = _attempt(accelerator.save_state, str(partial / ACCELERATE_DIR))
    if sharded is not None:
        failure = _first(gather_object([failure]))  # every rank, failed or not: collectives stay in step
        if failure is None:
            from trainer.rl.sharding import save_sharded

            failure = _attempt(save_sharded, *sharded, partial)
    rngs = gather_object([rng_state()])
    failure = _first(gather_object([failure]))
    if failure is None and main:

        def finish() -> None:
            # The JSON last: a directory named step_N with a state file is always complete.
            (partial / STATE_FILE).write_text(json.dumps({**state, "step": step, "rng": rngs}))
            _publish(partial, final)

        failure = _attempt(finish)
    failure = _first(gather_object([failure]))
    if failure is not None:
        kept = (f"The previous checkpoint {previous} is intact and --resume continues from it"
                if previous is not None else "There is no earlier checkpoint to resume from")
        needed = _tree_bytes(previous) if previous is not None else None
        raise _write_failed(failure, f"checkpoint {final}", final, needed, "the previous checkpoint",
                            kept, remove=main)
    if main:
        for other in checkpoints_dir.iterdir():
            if other != final and other.name.startswith("step_"):
                shutil.rmtree(other, ignore_errors=True)
    accelerator.wait_for_everyone()
    return final


def load_checkpoint(accelerator: Any, path: Path, *, sharded: tuple[Any, Any] | None = None) -> dict[str, Any]:
    """Restore model, optimizer and RNG states from `path` (after `accelerator.prepare`, or
    into the FSDP model and optimizer `sharded`) and return its JSON state."""
    accelerator.load_state(str(path / ACCELERATE_DIR))
    if sharded is not None:
        from trainer.rl.sharding import load_sharded

        load_sharded(*sharded, path)
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
    and DeepSpeed gather the full weights); the main process writes. A failed write raises
    StorageError on every process and leaves what was at `path` as it was."""
    from accelerate.utils import gather_object
    from peft import PeftModel

    unwrapped = accelerator.unwrap_model(model)
    is_lora = isinstance(unwrapped, PeftModel)
    state_dict = None if is_lora else accelerator.get_state_dict(model)
    partial = _partial(path)
    existed = path.is_dir()
    failure = None
    if accelerator.is_main_process:

        def write() -> None:
            _fresh_dir(partial)
            if is_lora:
                # Merge a copy: the training model keeps its separate adapters.
                copy.deepcopy(unwrapped).merge_and_unload().save_pretrained(partial)
            else:
                unwrapped.save_pretrained(partial, state_dict=state_dict)
            tokenizer.save_pretrained(partial)
            _publish(partial, path)

        failure = _attempt(write)
    failure = _first(gather_object([failure]))
    if failure is not None:
        if existed:
            needed, basis = _tree_bytes(path), "the model directory it replaces"
        else:
            needed, basis = _parameter_bytes(unwrapped), "the model's weights"
        kept = f"The model directory at {path} is intact" if existed else f"Nothing was left at {path}"
        raise _write_failed(failure, f"model directory {path}", path, needed, basis, kept,
                            remove=accelerator.is_main_process)


# --- writing directories whole ----------------------------------------------------------


def _partial(target: Path) -> Path:
    """Where `target` is written before it is renamed into place: beside it, on the same
    filesystem (a rename across filesystems is a copy, not atomic)."""
    return target.with_name(target.name + ".partial")


def _fresh_dir(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)  # left by a run that was killed mid-write
    path.mkdir(parents=True)


def _publish(partial: Path, target: Path) -> None:
    """Flush `partial` to disk, then rename it to `target`, replacing what was there."""
    _fsync_tree(partial)
    old = target.with_name(target.name + ".old")
    if target.exists():
        # A directory cannot be renamed over a non-empty one: the old one steps aside
        # first and comes back if the second rename fails. Only a crash between the two
        # renames leaves no `target`, with the old one complete at `<name>.old`.
        shutil.rmtree(old, ignore_errors=True)
        target.rename(old)
        try:
            partial.rename(target)
        except OSError:
            old.rename(target)
            raise
    else:
        partial.rename(target)
    _fsync(target.parent)  # the rename itself
    shutil.rmtree(old, ignore_errors=True)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)  # directories too, on POSIX
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(root: Path) -> None:
    """fsync every file and directory under `root`. A rename without it can publish files
    whose blocks are not yet written, and some filesystems (NFS, quotas, XFS with delayed
    allocation) report a full disk only here, not at write()."""
    for directory, _, files in os.walk(root):
        for name in files:
            _fsync(Path(directory) / name)
        _fsync(Path(directory))


def _attempt(write: Callable[..., object], *args: Any) -> tuple[int | None, str] | None:
    """Run `write(*args)`; None when it succeeded, else the OSError as (errno, text), a
    form that gather_object can carry to the other processes."""
    try:
        write(*args)
    except OSError as exc:
        return exc.errno, str(exc)
    return None


def _first(failures: list[tuple[int | None, str] | None]) -> tuple[int | None, str] | None:
    return next((failure for failure in failures if failure is not None), None)


def _write_failed(
    failure: tuple[int | None, str],
    what: str,
    target: Path,
    needed: int | None,
    basis: str,
    kept: str,
    *,
    remove: bool,
) -> StorageError:
    """The StorageError for a failed write of `what` to `target`; removes the partial
    directory (on the process that wrote it) after measuring what had been written."""
    code, text = failure
    partial = _partial(target)
    written = _tree_bytes(partial) if partial.exists() else 0
    if remove:
        shutil.rmtree(partial, ignore_errors=True)
    where = target.parent
    if code in (errno.ENOSPC, errno.EDQUOT):
        if needed:
            amount = f"at least {_size(needed)} (the size of {basis})"
        else:
            amount = f"more than the {_size(written)} written before it filled"
        message = (
            f"writing {what} failed: {text}. {kept}. The disk holding {where} is full "
            f"({_size(_free_bytes(where))} free): free {amount} there, or point the output "
            "directory at a larger disk, and run again."
        )
    else:
        message = f"writing {what} failed: {text}. {kept}. Fix the cause for {where} and run again."
    return StorageError(message, path=str(target), needed_bytes=needed)


def _tree_bytes(root: Path) -> int:
    return sum(file.stat().st_size for file in root.rglob("*") if file.is_file())


def _parameter_bytes(model: torch.nn.Module) -> int:
    return sum(tensor.numel() * tensor.element_size() for tensor in model.state_dict().values())


def _free_bytes(path: Path) -> int:
    while not path.exists():
        path = path.parent
    return shutil.disk_usage(path).free


def _size(n_bytes: float) -> str:
    if n_bytes < 1024:
        return f"{n_bytes:.0f} bytes"
    power = 1
    while power < 4 and n_bytes >= 1024 ** (power + 1):
        power += 1
    return f"{n_bytes / 1024**power:.1f} {('KiB', 'MiB', 'GiB', 'TiB')[power - 1]}"


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
