"""BFCL v4's own checker as an endpoint grader, served from BFCL's own environment.

`POST /grade` with OpenAI's endpoint-grader body `{"sample", "item", "trace_id"}` answers
`{"score": 1.0 | 0.0}` and BFCL's reasons (`valid`, `error_type`, `error`). The checker is
not rewritten: the answer is what bfcl_eval's evaluation of one entry says
(`_evaluate_single_ast_entry`, or `_evaluate_single_relevance_entry` for the relevance
categories), on the entry and possible answer it loads itself by `item.bfcl_id`, so a row
cannot change what it is graded against.

The sample becomes what BFCL records for a function-calling model on OpenAI's chat API (its
`OpenAICompletionsHandler`): the calls of the model's first response, `[{name: arguments}]`,
or its text when that response made no call. A model's first response is its first assistant
turn: `sample.output_tools` entries carry the `turn` that wrote them (calls without one count
as the first turn's), and later turns, answered by the tool server, are not BFCL's to grade.
Tool names go back to BFCL's dotted names first (envs/bfcl/calls.py), and the model is
registered with BFCL as a function-calling model that keeps dots (`underscore_to_dot`
False), so the checker compares BFCL's own names.

Why a server in another environment: the AST checker imports
`bfcl_eval.constants.model_config`, which imports every model handler and with them every
vendor SDK (openai, anthropic, mistralai, cohere, google-genai, qwen-agent, boto3), pinned
against numpy 1.26.4. Loading the checker without them would mean replacing a bfcl_eval
module with one of our own; it runs in `.venv-bfcl` instead (scripts/bfcl_env.sh).

Run: `.venv-bfcl/bin/python -m envs.bfcl.grader_server --port 0`; the first line on stdout is
`listening on http://HOST:PORT`. Standard library and bfcl_eval only.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from envs.bfcl.calls import bfcl_call_name, tool_names

MODEL = "agentrft-FC"  # the name the checker knows the model by (BFCL's registry of models)
MAX_BODY_BYTES = 4 * 1024 * 1024


def register_model() -> Any:
    """Register the model with BFCL as an OpenAI chat function-calling model whose tool names
    keep BFCL's dots, and return its handler (only its `decode_ast` is used)."""
    os.environ.setdefault("BFCL_PROJECT_ROOT", tempfile.mkdtemp(prefix="bfcl-"))  # BFCL writes folders at import
    # The handler builds an OpenAI client, which needs a key to exist; the checker never calls it.
    os.environ.setdefault("OPENAI_API_KEY", "unused-the-checker-makes-no-request")
    from bfcl_eval.constants.model_config import MODEL_CONFIG_MAPPING, ModelConfig
    from bfcl_eval.eval_checker.eval_runner import get_handler
    from bfcl_eval.model_handler.api_inference.openai_completion import OpenAICompletionsHandler

    MODEL_CONFIG_MAPPING[MODEL] = ModelConfig(
        model_name=MODEL, display_name="agentrft (FC)", url="", org="agentrft", license="",
        model_handler=OpenAICompletionsHandler, input_price=None, output_price=None, is_fc_model=True,
        underscore_to_dot=False,
    )
    return get_handler(MODEL)


def model_result(sample: dict[str, Any], names: dict[str, str]) -> Any:
    """What BFCL's OpenAI handler records for the model's first response: its calls as
    `[{bfcl_name: arguments_json}]`, else its text."""
    calls = [c for c in sample.get("output_tools") or [] if c.get("turn", 1) == 1]
    if not calls:
        return sample.get("output_text") or ""
    result = []
    for call in calls:
        function = call["function"]
        arguments = function.get("arguments", "")
        result.append({bfcl_call_name(function["name"], names):
                       arguments if isinstance(arguments, str) else json.dumps(arguments)})
    return result


