"""The python grader runs user code in a separate, fenced process: these tests run real
graders, including ones that misbehave (sleep, allocate 10 GB, open sockets, fork).
Every misbehaving one is bounded so that a broken fence could not hurt the machine."""

from __future__ import annotations

import socket
import sys
import threading
import time

import pytest

from trainer.graders import GraderContext, grade

CONTEXT = GraderContext(python_timeout_s=5.0, python_memory_mb=512)
SAMPLE = {"output_text": "fuzzy wuzzy was a bear", "output_json": None, "output_tools": []}
ITEM = {"reference_answer": "fuzzy wuzzy had no hair", "n": 3}
linux_only = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="the seccomp filter is Linux-only"
)


def python_grader(source: str) -> dict:
    return {"type": "python", "name": "py", "source": source}


def test_openai_docs_python_grader_examples_unchanged() -> None:
    """Both python graders of OpenAI's guide, verbatim, scored as their run example does."""
    minimal = {
        "type": "python",
        "source": "def grade(sample, item):\n    return 1.0",
        "image_tag": "2025-05-08",
    }
    assert grade(minimal, SAMPLE, ITEM, context=CONTEXT).to_json() == {
        "reward": 1.0,
        "errors": {},
        "sub_rewards": {},
    }

    grading_function = """
from rapidfuzz import fuzz, utils

def grade(sample, item) -> float:
    output_text = sample["output_text"]
    reference_answer = item["reference_answer"]
    return fuzz.WRatio(output_text, reference_answer, processor=utils.default_process) / 100.0
"""
    grader = {"type": "python", "source": grading_function}
    # "fuzzy wuzzy was a bear" vs "fuzzy wuzzy had no hair": Indel similarity
    # 2 * 17 / (22 + 23) = 0.7556 (WRatio takes the plain ratio for similar lengths).
    result = grade(grader, SAMPLE, ITEM, context=CONTEXT)
    assert result.reward == pytest.approx(34 / 45)


def test_grade_sees_sample_and_item() -> None:
    source = "def grade(sample, item):\n    return len(sample['output_text'].split()) / item['n'] + 0.5 * (sample['output_json'] is None)\n"
    assert grade(python_grader(source), SAMPLE, ITEM, context=CONTEXT).reward == pytest.approx(
        5 / 3 + 0.5
    )


@pytest.mark.parametrize(
    ("source", "message"),
    [
        ("def grade(sample, item):\n    return item['missing']\n", "KeyError: 'missing'"),
        ("def grade(sample, item):\n    return 1 / 0\n", "ZeroDivisionError: division by zero"),
        (
            "def grade(sample, item):\n    return 'high'\n",
            "grade returned str 'high', not a number",
        ),
        ("def grade(sample, item):\n    return True\n", "grade returned bool True, not a number"),
        (
            "def grade(sample, item):\n    return float('nan')\n",
            "grade returned nan, not a finite number",
        ),
        (
            "import os\ndef grade(sample, item):\n    os._exit(3)\n",
            "the grader process exited with code 3 without a result: no output",
        ),
    ],
)
def test_runtime_errors_carry_the_last_traceback_line(source: str, message: str) -> None:
    result = grade(python_grader(source), SAMPLE, ITEM, context=CONTEXT)
    assert result.reward is None
    assert result.errors == {"python_grader_runtime_error": message}


def test_prints_do_not_garble_the_answer() -> None:
    source = "def grade(sample, item):\n    print('{\"score\": 0.0}')\n    return 0.75\n"
    assert grade(python_grader(source), SAMPLE, ITEM, context=CONTEXT).reward == 0.75


def test_timeout_kills_the_grader() -> None:
    source = "import time\ndef grade(sample, item):\n    time.sleep(60)\n    return 1.0\n"
    started = time.monotonic()
    result = grade(python_grader(source), SAMPLE, ITEM, context=GraderContext(python_timeout_s=1.0))
    assert time.monotonic() - started < 5
    assert result.reward is None
    assert result.errors == {
        "python_grader_timeout_error": "the python grader ran past its 1 s limit and was killed"
    }


def test_memory_limit_stops_a_10_gb_allocation() -> None:
    source = "def grade(sample, item):\n    block = bytearray(10 * 1024 ** 3)\n    return 1.0\n"
    result = grade(python_grader(source), SAMPLE, ITEM, context=CONTEXT)
    assert result.errors == {"python_grader_runtime_error": "MemoryError"}


