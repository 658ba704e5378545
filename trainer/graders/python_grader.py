"""OpenAI's python grader: the user's `grade(sample, item) -> float` in a fenced process.

Each grade starts a fresh interpreter (`python -I python_runner.py`, the same Python and
packages as the trainer: numpy, rapidfuzz, rouge-score, nltk, ... as in OpenAI's
image) in a new session, in an empty temporary directory, with an environment that
holds no secrets (only PATH, locale and single-threaded BLAS settings). The runner
fences itself in before running the code: memory limit, no processes, no network, and
(with Landlock) no file outside the interpreter's installation, read-only, and its own
temporary folder (see python_runner.py for how and for what this does not protect
against).

How strict the fence is: `required` (no Landlock, no seccomp filter, an unknown CPU
architecture: the grade is a `python_grader_server_error` and the code never runs) or
`best_effort` (it runs behind the fences that hold). The strictest of three settings wins:
the grader's own `fence` (in the job's config, so it travels with the job to any work
pool; `agentrft api` writes `required` into every python grader of the jobs it accepts),
the `GraderContext`'s, and `AGENTRFT_PYTHON_GRADER_FENCE=required` in the environment (a
machine that refuses unfenced graders whatever a job says). A grade that ran unfenced is
said once, through this module's logger (the console of the process that grades, and of
every process it starts after: the reasons said are kept in the environment), never only
in the child's stderr. `check_python_fence` says it ahead of time, for a pipeline run.

The parent enforces the wall-time limit: past `GraderContext.python_timeout_s` the whole
process group is killed (SIGKILL to the session) and the grade is a
`python_grader_timeout_error`. An exception or a non-numeric return is a
`python_grader_runtime_error` carrying the traceback's last line; failing to start the
interpreter is a `python_grader_server_error`. Unlike OpenAI, which scores such
samples 0, these carry reward None: a broken grader is not a wrong answer.
"""

from __future__ import annotations

import json
import logging
import math
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from trainer.graders.config import PythonGrader
from trainer.graders.context import GraderContext
from trainer.graders.result import GraderError

_RUNNER = Path(__file__).with_name("python_runner.py")
_STDERR_TAIL_CHARS = 2000


def python_grader_score(
    grader: PythonGrader, sample: dict[str, Any], item: dict[str, Any], context: GraderContext
) -> float:
    """Run the grader's source on one sample; blocking (callers off the event loop)."""
    return run_python_grader(
        grader.source,
        sample,
        item,
        timeout_s=context.python_timeout_s,
        memory_mb=context.python_memory_mb,
        fence=strictest(grader.fence, context.python_fence),
    )


FENCE_ENV = "AGENTRFT_PYTHON_GRADER_FENCE"
_SAID_ENV = "AGENTRFT_PYTHON_GRADER_UNFENCED_SAID"  # the reasons already told, for this process's children
logger = logging.getLogger(__name__)


def fence_mode() -> str:
    """`required` where the environment says so (`agentrft api` sets it for the runs it
    starts), else `best_effort`."""
    return "required" if os.environ.get(FENCE_ENV) == "required" else "best_effort"


def strictest(*fences: str | None) -> str:
    """`required` when any setting (or the environment) says so, else `best_effort`."""
    return "required" if "required" in (*fences, fence_mode()) else "best_effort"


def python_graders(grader: dict[str, Any]) -> list[dict[str, Any]]:
    """The python graders of a grader object: itself, or those of a multi grader."""
    if grader.get("type") == "python":
        return [grader]
    if grader.get("type") == "multi":
        return [sub for sub in (grader.get("graders") or {}).values() if isinstance(sub, dict)
                and sub.get("type") == "python"]
    return []


def require_fence(grader: dict[str, Any]) -> dict[str, Any]:
    """A copy of `grader` whose python graders all say `fence: required`."""
    if grader.get("type") == "python":
        return {**grader, "fence": "required"}
    if grader.get("type") == "multi":
        return {**grader, "graders": {name: require_fence(sub) for name, sub in grader["graders"].items()}}
    return grader


def check_python_fence(grader: dict[str, Any]) -> list[str]:
    """Before a run: one trivial grade under the fence `grader`'s python graders ask for.
    Returns why they would run unfenced (empty: fenced, or no python grader); raises
    GraderError where the fence is required and cannot be put in place. What it returns is
    said here, and not again by later grades."""
    found = python_graders(grader)
    if not found:
        return []
    unfenced = fence_problems(strictest(*(sub.get("fence") for sub in found)))
    _mark_said(unfenced)
    return unfenced


