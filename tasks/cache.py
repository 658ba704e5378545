"""What a stage's cached result depends on, as Prefect cache policies.

Every stage task is cached with

    cache_policy=INPUTS - "ctx" + PipelineContext() + StageSource("tasks.<stage>")

- `INPUTS - "ctx"`: the config sections the task is given (each task takes only the
  sections it reads) and the upstream results it consumes, but not the run context, whose
  MLflow parent run is new at every pipeline run;
- `PipelineContext`: the data version (DVC md5) and the MLflow store the run records into;
- `StageSource`: the code the stage runs, i.e. the project modules its module imports,
  transitively, hashed as syntax trees without docstrings: a comment or docstring edit
  changes nothing, and a change to `trainer/rl/grpo.py` re-runs training but not
  `validate_data` or `baseline`, which never import it.

`--refresh STAGE` sets `refresh_cache` on that stage and the ones after it.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.util
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from prefect.cache_policies import INPUTS, CachePolicy
from prefect.utilities.hashing import hash_objects

ROOT = Path(__file__).resolve().parents[1]
PROJECT_PACKAGES = ("trainer", "tasks", "flows", "envs")


def _module_file(name: str) -> Path | None:
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    if spec is None or spec.origin is None or not spec.origin.endswith(".py"):
        return None
    path = Path(spec.origin).resolve()
    return path if ROOT in path.parents else None


def _imports(tree: ast.AST, package: str) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative import
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return {n for n in names if n.split(".")[0] in PROJECT_PACKAGES}


def _without_docstrings(tree: ast.AST) -> ast.AST:
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant) \
                    and isinstance(body[0].value.value, str):
                node.body = body[1:] or [ast.Pass()]
    return tree


@cache
def source_hash(module: str) -> str:
    """Hash of the code `module` runs: its own and every project module it imports."""
    digest = hashlib.sha256()
    seen: set[Path] = set()
    pending = [module]
    while pending:
        path = _module_file(pending.pop())
        if path is None or path in seen:
            continue
        seen.add(path)
        tree = ast.parse(path.read_text(encoding="utf-8"))
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        pending.extend(_imports(tree, name.rsplit(".", 1)[0]))
    for path in sorted(seen):
        digest.update(str(path.relative_to(ROOT)).encode())
        digest.update(ast.dump(_without_docstrings(ast.parse(path.read_text(encoding="utf-8")))).encode())
    return digest.hexdigest()[:16]


@dataclass
class StageSource(CachePolicy):
    """The code of the stage: `module` and the project modules it imports."""

    module: str = ""

    def compute_key(self, task_ctx: Any, inputs: dict[str, Any], flow_parameters: dict[str, Any],
                    **kwargs: Any) -> str | None:
        return source_hash(self.module)


@dataclass
class PipelineContext(CachePolicy):
    """The data version and the MLflow store of the run (from the task's `ctx` input)."""

    def compute_key(self, task_ctx: Any, inputs: dict[str, Any], flow_parameters: dict[str, Any],
                    **kwargs: Any) -> str | None:
        ctx = inputs["ctx"]
        return hash_objects({"data": ctx.data_md5, "store": ctx.tracking_uri})


def stage_cache(module: str) -> CachePolicy:
    """The cache policy of the stage implemented in `module`."""
    return INPUTS - "ctx" + PipelineContext() + StageSource(module=module)
