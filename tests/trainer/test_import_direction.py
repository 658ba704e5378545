"""The rooms of `trainer/` import each other one way: rl -> rollout -> generation ->
chat_formats, with config, graders and the plumbing modules as leaves; and the top-level
packages one way too: flows -> envs -> tasks -> trainer. Every import counts, the ones
inside functions included."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PLUMBING = {"errors", "data", "api_key", "memory", "progress", "plots", "quiet", "wire", "outbound", "lifeline"}

# What each room of trainer/ may import besides itself (plumbing imports only plumbing).
ALLOWED = {
    "plumbing": set(),
    "chat_formats": {"plumbing"},
    "graders": {"plumbing"},
    "config": {"plumbing", "graders"},
    "generation": {"plumbing", "config", "chat_formats"},
    "rollout": {"plumbing", "config", "graders", "chat_formats", "generation"},
    "rl": {"plumbing", "config", "graders", "chat_formats", "generation", "rollout"},
    "serving": {"plumbing", "config", "chat_formats", "generation"},
}
# The top-level packages, highest first: each imports only those below it.
PACKAGES = ["flows", "envs", "tasks", "trainer"]


def room(module: str) -> str:
    """The room of a `trainer.*` module, or the top-level package of any other."""
    parts = module.split(".")
    if parts[0] != "trainer" or len(parts) == 1:
        return parts[0]
    return "plumbing" if parts[1] in PLUMBING else parts[1]


def imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every absolute import in the file, at any depth."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
    return found


def wrong_way(root: Path) -> list[str]:
    """Every import under `root` that runs against the direction, as `file:line: a -> b`."""
    problems = []
    for path in sorted(path for package in PACKAGES for path in (root / package).rglob("*.py")):
        relative = path.relative_to(root)
        module = ".".join(relative.with_suffix("").parts)
        source = room(module)
        for line, target in imports(path):
            if target.split(".")[0] not in PACKAGES:
                continue
            destination = room(target)
            if source == destination:
                continue
            if source in ALLOWED:  # inside trainer/
                ok = destination in ALLOWED and destination in ALLOWED[source]
            else:
                top = PACKAGES.index(source)
                ok = destination in ALLOWED or PACKAGES.index(destination) > top
            if not ok:
                problems.append(f"{relative}:{line}: {source} -> {destination} ({target})")
    return problems


def test_every_import_runs_one_way():
    assert wrong_way(ROOT) == []


def test_every_room_of_trainer_says_what_it_owns_and_may_import():
    for package in sorted(p for p in (ROOT / "trainer").iterdir() if (p / "__init__.py").is_file()):
        docstring = ast.get_docstring(ast.parse((package / "__init__.py").read_text(encoding="utf-8")))
        assert docstring, f"trainer/{package.name}/__init__.py has no docstring"
        if package.name in ALLOWED:
            assert "May import" in docstring, f"trainer/{package.name}: the docstring does not say what it may import"


@pytest.mark.parametrize(("where", "line", "expected"), [
    ("trainer/generation/engine.py", "from trainer.rollout.record import RolloutRecord", "generation -> rollout"),
    ("trainer/rollout/loop.py", "from trainer.rl.loss import derived_seed", "rollout -> rl"),
    ("trainer/graders/f1.py", "from trainer.config.pipeline import PipelineConfig", "graders -> config"),
    ("trainer/errors.py", "from trainer.config.section import Section", "plumbing -> config"),
    ("tasks/ledger.py", "from flows.pipeline import outcome_of", "tasks -> flows"),
    ("envs/finqa/demo.py", "from flows.demo import run_demo", "envs -> flows"),
])
def test_a_reverse_import_is_caught(tmp_path: Path, where: str, line: str, expected: str):
    """The check on a copy of the tree with one import added that runs the wrong way,
    inside a function as lazy imports are."""
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            copy = tmp_path / path.relative_to(ROOT)
            copy.parent.mkdir(parents=True, exist_ok=True)
            copy.write_text(path.read_text(encoding="utf-8"), encoding="utf-8")
    target = tmp_path / where
    target.write_text(target.read_text(encoding="utf-8") + f"\n\ndef _added():\n    {line}\n", encoding="utf-8")
    problems = wrong_way(tmp_path)
    assert len(problems) == 1 and expected in problems[0], problems
