"""Child-process side of the python grader: fence this process in, then run `grade`.

Started by `python_grader.py` as `python -I python_runner.py` in a new session, in an
empty temporary folder, with the request `{"source", "sample", "item", "memory_mb",
"cpu_s", "fence"}` as JSON on stdin. It writes one JSON line on its original stdout:
`{"score": float}` or `{"kind", "message"}`. The user's prints go to stderr, so they
cannot garble the answer.

Before the user's code runs, this process
1. sets resource limits: address space (RLIMIT_AS, the memory limit), CPU seconds
   (a backstop for the parent's wall-time kill), file size (1 GB, OpenAI's disk limit)
   and no core dumps;
2. installs a seccomp filter (Linux x86_64 / aarch64) that the kernel enforces even
   against ctypes (and `_socket`): no new processes (fork, vfork, clone without CLONE_THREAD; clone3
   answers ENOSYS so threads fall back to clone), no sockets, no ptrace or
   process_vm_writev, and signals only to itself;
3. fences the file system with Landlock (Linux 5.13 and later; the kernel enforces it
   on every path, ctypes and C extensions included): from then on the process may read
   and run only the interpreter's installation (its standard library and site-packages)
   and the system's shared libraries, read and write only its own temporary folder, and
   open no TCP connection (Landlock ABI 4 and later). Everything else, the server's
   files, the MLflow store, the registry's models and the project's code included,
   answers EACCES;
4. replaces `socket.socket`, `_socket.socket`, `socket.create_connection`,
   `socket.getaddrinfo`, `os.fork`, `os.system`, `subprocess.Popen` and friends with
   functions that raise PermissionError with a readable message (the filter alone would
   give bare errnos; where there is no filter these are the only guard, and Python code
   can always reach the real C type behind them, so they are not a fence).

With `fence: "required"` (graders that arrive over the network, from `agentrft api`, and
any grader that asks for it) a fence that cannot be put in place is an error and the code
does not run: no Landlock, a seccomp filter the kernel refuses, a CPU architecture the
filter does not know. With `"best_effort"` (the config author's own graders) the code runs
behind whatever fences hold, and the answer says which did not (`"unfenced": [reasons]`),
so the parent can tell the user; nothing is printed to this process's stderr, which the
parent reads only when grading fails.

RLIMIT_NPROC is not used: it counts every process of the user, and root (which the
trainer often is in containers) ignores it; the seccomp filter is what stops fork bombs.
The grader still runs as the trainer's user: what the fences do not cover is CPU and
memory within the limits above, and reading the files the interpreter's installation holds.

This module imports only the standard library: `-I` keeps the project off sys.path.
"""

import _socket
import ctypes
import json
import math
import numbers
import os
import platform
import resource
import socket
import struct
import subprocess
import sys
import traceback

_PR_SET_NO_NEW_PRIVS = 38
_PR_SET_SECCOMP = 22
_SECCOMP_MODE_FILTER = 2
_RET_ALLOW = 0x7FFF0000
_RET_KILL_PROCESS = 0x80000000
_RET_ERRNO = 0x00050000
_EPERM, _EACCES, _ENOSYS = 1, 13, 38
_CLONE_THREAD = 0x00010000
_X32_SYSCALL_BIT = 0x40000000
# BPF opcodes: load word at absolute offset, jump if equal / if any bit set / if >=, return.
_LD_ABS, _JEQ, _JSET, _JGE, _RET = 0x20, 0x15, 0x45, 0x35, 0x06
# seccomp_data offsets: syscall number, audit arch, low word of the first argument.
_NR, _ARCH, _ARG0 = 0, 4, 16
_SYSCALLS = {
    "x86_64": {
        "arch": 0xC000003E, "fork": 57, "vfork": 58, "clone": 56, "clone3": 435, "socket": 41,
        "ptrace": 101, "kill": 62, "tkill": 200, "tgkill": 234, "pidfd_send_signal": 424,
        "process_vm_writev": 311,
    },
    "aarch64": {
        "arch": 0xC00000B7, "clone": 220, "clone3": 435, "socket": 198, "ptrace": 117,
        "kill": 129, "tkill": 130, "tgkill": 131, "pidfd_send_signal": 424,
        "process_vm_writev": 271,
    },
}  # fmt: skip
_PROCESS_FUNCTIONS = (
    "fork", "forkpty", "system", "popen", "posix_spawn", "posix_spawnp",
    "execv", "execve", "execl", "execle", "execlp", "execlpe", "execvp", "execvpe",
    "spawnv", "spawnve", "spawnl", "spawnle", "spawnlp", "spawnlpe", "spawnvp", "spawnvpe",
)  # fmt: skip


