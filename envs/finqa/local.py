"""The demo tool server started on loopback for a pipeline run, tests or the CLI.

`local_tool_endpoints` serves the FinQA-style tools in a background thread and yields the
endpoints a job would declare (`{"name", "server_url", "headers"}`, one URL per tool),
so everything downstream talks to it over real HTTP exactly as it would to a user's server.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from envs.finqa.faults import FaultConfig
from envs.finqa.server import create_app, serve_in_thread
from envs.finqa.tool_schemas import TOOL_NAMES
from trainer.tools import ToolEndpoint


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
