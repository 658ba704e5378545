"""The FinQA tool server, started for real with uvicorn on loopback over a tiny corpus.

One search index (the real MiniLM) is built per module and shared by the apps under test,
so only the first build pays for the embedding.
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest

from envs.finqa.calculator import evaluate
from envs.finqa.faults import Fault, FaultConfig, FaultInjector
from envs.finqa.search import (
    COLUMN_YEAR_BOOST,
    DEFAULT_MODEL,
    PATH_WORD_BOOST,
    ROW_LABEL_BOOST,
    QueryEncoder,
    SearchIndex,
    encode,
    table_keys,
)
from envs.finqa.server import create_app
from envs.tool_server import TraceStore, serve_in_thread

pytestmark = pytest.mark.integration

PAGES = {
    "reports/ACME/2019/page_1.txt": "ACME Corp annual report 2019\nNet revenue rose to $1,250 "
    "million from $1,100 million in 2018, driven by higher product sales.",
    "reports/ACME/2019/page_2.txt": "ACME Corp annual report 2019\nShare repurchase program: "
    "the board authorised buying back 5 million common shares during the year.",
    "reports/ACME/2019/page_3.txt": "ACME Corp annual report 2019\nLong-term debt maturities: "
    "senior notes of $300 million are due in 2024.",
    "reports/ACME/2020/page_1.txt": "ACME Corp annual report 2020\nNet revenue fell to $1,180 "
    "million as the pandemic closed retail stores.",
    "reports/ACME/2020/page_2.txt": "ACME Corp annual report 2020\nEmployee headcount was "
    "12,400 at year end, down from 13,000.",
    "reports/BOLT/2019/page_1.txt": "Bolt Energy annual report 2019\nGoodwill impairment: we "
    "recorded a non-cash impairment charge of $45 million on the solar segment.",
    "reports/BOLT/2019/page_2.txt": "Bolt Energy annual report 2019\nCapital expenditures on "
    "new wind turbines totalled $210 million.",
    "reports/BOLT/2020/page_1.txt": "Bolt Energy annual report 2020\nDividends paid per share "
    "increased to $1.32 from $1.20.",
    "reports/BOLT/2020/page_2.txt": "Bolt Energy annual report 2020\nOperating lease "
    "liabilities for office space amounted to $88 million.",
    "reports/CRUX/2021/page_1.txt": "Crux Pharma annual report 2021\nResearch and development "
    "spending on clinical trials reached $640 million.",
    "reports/CRUX/2021/page_2.txt": "Crux Pharma annual report 2021\nInventory of raw "
    "materials and finished drugs was valued at $95 million.",
    "reports/CRUX/2021/page_10.txt": "Crux Pharma annual report 2021\nRisk factors\n"
    + "Our business depends on patents that may be challenged. " * 40,
}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    base = tmp_path_factory.mktemp("finqa")
    root = base / "corpus"
    for rel, text in PAGES.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    outside = base / "outside"
    outside.mkdir()
    (outside / "secret.txt").write_text("do not leak")
    (root / "reports" / "link").symlink_to(outside, target_is_directory=True)
    (root / "reports" / "ACME" / "leak.txt").symlink_to(outside / "secret.txt")
    return root


@pytest.fixture(scope="module")
def index(corpus, tmp_path_factory) -> SearchIndex:
    return SearchIndex.from_corpus(corpus, cache_dir=tmp_path_factory.mktemp("index_cache"))


@pytest.fixture(scope="module")
def base_url(corpus, index):
    with serve_in_thread(create_app(corpus, index=index, max_output_chars=500)) as url:
        yield url


@pytest.fixture
def client():
    with httpx.Client(timeout=30) as c:
        yield c


def wire(name: str, arguments: dict | str, trace_id: str = "trace_test", **fields) -> dict:
    return {
        "type": "function_call",
        "id": "fc_1",
        "call_id": "call_1",
        "name": name,
        "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments),
        "item": {"id": "item_1"},
        "trace_id": trace_id,
        **fields,
    }


def call(client: httpx.Client, base_url: str, name: str, arguments, **fields) -> httpx.Response:
    return client.post(f"{base_url}/tools/{name}", json=wire(name, arguments, **fields))


# --- tools -------------------------------------------------------------------------------


def test_search_finds_the_page_on_topic(client, base_url):
    r = call(client, base_url, "search", {"query": "goodwill impairment charge", "top_k": 3})
    assert r.status_code == 200
    body = r.json()
    assert body["type"] == "function_call_output"
    assert (body["call_id"], body["id"]) == ("call_1", "fc_1")
    lines = body["output"].splitlines()
    assert len(lines) == 3
    path, score, snippet = lines[0].split(" | ", 2)
    assert path == "reports/BOLT/2019/page_1.txt"
    assert 0 < float(score) <= 1
    assert "impairment charge of $45 million" in snippet
    scores = [float(line.split(" | ")[1]) for line in lines]
    assert scores == sorted(scores, reverse=True)


@pytest.mark.parametrize(
    ("query", "page"),
    [
        ("how many shares did ACME buy back", "reports/ACME/2019/page_2.txt"),
        ("Crux research and development spending", "reports/CRUX/2021/page_1.txt"),
        ("dividends per share Bolt 2020", "reports/BOLT/2020/page_1.txt"),
    ],
)
def test_search_ranks_the_right_page_first(index, query, page):
    assert index.search(query, top_k=1)[0].path == page


def test_concurrent_searches_match_sequential_ones(index):
    queries = [
        "net revenue", "goodwill impairment", "wind turbines", "headcount", "patents",
        "dividends", "inventory", "lease liabilities", "senior notes due", "share buyback",
    ]
    alone = [index.search(q, 3) for q in queries]
    with ThreadPoolExecutor(max_workers=len(queries)) as pool:
        together = list(pool.map(lambda q: index.search(q, 3), queries))
    for a, b in zip(alone, together, strict=True):
        assert [hit.path for hit in a] == [hit.path for hit in b]
        assert [hit.score for hit in a] == pytest.approx([hit.score for hit in b], abs=1e-4)


def test_query_vectors_are_cached_up_to_the_bound(monkeypatch):
    queries = QueryEncoder(DEFAULT_MODEL, 64, cache_size=2)
    encoded: list[str] = []

    def counting(texts, **kwargs):
        encoded.extend(texts)
        return encode(texts, **kwargs)

    monkeypatch.setattr("envs.finqa.search.encode", counting)
    first = queries.encode("net revenue 2021")
    again = queries.encode("net revenue 2021")
    assert encoded == ["net revenue 2021"] and again is first
    assert np.allclose(first, encode(["net revenue 2021"], max_seq_length=64)[0], atol=1e-5)
    queries.encode("goodwill")
    queries.encode("dividends")  # a third distinct query pushes out the least recently used
    queries.encode("net revenue 2021")
    assert encoded == ["net revenue 2021", "goodwill", "dividends", "net revenue 2021"]


def test_call_route_dispatches_on_the_body_name(client, base_url):
    r = client.post(f"{base_url}/call", json=wire("calculator", {"expression": "(120.5-100)/100"}))
    assert r.status_code == 200
    assert r.json()["output"] == "0.205"


def test_list_shows_children_dirs_with_slash_in_natural_order(client, base_url):
    r = call(client, base_url, "list", {"path": "reports"})
    assert r.json()["output"].splitlines() == [
        "ACME/", "BOLT/", "CRUX/",
    ]  # the link leading outside is not shown
    r = call(client, base_url, "list", {"path": "reports/CRUX/2021"})
    assert r.json()["output"].splitlines() == [
        "page_1.txt",
        "page_2.txt",
        "page_10.txt",
    ]
    assert call(client, base_url, "list", {"path": ""}).json()["output"] == "reports/"


def test_cat_returns_the_page(client, base_url):
    r = call(client, base_url, "cat", {"path": "reports/BOLT/2019/page_2.txt"})
    assert r.status_code == 200
    assert r.json()["output"] == PAGES["reports/BOLT/2019/page_2.txt"]


def test_cat_truncates_with_a_visible_marker(client, base_url):
    page = PAGES["reports/CRUX/2021/page_10.txt"]
    output = call(client, base_url, "cat", {"path": "reports/CRUX/2021/page_10.txt"}).json()[
        "output"
    ]
    assert output == page[:500] + f"\n[truncated: {len(page) - 500} more chars]"


def test_calculator_evaluates_and_refuses_code(client, base_url):
    assert call(client, base_url, "calculator", {"expression": "2**10 - -6"}).json()["output"] == (
        "1030"
    )
    r = call(client, base_url, "calculator", {"expression": "__import__('os')"})
    assert r.status_code == 400
    assert "Call is not allowed" in r.json()["output"]
    r = call(client, base_url, "calculator", {"expression": "1/0"})
    assert r.status_code == 400 and "division by zero" in r.json()["detail"]


def test_calculator_module_limits():
    assert evaluate("-(3 + 4) * 2 / 7") == -2.0
    for expression, message in [
        ("2**1000", "exponent"),
        ("().__class__", "not allowed"),
        ("1,234 + 1", "commas"),
        ("1" * 301, "at most 300"),
        ("1e308 * 10", "finite"),
    ]:
        with pytest.raises(ValueError, match=message):
            evaluate(expression)


# --- bad input ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("tool", "path", "message"),
    [
        ("cat", "../outside/secret.txt", "'..' is not allowed"),
        ("cat", "reports/../../outside/secret.txt", "'..' is not allowed"),
        ("cat", "/etc/passwd", "absolute path"),
        ("list", "/", "absolute path"),
        ("cat", "reports/link/secret.txt", "outside the corpus"),
        ("cat", "reports/ACME/leak.txt", "outside the corpus"),
        ("list", "reports/link", "outside the corpus"),
    ],
)
def test_paths_outside_the_corpus_are_400(client, base_url, tool, path, message):
    r = call(client, base_url, tool, {"path": path})
    assert r.status_code == 400
    assert message in r.json()["detail"]
    assert "do not leak" not in r.text


def test_missing_page_is_404_with_a_hint(client, base_url):
    r = call(client, base_url, "cat", {"path": "reports/ACME/2019/page_99.txt"})
    assert r.status_code == 404
    assert r.json()["output"].startswith("Error: no such page 'reports/ACME/2019/page_99.txt'")
    assert "search or list" in r.json()["output"]


def test_unknown_tool_is_404(client, base_url):
    r = client.post(f"{base_url}/tools/rm", json=wire("rm", {"path": "x"}))
    assert r.status_code == 404 and "unknown tool 'rm'" in r.json()["detail"]
    r = client.post(f"{base_url}/call", json=wire("rm", {"path": "x"}))
    assert r.status_code == 404 and "unknown tool 'rm'" in r.json()["detail"]


def test_malformed_json_body_is_422(client, base_url):
    r = client.post(f"{base_url}/tools/search", content=b'{"type": "function_call",',
                    headers={"content-type": "application/json"})
    assert r.status_code == 422
    assert "not valid JSON" in r.json()["detail"]


@pytest.mark.parametrize(
    ("body_change", "field"),
    [
        ({"arguments": json.dumps({"query": 5})}, "arguments.query"),
        ({"arguments": json.dumps({"query": "x", "top_k": "3"})}, "arguments.top_k"),
        ({"arguments": json.dumps({"top_k": 3})}, "'query' is a required property"),
        ({"arguments": json.dumps({"query": "x", "rm": 1})}, "'rm' was unexpected"),
        ({"arguments": "{not json"}, "arguments: not a valid JSON string"),
        ({"arguments": {"query": "x"}}, "arguments: Input should be a valid string"),
        ({"type": "message"}, "type: Input should be 'function_call'"),
        ({"trace_id": None}, "trace_id"),
        ({"item": "row"}, "item: Input should be a valid dictionary"),
    ],
)
def test_bad_bodies_are_422_naming_the_field(client, base_url, body_change, field):
    body = wire("search", {"query": "revenue"}) | body_change
    r = client.post(f"{base_url}/tools/search", json=body)
    assert r.status_code == 422
    assert field in r.json()["detail"]


def test_body_over_1mb_is_413(client, base_url):
    body = wire("search", {"query": "x" * (1024 * 1024)})
    r = client.post(f"{base_url}/tools/search", json=body)
    assert r.status_code == 413
    assert "at most 1048576" in r.json()["detail"]

    def chunks():  # no Content-Length: the middleware must count the bytes
        for _ in range(12):
            yield b"x" * 100_000

    r = client.post(f"{base_url}/tools/search", content=chunks())
    assert r.status_code == 413
    assert client.get(f"{base_url}/health").json()["status"] == "ok"


def test_tool_exception_is_500_and_server_keeps_serving(corpus, index, client):
    app = create_app(corpus, index=index)

    def broken(expression: str) -> str:
        raise RuntimeError("boom")

    app.state.tools.calculator = broken
    with serve_in_thread(app) as url:
        r = call(client, url, "calculator", {"expression": "1+1"})
        assert r.status_code == 500
        assert r.json()["detail"] == "internal error in tool 'calculator': RuntimeError"
        assert call(client, url, "cat", {"path": "reports/ACME/2020/page_2.txt"}).status_code == 200


# --- traces ------------------------------------------------------------------------------


def test_traces_record_calls_per_trace_id(client, base_url):
    call(client, base_url, "search", {"query": "net revenue"}, trace_id="trace_a")
    call(client, base_url, "cat", {"path": "reports/ACME/2019/page_1.txt"}, trace_id="trace_a")
    call(client, base_url, "cat", {"path": "../x"}, trace_id="trace_a")
    call(client, base_url, "calculator", {"expression": "1250/1100-1"}, trace_id="trace_a")
    call(client, base_url, "list", {"path": "reports"}, trace_id="trace_b")

    trace_a = client.get(f"{base_url}/traces/trace_a").json()
    assert [c["name"] for c in trace_a["calls"]] == ["search", "cat", "cat", "calculator"]
    assert [c["status_code"] for c in trace_a["calls"]] == [200, 200, 400, 200]
    first, _, refused, calc = trace_a["calls"]
    assert first["arguments"] == {"query": "net revenue"}
    assert first["output"].startswith("reports/ACME/") and first["error"] is None
    assert refused["output"] is None and "'..' is not allowed" in refused["error"]
    assert calc["output"] == "0.136363636364"
    assert first["started_at"] <= first["finished_at"] and first["latency_ms"] > 0

    trace_b = client.get(f"{base_url}/traces/trace_b").json()
    assert [c["name"] for c in trace_b["calls"]] == ["list"]
    assert client.get(f"{base_url}/traces/trace_none").status_code == 404


def test_trace_store_is_bounded_lru():
    store = TraceStore(max_traces=2, max_calls=2)
    store.record("t1", {"n": 1})
    store.record("t2", {"n": 2})
    assert store.get("t1") is not None  # t1 is now the most recent
    store.record("t3", {"n": 3})
    assert store.get("t2") is None and len(store) == 2
    for n in range(3):
        store.record("t3", {"n": n})
    assert len(store.get("t3")["calls"]) == 2 and store.get("t3")["dropped_calls"] == 2


# --- faults and latency --------------------------------------------------------------------


def test_error_rate_one_gives_5xx_on_tools_only(corpus, index, client):
    app = create_app(corpus, index=index, faults=FaultConfig(error_rate=1.0))
    with serve_in_thread(app) as url:
        for _ in range(3):
            r = call(client, url, "cat", {"path": "reports/ACME/2019/page_1.txt"}, trace_id="t_f")
            assert r.status_code == 503
        assert client.get(f"{url}/health").status_code == 200
        calls = client.get(f"{url}/traces/t_f").json()["calls"]
        assert [c["status_code"] for c in calls] == [503, 503, 503]


def test_drop_rate_one_closes_the_connection_unanswered(corpus, index, client):
    app = create_app(corpus, index=index, faults=FaultConfig(drop_rate=1.0))
    with serve_in_thread(app) as url:
        with pytest.raises((httpx.RemoteProtocolError, httpx.ReadError)):
            call(client, url, "list", {"path": "reports"})
        assert client.get(f"{url}/health").status_code == 200


def test_timeout_fault_outlasts_the_client_timeout(corpus, index):
    app = create_app(corpus, index=index, faults=FaultConfig(timeout_rate=1.0, timeout_s=1.0))
    with serve_in_thread(app) as url, httpx.Client(timeout=0.2) as client:
        with pytest.raises(httpx.ReadTimeout):
            call(client, url, "list", {"path": "reports"})


def test_latency_ms_delays_each_call(corpus, index, client):
    app = create_app(corpus, index=index, faults=FaultConfig(latency_ms=300))
    with serve_in_thread(app) as url:
        start = time.perf_counter()
        assert call(client, url, "calculator", {"expression": "1+1"}).json()["output"] == "2"
        assert time.perf_counter() - start >= 0.3


def test_fault_draws_follow_the_seed():
    config = FaultConfig(error_rate=0.2, drop_rate=0.1, slow_rate=0.3, seed=7)
    a = FaultInjector(config)
    b = FaultInjector(config)
    sequence = [a.draw() for _ in range(2000)]
    assert sequence == [b.draw() for _ in range(2000)]
    assert abs(sequence.count(Fault.ERROR) / 2000 - 0.2) < 0.03
    assert abs(sequence.count(None) / 2000 - 0.4) < 0.03
    with pytest.raises(ValueError, match="at most 1"):
        FaultConfig(error_rate=0.6, timeout_rate=0.6)


# --- grading -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("answer", "expected"),
    [("The change is 13.6%.", 1.0), ("about 14.0%", 0.78), ("0.136", 1.0), ("45%", 0.0)],
)
def test_grade_gives_numeric_partial_credit(client, base_url, answer, expected):
    body = {
        "sample": {"output_text": answer, "output_json": None, "output_tools": []},
        "item": {"id": "item_1", "reference_answer": "13.6%"},
        "trace_id": "trace_grade",
    }
    r = client.post(f"{base_url}/grade", json=body)
    assert r.status_code == 200
    assert r.json()["score"] == pytest.approx(expected, abs=0.05)


def test_grade_reference_without_number_is_422(client, base_url):
    body = {"sample": {"output_text": "12"}, "item": {"reference_answer": "n/a"}}
    r = client.post(f"{base_url}/grade", json=body)
    assert r.status_code == 422
    assert "reference_parse_error" in r.json()["errors"]
    assert client.post(f"{base_url}/grade", json={"sample": {}}).status_code == 422


# --- search index --------------------------------------------------------------------------


def test_index_cache_is_keyed_by_corpus_md5(corpus, index, tmp_path):
    again = SearchIndex.from_corpus(corpus, cache_dir=tmp_path)
    assert not again.from_cache
    cached = SearchIndex.from_corpus(corpus, cache_dir=tmp_path)
    assert cached.from_cache and cached.md5 == index.md5
    np.testing.assert_allclose(cached.embeddings, index.embeddings, atol=1e-5)
    in_memory = SearchIndex.from_pages(PAGES.items(), cache_dir=tmp_path)
    assert in_memory.from_cache and in_memory.md5 == index.md5
    changed = dict(PAGES) | {"reports/ACME/2019/page_1.txt": "changed"}
    assert SearchIndex.from_pages(changed.items(), cache_dir=tmp_path).md5 != index.md5
    norms = np.linalg.norm(index.embeddings, axis=1)
    np.testing.assert_allclose(norms, 1.0, atol=1e-5)
    assert index.embeddings.dtype == np.float32 and index.embeddings.shape == (len(PAGES), 384)


def test_search_prefers_the_company_and_year_the_query_names_and_shows_the_row(tmp_path) -> None:
    # Four pages that differ only in company and year: cosine alone can barely tell them apart.
    def page(ticker: str, year: int) -> str:
        return (f"{ticker} {year} annual report - consolidated statements of operations\n"
                f"The results of {ticker} are summarized below.\n\n(in $ millions) | {year} | {year - 1}\n"
                f"net revenue | {year - 1900} | {year - 1901}\ncost of revenue | 50 | 40\n")

    pages = [(f"reports/{t}/{y}/page_1.txt", page(t, y)) for t in ("ACME", "BRIX") for y in (2020, 2021)]
    index = SearchIndex.from_pages(pages, cache_dir=tmp_path)
    for ticker in ("ACME", "BRIX"):
        for year in (2020, 2021):
            hit = index.search(f"{ticker} {year} net revenue", top_k=1)[0]
            assert hit.path == f"reports/{ticker}/{year}/page_1.txt"
            assert hit.snippet.endswith(f"net revenue | {year - 1900} | {year - 1901}")
    # the boosts themselves: each directory name the query says, each row label it names,
    # each year of the table's columns it names, added to the cosine
    query = "ACME 2021 net revenue"
    cosine = dict(zip(index.paths, (index.embeddings @ index._queries.encode(query)).tolist(), strict=True))
    for hit in index.search(query, top_k=4):
        named = ("/ACME/" in hit.path) + ("/2021/" in hit.path)
        column = "/2021/" in hit.path  # the 2020 report's columns are 2020 and 2019
        expected = cosine[hit.path] + named * PATH_WORD_BOOST + ROW_LABEL_BOOST + column * COLUMN_YEAR_BOOST
        assert hit.score == pytest.approx(expected, abs=1e-5)


def test_search_prefers_the_page_whose_table_has_the_row_and_the_years_named(tmp_path) -> None:
    def page(year: int, topic: str, rows: list[str]) -> str:
        body = "\n".join(f"{row} | {10 + i} | {9 + i}" for i, row in enumerate(rows))
        return (f"ACME {year} annual report - {topic}\nACME's figures for {year} are shown below.\n\n"
                f"(in $ millions) | {year} | {year - 1}\n{body}\n")

    pages = [
        ("reports/ACME/2021/page_1.txt", page(2021, "balance sheet", ["cash", "inventories", "total assets"])),
        ("reports/ACME/2021/page_2.txt", page(2021, "balance sheet funding", ["accounts payable", "long-term debt"])),
        ("reports/ACME/2022/page_1.txt", page(2022, "balance sheet", ["cash", "inventories", "total assets"])),
        ("reports/ACME/2022/page_2.txt", page(2022, "balance sheet funding", ["accounts payable", "long-term debt"])),
    ]
    assert table_keys(pages[0][1]) == ({"cash", "inventories", "total assets"}, {"2021", "2020"})
    index = SearchIndex.from_pages(pages, cache_dir=tmp_path)
    # the row named, and of the two reports naming 2021 the one whose table covers both years
    query = "What was the change in ACME's long-term debt from 2021 to 2022?"
    top = index.search(query, top_k=1)[0]
    assert top.path == "reports/ACME/2022/page_2.txt"
    cosine = dict(zip(index.paths, (index.embeddings @ index._queries.encode(query)).tolist(), strict=True))
    for hit in index.search(query, top_k=4):
        label = "page_2" in hit.path
        years = 2 if "/2022/" in hit.path else 1  # the 2021 report's columns are 2021 and 2020
        expected = cosine[hit.path] + 2 * PATH_WORD_BOOST + label * ROW_LABEL_BOOST + years * COLUMN_YEAR_BOOST
        assert hit.score == pytest.approx(expected, abs=1e-5)
    assert top.snippet.endswith("long-term debt | 11 | 10")
    assert index.search("ACME 2021 inventories", top_k=1)[0].path == "reports/ACME/2021/page_1.txt"


# --- filing periods ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def periods_url(tmp_path_factory):
    """The pages above, declared as two filing periods: 2019, and 2020-2021."""
    root = tmp_path_factory.mktemp("periods") / "corpus"
    for rel, text in PAGES.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    (root / "periods.json").write_text(json.dumps({"periods": [[2019, 2019], [2020, 2021]]}))
    app = create_app(root, index_cache_dir=tmp_path_factory.mktemp("periods_cache"))
    with serve_in_thread(app) as url:
        yield url, root, app


def _paths(output: str) -> set[str]:
    return {line.split(" | ")[0] for line in output.splitlines()}


def test_an_items_year_scopes_every_tool_to_its_filing_period(client, periods_url):
    url, _, _ = periods_url
    early, late = {"id": "a", "year": 2019}, {"id": "b", "year": 2021}
    query = {"query": "net revenue annual report", "top_k": 10}
    assert {path.split("/")[2] for path in _paths(call(client, url, "search", query, item=early).json()["output"])} \
        == {"2019"}
    assert {path.split("/")[2] for path in _paths(call(client, url, "search", query, item=late).json()["output"])} \
        == {"2020", "2021"}
    # without a year (or outside every period) an item sees the whole corpus
    assert len(_paths(call(client, url, "search", query, item={"id": "c"}).json()["output"])) == 10
    assert call(client, url, "list", {"path": "reports/ACME"}, item=early).json()["output"] == "2019/"
    assert call(client, url, "list", {"path": "reports/ACME"}, item=late).json()["output"] == "2020/"
    assert call(client, url, "list", {"path": "reports/ACME"}, item={"id": "c"}).json()["output"] == "2019/\n2020/"
    hidden = call(client, url, "cat", {"path": "reports/ACME/2020/page_1.txt"}, item=early)
    assert hidden.status_code == 404 and "no such page" in hidden.json()["output"]
    assert call(client, url, "list", {"path": "reports/ACME/2019"}, item=late).status_code == 404
    assert "pandemic" in call(client, url, "cat", {"path": "reports/ACME/2020/page_1.txt"}, item=late).json()["output"]
    # the periods file is the server's, not a page
    assert "periods.json" not in call(client, url, "list", {"path": "."}, item={"id": "c"}).json()["output"]


def test_a_scoped_search_ranks_as_an_index_of_the_periods_pages_alone(periods_url, tmp_path):
    from envs.finqa.server import path_year

    _, root, _ = periods_url
    alone = tmp_path / "corpus"
    for rel, text in PAGES.items():
        if path_year(rel) == 2019:
            (alone / rel).parent.mkdir(parents=True, exist_ok=True)
            (alone / rel).write_text(text)
    whole = SearchIndex.from_corpus(root, cache_dir=tmp_path / "cache")
    assert "periods.json" not in whole.paths
    allowed = np.array([path_year(path) == 2019 for path in whole.paths])
    only = SearchIndex.from_corpus(alone, cache_dir=tmp_path / "cache")
    for query in ("net revenue", "share repurchase program", "capital expenditures wind"):
        assert [(h.path, round(h.score, 5)) for h in whole.search(query, 4, allowed)] == \
            [(h.path, round(h.score, 5)) for h in only.search(query, 4)]