def main() -> None:
    request = json.loads(sys.stdin.buffer.read())
    answer_fd = os.dup(1)
    os.dup2(2, 1)  # the user's prints land on stderr, not in the answer
    sys.stdout = sys.stderr
    required = request.get("fence") == "required"
    _limit_resources(request["memory_mb"], request["cpu_s"])
    unfenced = []
    for fence in (lambda: _fence_file_system(os.getcwd()), _install_seccomp_filter):
        problem = fence()
        if problem is not None:
            unfenced.append(problem)
            if required:  # before any of the user's code runs
                _answer(answer_fd, {"kind": "python_grader_server_error", "message": (
                    f"the python grader's fence is required (fence: required) and cannot be put in place here: "
                    f"{problem}; the grader did not run")})
                return
    _install_python_guards()
    answer = _run(request["source"], request["sample"], request["item"])
    _answer(answer_fd, {**answer, "unfenced": unfenced} if unfenced else answer)


def _answer(fd: int, answer: dict) -> None:
    os.write(fd, (json.dumps(answer) + "\n").encode())


def _run(source: str, sample: dict, item: dict) -> dict:
    try:
        namespace: dict = {"__name__": "grader"}
        exec(compile(source, "<grader>", "exec"), namespace)
        grade = namespace.get("grade")
        if not callable(grade):
            return _runtime_error("the source defines no grade(sample, item) function")
        score = grade(sample, item)
    except BaseException as exc:  # SystemExit and MemoryError too: they are the grader's doing
        lines = traceback.format_exception_only(type(exc), exc)
        return _runtime_error(lines[-1].strip() if lines else type(exc).__name__)
    if isinstance(score, bool) or not isinstance(score, numbers.Real):
        return _runtime_error(f"grade returned {type(score).__name__} {score!r:.80}, not a number")
    if not math.isfinite(float(score)):
        return _runtime_error(f"grade returned {score}, not a finite number")
    return {"score": float(score)}


def _runtime_error(message: str) -> dict:
    return {"kind": "python_grader_runtime_error", "message": message}


def _limit_resources(memory_mb: int, cpu_s: int) -> None:
    _lower_limit(resource.RLIMIT_AS, memory_mb * 1024 * 1024)
    _lower_limit(resource.RLIMIT_CPU, cpu_s)
    _lower_limit(resource.RLIMIT_FSIZE, 1 << 30)
    _lower_limit(resource.RLIMIT_CORE, 0)


def _lower_limit(kind: int, value: int) -> None:
    """Set soft and hard limit to `value`, never above a hard limit already in force
    (raising it would fail for an unprivileged user)."""
    _, hard = resource.getrlimit(kind)
    if hard != resource.RLIM_INFINITY:
        value = min(value, hard)
    resource.setrlimit(kind, (value, value))


# Landlock (linux/landlock.h): its three system calls have the same numbers on every architecture.
_LANDLOCK_CREATE_RULESET, _LANDLOCK_ADD_RULE, _LANDLOCK_RESTRICT_SELF = 444, 445, 446
_LANDLOCK_CREATE_RULESET_VERSION = 1
_LANDLOCK_RULE_PATH_BENEATH = 1
# File-system rights by ABI: 1 has EXECUTE..MAKE_SYM (13 bits), 2 adds REFER, 3 TRUNCATE, 5 IOCTL_DEV.
_FS_EXECUTE, _FS_WRITE_FILE, _FS_READ_FILE, _FS_READ_DIR = 1 << 0, 1 << 1, 1 << 2, 1 << 3
_FS_FILE_RIGHTS = _FS_EXECUTE | _FS_WRITE_FILE | _FS_READ_FILE | (1 << 14) | (1 << 15)  # rights a file may carry


def landlock_abi() -> int:
    """The kernel's Landlock ABI version, 0 where there is none (or it is disabled)."""
    if not sys.platform.startswith("linux"):
        return 0
    libc = ctypes.CDLL(None, use_errno=True)
    version = libc.syscall(_LANDLOCK_CREATE_RULESET, None, ctypes.c_size_t(0),
                           ctypes.c_uint32(_LANDLOCK_CREATE_RULESET_VERSION))
    return max(int(version), 0)


