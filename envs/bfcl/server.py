"""The BFCL environment's tool server: every row's own functions, in the Agent RFT wire format.

A BFCL row offers functions of its own (`tools`), a thousand and more names across the
benchmark, so the server takes any tool the row it is sent offers (envs/tool_server.py with
`schemas` None: a call is checked against the schemas of the row in its body) and a config
names it once, as the endpoint of every tool (`{name: "*", server_url: ".../call"}`).

What a call gets back: bfcl_eval ships no implementation of its single-turn functions (the
executable categories it once had are among its unused data sets, without their functions;
what it does ship, `eval_checker/multi_turn_eval/func_source_code`, are the stateful APIs of
its multi-turn categories, with other signatures). So a call is answered with a neutral
acknowledgement that names the function and its arguments and claims no result. BFCL grades
a single-turn entry on the model's first response alone (envs/bfcl/grader_server.py), so what
the model does after the acknowledgement never changes its score.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import FastAPI

from envs.tool_server import MAX_BODY_BYTES, create_tool_app


class BFCLTools:
    """The rows' own functions, acknowledged."""

    schemas = None  # each row's `tools`

    def run(self, name: str, args: dict[str, Any], item: dict[str, Any] | None = None) -> str:
        bfcl_name = ((item or {}).get("tool_names") or {}).get(name, name)
        return json.dumps({"function": bfcl_name, "arguments": args, "status": "received",
                           "note": "the call was received; this function returns no data"})


def create_app(*, max_traces: int = 10_000, max_body_bytes: int = MAX_BODY_BYTES, api_key: str | None = None
               ) -> FastAPI:
    """The BFCL tool server; with `api_key`, every route but /health needs it."""
    return create_tool_app(BFCLTools(), title="BFCL tool server", max_traces=max_traces,
                           max_body_bytes=max_body_bytes, api_key=api_key)
