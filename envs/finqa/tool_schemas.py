"""Chat Completions tool schemas of the FinQA-style environment.

They are embedded in every data row's `tools` field (OpenAI RFT shape) and served by the
tool server; the tool client validates the model's arguments against them before any
request is sent. Outputs are kept compact on purpose: small models read them better.
"""

from __future__ import annotations

TOOL_NAMES = ("search", "list", "cat", "calculator")

TOOL_SCHEMAS: list[dict] = [
    {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Find report pages about a topic; returns page paths with titles.",
            "parameters": {
                "type": "object",
                "properties": {
                    "query": {"type": "string", "minLength": 1, "maxLength": 500},
                    "top_k": {"type": "integer", "minimum": 1, "maximum": 10},
                },
                "required": ["query"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "list",
            "description": "List a directory, e.g. reports/ACME/2019.",
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string", "maxLength": 300}},
                "required": ["path"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "cat",
            "description": "Read a page, e.g. reports/ACME/2019/page_3.txt.",
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string", "minLength": 1, "maxLength": 300}},
                "required": ["path"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate arithmetic, e.g. (120.5-100)/100.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string", "minLength": 1, "maxLength": 300}},
                "required": ["expression"],
                "additionalProperties": False,
            },
        },
    },
]
