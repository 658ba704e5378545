"""An interpreter on a kernel that lacks what the python grader's fences need, for tests.

`python_without(folder, "landlock", "seccomp", "arch")` writes an executable that stands
for `sys.executable`: it takes the features away from itself with the kernel's own means
and then execs the real interpreter, so everything it runs sees a kernel without them.

- `landlock`: a seccomp filter answers Landlock's three system calls with ENOSYS, as a
  kernel without Landlock does;
- `seccomp`: the same filter answers a further `prctl(PR_SET_SECCOMP)` and `seccomp()` with
  EINVAL, as a kernel built without seccomp filters does;
- `arch`: the 32-bit personality (`setarch linux32`), so `uname` names a CPU (i686) the
  grader's filter has no system-call table for.

x86_64 Linux only (the system-call numbers are x86_64's).
"""

from __future__ import annotations

import platform
import stat
import sys
from pathlib import Path

SUPPORTED = sys.platform.startswith("linux") and platform.machine() == "x86_64"

_WRAPPER = '''#!{python}
import ctypes, os, struct, sys
FEATURES = {features!r}
LD, JEQ, RET = 0x20, 0x15, 0x06
ALLOW, ENOSYS, EINVAL = 0x7FFF0000, 0x00050000 | 38, 0x00050000 | 22
program = [(LD, 0, 0, 0)]  # the system call number
if "landlock" in FEATURES:
    for number in (444, 445, 446):  # landlock_create_ruleset, _add_rule, _restrict_self
        program += [(JEQ, 0, 1, number), (RET, 0, 0, ENOSYS)]
if "seccomp" in FEATURES:
    program += [(JEQ, 0, 1, 317), (RET, 0, 0, EINVAL),  # seccomp()
                (JEQ, 0, 3, 157), (LD, 0, 0, 16), (JEQ, 0, 1, 22), (RET, 0, 0, EINVAL)]  # prctl(PR_SET_SECCOMP)
program.append((RET, 0, 0, ALLOW))
libc = ctypes.CDLL(None, use_errno=True)
libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
if len(program) > 2:
    filters = ctypes.create_string_buffer(b"".join(struct.pack("=HBBI", *op) for op in program))
    class Prog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]
    prog = Prog(len(program), ctypes.addressof(filters))
    assert libc.prctl(38, 1, 0, 0, 0) == 0 and libc.prctl(22, 2, ctypes.addressof(prog), 0, 0) == 0
if "arch" in FEATURES:
    assert libc.personality(0x0008) != -1  # PER_LINUX32
os.execv({python!r}, [{python!r}, *sys.argv[1:]])
'''


def python_without(folder: Path, *features: str) -> Path:
    """An executable standing for `sys.executable` on a kernel without `features`."""
    unknown = set(features) - {"landlock", "seccomp", "arch"}
    if unknown:
        raise ValueError(f"unknown features {sorted(unknown)}")
    path = Path(folder) / f"python-without-{'-'.join(features) or 'nothing'}"
    path.write_text(_WRAPPER.format(python=sys.executable, features=tuple(features)))
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path
