"""The DVC pin of the demo data: compute DVC's directory md5 and check data/ against data.dvc.

`data/` is tracked by DVC (`dvc add data` wrote `data.dvc`); its md5 is the data version
that every MLflow run is tagged with. The demo data is generated, so instead of pulling it
from a remote, a fresh clone regenerates it and proves it byte-identical to the pin.

DVC 3 hashes a directory as the md5 of its `.dir` manifest: the JSON list
`[{"md5": <file md5>, "relpath": <posix path>}, ...]` sorted by relpath and serialized with
`json.dumps(..., sort_keys=True)` (as dvc-data's `Tree.as_bytes`), with `.dir` appended in
the .dvc file. It is computed here with hashlib alone: the same value, without starting
DVC's repo machinery and state database.
"""

from __future__ import annotations

import hashlib
import json
import tempfile
from dataclasses import dataclass
from pathlib import Path

import yaml

from envs.finqa.generate import generate_dataset
from trainer.errors import DataError


def dir_manifest(path: Path) -> list[dict[str, str]]:
    """DVC's `.dir` manifest of a directory: every file's md5 and posix relpath, sorted."""
    path = Path(path)
    if not path.is_dir():
        raise DataError(
            f"{path}: data directory not found; generate it with `agentrft data generate`"
        )
    entries = [
        {
            "md5": hashlib.md5(file.read_bytes(), usedforsecurity=False).hexdigest(),
            "relpath": file.relative_to(path).as_posix(),
        }
        for file in path.rglob("*")
        if file.is_file()
    ]
    return sorted(entries, key=lambda entry: entry["relpath"])


def manifest_md5(manifest: list[dict[str, str]]) -> str:
    """The md5 of a `.dir` manifest, serialized exactly as dvc-data does (without '.dir')."""
    return hashlib.md5(
        json.dumps(manifest, sort_keys=True).encode("utf-8"), usedforsecurity=False
    ).hexdigest()


def dir_md5(path: Path) -> str:
    """The md5 `dvc add` records for a directory, without the '.dir' suffix."""
    return manifest_md5(dir_manifest(path))


def pinned_md5(dvc_file: Path) -> str:
    """The directory md5 pinned in a .dvc file (`outs[0].md5`, '.dir' stripped)."""
    dvc_file = Path(dvc_file)
    if not dvc_file.is_file():
        raise DataError(f"{dvc_file}: DVC file not found; create it with `dvc add data`")
    try:
        pin = yaml.safe_load(dvc_file.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        raise DataError(f"{dvc_file}: not valid YAML ({exc})") from None
    try:
        md5 = pin["outs"][0]["md5"]
    except (TypeError, KeyError, IndexError):
        raise DataError(f"{dvc_file}: no 'outs[0].md5'; recreate it with `dvc add data`") from None
    if not isinstance(md5, str) or not md5:
        raise DataError(f"{dvc_file}: 'outs[0].md5' must be a string, got {md5!r}")
    return md5.removesuffix(".dir")


def first_difference(expected: list[dict[str, str]], actual: list[dict[str, str]]) -> str | None:
    """The first relpath (in sorted order) that is missing, extra or different in actual."""
    want = {entry["relpath"]: entry["md5"] for entry in expected}
    have = {entry["relpath"]: entry["md5"] for entry in actual}
    for relpath in sorted([*want, *(p for p in have if p not in want)]):
        if want.get(relpath) != have.get(relpath):
            state = (
                "missing"
                if relpath not in have
                else "unexpected"
                if relpath not in want
                else "differs"
            )
            return f"{relpath} ({state})"
    return None


@dataclass(frozen=True)
class VerifyResult:
    """Whether the generator reproduces the pin and data_dir holds it, and why not."""

    ok: bool
    pinned_md5: str
    regenerated_md5: str
    data_md5: str | None  # None when data_dir does not exist
    first_difference: str | None
    message: str

    def raise_if_mismatch(self) -> None:
        if not self.ok:
            raise DataError(self.message)


def verify_data(data_dir: Path, dvc_file: Path, *, seed: int = 0) -> VerifyResult:
    """Regenerate the demo data with `seed` into a temporary directory and compare its md5
    with the pin in dvc_file and with data_dir. On a mismatch the message names the md5s
    and the first file that differs between the regenerated data and data_dir."""
    data_dir, dvc_file = Path(data_dir), Path(dvc_file)
    pinned = pinned_md5(dvc_file)
    with tempfile.TemporaryDirectory(prefix="agentrft-data-") as tmp:
        generate_dataset(Path(tmp), seed=seed)
        regenerated_manifest = dir_manifest(Path(tmp))
    regenerated = manifest_md5(regenerated_manifest)
    data_manifest = dir_manifest(data_dir) if data_dir.is_dir() else None
    data = manifest_md5(data_manifest) if data_manifest is not None else None
    difference = (
        first_difference(regenerated_manifest, data_manifest) if data_manifest is not None else None
    )

    if regenerated == pinned and data in (pinned, None):
        where = f"{data_dir} matches it" if data else f"{data_dir} does not exist yet"
        message = f"data OK: generator (seed {seed}) reproduces {dvc_file} md5 {pinned}; {where}"
    elif regenerated != pinned:
        message = (
            f"data mismatch: {dvc_file} pins md5 {pinned} but the generator (seed {seed}) gives "
            f"{regenerated}; first file differing from {data_dir}: "
            f"{difference or ('none (it does not exist)' if data is None else 'none')}. "
            f"Use the seed the pin was made with, or regenerate and run `dvc add {data_dir}`."
        )
    else:
        message = (
            f"data mismatch: {data_dir} has md5 {data} but {dvc_file} pins {pinned} (the generator "
            f"reproduces the pin); first differing file: {difference}. "
            f"Regenerate it with `agentrft data generate --out {data_dir} --seed {seed}` or `dvc checkout`."
        )
    return VerifyResult(
        ok=regenerated == pinned and data in (pinned, None),
        pinned_md5=pinned,
        regenerated_md5=regenerated,
        data_md5=data,
        first_difference=difference,
        message=message,
    )
