"""What a stage's cache key depends on: its inputs, the data version, the store and the
code it runs, and nothing else.

`StageSource` hashes the project modules a stage's module imports, as syntax trees without
docstrings: a comment or docstring edit leaves every key alone, a code edit changes the keys
of exactly the stages that import the module. The unchanged pipeline rerun served from
cache is in tests/flows/test_pipeline.py.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

import tasks.cache as cache


def _modules(stage: str) -> set[str]:
    """The project files `source_hash` reads for a stage module."""
    seen: set[Path] = set()
    pending = [stage]
    while pending:
        path = cache._module_file(pending.pop())
        if path is None or path in seen:
            continue
        seen.add(path)
        import ast

        name = ".".join(path.relative_to(cache.ROOT).with_suffix("").parts)
        pending.extend(cache._imports(ast.parse(path.read_text()), name.rsplit(".", 1)[0]))
    return {str(p.relative_to(cache.ROOT)) for p in seen}


def test_validation_and_baseline_do_not_run_the_trainer_or_any_environment():
    for stage in ("tasks.validate", "tasks.baseline", "tasks.optimize"):
        files = _modules(stage)
        assert f"{stage.replace('.', '/')}.py" in files
        assert "trainer/rl/grpo.py" not in files and "trainer/rl/update.py" not in files, stage
        assert not any(f.startswith("envs/") for f in files), stage
    assert "trainer/rl/grpo.py" in _modules("tasks.train")  # training does
    assert "trainer/rollout/loop.py" in _modules("tasks.baseline")  # the baseline runs rollouts


@pytest.fixture
def package(tmp_path, monkeypatch):
    """A throwaway project package whose modules the test edits."""
    root = tmp_path / "proj"
    (root / "trainer").mkdir(parents=True)
    (root / "trainer" / "__init__.py").write_text("")
    (root / "trainer" / "stage.py").write_text("from trainer import helper\n\ndef run():\n    return helper.f()\n")
    (root / "trainer" / "helper.py").write_text('"""Helper."""\n\n\ndef f():\n    # a comment\n    return 1\n')
    monkeypatch.setattr(cache, "ROOT", root)
    monkeypatch.syspath_prepend(str(root))
    for name in [n for n in sys.modules if n == "trainer" or n.startswith("trainer.")]:
        monkeypatch.delitem(sys.modules, name)
    importlib.invalidate_caches()
    yield root
    cache.source_hash.cache_clear()


def _hash() -> str:
    cache.source_hash.cache_clear()
    importlib.invalidate_caches()
    return cache.source_hash("trainer.stage")


def test_comments_and_docstrings_do_not_change_the_key_but_code_does(package):
    helper = package / "trainer" / "helper.py"
    first = _hash()
    helper.write_text('"""Helper, documented at length now."""\n\n\ndef f():\n    # another comment\n\n    return 1\n')
    assert _hash() == first
    helper.write_text('"""Helper."""\n\n\ndef f():\n    return 2\n')
    assert _hash() != first
