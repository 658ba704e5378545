"""A disk that fills while a checkpoint or a model directory is written.

`FullDisk` makes the N-th file (or directory) written under a root fail with ENOSPC,
leaving that file half-written, as a disk that fills during it would. A census run
first counts every write of a checkpoint and of a model directory (and checks that the
hooks saw every file that ended up on disk, and that all of them went to the `.partial`
directory); then the disk fills at each write in turn. Each time the save raises
StorageError naming the path and what to free, the previous checkpoint is the latest
and resumes to the exact weights, optimizer moments and state it held, the previous
model directory is byte for byte what it was, and no partial directory is left behind.
"""

from __future__ import annotations

import builtins
import errno
import io
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch

from envs.finqa.tiny_model import build_model, tiny_config
from envs.finqa.tokenizer import build_tokenizer
from trainer.errors import InfraError, StorageError
from trainer.rl.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint, save_model


class FullDisk:
    """ENOSPC (or `code`) at the `fail_at`-th write under `root`, counting from 1; None
    only counts. Hooked: Python's open in a writing mode (JSON and text files), os.mkdir,
    torch.save to a path (accelerate's optimizer and RNG files), safetensors' save_file
    wherever it was imported (weights) and the tokenizers backend's Rust save
    (tokenizer.json). A file that fails is left half-written."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, root: Path, tokenizer: Any, fail_at: int | None,
                 code: int = errno.ENOSPC):
        self.root, self.fail_at, self.code = root.resolve(), fail_at, code
        self.written: list[Path] = []
        self._inside = 0  # a hooked library call is writing: its own opens are not counted again
        real_open, real_mkdir, real_torch_save = builtins.open, os.mkdir, torch.save

        def open_(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
            if isinstance(file, str | os.PathLike) and set(mode) & set("wax+") and self._due(file):
                real_open(file, mode, *args, **kwargs).close()
                self._fail(file)
            return real_open(file, mode, *args, **kwargs)

        def mkdir(path: Any, *args: Any, **kwargs: Any) -> None:
            # only a call that creates a directory writes (makedirs tries existing ones)
            if not os.path.lexists(path) and os.path.isdir(os.path.dirname(os.fspath(path))) and self._due(path):
                self._fail(path)
            real_mkdir(path, *args, **kwargs)

        def torch_save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
            if not isinstance(f, str | os.PathLike):
                return real_torch_save(obj, f, *args, **kwargs)  # a file object: counted at its open
            self._written_by(real_torch_save, f, obj, f, *args, **kwargs)

        monkeypatch.setattr(builtins, "open", open_)
        monkeypatch.setattr(io, "open", open_)  # pathlib's write_text
        monkeypatch.setattr(os, "mkdir", mkdir)
        monkeypatch.setattr(torch, "save", torch_save)

        real_save_file = safetensors.torch.save_file

        def save_file(tensors: Any, filename: Any, *args: Any, **kwargs: Any) -> None:
            self._written_by(real_save_file, filename, tensors, filename, *args, **kwargs)

        for module in list(sys.modules.values()):
            for name, value in list(getattr(module, "__dict__", {}).items()):
                if value is real_save_file:
                    monkeypatch.setattr(module, name, save_file)

        backend = type(tokenizer).backend_tokenizer
        disk = self

        class SavingBackend:
            def __init__(self, inner: Any):
                self._inner = inner

            def __getattr__(self, name: str) -> Any:
                return getattr(self._inner, name)

            def save(self, path: str, *args: Any, **kwargs: Any) -> None:
                disk._written_by(self._inner.save, path, path, *args, **kwargs)

        monkeypatch.setattr(type(tokenizer), "backend_tokenizer", property(lambda tok: SavingBackend(backend.fget(tok))))

    def _due(self, path: Any) -> bool:
        """Count a write under root; True when it is the one that fails."""
        path = Path(os.fspath(path)).resolve()
        if self._inside or not path.is_relative_to(self.root):
            return False
        self.written.append(path)
        return len(self.written) == self.fail_at

    def _written_by(self, write: Callable[..., Any], path: Any, *args: Any, **kwargs: Any) -> None:
        self._inside += 1
        try:
            write(*args, **kwargs)
        finally:
            self._inside -= 1
        if self._due(path):
            os.truncate(path, os.path.getsize(path) // 2)
            self._fail(path)

    def _fail(self, path: Any) -> None:
        raise OSError(self.code, os.strerror(self.code), os.fspath(path))


@pytest.fixture
def training(tmp_path: Path):
    from accelerate import Accelerator

    accelerator = Accelerator()
    tokenizer = build_tokenizer(["revenue grew 12% in 2021", "Answer: 3.5"] * 20, vocab_size=300)
    model = build_model(tiny_config(len(tokenizer), hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1,
                                    intermediate_size=32, pad_token_id=tokenizer.pad_token_id,
                                    eos_token_id=tokenizer.eos_token_id), seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = accelerator.prepare(model, optimizer)
    return accelerator, model, optimizer, tokenizer


def train_step(model: Any, optimizer: Any) -> None:
    ids = torch.randint(0, 64, (2, 8))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def tensors(model: Any, optimizer: Any) -> dict[str, torch.Tensor]:
    moments = {f"adam.{k}": v for k, v in optimizer.state_dict()["state"][0].items()}
    return {k: v.detach().clone() for k, v in {**model.state_dict(), **moments}.items()}


def files(root: Path) -> dict[Path, bytes]:
    return {p.relative_to(root): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def census(monkeypatch: pytest.MonkeyPatch, tokenizer: Any, root: Path, save: Callable[[Path], Path]) -> int:
    """Writes one save into the existing directory `root` makes, checked against what it
    left on disk."""
    root.mkdir()
    with monkeypatch.context() as patch:
        disk = FullDisk(patch, root, tokenizer, fail_at=None)
        final = save(root)
    partial = final.with_name(final.name + ".partial")
    assert all(p.is_relative_to(partial) for p in disk.written)  # nothing is written in place
    on_disk = {p.relative_to(final) for p in final.rglob("*")}
    assert {p.relative_to(partial) for p in disk.written if p != partial} == on_disk  # every write seen
    return len(disk.written)


def test_full_disk_at_each_checkpoint_write_keeps_the_last_checkpoint(training, tmp_path, monkeypatch):
    accelerator, model, optimizer, tokenizer = training
    train_step(model, optimizer)
    root = tmp_path / "checkpoints"
    save_checkpoint(accelerator, root, 1, {"history": [{"step": 1}], "epoch": 0, "position": 2})
    good = tensors(model, optimizer)
    writes = census(monkeypatch, tokenizer, tmp_path / "census",
                    lambda where: save_checkpoint(accelerator, where, 1, {"history": []}))
    assert writes == 6  # two directories, weights, optimizer, RNG states, trainer_state.json

    for fail_at in range(1, writes + 1):
        train_step(model, optimizer)  # the run moved on and saves step 2
        with monkeypatch.context() as patch, pytest.raises(StorageError) as failure:
            FullDisk(patch, root, tokenizer, fail_at)
            save_checkpoint(accelerator, root, 2, {"history": [{"step": 1}, {"step": 2}], "epoch": 0, "position": 4})
        message = str(failure.value)
        assert isinstance(failure.value, InfraError) and failure.value.path == str(root / "step_2")
        assert f"writing checkpoint {root / 'step_2'} failed" in message and "No space left on device" in message
        assert f"The previous checkpoint {root / 'step_1'} is intact" in message
        assert failure.value.needed_bytes == sum(p.stat().st_size for p in (root / "step_1").rglob("*") if p.is_file())
        assert f"The disk holding {root} is full" in message and "free at least" in message

        assert sorted(p.name for p in root.iterdir()) == ["step_1"], f"write {fail_at}"
        assert latest_checkpoint(root) == root / "step_1"
        state = load_checkpoint(accelerator, root / "step_1")
        assert state["step"] == 1 and state["history"] == [{"step": 1}] and state["position"] == 2
        restored = tensors(model, optimizer)
        assert restored.keys() == good.keys() and all(torch.equal(restored[k], good[k]) for k in good)

    # once there is room again, the next save goes through and replaces it
    save_checkpoint(accelerator, root, 2, {"history": [], "epoch": 0, "position": 4})
    assert sorted(p.name for p in root.iterdir()) == ["step_2"]


def test_full_disk_at_each_model_write_keeps_the_previous_model(training, tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    accelerator, model, optimizer, tokenizer = training
    final = tmp_path / "out" / "final"
    save_model(accelerator, model, tokenizer, final)
    before = files(final)
    writes = census(monkeypatch, tokenizer, tmp_path / "census",
                    lambda where: save_model(accelerator, model, tokenizer, where / "m") or where / "m")
    assert writes >= 7  # the directory, config, generation config, weights, tokenizer files
    train_step(model, optimizer)

    for fail_at in range(1, writes + 1):
        with monkeypatch.context() as patch, pytest.raises(StorageError) as failure:
            FullDisk(patch, final.parent, tokenizer, fail_at)
            save_model(accelerator, model, tokenizer, final)
        message = str(failure.value)
        assert f"writing model directory {final} failed" in message and "No space left on device" in message
        assert f"The model directory at {final} is intact" in message
        assert failure.value.needed_bytes == sum(len(b) for b in before.values())
        assert sorted(p.name for p in final.parent.iterdir()) == ["final"], f"write {fail_at}"
        assert files(final) == before
    AutoModelForCausalLM.from_pretrained(final)  # still loads

    save_model(accelerator, model, tokenizer, final)
    assert files(final) != before and sorted(p.name for p in final.parent.iterdir()) == ["final"]


def test_first_save_that_fails_leaves_nothing_and_other_errors_say_so(training, tmp_path, monkeypatch):
    accelerator, model, _, tokenizer = training
    fresh = tmp_path / "fresh"
    with monkeypatch.context() as patch, pytest.raises(StorageError) as failure:
        FullDisk(patch, tmp_path, tokenizer, fail_at=3)
        save_model(accelerator, model, tokenizer, fresh)
    assert list(tmp_path.iterdir()) == []
    assert f"Nothing was left at {fresh}" in str(failure.value)
    weights = sum(t.numel() * t.element_size() for t in accelerator.unwrap_model(model).state_dict().values())
    assert failure.value.needed_bytes == weights

    with monkeypatch.context() as patch, pytest.raises(StorageError) as failure:
        FullDisk(patch, tmp_path, tokenizer, fail_at=2, code=errno.EROFS)
        save_checkpoint(accelerator, tmp_path / "checkpoints", 1, {})
    assert "Read-only file system" in str(failure.value) and "Fix the cause" in str(failure.value)
    assert "There is no earlier checkpoint" in str(failure.value)
    assert list((tmp_path / "checkpoints").iterdir()) == []
