"""The units environment's tool server: `convert` and `calculator` in the Agent RFT wire
format (envs/tool_server.py), with the numeric endpoint grader at `POST /grade`.

Run it with `agentrft env serve units`, or in tests with `serve_in_thread(create_app())`.
"""

from __future__ import annotations

from typing import Any

import uvicorn
from fastapi import FastAPI

from envs.finqa.faults import FaultConfig
from envs.tool_server import MAX_BODY_BYTES, create_tool_app
from envs.units.tools import UNITS, UnitTools

# Full credit within 1% relative error, falling to 0 at 10% (the project's numeric grader).
ANSWER_GRADER = {"type": "numeric", "name": "answer", "input": "{{sample.output_text}}",
                 "reference": "{{item.reference_answer}}"}


def create_app(*, faults: FaultConfig | None = None, max_traces: int = 10_000, max_body_bytes: int = MAX_BODY_BYTES,
               api_key: str | None = None) -> FastAPI:
    """The units tool server; with `api_key`, every route but /health needs it."""
    return create_tool_app(UnitTools(), title="Units tool server", faults=faults, max_traces=max_traces,
                           max_body_bytes=max_body_bytes, api_key=api_key, grader=ANSWER_GRADER,
                           health=lambda: {"units": sum(len(units) for units in UNITS.values())})


def serve(host: str = "127.0.0.1", port: int = 8000, *, log_level: str = "info", access_log: bool = True,
          **app_options: Any) -> None:
    """Serve the units tools with uvicorn until interrupted; `app_options` go to `create_app`."""
    # A call in progress (a hanging fault, a slow tool) gets 2 s after SIGTERM, not its whole time.
    uvicorn.run(create_app(**app_options), host=host, port=port, log_level=log_level, access_log=access_log,
                timeout_graceful_shutdown=2)
