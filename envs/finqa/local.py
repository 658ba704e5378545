"""The demo tool server started on loopback for a pipeline run, tests or the CLI.

`local_tool_endpoints` serves the FinQA-style tools in a background thread and yields the
endpoints a job would declare (`{"name", "server_url", "headers"}`, one URL per tool),
so everything downstream talks to it over real HTTP exactly as it would to a user's server.
`tool_endpoints_in_process` serves them from a child process instead, as a user's tool
server would be: it does not share the caller's GIL (benchmarks that time a trainer).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from envs.finqa.faults import FaultConfig
from envs.finqa.server import create_app
from envs.finqa.tool_schemas import TOOL_NAMES
from envs.tool_server import serve_in_thread
from trainer.config.tools import ToolEndpoint


@contextmanager
def local_tool_endpoints(
    corpus_dir: Path,
    *,
    port: int = 0,
    max_output_chars: int = 2000,
    faults: FaultConfig | None = None,
) -> Iterator[list[ToolEndpoint]]:
    app = create_app(Path(corpus_dir), max_output_chars=max_output_chars, faults=faults)
    with serve_in_thread(app, port=port) as base_url:
        yield [ToolEndpoint(name=name, server_url=f"{base_url}/tools/{name}") for name in TOOL_NAMES]


def _serve(conn: multiprocessing.connection.Connection, corpus_dir: Path, max_output_chars: int,
           faults: FaultConfig | None) -> None:
    with local_tool_endpoints(corpus_dir, max_output_chars=max_output_chars, faults=faults) as endpoints:
        conn.send(endpoints)
        conn.recv()  # serve until told to stop


@contextmanager
def tool_endpoints_in_process(
    corpus_dir: Path,
    *,
    max_output_chars: int = 2000,
    faults: FaultConfig | None = None,
    startup_timeout_s: float = 120.0,
) -> Iterator[list[ToolEndpoint]]:
    """`local_tool_endpoints`, served by a child process (spawned) for the block."""
    spawn = multiprocessing.get_context("spawn")
    here, there = spawn.Pipe()
    process = spawn.Process(target=_serve, args=(there, Path(corpus_dir), max_output_chars, faults), daemon=True,
                            name="agentrft-tools")
    process.start()
    try:
        deadline = time.monotonic() + startup_timeout_s
        while not here.poll(0.2):
            if not process.is_alive():
                raise RuntimeError(f"the tool server process for {corpus_dir} exited with code {process.exitcode} "
                                   "before it served (its output above says why)")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the tool server process for {corpus_dir} did not start within "
                                   f"{startup_timeout_s:.0f} s")
        yield here.recv()
    finally:
        with contextlib.suppress(OSError):
            here.send(None)
        process.join(timeout=30)
        if process.is_alive():
            process.kill()
            process.join(timeout=10)
