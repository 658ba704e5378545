"""trainer/lifeline.py: a guarded child and everything under it die with the process that
started it, whatever kills that process; a stop is SIGTERM, then SIGKILL after the grace.

Real processes throughout: a parent started here starts a guarded command that starts a
grandchild in a session of its own (as vLLM and python graders are started), and the test
looks the processes up by pid.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time

import psutil

from trainer import lifeline

# The command: a grandchild in a session of its own, its pid printed, then a long sleep.
COMMAND = textwrap.dedent("""
    import signal, subprocess, sys, time
    if "ignore-term" in sys.argv:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"], start_new_session=True)
    print(grandchild.pid, flush=True)
    if "exit" in sys.argv:
        sys.exit(3)
    time.sleep(300)
""")


def _gone(pids: list[int], within: float = 5.0) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        alive = []
        for pid in pids:
            try:
                if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    alive.append(pid)
            except psutil.NoSuchProcess:
                pass
        if not alive:
            return True
        time.sleep(0.05)
    return False


def _tree(guard: subprocess.Popen) -> list[int]:
    grandchild = int(guard.stdout.readline())
    try:
        children = [p.pid for p in psutil.Process(guard.pid).children(recursive=True)]
    except psutil.NoSuchProcess:  # the command exited and the guard with it
        children = []
    return sorted({guard.pid, *children, grandchild})


def test_a_killed_parent_takes_the_whole_tree_with_it_even_from_a_finished_thread():
    # The parent starts the guard from a thread that ends at once: PR_SET_PDEATHSIG would
    # have fired there; the lifeline is the process's.
    parent = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import subprocess, sys, threading, time
        from trainer import lifeline
        started = []
        thread = threading.Thread(target=lambda: started.append(lifeline.start(
            [sys.executable, "-c", {COMMAND!r}], stdout=subprocess.PIPE, text=True)))
        thread.start(); thread.join()
        print(started[0].pid, started[0].stdout.readline().strip(), flush=True)
        time.sleep(300)
    """)], stdout=subprocess.PIPE, text=True)
    try:
        guard, grandchild = map(int, parent.stdout.readline().split())
        tree = sorted({guard, *(p.pid for p in psutil.Process(guard).children(recursive=True)), grandchild})
        assert len(tree) == 3 and _gone(tree, within=0.5) is False  # alive while the parent lives
        parent.kill()
        parent.wait()
        assert _gone(tree)
    finally:
        parent.kill()


def test_a_stop_sends_sigterm_then_kills_after_the_grace():
    guard = lifeline.start([sys.executable, "-c", COMMAND], grace=1.0, stdout=subprocess.PIPE, text=True)
    tree = _tree(guard)
    assert lifeline.stop(guard) == 128 + signal.SIGTERM  # the command's own status, as a shell reports it
    assert _gone(tree, within=1.0)

    stubborn = lifeline.start([sys.executable, "-c", COMMAND, "ignore-term"], grace=1.0, stdout=subprocess.PIPE,
                              text=True)
    tree = _tree(stubborn)
    started = time.monotonic()
    assert lifeline.stop(stubborn) == 128 + signal.SIGKILL
    assert time.monotonic() - started >= 1.0 and _gone(tree, within=1.0)


def test_what_a_command_leaves_behind_when_it_exits_is_killed():
    guard = lifeline.start([sys.executable, "-c", COMMAND, "exit"], stdout=subprocess.PIPE, text=True)
    tree = _tree(guard)
    assert guard.wait(timeout=10) == 3
    assert _gone(tree)


def test_a_stop_past_its_timeout_kills_the_tree_from_the_parent_side_too():
    # The guard's own stop would take 30 s; past the caller's timeout the tree is killed from
    # here. Killing the guard's process group alone would leave the grandchild (a session of
    # its own) to init.
    guard = lifeline.start([sys.executable, "-c", COMMAND, "ignore-term"], grace=30.0, stdout=subprocess.PIPE,
                           text=True)
    tree = _tree(guard)
    started = time.monotonic()
    assert lifeline.stop(guard, timeout=0.5) == -signal.SIGKILL  # the guard itself was killed
    assert time.monotonic() - started < 5 and _gone(tree, within=1.0)
