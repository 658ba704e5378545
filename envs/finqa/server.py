"""The FinQA-style tool server: search, list, cat and calculator over a corpus of report
pages, wire-compatible with OpenAI Agent RFT tool endpoints (envs/tool_server.py serves
them), plus an endpoint grader.

A corpus may declare filing periods (`periods.json` at its root, `{"periods": [[2016,
2022], [2023, 2027]]}`): a call whose item has a `year` inside a period sees that period's
reports alone (search ranks them as an index of those pages would, `list` and `cat` do not
show the others), so one server holds the demo's earlier filings, which train and
validation ask about, and the later ones its test split asks about, without either
distracting the other. An item without a year, or outside every period, sees everything.

`POST /grade` is an endpoint grader (`{"sample", "item", "trace_id"}` -> `{"score"}`):
the project's numeric grader, partial credit against `item.reference_answer`.

Search embeds the query on the CPU; tools run in the server's threadpool. Run it with
`agentrft env serve finqa --corpus data/corpus`, or in tests with
`serve_in_thread(create_app(corpus_dir))`.
"""

from __future__ import annotations

import json
import re
from pathlib import Path, PurePosixPath
from typing import Any

import numpy as np
import uvicorn
from fastapi import FastAPI

from envs.finqa.calculator import evaluate, format_number
from envs.finqa.faults import FaultConfig
from envs.finqa.search import SearchIndex
from envs.finqa.tool_schemas import TOOL_SCHEMAS
from envs.tool_server import MAX_BODY_BYTES, ToolError, create_tool_app, truncate

# The endpoint grader's score: numeric partial credit against the item's reference
# (full credit within 1% relative error, falling to 0 at 10%).
ANSWER_GRADER = {
    "type": "numeric",
    "name": "answer",
    "input": "{{sample.output_text}}",
    "reference": "{{item.reference_answer}}",
}


def _natural_key(name: str) -> list:
    # page_2 before page_10
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def path_year(path: str) -> int | None:
    """The report year a corpus path lies under (its first four-digit part), if any."""
    return next((int(part) for part in PurePosixPath(path).parts if re.fullmatch(r"\d{4}", part)), None)