class Checker:
    """BFCL's entries, possible answers and per-entry evaluation, loaded once."""

    def __init__(self, categories: list[str]):
        from bfcl_eval.utils import (
            is_relevance_or_irrelevance,
            load_dataset_entry,
            load_ground_truth_entry,
        )

        self.handler = register_model()
        self.entries: dict[str, dict[str, Any]] = {}
        self.answers: dict[str, Any] = {}
        self.category: dict[str, str] = {}
        for category in categories:
            # The checker's view of the functions: without the hint inference adds to descriptions.
            for entry in load_dataset_entry(category, include_prereq=False, include_language_specific_hint=False):
                self.entries[entry["id"]] = entry
                self.category[entry["id"]] = category
            if not is_relevance_or_irrelevance(category):
                self.answers.update((a["id"], a["ground_truth"]) for a in load_ground_truth_entry(category))

    def verdict(self, bfcl_id: str, sample: dict[str, Any]) -> dict[str, Any]:
        """BFCL's evaluation of the sample as entry `bfcl_id`'s model result."""
        from bfcl_eval.constants.enums import Language, ReturnFormat
        from bfcl_eval.eval_checker.eval_runner import (
            _evaluate_single_ast_entry,
            _evaluate_single_relevance_entry,
        )

        entry, category = self.entries[bfcl_id], self.category[bfcl_id]
        result = model_result(sample, tool_names(entry["function"], where=bfcl_id))
        if bfcl_id not in self.answers:
            return _evaluate_single_relevance_entry(self.handler, bfcl_id, result, entry, MODEL, category)
        return _evaluate_single_ast_entry(
            self.handler, bfcl_id, result, self.answers[bfcl_id], entry, MODEL, category,
            language=Language.PYTHON, return_format=ReturnFormat.PYTHON, has_tool_call_tag=False,
        )


def make_handler(checker: Checker) -> type[BaseHTTPRequestHandler]:
    class GradeHandler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:  # quiet: one line a grade is noise
            pass

        def answer(self, status: int, body: dict[str, Any]) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            if self.path == "/health":
                self.answer(200, {"status": "ok", "entries": len(checker.entries), "model": MODEL})
            else:
                self.answer(404, {"detail": f"no route {self.path}; POST /grade, GET /health"})

        def do_POST(self) -> None:
            if self.path != "/grade":
                self.answer(404, {"detail": f"no route {self.path}; POST /grade"})
                return
            length = int(self.headers.get("Content-Length") or 0)
            if length > MAX_BODY_BYTES:
                self.close_connection = True
                self.answer(413, {"detail": f"request body is {length} bytes; at most {MAX_BODY_BYTES}"})
                return
            try:
                body = json.loads(self.rfile.read(length))
                sample, item = body["sample"], body["item"]
                bfcl_id = item["bfcl_id"]
            except (ValueError, KeyError, TypeError) as exc:
                self.answer(422, {"detail": f'the body must be {{"sample", "item": {{"bfcl_id", ...}}}}: {exc!r}'})
                return
            if bfcl_id not in checker.entries:
                self.answer(422, {"detail": f"item.bfcl_id {bfcl_id!r} is not an entry of the categories served"})
                return
            try:
                result = checker.verdict(bfcl_id, sample)
            except Exception as exc:  # a sample BFCL cannot take (not the model's mistake): never a 0
                self.answer(500, {"detail": f"BFCL's checker failed on {bfcl_id}: {type(exc).__name__}: {exc}"})
                return
            self.answer(200, {"score": 1.0 if result["valid"] else 0.0, "valid": result["valid"],
                              "error_type": result.get("error_type"), "error": result.get("error")})

    return GradeHandler


def main() -> None:
    from envs.bfcl.export import CATEGORIES

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0 takes a free port")
    parser.add_argument("--categories", nargs="*", default=list(CATEGORIES))
    args = parser.parse_args()
    checker = Checker(args.categories)
    server = ThreadingHTTPServer((args.host, args.port), make_handler(checker))
    host, port = server.server_address[:2]
    print(f"listening on http://{host}:{port}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
        sys.stdout.flush()


if __name__ == "__main__":
    main()
