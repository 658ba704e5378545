"""The test-split ledger: every reading of a test split, in a file the project commits.

A test split is meant to be read once per frozen config; every reading is a choice made
on it, which its figures no longer survive. An MLflow store counts readings from zero on
every clone, so the count lives in a JSONL file beside the data (`data.test_ledger`,
committed with the project): `regression_eval` and `agentrft eval --split test` append a
line per reading (when, which split, which config, which command, which MLflow run), tag
their MLflow run with the count, and say it in their report.

A split is named by the sha256 of its items as the stages read them (every item of
`split_items(data, "test")`, whatever `max_items` a reading used), so a regenerated or
re-ordered file is another split, and the seeded half of a validation file is one too.
A shift evaluation's split is read and counted the same way (`split_file`).

Every reading records the config's `name` (every reader writes the same one: the regression
stage once wrote its MLflow experiment's, so one config counted as two) and the checkout's
git commit, `-dirty` when tracked files differ from it. `rename_config` gives rows recorded
under another name the config's, keeping what they said as `recorded_as` and nothing else
changed (`agentrft data readings --rename OLD`).

A config is named by what it sets (`PipelineConfig.written_hash`: the values away from the
defaults) and by what it resolves to (`config_hash`: every value, defaults included). A
default added later leaves the first alone: the same config read again is counted as one,
and the sentence says when its resolved hash moved (a default changed under it).

    agentrft data readings --config job.yaml    # each split's readings, by which configs
"""

from __future__ import annotations

import datetime
import fcntl
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainer.data import read_jsonl, split_items
from trainer.errors import DataError


@dataclass
class Readings:
    split: str  # the split's sha256 (its first 16 hex digits name it)
    count: int  # readings of this split, this one included
    configs: list[str]  # the distinct configs (name and hash) that read it, oldest first

    def sentence(self) -> str:
        times = "once" if self.count == 1 else f"{self.count} times"
        return (f"This test split (sha256 {self.split[:16]}) has been read {times}, by "
                f"{len(self.configs)} config{'s' if len(self.configs) != 1 else ''}: {', '.join(self.configs)}.")


def split_digest(data: Any, split_file: str | None = None) -> tuple[str, int]:
    """(sha256 of the test split's items, or of `split_file`'s, and their number)."""
    items = read_jsonl(Path(split_file)) if split_file else split_items(data, "test")
    digest = hashlib.sha256("".join(json.dumps(item, sort_keys=True) + "\n" for item in items).encode())
    return digest.hexdigest(), len(items)


def _config_key(row: dict[str, Any]) -> tuple[str, str]:
    """A reading's config: its name and what it sets (rows written before the written hash
    was recorded name it by the resolved one)."""
    return row["config"], row.get("config_written_hash") or row.get("config_hash") or ""


def readings(ledger: Path, split: str) -> Readings:
    rows = [r for r in read_jsonl(ledger) if r.get("split_sha256") == split] if ledger.is_file() else []
    resolved: dict[tuple[str, str], list[str]] = {}
    for row in rows:
        hashes = resolved.setdefault(_config_key(row), [])
        if row.get("config_hash") and row["config_hash"][:8] not in hashes:
            hashes.append(row["config_hash"][:8])
    configs = []
    for (name, written), hashes in resolved.items():
        if not written:
            configs.append(name)
        elif len(hashes) > 1:
            configs.append(f"{name} ({written[:8]}; resolved {' -> '.join(hashes)}: a default changed under it)")
        else:
            configs.append(f"{name} ({written[:8]})")
    return Readings(split=split, count=len(rows), configs=configs)


def ledger_path(data: Any) -> Path | None:
    """Where `data.test_ledger` says readings go (auto: beside the DVC file when the data is
    pinned, outside what it pins, whether or not the config names that file; else beside the
    test split's file)."""
    if not data.test_ledger:
        return None
    if data.test_ledger == "auto":
        if data.dvc_file:
            return Path(data.dvc_file).parent / "test_readings.jsonl"
        split = Path(data.test_file or data.validation_file)
        for folder in split.resolve().parents:  # a folder DVC tracks (`dvc add data` wrote data.dvc beside it)
            if folder.name and folder.with_name(f"{folder.name}.dvc").is_file():
                return folder.parent / "test_readings.jsonl"
        return split.parent / "test_readings.jsonl"
    return Path(data.test_ledger)