def read_periods(corpus_dir: Path) -> list[tuple[int, int]]:
    """The corpus's filing periods (`periods.json`), [] when it declares none."""
    file = Path(corpus_dir) / "periods.json"
    if not file.is_file():
        return []
    try:
        periods = [(int(first), int(last)) for first, last in json.loads(file.read_text())["periods"]]
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{file}: expected {{\"periods\": [[first_year, last_year], ...]}} ({exc})") from None
    return periods


class CorpusTools:
    """The four tools over one corpus directory; each returns the output text or raises
    ToolError. With `periods`, an item's `year` scopes search, list and cat to its period."""

    schemas = TOOL_SCHEMAS

    def __init__(self, corpus_dir: Path, index: SearchIndex, max_output_chars: int,
                 periods: list[tuple[int, int]] | None = None):
        self.root = Path(corpus_dir).resolve()
        self.index = index
        self.max_output_chars = max_output_chars
        self.periods = list(periods or [])
        years = [path_year(path) for path in index.paths]
        self._allowed = {period: np.array([year is None or period[0] <= year <= period[1] for year in years])
                         for period in self.periods}

    def period_of(self, item: dict[str, Any] | None) -> tuple[int, int] | None:
        year = (item or {}).get("year")
        if isinstance(year, int) and not isinstance(year, bool):
            return next((period for period in self.periods if period[0] <= year <= period[1]), None)
        return None

    def run(self, name: str, args: dict[str, Any], item: dict[str, Any] | None = None) -> str:
        period = self.period_of(item)
        match name:
            case "search":
                output = self.search(args["query"], args.get("top_k", 3), period)
            case "list":
                output = self.list(args["path"], period)
            case "cat":
                output = self.cat(args["path"], period)
            case "calculator":
                output = self.calculator(args["expression"])
            case _:
                raise ToolError(404, f"unknown tool {name!r}")
        return truncate(output, self.max_output_chars)

    def search(self, query: str, top_k: int, period: tuple[int, int] | None = None) -> str:
        hits = self.index.search(query, top_k, None if period is None else self._allowed[period])
        if not hits:
            return "no pages found"
        return "\n".join(f"{hit.path} | {hit.score:.2f} | {hit.snippet}" for hit in hits)

    @staticmethod
    def _outside(relative: str, period: tuple[int, int] | None) -> bool:
        year = path_year(relative)
        return period is not None and year is not None and not period[0] <= year <= period[1]

    def list(self, path: str, period: tuple[int, int] | None = None) -> str:
        directory = self.resolve(path)
        if not directory.exists() or self._outside(directory.relative_to(self.root).as_posix(), period):
            raise ToolError(404, f"no such directory {path!r}; try list with path 'reports'")
        if not directory.is_dir():
            raise ToolError(400, f"{path!r} is a page, not a directory; use cat to read it")
        lines = []
        for child in sorted(directory.iterdir(), key=lambda p: _natural_key(p.name)):
            if child.name.startswith(".") or not child.resolve().is_relative_to(self.root):
                continue
            if self._outside(child.relative_to(self.root).as_posix(), period) or child == self.root / "periods.json":
                continue
            # Names relative to the listed directory: compact, as `ls` prints them.
            lines.append(f"{child.name}/" if child.is_dir() else child.name)
        return "\n".join(lines) if lines else f"{path!r} is empty"

    def cat(self, path: str, period: tuple[int, int] | None = None) -> str:
        page = self.resolve(path)
        outside = self._outside(page.relative_to(self.root).as_posix(), period)
        if page.is_dir() and not outside:
            raise ToolError(400, f"{path!r} is a directory; use list to see its pages")
        if not page.is_file() or outside:
            raise ToolError(404, f"no such page {path!r}; use search or list to find pages")
        return page.read_text(encoding="utf-8", errors="replace")

    def calculator(self, expression: str) -> str:
        try:
            return format_number(evaluate(expression))
        except ValueError as exc:
            raise ToolError(400, f"calculator: {exc}") from None

    def resolve(self, path: str) -> Path:
        """The file or directory `path` names, refusing anything outside the corpus."""
        if "\0" in path:
            raise ToolError(400, "path contains a NUL character")
        rel = PurePosixPath(path.strip())
        if rel.is_absolute() or path.startswith("\\") or re.match(r"^[A-Za-z]:", path):
            raise ToolError(
                400,
                f"absolute path {path!r} is not allowed; give a path relative to the corpus "
                "root, e.g. 'reports' or 'reports/ACME/2019/page_3.txt'",
            )
        if ".." in rel.parts or "\\" in path:
            raise ToolError(400, f"path {path!r} leaves the corpus; '..' is not allowed")
        full = (self.root / rel).resolve()
        if not full.is_relative_to(self.root):
            raise ToolError(400, f"path {path!r} leads outside the corpus (through a link)")
        return full


def create_app(
    corpus_dir: Path,
    *,
    max_output_chars: int = 2000,
    faults: FaultConfig | None = None,
    index_cache_dir: Path | None = None,
    index: SearchIndex | None = None,
    max_seq_length: int = 128,
    max_traces: int = 10_000,
    max_body_bytes: int = MAX_BODY_BYTES,
    api_key: str | None = None,
) -> FastAPI:
    """The tool server over `corpus_dir`. The search index is built (or loaded from the
    cache in `index_cache_dir`) here, before the first request; pass `index` to share one
    already built. With `api_key`, every route but /health (the traces included) needs it."""
    corpus_dir = Path(corpus_dir)
    if not corpus_dir.is_dir():
        raise FileNotFoundError(f"corpus directory {corpus_dir} does not exist")
    if index is None:
        index = SearchIndex.from_corpus(
            corpus_dir, cache_dir=index_cache_dir, max_seq_length=max_seq_length
        )
    tools = CorpusTools(corpus_dir, index, max_output_chars, read_periods(corpus_dir))
    return create_tool_app(tools, title="FinQA-style tool server", faults=faults, max_traces=max_traces,
                           max_body_bytes=max_body_bytes, api_key=api_key, grader=ANSWER_GRADER,
                           health=lambda: {"pages": len(index)})


def serve(
    corpus_dir: Path,
    host: str = "127.0.0.1",
    port: int = 8000,
    *,
    log_level: str = "info",
    access_log: bool = True,
    **app_options: Any,
) -> None:
    """Build the app over `corpus_dir` and serve it with uvicorn until interrupted;
    `app_options` go to `create_app`."""
    app = create_app(corpus_dir, **app_options)
    # A call in progress (a hanging fault, a slow tool) gets 2 s after SIGTERM, not its whole time.
    uvicorn.run(app, host=host, port=port, log_level=log_level, access_log=access_log, timeout_graceful_shutdown=2)