def fence_problems(fence: str = "best_effort") -> list[str]:
    """Why a python grader would run unfenced on this machine (empty: every fence holds), from
    one trivial grade; under `required` a fence that cannot hold raises GraderError."""
    return _run_runner("def grade(sample, item):\n    return 0.0\n", {}, {}, timeout_s=30.0, memory_mb=512,
                       fence=fence)[1]


def unfenced_message(reasons: list[str]) -> str:
    return ("python graders run unfenced (fence: best_effort): " + "; ".join(reasons)
            + ". They can read what this user can read and keep running; set `fence: required` on the grader to "
            "refuse to run them instead")


def _said() -> set[str]:
    return set(filter(None, os.environ.get(_SAID_ENV, "").split("\n")))


def _mark_said(reasons: list[str]) -> list[str]:
    """The reasons not told before in this process (or its parent); marks them told."""
    new = [reason for reason in reasons if reason not in _said()]
    if new:
        os.environ[_SAID_ENV] = "\n".join(sorted(_said() | set(new)))
    return new


def run_python_grader(
    source: str, sample: dict[str, Any], item: dict[str, Any], *, timeout_s: float, memory_mb: int,
    fence: str | None = None,
) -> float:
    score, unfenced = _run_runner(source, sample, item, timeout_s=timeout_s, memory_mb=memory_mb,
                                  fence=strictest(fence))
    new = _mark_said(unfenced)
    if new:
        logger.warning(unfenced_message(new))
    return score


def _run_runner(
    source: str, sample: dict[str, Any], item: dict[str, Any], *, timeout_s: float, memory_mb: int, fence: str,
) -> tuple[float, list[str]]:
    """The score and the fences that did not hold (best_effort), from one runner process."""
    request = json.dumps(
        {
            "source": source,
            "sample": sample,
            "item": item,
            "memory_mb": memory_mb,
            "cpu_s": math.ceil(timeout_s) + 1,
            "fence": fence,
        },
        default=str,
    ).encode()
    with (
        tempfile.TemporaryDirectory(prefix="python-grader-") as workdir,
        tempfile.TemporaryFile() as stderr,
    ):
        environment = {
            "PATH": os.defpath,
            "LANG": "C.UTF-8",
            "HOME": workdir,
            "TMPDIR": workdir,
            # one thread each: BLAS pools reserve address space per thread, which the
            # memory limit counts
            "OPENBLAS_NUM_THREADS": "1",
            "OMP_NUM_THREADS": "1",
            "MKL_NUM_THREADS": "1",
        }
        try:
            process = subprocess.Popen(
                [sys.executable, "-I", str(_RUNNER)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=stderr,
                cwd=workdir,
                env=environment,
                start_new_session=True,
            )
        except OSError as exc:
            raise GraderError(
                "python_grader_server_error", f"could not start the python grader process: {exc}"
            ) from None
        try:
            stdout, _ = process.communicate(request, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _kill_session(process)
            raise GraderError(
                "python_grader_timeout_error",
                f"the python grader ran past its {timeout_s:g} s limit and was killed",
            ) from None
        finally:
            if process.poll() is None:  # an exception (e.g. KeyboardInterrupt) mid-wait
                _kill_session(process)
        stderr.seek(0, os.SEEK_END)
        stderr.seek(max(0, stderr.tell() - _STDERR_TAIL_CHARS))
        stderr_tail = stderr.read().decode(errors="replace").strip()
    return _read_answer(stdout, process.returncode, stderr_tail)


def _read_answer(stdout: bytes, returncode: int, stderr_tail: str) -> tuple[float, list[str]]:
    try:
        answer = json.loads(stdout.decode().strip().splitlines()[-1])
    except (IndexError, UnicodeDecodeError, json.JSONDecodeError):
        answer = None
    if isinstance(answer, dict) and isinstance(answer.get("score"), float):
        return answer["score"], [str(reason) for reason in answer.get("unfenced") or []]
    if isinstance(answer, dict) and "kind" in answer:
        raise GraderError(answer["kind"], str(answer.get("message", "")))
    if returncode < 0:
        how = f"was killed by signal {-returncode}"
        if -returncode == signal.SIGXCPU:
            how += " (SIGXCPU: CPU time limit)"
    else:
        how = f"exited with code {returncode}"
    last_line = stderr_tail.splitlines()[-1] if stderr_tail else "no output"
    raise GraderError(
        "python_grader_runtime_error", f"the grader process {how} without a result: {last_line}"
    )


def _kill_session(process: subprocess.Popen[bytes]) -> None:
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.communicate()
