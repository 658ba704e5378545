"""Child processes that die with the process that started them, whatever kills it.

A server that starts servers (`agentrft api`: a Prefect server and the deployment runner,
whose flow runs start trainers and vLLM servers) must not leave them running when it is
killed, and SIGKILL or the OOM killer run no handler in it. So such a child is started under
a guard: this file run as a script, a small process of its own between the parent and the
command, that holds three things:

- a lifeline. The parent opens one pipe and keeps its write end for as long as it lives;
  every guard gets the read end. When the parent dies, however it dies, the kernel closes
  the write end and the guard reads end-of-file at once. `PR_SET_PDEATHSIG` alone would not
  do: it fires when the parent *thread* that started the child ends, not the process (a
  child started from a request's worker thread would be killed when that thread is
  recycled), and it reaches direct children only.
- the whole tree. The guard is a child subreaper (`PR_SET_CHILD_SUBREAPER`): a descendant
  whose own parent dies (a flow run whose runner was killed, a vLLM server in a session of
  its own) is re-parented to the guard, not to init, so the guard still sees it.
- its command, started from the guard's only thread with `PR_SET_PDEATHSIG` = SIGKILL, so
  a guard that is killed takes its command with it.

What the guard does:
- end-of-file on the lifeline (the parent is gone): SIGKILL to the whole tree, then it exits.
  Nobody is left to wait for a graceful stop; a restarted parent marks what was in flight.
- SIGTERM or SIGINT (`stop()`): SIGTERM to the command, then SIGKILL to the tree once the
  command has exited or `grace` seconds have passed, whichever is first.
- the command exits on its own: what it left running is killed, and the guard exits with
  the command's status (128 + N for a signal N, as a shell reports it).

The guard is its own session's leader, so `os.killpg(process.pid, ...)` still reaches the
command. Linux only (prctl); elsewhere the guard still follows the lifeline and kills what
it can see of the tree.
"""

from __future__ import annotations

import ctypes
import os
import select
import signal
import subprocess
import sys
import threading
import time
from typing import Any

_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36

_lock = threading.Lock()
_pipe: tuple[int, int] | None = None  # (read, write): the lifeline of this process's guards


def _forget_lifeline_in_fork() -> None:
    """A forked child (no exec) is not the owner: it must not hold the parent's lifeline open."""
    global _pipe
    if _pipe is not None:
        for fd in _pipe:
            try:
                os.close(fd)
            except OSError:
                pass
    _pipe = None


os.register_at_fork(after_in_child=_forget_lifeline_in_fork)


def _lifeline() -> int:
    """The read end of this process's lifeline (made on first use, held until it exits)."""
    global _pipe
    with _lock:
        if _pipe is None:
            _pipe = os.pipe()  # both ends close-on-exec: only a guard, through pass_fds, gets the read end
        return _pipe[0]


def start(command: list[str], *, grace: float = 3.0, **popen: Any) -> subprocess.Popen:
    """Start `command` under a guard (see the module's docstring); the Popen is the guard's,
    with the command's stdio (`stdout=`, `stderr=`, `env=`, `cwd=` as for Popen)."""
    fd = _lifeline()
    pass_fds = (fd, *popen.pop("pass_fds", ()))
    flags = ["-P"] if sys.version_info >= (3, 11) else []  # this file's folder is not the guard's sys.path[0]
    return subprocess.Popen([sys.executable, *flags, __file__, str(fd), str(grace), "--", *command],
                            pass_fds=pass_fds, start_new_session=True, **popen)


def stop(process: subprocess.Popen, timeout: float | None = None) -> int:
    """Stop a guarded command (SIGTERM, then SIGKILL after its grace) and wait for the guard;
    its status. Past `timeout` (default 30 s) the tree is killed from here: every descendant
    of the guard, then the guard's group (killed first, the guard would leave them to init)."""
    if process.poll() is None:
        try:
            process.send_signal(signal.SIGTERM)
            process.wait(timeout=timeout if timeout is not None else 30)
        except subprocess.TimeoutExpired:
            # The guard did not finish its own stop: its tree is killed from here, the
            # processes first (killed, the guard would leave orphans to init, not to us).
            import psutil

            try:
                tree = psutil.Process(process.pid).children(recursive=True)
            except psutil.Error:
                tree = []
            for member in tree:
                try:
                    member.kill()
                except psutil.Error:
                    pass
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            process.wait()
    return process.returncode


# --- the guard ---------------------------------------------------------------------------------


def _prctl(option: int, value: int) -> bool:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(option, value, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _descendants() -> list[Any]:
    import psutil

    try:
        return psutil.Process().children(recursive=True)
    except psutil.Error:
        return []


def _reap_orphans(command_pid: int) -> None:
    """Collect the exit status of descendants re-parented to the guard (not the command's:
    Popen collects that)."""
    while True:
        try:
            exited = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            return
        if exited is None or exited.si_pid == command_pid:
            return
        try:
            os.waitpid(exited.si_pid, 0)
        except ChildProcessError:
            return


def _kill_tree(command: subprocess.Popen) -> None:
    """SIGKILL to every descendant until none is left (orphans keep arriving while parents die)."""
    import psutil

    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        alive = [p for p in _descendants() if _running(p)]
        if not alive:
            break
        for process in alive:
            try:
                process.kill()
            except psutil.Error:
                pass
        command.poll()
        _reap_orphans(command.pid)
        time.sleep(0.02)
    command.poll()
    _reap_orphans(command.pid)


def _running(process: Any) -> bool:
    import psutil

    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _status(code: int) -> int:
    return 128 - code if code < 0 else code


def _guard(lifeline: int, grace: float, command: list[str]) -> int:
    _prctl(_PR_SET_CHILD_SUBREAPER, 1)
    stop_at: list[float] = []

    def on_stop(_signum: int, _frame: Any) -> None:
        if not stop_at:
            stop_at.append(time.monotonic())

    signal.signal(signal.SIGTERM, on_stop)
    signal.signal(signal.SIGINT, on_stop)
    guard_pid = os.getpid()

    def die_with_guard() -> None:
        _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != guard_pid:  # the guard died before the line above
            os._exit(1)

    # Signals (a stop, a child's exit) wake the loop through this pipe; the lifeline wakes it too.
    wake_read, wake_write = os.pipe()
    for fd in (wake_read, wake_write, lifeline):
        os.set_blocking(fd, False)
    signal.set_wakeup_fd(wake_write)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    child = subprocess.Popen(command, preexec_fn=die_with_guard)
    signalled = False
    while True:
        wait = 1.0 if not stop_at else max(0.0, grace - (time.monotonic() - stop_at[0]))
        readable, _, _ = select.select([lifeline, wake_read], [], [], wait)
        if wake_read in readable:
            while True:
                try:
                    if not os.read(wake_read, 512):
                        break
                except BlockingIOError:
                    break
        if lifeline in readable:
            try:
                data = os.read(lifeline, 1)
            except BlockingIOError:
                data = b"?"
            if not data:  # the parent is gone
                _kill_tree(child)
                return 137
        if stop_at and not signalled:
            signalled = True
            try:
                child.send_signal(signal.SIGTERM)
            except ProcessLookupError:
                pass
        if child.poll() is not None or (stop_at and time.monotonic() - stop_at[0] >= grace):
            _kill_tree(child)
            child.wait()
            return _status(child.returncode)
        _reap_orphans(child.pid)


if __name__ == "__main__":
    # python lifeline.py FD GRACE -- COMMAND...
    sys.exit(_guard(int(sys.argv[1]), float(sys.argv[2]), sys.argv[4:]))