def test_network_is_blocked() -> None:
    """Python-level guard first; under it the seccomp filter refuses the socket syscall."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]
    accepted: list[socket.socket] = []
    threading.Thread(target=lambda: accepted.append(listener.accept()[0]), daemon=True).start()
    try:
        source = f"import socket\ndef grade(sample, item):\n    socket.create_connection(('127.0.0.1', {port}), timeout=1)\n    return 1.0\n"
        result = grade(python_grader(source), SAMPLE, ITEM, context=CONTEXT)
        assert result.errors == {
            "python_grader_runtime_error": "PermissionError: network access is disabled in python graders"
        }
        time.sleep(0.1)
        assert accepted == []  # nothing ever connected
    finally:
        listener.close()


@linux_only
def test_network_is_blocked_below_python() -> None:
    """`_socket` is guarded in Python too; its C type, reachable through socket.socket's
    bases, is stopped by the kernel filter."""
    guarded = "import _socket\ndef grade(sample, item):\n    _socket.socket()\n    return 1.0\n"
    assert grade(python_grader(guarded), SAMPLE, ITEM, context=CONTEXT).errors == {
        "python_grader_runtime_error": "PermissionError: network access is disabled in python graders"
    }
    below = "import socket\ndef grade(sample, item):\n    socket.socket.__mro__[1]()\n    return 1.0\n"
    assert grade(python_grader(below), SAMPLE, ITEM, context=CONTEXT).errors == {
        "python_grader_runtime_error": "PermissionError: [Errno 13] Permission denied"
    }


def test_fork_bomb_is_contained() -> None:
    """A bounded fork loop: every fork is refused (a broken fence would make 200 children
    that exit at once, not a bomb)."""
    source = (
        "import os\n"
        "def grade(sample, item):\n"
        "    refused = 0\n"
        "    for _ in range(200):\n"
        "        try:\n"
        "            pid = os.fork()\n"
        "        except OSError:\n"
        "            refused += 1\n"
        "            continue\n"
        "        if pid == 0:\n"
        "            os._exit(0)\n"
        "    return refused / 200\n"
    )
    assert grade(python_grader(source), SAMPLE, ITEM, context=CONTEXT).reward == 1.0
    spawn = "import subprocess\ndef grade(sample, item):\n    subprocess.run(['true'])\n    return 1.0\n"
    assert grade(python_grader(spawn), SAMPLE, ITEM, context=CONTEXT).errors == {
        "python_grader_runtime_error": "PermissionError: starting processes is disabled in python graders"
    }


@linux_only
def test_fork_is_refused_by_the_kernel_even_through_ctypes() -> None:
    source = (
        "import ctypes, os\n"
        "def grade(sample, item):\n"
        "    pid = ctypes.CDLL(None, use_errno=True).fork()\n"
        "    if pid == 0:\n"
        "        os._exit(0)\n"
        "    return 1.0 if pid == -1 else 0.0\n"
    )
    assert grade(python_grader(source), SAMPLE, ITEM, context=CONTEXT).reward == 1.0


@linux_only
def test_threads_still_work_and_other_processes_cannot_be_signalled() -> None:
    threads = (
        "import threading\n"
        "def grade(sample, item):\n"
        "    out = []\n"
        "    worker = threading.Thread(target=lambda: out.append(0.5))\n"
        "    worker.start(); worker.join()\n"
        "    return out[0]\n"
    )
    assert grade(python_grader(threads), SAMPLE, ITEM, context=CONTEXT).reward == 0.5
    signal_parent = (
        "import os\ndef grade(sample, item):\n    os.kill(os.getppid(), 0)\n    return 1.0\n"
    )
    assert grade(python_grader(signal_parent), SAMPLE, ITEM, context=CONTEXT).errors == {
        "python_grader_runtime_error": "PermissionError: [Errno 1] Operation not permitted"
    }


def test_secrets_in_the_environment_are_not_passed_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPENAI_API_KEY", "sk-do-not-leak")
    source = (
        "import os\ndef grade(sample, item):\n    return float('OPENAI_API_KEY' in os.environ)\n"
    )
    assert grade(python_grader(source), SAMPLE, ITEM, context=CONTEXT).reward == 0.0


def test_interpreter_that_cannot_start_is_a_server_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "executable", "/nonexistent/python3")
    result = grade(
        python_grader("def grade(sample, item):\n    return 1.0\n"), SAMPLE, ITEM, context=CONTEXT
    )
    assert result.reward is None
    assert (
        "could not start the python grader process" in result.errors["python_grader_server_error"]
    )
