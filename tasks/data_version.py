"""The data version: what DVC pins, checked by DVC.

A job's data lives under DVC (`dvc add data` wrote `data.dvc`); the md5 of that output,
as DVC computed it, is the data version every MLflow run and cache key carries. Before any
stage reads the data, DVC itself compares the workspace with the pin (`Repo.data_status`):
a modified or missing output stops the run with the DVC command that fixes it. Jobs whose
data is not under DVC (`data.dvc_file: null`, e.g. an OpenAI job's two files) get the md5
of their dataset files instead.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from trainer.errors import DataError


def _repo(dvc_file: Path) -> Any:
    from dvc.exceptions import NotDvcRepoError
    from dvc.repo import Repo

    try:
        return Repo(Repo.find_root(str(dvc_file.resolve().parent)))
    except NotDvcRepoError:
        raise DataError(
            f"{dvc_file}: not inside a DVC repository; run `dvc init` in the project root (or set "
            "data.dvc_file: null to version the data by the md5 of its files)"
        ) from None


def _output(repo: Any, dvc_file: Path) -> Any:
    from dvc.exceptions import DvcException

    if not dvc_file.is_file():
        raise DataError(f"{dvc_file}: DVC file not found; pin the data with `dvc add <data dir>`")
    try:
        stage = repo.stage.load_one(str(dvc_file.resolve()))
    except DvcException as exc:
        raise DataError(f"{dvc_file}: not a valid DVC file ({exc}); recreate it with `dvc add <data dir>`") from None
    if len(stage.outs) != 1 or not stage.outs[0].hash_info.value:
        raise DataError(f"{dvc_file}: expected one pinned output with an md5; recreate it with `dvc add`")
    return stage.outs[0]


def pinned_md5(dvc_file: str | Path) -> str:
    """The md5 DVC recorded for the pinned output (a directory's without '.dir')."""
    dvc_file = Path(dvc_file)
    with _repo(dvc_file) as repo:
        return str(_output(repo, dvc_file).hash_info.value).removesuffix(".dir")


def pinned_output(dvc_file: str | Path) -> Path:
    """The directory or file `dvc_file` pins, as DVC resolves it."""
    dvc_file = Path(dvc_file)
    with _repo(dvc_file) as repo:
        return Path(_output(repo, dvc_file).fs_path).resolve()


def check_pinned(dvc_file: str | Path) -> str:
    """Ask DVC whether the workspace holds exactly what `dvc_file` pins; returns the md5.
    DataError naming the output and the DVC command to run when it does not."""
    dvc_file = Path(dvc_file)
    with _repo(dvc_file) as repo:
        out = _output(repo, dvc_file)
        path = Path(out.fs_path)
        if not path.exists():
            raise DataError(
                f"{path}: the data {dvc_file} pins is missing; run `dvc checkout {dvc_file}` (or `dvc pull`) "
                "to restore it"
            )
        # DVC matches targets against paths relative to the repository root.
        target = path.resolve().relative_to(Path(repo.root_dir).resolve()).as_posix()
        status = repo.data_status(targets=[target], not_in_remote=False, remote_refresh=False)
        changed = {kind: paths for kind, paths in status.get("uncommitted", {}).items() if paths}
        if changed:
            described = "; ".join(f"{kind}: {', '.join(map(str, paths[:5]))}" for kind, paths in changed.items())
            raise DataError(
                f"{path}: differs from the version {dvc_file} pins ({described}); restore it with "
                f"`dvc checkout {dvc_file}`, or pin the new data with `dvc add {path.name}` and commit {dvc_file}"
            )
        return str(out.hash_info.value).removesuffix(".dir")


def ensure_pinned(dvc_file: str | Path, data_dir: Path, generate: Any, *, seed: int, source: str,
                  log: Any = print) -> str:
    """An environment's generated data in place and exactly what `dvc_file` pins; returns the
    md5. Missing or different data is written by `generate(data_dir, seed=seed)` and checked
    again; data that still differs means the generator (`source`) no longer reproduces the pin."""
    try:
        return check_pinned(dvc_file)
    except DataError as first:
        log(f"regenerating {data_dir} from seed {seed} ({first})")
    generate(data_dir, seed=seed)
    try:
        return check_pinned(dvc_file)
    except DataError as exc:
        raise DataError(f"the regenerated data does not match {dvc_file}: {exc}; the generator no longer "
                        f"reproduces the pinned data: restore {source}, or pin the new data with `dvc add "
                        f"{data_dir}` and commit {dvc_file}") from None


def add(data_dir: str | Path) -> Path:
    """`dvc add data_dir` (through DVC's API); returns the .dvc file it wrote."""
    from dvc.repo import Repo

    data_dir = Path(data_dir).resolve()
    with Repo(Repo.find_root(str(data_dir.parent))) as repo:
        repo.add(str(data_dir))
    return data_dir.with_name(data_dir.name + ".dvc")


def init(root: str | Path) -> None:
    """`dvc init --no-scm` in `root` (a project without git, e.g. a test's)."""
    from dvc.repo import Repo

    Repo.init(str(root), no_scm=True, force=True).close()


def files_md5(paths: list[str | Path]) -> str:
    """The data version of files not under DVC: the md5 of their bytes, in order."""
    digest = hashlib.md5(usedforsecurity=False)
    for path in paths:
        try:
            digest.update(Path(path).read_bytes())
        except OSError as exc:
            raise DataError(f"{path}: cannot read the dataset ({exc.strerror}); check the path in the config") from None
    return digest.hexdigest()


def data_version(data: Any) -> str:
    """The version of a config's `data` section: DVC's pinned md5, checked against the
    workspace, or the md5 of the dataset files."""
    if data.dvc_file:
        return check_pinned(data.dvc_file)
    files = [data.train_file, data.validation_file] + ([data.test_file] if data.test_file else [])
    return files_md5(files)
