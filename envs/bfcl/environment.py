"""What a BFCL run needs before it starts: BFCL's environment, the rows, the two servers.

1. BFCL's own environment, `.venv-bfcl` (scripts/bfcl_env.sh, `make bfcl`): bfcl-eval with its
   pins, apart from the project's, built once per machine.
2. The rows: written from the installed bfcl_eval by `envs/bfcl/export.py` (run in that
   environment) into `envs/bfcl/data/`, then checked against `envs/bfcl/data.dvc` by DVC
   itself, as the other environments' data are: the same package version and seed give the
   same bytes, and a package that gives other rows is caught here, not in a score.
3. The grader: BFCL's checker behind OpenAI's endpoint-grader wire
   (`envs/bfcl/grader_server.py`), a process of BFCL's environment on the loopback port the
   config's `grader.url` names. It takes ten seconds or more to import every model handler.
4. The tools: the rows' own functions acknowledged (`envs/bfcl/server.py`), in this process,
   on the loopback port the config's endpoints name.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from trainer.errors import AgentRFTError, ConfigError, InfraError

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
BFCL_VENV = ROOT / ".venv-bfcl"
DATA_DIR = HERE / "data"
DVC_FILE = HERE / "data.dvc"
STARTUP_TIMEOUT_S = 300.0


def bfcl_python() -> Path:
    """The Python of BFCL's environment; an error saying how to build it when it is missing."""
    python = BFCL_VENV / "bin" / "python"
    if not python.exists():
        raise AgentRFTError(f"BFCL's environment is missing ({BFCL_VENV}): build it with `make bfcl` "
                            "(scripts/bfcl_env.sh, once per machine, about 2 GB)")
    return python


def bfcl_env() -> dict[str, str]:
    """The environment of a BFCL process: this checkout's envs/ importable, and BFCL's result
    and score folders (it makes them when imported) in a scratch folder."""
    return {**os.environ, "PYTHONPATH": str(ROOT),
            "BFCL_PROJECT_ROOT": os.environ.get("BFCL_PROJECT_ROOT") or tempfile.mkdtemp(prefix="bfcl-")}


def run_in_bfcl(module: str, *args: str, timeout_s: float = 600.0) -> str:
    """`python -m module args` in BFCL's environment; its stdout, or an error quoting its
    last lines of stderr."""
    try:
        done = subprocess.run([str(bfcl_python()), "-m", module, *args], cwd=ROOT, env=bfcl_env(),
                              capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise InfraError(f"{module} in BFCL's environment ran past {timeout_s:.0f} s") from None
    if done.returncode != 0:
        raise AgentRFTError(f"{module} in BFCL's environment failed (exit {done.returncode}): "
                            f"{_root_cause(done.stderr)}")
    return done.stdout


def generate(out: Path, *, seed: int = 0) -> None:
    """Write the rows from the installed bfcl_eval (envs/bfcl/export.py) into `out`."""
    run_in_bfcl("envs.bfcl.export", "--out", str(out), "--seed", str(seed))


def ensure_data(*, seed: int = 0, log: Any = print) -> str:
    """The rows in envs/bfcl/data and exactly what envs/bfcl/data.dvc pins; returns the md5."""
    from tasks.data_version import ensure_pinned

    return ensure_pinned(DVC_FILE, DATA_DIR, generate, seed=seed,
                         source="envs/bfcl/export.py and bfcl-eval==2026.3.23", log=log)


def _root_cause(log_text: str, lines: int = 3) -> str:
    """The last lines of a child's log that say something (its traceback's end)."""
    said = [line for line in log_text.splitlines() if line.strip() and "Warning" not in line]
    return " | ".join(said[-lines:]) or "(it printed nothing)"


def _loopback(url: str, what: str) -> tuple[str, int]:
    parsed = urlparse(url)
    if parsed.hostname not in ("127.0.0.1", "localhost") or not parsed.port:
        raise ConfigError(f"{what}: the BFCL environment serves it on a loopback port; got {url!r} "
                          "(use http://127.0.0.1:PORT/...)")
    return parsed.hostname, parsed.port


@contextmanager
def grader_server(url: str | None = None, *, log: Any = print) -> Iterator[str]:
    """BFCL's checker served from BFCL's environment; yields its base URL. With `url` (a
    config's `grader.url`) on that URL's loopback port, else on a free one."""
    host, port = _loopback(url, "grader.url") if url else ("127.0.0.1", 0)
    with tempfile.TemporaryFile("w+") as errors:
        process = subprocess.Popen(
            [str(bfcl_python()), "-m", "envs.bfcl.grader_server", "--host", host, "--port", str(port)],
            cwd=ROOT, env=bfcl_env(), stdout=subprocess.PIPE, stderr=errors, text=True)
        try:
            base_url = _wait_listening(process, errors)
            log(f"BFCL grader (its checker, in {BFCL_VENV.name}): {base_url}/grade")
            yield base_url
        finally:
            process.terminate()
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def _wait_listening(process: subprocess.Popen, errors: Any) -> str:
    """The URL the grader server prints once it listens; an error quoting its log otherwise."""
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.append(process.stdout.readline()), daemon=True)
    reader.start()
    reader.join(STARTUP_TIMEOUT_S)
    line = lines[0].strip() if lines else ""
    if not line.startswith("listening on "):
        process.kill()
        process.wait()
        errors.seek(0)
        why = f"it did not start within {STARTUP_TIMEOUT_S:.0f} s" if reader.is_alive() else \
            f"it exited with status {process.returncode}"
        raise InfraError(f"BFCL's grader server failed ({why}): {_root_cause(errors.read())}")
    return line.removeprefix("listening on ")


@contextmanager
def tool_server(config: Any, *, api_key: str | None = None) -> Iterator[str]:
    """The rows' functions served (acknowledged) on the loopback port the config's endpoints name."""
    from envs.bfcl.server import create_app
    from envs.tool_server import serve_in_thread

    ports = {_loopback(e.server_url, "tools.endpoints") for e in config.tools.endpoints}
    if len(ports) != 1:
        raise ConfigError(f"the BFCL environment serves every tool from one server; the endpoints name {ports}")
    host, port = ports.pop()
    try:
        with serve_in_thread(create_app(api_key=api_key), host=host, port=port) as base_url:
            yield base_url
    except OSError as exc:
        raise AgentRFTError(f"cannot start the BFCL tool server on {host}:{port} ({exc.strerror}); stop "
                            "whatever uses that port or change tools.endpoints in the config") from None


@contextmanager
def servers(config: Any, *, log: Any = print) -> Iterator[None]:
    """The data checked, BFCL's grader and the tool server up, for a run on `config`."""
    if config.grader.get("type") != "endpoint":
        raise ConfigError(f"the BFCL environment grades with BFCL's checker (an endpoint grader); the config's "
                          f"grader is {config.grader.get('type')!r}")
    started = time.perf_counter()
    bfcl_python()
    ensure_data(log=log)
    with grader_server(config.grader["url"], log=log), tool_server(config) as tools_url:
        log(f"BFCL tool server: {tools_url} (ready after {time.perf_counter() - started:.0f} s)")
        yield


if __name__ == "__main__":  # `python -m envs.bfcl.environment`: write and check the rows
    print(ensure_data(log=lambda line: print(line, file=sys.stderr)))
