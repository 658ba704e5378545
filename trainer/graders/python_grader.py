"""OpenAI's python grader: the user's `grade(sample, item) -> float` in a fenced process.

Each grade starts a fresh interpreter (`python -I python_runner.py`, the same Python and
packages as the trainer: numpy, rapidfuzz, rouge-score, nltk, ... as in OpenAI's
image) in a new session, in an empty temporary directory, with an environment that
holds no secrets (only PATH, locale and single-threaded BLAS settings). The runner
fences itself in before running the code: memory limit, no processes, no network, and
(with Landlock) no file outside the interpreter's installation, read-only, and its own
temporary folder (see python_runner.py for how and for what this does not protect
against). `AGENTRFT_PYTHON_GRADER_FENCE=required` makes the file-system fence a condition
of running at all.

The parent enforces the wall-time limit: past `GraderContext.python_timeout_s` the whole
process group is killed (SIGKILL to the session) and the grade is a
`python_grader_timeout_error`. An exception or a non-numeric return is a
`python_grader_runtime_error` carrying the traceback's last line; failing to start the
interpreter is a `python_grader_server_error`. Unlike OpenAI, which scores such
samples 0, these carry reward None: a broken grader is not a wrong answer.
"""

from __future__ import annotations

import json
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
        fence=context.python_fence,
    )


FENCE_ENV = "AGENTRFT_PYTHON_GRADER_FENCE"


def fence_mode() -> str:
    """`required` where graders arrive over the network (`agentrft api` sets it for the runs it
    starts): no Landlock, no grade. Else `best_effort`: the config author's own code."""
    return "required" if os.environ.get(FENCE_ENV) == "required" else "best_effort"


def run_python_grader(
    source: str, sample: dict[str, Any], item: dict[str, Any], *, timeout_s: float, memory_mb: int,
    fence: str | None = None,
) -> float:
    request = json.dumps(
        {
            "source": source,
            "sample": sample,
            "item": item,
            "memory_mb": memory_mb,
            "cpu_s": math.ceil(timeout_s) + 1,
            "fence": fence or fence_mode(),
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


def _read_answer(stdout: bytes, returncode: int, stderr_tail: str) -> float:
    try:
        answer = json.loads(stdout.decode().strip().splitlines()[-1])
    except (IndexError, UnicodeDecodeError, json.JSONDecodeError):
        answer = None
    if isinstance(answer, dict) and isinstance(answer.get("score"), float):
        return answer["score"]
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