def _check_outside_pin(data: Any, ledger: Path) -> None:
    """A ledger inside the DVC-pinned data would change the data version at every reading."""
    if not data.dvc_file:
        return
    from tasks.data_version import pinned_output

    pinned = pinned_output(data.dvc_file)
    if ledger.resolve().is_relative_to(pinned):
        raise DataError(f"data.test_ledger: {ledger} is inside {pinned}, which {data.dvc_file} pins; every reading "
                        "would change the data version. Put the ledger outside it (e.g. beside "
                        f"{data.dvc_file}, which `auto` does)")


def record_reading(data: Any, *, command: str, config: str, config_hash: str, model: str,
                   config_written_hash: str = "", git_commit: str = "", mlflow_run_id: str = "", note: str = "",
                   split_file: str | None = None) -> Readings | None:
    """Append this reading of the test split (or of `split_file`, a shift evaluation's) to
    `data.test_ledger` (None: no ledger, nothing recorded) and return the split's readings
    so far, this one included. `config` is the config's `name`; the commit, when not given,
    is this checkout's."""
    from tasks.tracking import git_commit as checkout_commit

    ledger = ledger_path(data)
    if ledger is None:
        return None
    git_commit = git_commit or checkout_commit()
    _check_outside_pin(data, ledger)
    split, n_items = split_digest(data, split_file)
    row = {
        "time": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "split_sha256": split, "test_file": split_file or data.test_file or f"{data.validation_file} (seeded half)",
        "items": n_items, "command": command, "config": config, "config_hash": config_hash,
        "config_written_hash": config_written_hash, "model": model, "git_commit": git_commit,
        "mlflow_run_id": mlflow_run_id,
    } | ({"note": note} if note else {})
    ledger.parent.mkdir(parents=True, exist_ok=True)
    with ledger.open("a") as handle:  # one line at a time, whoever else appends
        fcntl.flock(handle, fcntl.LOCK_EX)
        handle.write(json.dumps(row) + "\n")
    return readings(ledger, split)


def tag_run(client: Any, run_id: str, found: Readings | None) -> None:
    if found is not None:
        client.set_tag(run_id, "test_split.sha256", found.split)
        client.set_tag(run_id, "test_split.readings", str(found.count))
        client.set_tag(run_id, "test_split.configs", ", ".join(found.configs)[:5000])


def split_readings(data: Any, ledger: Path, shift_files: dict[str, str]) -> list[dict[str, Any]]:
    """Every split the ledger holds readings of, with its count and configs: the config's test
    split and shift splits by name first (also when never read), then the others (retired
    splits), each with the files its readings named."""
    rows = read_jsonl(ledger) if ledger.is_file() else []
    named, out = {}, []
    for name, file in {"test": None, **shift_files}.items():
        try:
            named[name] = split_digest(data, file)
        except DataError as exc:  # not written yet (its data is generated): the ledger's splits still count
            out.append({"split": name, "sha256": None, "readings": None, "unread_because": str(exc)})
    order = [digest for digest, _ in named.values()]
    order += [split for split in dict.fromkeys(r.get("split_sha256") for r in rows) if split and split not in order]
    for split in order:
        found = readings(ledger, split)
        names = [name for name, (digest, _) in named.items() if digest == split]
        files = list(dict.fromkeys(r.get("test_file") for r in rows if r.get("split_sha256") == split))
        items = next((n for digest, n in named.values() if digest == split),
                     next((r.get("items") for r in rows if r.get("split_sha256") == split), None))
        out.append({"split": ", ".join(names) or "(no longer this config's)", "sha256": split, "items": items,
                    "readings": found.count, "configs": found.configs, "files": files})
    return out


def rename_config(ledger: Path, name: str, recorded: set[str]) -> int:
    """Rows whose `config` is one of `recorded` get `name`, what they said kept as
    `recorded_as`; every other field and every other row stays byte for byte. Returns the
    rows renamed."""
    if not ledger.is_file():
        raise DataError(f"{ledger}: no such ledger")
    renamed = 0
    with ledger.open("r+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)  # no reading appended while the file is rewritten
        lines = handle.read().splitlines(keepends=True)
        out = []
        for number, line in enumerate(lines, 1):
            try:
                row = json.loads(line) if line.strip() else None
            except json.JSONDecodeError as exc:
                raise DataError(f"{ledger}:{number}: not JSON ({exc.msg}); nothing was renamed") from None
            if not isinstance(row, dict) or row.get("config") not in recorded or row["config"] == name:
                out.append(line)
                continue
            row.setdefault("recorded_as", row["config"])  # renamed twice: the first name stays
            row["config"] = name
            out.append(json.dumps(row) + "\n")
            renamed += 1
        handle.seek(0)
        handle.write("".join(out))
        handle.truncate()
    return renamed