def _fs_rights(abi: int) -> int:
    rights = (1 << 13) - 1
    if abi >= 2:
        rights |= 1 << 13  # REFER
    if abi >= 3:
        rights |= 1 << 14  # TRUNCATE
    if abi >= 5:
        rights |= 1 << 15  # IOCTL_DEV
    return rights


def _readable_roots() -> list[str]:
    """What a grader may read (and run): the interpreter's installation and the shared
    libraries its extension modules load."""
    import sysconfig

    roots = {sys.base_prefix, sys.base_exec_prefix}
    for name in ("stdlib", "platstdlib", "purelib", "platlib"):
        path = sysconfig.get_paths().get(name)
        if path:
            roots.add(path)
    roots.add(os.path.dirname(os.path.realpath(sys.executable)))
    roots.update(("/lib", "/lib64", "/usr/lib", "/usr/lib64", "/usr/local/lib"))
    return sorted(os.path.realpath(r) for r in roots if os.path.exists(r))


def _fence_file_system(workdir: str) -> str | None:
    """Landlock this process to read-only installation paths and a read-write `workdir`, no
    TCP; None when the fence is in place, else why it is not."""
    abi = landlock_abi()
    if abi < 1:
        return ("no file-system fence: this kernel offers no Landlock (Linux 5.13 and later, enabled in the LSM "
                "list)")
    handled = _fs_rights(abi)

    class _Ruleset(ctypes.Structure):
        _fields_ = [("fs", ctypes.c_uint64), ("net", ctypes.c_uint64), ("scoped", ctypes.c_uint64)]

    class _PathBeneath(ctypes.Structure):
        _pack_ = 1
        _fields_ = [("allowed", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]

    libc = ctypes.CDLL(None, use_errno=True)
    net = 0b11 if abi >= 4 else 0  # BIND_TCP, CONNECT_TCP: handled and never allowed
    size = ctypes.sizeof(_Ruleset) if abi >= 6 else (16 if abi >= 4 else 8)
    ruleset = _Ruleset(handled, net, 0)
    fd = libc.syscall(_LANDLOCK_CREATE_RULESET, ctypes.byref(ruleset), ctypes.c_size_t(size), ctypes.c_uint32(0))
    if fd < 0:
        return f"no file-system fence: Landlock refused the ruleset ({os.strerror(ctypes.get_errno())})"
    try:
        read = _FS_EXECUTE | _FS_READ_FILE | _FS_READ_DIR
        rules = [(path, read) for path in _readable_roots()] + [(workdir, handled), ("/dev/null", _FS_READ_FILE | _FS_WRITE_FILE)]
        for path, allowed in rules:
            try:
                target = os.open(path, os.O_PATH | os.O_CLOEXEC)
            except OSError:
                continue
            try:
                if not os.path.isdir(path):
                    allowed &= _FS_FILE_RIGHTS & handled
                rule = _PathBeneath(allowed, target)
                if libc.syscall(_LANDLOCK_ADD_RULE, fd, _LANDLOCK_RULE_PATH_BENEATH, ctypes.byref(rule), 0) != 0:
                    return f"no file-system fence: Landlock refused a rule for {path} ({os.strerror(ctypes.get_errno())})"
            finally:
                os.close(target)
        if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
            return f"no file-system fence: no_new_privs refused ({os.strerror(ctypes.get_errno())})"
        if libc.syscall(_LANDLOCK_RESTRICT_SELF, fd, ctypes.c_uint32(0)) != 0:
            return f"no file-system fence: Landlock refused to restrict this process ({os.strerror(ctypes.get_errno())})"
    finally:
        os.close(fd)
    return None


def _install_seccomp_filter() -> str | None:
    """The kernel filter on processes, sockets and signals; None when it is in place, else why
    it is not."""
    machine = platform.machine()
    syscalls = _SYSCALLS.get(machine)
    if not sys.platform.startswith("linux"):
        return f"no seccomp filter: seccomp is Linux's, this is {sys.platform}"
    if syscalls is None:
        return (f"no seccomp filter: the filter knows the system calls of {', '.join(_SYSCALLS)}, not of this "
                f"CPU architecture ({machine})")
    program = _filter_program(syscalls, os.getpid())
    # struct sock_filter {u16 code; u8 jt; u8 jf; u32 k}, in the machine's byte order
    filters = ctypes.create_string_buffer(b"".join(struct.pack("=HBBI", *op) for op in program))

    class _Program(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    prog = _Program(len(program), ctypes.addressof(filters))
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl.argtypes = [
        ctypes.c_int,
        ctypes.c_ulong,
        ctypes.c_ulong,
        ctypes.c_ulong,
        ctypes.c_ulong,
    ]
    if (
        libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0
        or libc.prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, ctypes.addressof(prog), 0, 0) != 0
    ):
        return f"no seccomp filter: the kernel refused it ({os.strerror(ctypes.get_errno())})"
    return None


def _filter_program(nr: dict, pid: int) -> list[tuple[int, int, int, int]]:
    """The BPF program as (code, jt, jf, k) tuples; jumps are written as labels first."""
    allow, eperm, enosys, eacces, kill = "allow", "eperm", "enosys", "eacces", "kill"
    code: list[tuple] = [
        (_LD_ABS, None, None, _ARCH),
        (_JEQ, None, kill, nr["arch"]),
        (_LD_ABS, None, None, _NR),
    ]
    if "fork" in nr:  # x86_64: x32-ABI numbers would bypass the checks below
        code.append((_JGE, eperm, None, _X32_SYSCALL_BIT))
    for name in ("fork", "vfork", "ptrace", "tkill", "pidfd_send_signal", "process_vm_writev"):
        if name in nr:
            code.append((_JEQ, eperm, None, nr[name]))
    code += [
        (_JEQ, enosys, None, nr["clone3"]),
        (_JEQ, eacces, None, nr["socket"]),
        (_JEQ, "clone", None, nr["clone"]),
        (_JEQ, "signal", None, nr["kill"]),
        (_JEQ, "signal", None, nr["tgkill"]),
        (_RET, None, None, _RET_ALLOW),
        ("clone",),
        (_LD_ABS, None, None, _ARG0),
        (_JSET, allow, eperm, _CLONE_THREAD),
        ("signal",),  # kill(pid) / tgkill(tgid): only this process (or kill(0): its own group)
        (_LD_ABS, None, None, _ARG0),
        (_JEQ, allow, None, pid),
        (_JEQ, allow, eperm, 0),
        (allow,), (_RET, None, None, _RET_ALLOW),
        (eperm,), (_RET, None, None, _RET_ERRNO | _EPERM),
        (enosys,), (_RET, None, None, _RET_ERRNO | _ENOSYS),
        (eacces,), (_RET, None, None, _RET_ERRNO | _EACCES),
        (kill,), (_RET, None, None, _RET_KILL_PROCESS),
    ]  # fmt: skip
    labels, program = {}, []
    for entry in code:
        if len(entry) == 1:
            labels[entry[0]] = len(program)
        else:
            program.append(entry)
    resolved = []
    for index, (op, jt, jf, k) in enumerate(program):

        def offset(target: str | None, index: int = index) -> int:
            return 0 if target is None else labels[target] - index - 1

        resolved.append((op, offset(jt), offset(jf), k))
    return resolved


def _install_python_guards() -> None:
    def refuse(what: str):
        def refused(*args, **kwargs):
            raise PermissionError(f"{what} is disabled in python graders")

        return refused

    no_network = refuse("network access")
    socket.socket.__init__ = no_network
    for name in ("create_connection", "create_server", "socketpair", "fromfd", "getaddrinfo", "gethostbyname",
                 "gethostbyname_ex", "gethostbyaddr"):
        setattr(socket, name, no_network)
    # `_socket` is the C module under `socket`: its type cannot be patched, so the names that
    # reach it are replaced (the type itself stays reachable, e.g. through socket.socket's
    # bases, which only the kernel filter stops).
    for name in ("socket", "SocketType", "socketpair", "fromfd", "dup", "getaddrinfo", "gethostbyname",
                 "gethostbyname_ex", "gethostbyaddr"):
        if hasattr(_socket, name):
            setattr(_socket, name, no_network)
    no_processes = refuse("starting processes")
    for name in _PROCESS_FUNCTIONS:
        if hasattr(os, name):
            setattr(os, name, no_processes)
    subprocess.Popen.__init__ = no_processes


if __name__ == "__main__":
    main()
