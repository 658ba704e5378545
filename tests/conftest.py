"""Shared test setup: offline libraries, quiet Prefect, the demo data on disk, and the micro
pipeline world (items, tool server, a tiny taught model, Prefect's test harness).

`data/` is owned by DVC and not committed; a fresh clone regenerates it from the
deterministic generator (the data tests check it reproduces the md5 in data.dvc).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Stage tasks called directly by unit tests (no flow run) log through Prefect's API handler,
# which warns once per record that there is no flow run to attach the log to (109 times in
# test_promote.py alone); those logs still reach the console.
os.environ.setdefault("PREFECT_LOGGING_TO_API_WHEN_MISSING_FLOW", "ignore")
# The test workers (`pytest -n 2`) share the machine's cores: each one's torch, and the trainers
# and servers it starts, get their share. Two workers of two OpenMP threads each on 2 cores
# fitted a tiny model 7x slower than two of one thread (8.4 s against 1.2 s).
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))))

REPO_ROOT = Path(__file__).resolve().parent.parent

# The files that take longest, longest first (pytest's --durations table of the whole suite on
# 2 cores). `make test` hands each file whole to one worker (`--dist loadfile`) in collection
# order (`--no-loadscope-reorder`: xdist would put the files of most tests first, which left
# these few-test, long files to run alone at the end); the others follow in their own order.
LONGEST_FIRST = [
    "tests/flows/test_cli.py", "tests/trainer/test_model_families.py", "tests/flows/test_openai_api.py",
    "tests/trainer/test_vllm_backend.py", "tests/flows/test_second_environment.py",
    "tests/reliability/test_faults_and_resume.py", "tests/flows/test_deployments.py", "tests/trainer/test_grpo.py",
    "tests/flows/test_pipeline.py", "tests/reliability/test_concurrent_runs.py",
    "tests/reliability/test_mlflow_restart.py", "tests/envs/test_demo_model.py", "tests/trainer/test_rollout.py",
    "tests/reliability/test_bad_input.py", "tests/flows/test_openai_job.py", "tests/trainer/test_real_model.py",
    "tests/flows/test_monitor.py", "tests/reliability/test_secret_scan.py", "tests/flows/test_vllm_stages.py",
    "tests/trainer/test_model_server.py", "tests/tasks/test_promote.py", "tests/flows/test_demo.py",
]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {path: index for index, path in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))  # stable: tests keep file order


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO_ROOT


@pytest.fixture(scope="session")
def demo_data_dir() -> Path:
    """The pinned demo data, generated on first use in a fresh clone."""
    from filelock import FileLock

    from envs.finqa.generate import generate_dataset

    data_dir = REPO_ROOT / "data"
    with FileLock(str(REPO_ROOT / ".data.lock")):  # test workers (pytest -n) share one checkout
        if not (data_dir / "train.jsonl").is_file():
            generate_dataset(data_dir, seed=0)
    return data_dir


@pytest.fixture(scope="session")
def world(demo_data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two training, two validation and six test items with their corpus pages, pinned by
    DVC in a project of their own."""
    from envs.finqa.generate import retired_first_test_split
    from tasks.data_version import add, init
    from tests.taught_model import copy_items
    from trainer.data import read_items

    root = tmp_path_factory.mktemp("pipeline")
    data = root / "data"
    data.mkdir()
    for split, count in (("train", 2), ("validation", 2)):
        copy_items(demo_data_dir, read_items(demo_data_dir / f"{split}.jsonl", count), data, f"{split}.jsonl")
    # The micro world's test items (the tests' promotion figures rest on them) are the first
    # six of the demo's retired first test split, as they always were.
    copy_items(demo_data_dir, retired_first_test_split()[:6], data, "test.jsonl")
    init(root)
    add(data)
    return root


@pytest.fixture(scope="session")
def endpoints(world: Path):
    from envs.finqa.local import local_tool_endpoints
    from tests.taught_model import OUTPUT_CHARS

    with local_tool_endpoints(world / "data" / "corpus", max_output_chars=OUTPUT_CHARS) as served:
        yield served


@pytest.fixture(scope="session")
def taught_model(world: Path, endpoints) -> Path:
    from tests.taught_model import direct_first_scripts, teach_model

    data = world / "data"
    files = [data / f"{split}.jsonl" for split in ("train", "validation", "test")]
    # A quarter of the 50 scripts a step, 200 passes (about a minute on 2 cores): 80 passes
    # of whole-data steps left the tool-call syntax garbled (validation score 0, not ~0.6).
    return teach_model(files, data / "corpus", endpoints, world / "model", epochs=200, batch_share=0.25,
                       ways=direct_first_scripts)


@pytest.fixture(scope="session")
def harness(world: Path):
    from prefect.settings import PREFECT_LOCAL_STORAGE_PATH, temporary_settings
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        with temporary_settings({PREFECT_LOCAL_STORAGE_PATH: world / "prefect-results"}):
            yield


def _console_handlers_on_live_streams() -> None:
    import logging
    import sys

    from prefect.logging.handlers import PrefectConsoleHandler

    for logger in [logging.getLogger(), *logging.Logger.manager.loggerDict.values()]:
        for handler in getattr(logger, "handlers", []):
            if not getattr(getattr(handler, "stream", None), "closed", False):
                continue
            handler.stream = sys.stderr  # DVC's handler too, set up by a `dvc` command run in a test
            if isinstance(handler, PrefectConsoleHandler):
                handler.console.file = sys.stderr


@pytest.fixture(autouse=True)
def _prefect_logs_outlive_capsys():
    """Prefect (and DVC) bind their console log handlers to the sys.stderr of the moment
    their logging is (re)configured; configured inside a test that captures output (capsys), it would
    write to that test's closed stream afterwards (ValueError, then a recursion through
    log_prints). Each test starts and ends with the handlers on a live stream."""
    _console_handlers_on_live_streams()
    yield
    _console_handlers_on_live_streams()
