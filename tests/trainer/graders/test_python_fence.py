"""The python grader's fence fails closed: on a kernel that lacks Landlock, a seccomp filter
or the CPU's system-call table (taken away by the kernel's own means, tests/kernel_features.py),
`fence: required` refuses to run the code and says why; `best_effort` runs it and says
once, in the parent's log, what did not hold; `_socket` is guarded even where no filter is."""

from __future__ import annotations

import logging
import socket
import sys

import pytest

from tests.kernel_features import SUPPORTED, python_without
from trainer.graders import GraderContext, grade
from trainer.graders.python_grader import FENCE_ENV, check_python_fence, require_fence

pytestmark = pytest.mark.skipif(not SUPPORTED, reason="the kernel features are taken away on x86_64 Linux")

CONTEXT = GraderContext(python_timeout_s=10.0)
RETURNS_HALF = {"type": "python", "name": "half", "source": "def grade(sample, item):\n    return 0.5\n"}
SAMPLE = {"output_text": "1"}


@pytest.fixture(autouse=True)
def _nothing_said_yet(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AGENTRFT_PYTHON_GRADER_UNFENCED_SAID", raising=False)
    monkeypatch.delenv(FENCE_ENV, raising=False)


def on_a_kernel_without(monkeypatch: pytest.MonkeyPatch, tmp_path, *features: str) -> None:
    monkeypatch.setattr(sys, "executable", str(python_without(tmp_path, *features)))


def test_best_effort_runs_and_says_once_in_the_parents_log(monkeypatch, tmp_path, caplog):
    on_a_kernel_without(monkeypatch, tmp_path, "landlock")
    with caplog.at_level(logging.WARNING, logger="trainer.graders.python_grader"):
        rewards = [grade(RETURNS_HALF, SAMPLE, {}, context=CONTEXT).reward for _ in range(3)]
    assert rewards == [0.5, 0.5, 0.5]
    said = [r.getMessage() for r in caplog.records if r.name == "trainer.graders.python_grader"]
    assert len(said) == 1, said  # three grades, one warning
    assert "run unfenced (fence: best_effort)" in said[0] and "no Landlock" in said[0]
    assert "fence: required" in said[0]  # and how to insist


def test_required_refuses_without_landlock_from_the_grader_alone(monkeypatch, tmp_path):
    """The requirement is in the grader object (a job's config carries it to any work pool):
    no environment variable, no context."""
    on_a_kernel_without(monkeypatch, tmp_path, "landlock")
    result = grade(require_fence(RETURNS_HALF), SAMPLE, {}, context=CONTEXT)
    assert result.reward is None
    message = result.errors["python_grader_server_error"]
    assert "fence: required" in message and "no Landlock" in message and "did not run" in message
    multi = {"type": "multi", "graders": {"p": RETURNS_HALF}, "calculate_output": "p"}
    assert require_fence(multi)["graders"]["p"]["fence"] == "required"
    assert grade(require_fence(multi), SAMPLE, {}, context=CONTEXT).reward is None


@pytest.mark.parametrize(("missing", "reason"), [
    ("seccomp", "no seccomp filter: the kernel refused it (Invalid argument)"),
    ("arch", "not of this CPU architecture (i686)"),
])
def test_required_refuses_when_the_seccomp_filter_cannot_be_installed(monkeypatch, tmp_path, missing, reason):
    """Landlock holds here; the filter on processes and sockets does not."""
    on_a_kernel_without(monkeypatch, tmp_path, missing)
    leaked = tmp_path / "ran.txt"
    writes = {"type": "python", "source": f"def grade(sample, item):\n    open({str(leaked)!r}, 'w')\n    return 1.0\n"}
    result = grade({**writes, "fence": "required"}, SAMPLE, {}, context=CONTEXT)
    assert reason in result.errors["python_grader_server_error"]
    # best_effort runs it behind Landlock alone (which refuses the write), and says what is missing
    monkeypatch.delenv("AGENTRFT_PYTHON_GRADER_UNFENCED_SAID", raising=False)
    assert "Permission denied" in grade(writes, SAMPLE, {}, context=CONTEXT).errors["python_grader_runtime_error"]
    assert not leaked.exists()
    (said,) = check_python_fence(RETURNS_HALF)  # what a pipeline run says before its first stage
    assert reason in said


def test_the_strictest_setting_wins(monkeypatch, tmp_path):
    """A job cannot loosen what the machine or the server requires."""
    on_a_kernel_without(monkeypatch, tmp_path, "landlock")
    loose = {**RETURNS_HALF, "fence": "best_effort"}
    assert grade(loose, SAMPLE, {}, context=GraderContext(python_fence="required")).reward is None
    monkeypatch.setenv(FENCE_ENV, "required")
    assert grade(loose, SAMPLE, {}, context=CONTEXT).reward is None
    with pytest.raises(Exception, match="fence: required"):
        check_python_fence(loose)


def test_socket_below_python_is_guarded_where_no_fence_holds(monkeypatch, tmp_path):
    """No Landlock (so no TCP rule) and no seccomp filter: the Python guard is all there is,
    and it covers `_socket` as well as `socket`."""
    on_a_kernel_without(monkeypatch, tmp_path, "landlock", "seccomp")
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()  # a connection would wait in the backlog, accepted or not
    port = listener.getsockname()[1]
    try:
        for module in ("_socket", "socket"):
            source = (f"import {module}\ndef grade(sample, item):\n"
                      f"    s = {module}.socket({module}.AF_INET, {module}.SOCK_STREAM)\n"
                      f"    s.connect(('127.0.0.1', {port}))\n    return 1.0\n")
            result = grade({"type": "python", "source": source}, SAMPLE, {}, context=CONTEXT)
            assert result.errors == {"python_grader_runtime_error":
                                     "PermissionError: network access is disabled in python graders"}, module
        listener.settimeout(0.2)
        with pytest.raises(TimeoutError):
            listener.accept()  # nothing ever connected
    finally:
        listener.close()
