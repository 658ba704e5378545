"""Benchmark of the FinQA tool server: search latency, throughput under open-loop load,
the largest request rate it sustains with p99 under 200 ms, and a soak through the real
tool client.

  python benchmarks/bench_tool_server.py --duration 60 --json bench_tool_server.json
  python benchmarks/bench_tool_server.py --soak-only --soak-seconds 600

(a) Search latency p50/p95 on the demo corpus (`data/corpus`, else generated) and on a
    synthetic 100,000-page corpus, measured in-process through `SearchIndex` and over
    HTTP. Embedding 100,000 pages takes minutes on two CPU cores: it uses a short
    `max_seq_length` and is cached by corpus md5, and its build time is printed apart.
(b) Throughput and p50/p95/p99 at a fixed rate (default 50 requests/s) for `--duration`
    seconds, open loop: requests leave on schedule whether or not earlier ones came back,
    and latency counts from the scheduled send time, so a stalled server cannot hide its
    queue (no coordinated omission). The mix is 40% search, 40% cat, 20% list.
(c) Rates 50, 100, 200, 400, ... for `--max-rate-step-s` seconds each, up to the first
    one whose p99 is 200 ms or more (or that has errors); the last one that held is
    reported (0 when the first step already failed).
(d) Soak: `--soak-seconds` (default 600) at `--soak-rate` (default 50, what OpenAI asks
    tool servers to take) through the project's `ToolClient` with the pipeline's default
    tool settings, open loop as in (b). It counts what the client's retries would hide:
    attempts that failed with `ReadError` / `RemoteProtocolError` (a pooled keep-alive
    connection the server had just closed), stale-connection resends, and every other
    failed attempt, next to p50/p95/p99 of whole calls, retries included.

The server runs as its own uvicorn process, so the load generator does not share its GIL;
on a 2-core machine they still share the cores, which the figures include.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import numpy as np

from envs.finqa.search import DEFAULT_CACHE_DIR, SearchIndex, corpus_pages
from envs.finqa.tool_schemas import TOOL_NAMES, TOOL_SCHEMAS
from trainer.config.tools import ToolEndpoint, ToolsConfig
from trainer.errors import InfraError
from trainer.rollout.tool_client import ToolClient

REPO = Path(__file__).resolve().parents[1]

MIX = (("search", 0.4), ("cat", 0.4), ("list", 0.2))
P99_TARGET_MS = 200.0
# Failed attempts that mean "a connection closed under the request" (the keep-alive race).
CONNECTION_DROPS = ("ReadError", "RemoteProtocolError", "WriteError")
# The server's own process: the load generator must not share its GIL.
SERVE = """
import json, sys
from pathlib import Path
from envs.finqa.faults import FaultConfig
from envs.finqa.server import serve
o = json.loads(sys.argv[1])
serve(Path(o["corpus"]), port=o["port"], log_level="warning", access_log=False,
      index_cache_dir=Path(o["cache_dir"]), max_seq_length=o["max_seq_length"],
      faults=FaultConfig(latency_ms=o["latency_ms"]) if o["latency_ms"] else None)
"""
SECTIONS = (
    ("consolidated statements of operations", ("net revenue", "cost of revenue",
                                               "gross profit", "operating income")),
    ("consolidated balance sheets - assets", ("cash and equivalents", "receivables",
                                              "inventories", "total assets")),
    ("consolidated balance sheets - liabilities", ("accounts payable", "long-term debt",
                                                   "total liabilities", "equity")),
    ("cash flows", ("operating cash flow", "capital expenditures", "dividends paid",
                    "share repurchases")),
    ("segment results", ("segment revenue", "segment margin", "headcount", "backlog")),
)


def percentiles(values_ms: list[float]) -> dict[str, float]:
    if not values_ms:
        return {"p50": float("nan"), "p95": float("nan"), "p99": float("nan")}
    p50, p95, p99 = np.percentile(values_ms, [50, 95, 99])
    return {"p50": round(float(p50), 2), "p95": round(float(p95), 2), "p99": round(float(p99), 2)}


# --- corpora -------------------------------------------------------------------------------


def demo_corpus() -> tuple[Path, list[str]]:
    """The demo corpus and its validation questions: data/, regenerated from its seed and
    checked against data.dvc when a fresh clone lacks it."""
    from envs.finqa.demo import DEMO_CONFIG, ensure_data
    from trainer.config.loading import load_config

    config = load_config(DEMO_CONFIG)
    ensure_data(config)
    data = Path(config.data.train_file).parent
    questions = [json.loads(line)["question"] for line in (data / "validation.jsonl").open()]
    return data / "corpus", questions


def synthetic_pages(n_pages: int, seed: int = 0) -> Iterator[tuple[str, str]]:
    """`n_pages` report pages in the demo's shape (title, sentence, a small table), made
    from templates: one page per section and company-year, 10 years a company."""
    rng = random.Random(seed)
    letters = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
    tickers: list[str] = []
    seen: set[str] = set()
    while len(tickers) * 10 * len(SECTIONS) < n_pages:
        ticker = "".join(rng.choice(letters) for _ in range(rng.randint(3, 5)))
        if ticker not in seen:
            seen.add(ticker)
            tickers.append(ticker)
    n = 0
    for ticker in tickers:
        for year in range(2013, 2023):
            for page, (section, rows) in enumerate(SECTIONS, start=1):
                if n == n_pages:
                    return
                table = "\n".join(
                    f"{row} | {rng.randint(10, 5000)} | {rng.randint(10, 5000)}" for row in rows
                )
                text = (
                    f"{ticker} {year} annual report - {section}\n"
                    f"This section presents {ticker}'s {section} for {year}.\n\n"
                    f"(in $ millions) | {year} | {year - 1}\n{table}\n\n"
                    f"All amounts are in millions of US dollars.\n"
                )
                yield f"reports/{ticker}/{year}/page_{page}.txt", text
                n += 1


def write_pages(root: Path, pages: list[tuple[str, str]]) -> None:
    for path, text in pages:
        file = root / path
        file.parent.mkdir(parents=True, exist_ok=True)
        file.write_text(text)


def synthetic_questions(pages: list[tuple[str, str]], n: int, seed: int = 1):
    """(question, gold page) pairs asking for a row of a random synthetic page."""
    rng = random.Random(seed)
    out = []
    for path, text in rng.sample(pages, n):
        ticker, year = path.split("/")[1:3]
        row = rng.choice(text.splitlines()[4:8]).split(" | ")[0]
        out.append((f"What was {ticker}'s {row} in {year}?", path))
    return out


# --- in-process and HTTP search latency -------------------------------------------------------


def index_latency(index: SearchIndex, queries: list[str]) -> dict:
    index.search(queries[0], 5)  # warm-up
    times = []
    for query in queries:
        start = time.perf_counter()
        index.search(query, 5)
        times.append((time.perf_counter() - start) * 1000)
    return percentiles(times)


def wire(name: str, arguments: dict, n: int) -> dict:
    return {
        "type": "function_call",
        "id": f"fc_{n}",
        "call_id": f"call_{n}",
        "name": name,
        "arguments": json.dumps(arguments),
        "item": {"id": "bench"},
        "trace_id": f"trace_bench_{n // 5}",  # five calls a rollout
    }


def http_search_latency(base_url: str, queries: list[str]) -> dict:
    times = []
    with httpx.Client(timeout=30) as client:
        client.post(f"{base_url}/tools/search", json=wire("search", {"query": queries[0]}, 0))
        for n, query in enumerate(queries):
            start = time.perf_counter()
            r = client.post(f"{base_url}/tools/search", json=wire("search", {"query": query}, n))
            r.raise_for_status()
            times.append((time.perf_counter() - start) * 1000)
    return percentiles(times)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def server_process(
    corpus: Path, cache_dir: Path, max_seq_length: int, latency_ms: float
) -> Iterator[str]:
    """A uvicorn tool server in its own process; yields its base URL once /health answers."""
    port = free_port()
    options = {"corpus": str(corpus), "port": port, "cache_dir": str(cache_dir),
               "max_seq_length": max_seq_length, "latency_ms": latency_ms}
    command = [sys.executable, "-c", SERVE, json.dumps(options)]
    env = os.environ | {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.Popen(command, cwd=REPO, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 1800
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"tool server exited with {proc.returncode}")
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("tool server did not become healthy")
            time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# --- open-loop load --------------------------------------------------------------------------


def request_mix(corpus: Path, queries: list[str], n: int, seed: int = 0) -> list[tuple[str, dict]]:
    rng = random.Random(seed)
    pages = [path for path, _ in corpus_pages(corpus)]
    dirs = sorted({path.rsplit("/", 1)[0] for path in pages} | {"reports"})
    names = [name for name, _ in MIX]
    weights = [weight for _, weight in MIX]
    calls = []
    for name in rng.choices(names, weights, k=n):
        match name:
            case "search":
                calls.append((name, {"query": rng.choice(queries), "top_k": 5}))
            case "cat":
                calls.append((name, {"path": rng.choice(pages)}))
            case "list":
                calls.append((name, {"path": rng.choice(dirs)}))
    return calls


async def open_loop(base_url: str, calls: list[tuple[str, dict]], rate: float) -> dict:
    """Send `calls` at `rate` per second on schedule; latency from the scheduled time."""
    latencies: list[float] = []
    errors: dict[str, int] = {}
    limits = httpx.Limits(max_connections=512, max_keepalive_connections=512)
    async with httpx.AsyncClient(timeout=10, limits=limits) as client:

        async def one(n: int, name: str, arguments: dict, scheduled: float) -> None:
            try:
                r = await client.post(f"{base_url}/tools/{name}", json=wire(name, arguments, n))
                if r.status_code != 200:
                    errors[str(r.status_code)] = errors.get(str(r.status_code), 0) + 1
                    return
            except httpx.HTTPError as exc:
                errors[type(exc).__name__] = errors.get(type(exc).__name__, 0) + 1
                return
            latencies.append((time.perf_counter() - scheduled) * 1000)

        start = time.perf_counter()
        tasks = []
        for n, (name, arguments) in enumerate(calls):
            scheduled = start + n / rate
            delay = scheduled - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(n, name, arguments, scheduled)))
        await asyncio.gather(*tasks)
        elapsed = time.perf_counter() - start
    return {
        "rate": rate,
        "sent": len(calls),
        "ok": len(latencies),
        "errors": sum(errors.values()),
        "error_kinds": errors,
        "throughput_rps": round(len(latencies) / elapsed, 1),
        **percentiles(latencies),
    }


def max_sustained_rate(
    base_url: str, corpus: Path, queries: list[str], step_s: float, max_rate: int
) -> tuple[list[dict], int]:
    steps, best, rate = [], 0, 50
    while rate <= max_rate:
        calls = request_mix(corpus, queries, int(rate * step_s), seed=rate)
        result = asyncio.run(open_loop(base_url, calls, rate))
        result["holds"] = result["p99"] < P99_TARGET_MS and result["errors"] == 0
        steps.append(result)
        print(f"  step {rate:>5} req/s: p99 {result['p99']:.1f} ms, errors {result['errors']}, "
              f"{'holds' if result['holds'] else 'fails'}", flush=True)
        if not result["holds"]:
            break
        best = rate
        rate *= 2
    return steps, best


# --- soak through the tool client -------------------------------------------------------------


async def soak(base_url: str, calls: list[tuple[str, dict]], rate: float) -> dict:
    """Send `calls` at `rate` per second through a ToolClient, open loop; what its retries hid."""
    endpoints = [ToolEndpoint(name=name, server_url=f"{base_url}/tools/{name}") for name in TOOL_NAMES]
    latencies: list[float] = []
    infra_errors: dict[str, int] = {}
    model_errors = 0
    async with ToolClient.from_config(ToolsConfig(endpoints=endpoints, schemas=TOOL_SCHEMAS)) as client:

        async def one(n: int, name: str, arguments: dict, scheduled: float) -> None:
            nonlocal model_errors
            try:
                result = await client.call(name, json.dumps(arguments), item={"id": "bench"},
                                           trace_id=f"trace_soak_{n // 5}")
            except InfraError as exc:
                kind = str(exc).rsplit("last: ", 1)[-1].split(":", 1)[0]
                infra_errors[kind] = infra_errors.get(kind, 0) + 1
                return
            model_errors += result.error is not None
            latencies.append((time.perf_counter() - scheduled) * 1000)

        start = time.perf_counter()
        tasks = []
        for n, (name, arguments) in enumerate(calls):
            scheduled = start + n / rate
            delay = scheduled - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(n, name, arguments, scheduled)))
            if n % int(rate * 60) == 0 and n:
                print(f"  {n / rate:.0f} s: {n} sent, {sum(client.stats.failed_attempts.values())} failed "
                      f"attempts, {client.stats.stale_connection_resends} stale-connection resends", flush=True)
        await asyncio.gather(*tasks)
        elapsed = time.perf_counter() - start
        stats = client.stats
    return {
        "rate": rate,
        "seconds": round(elapsed, 1),
        "sent": len(calls),
        "ok": len(latencies),
        "infra_errors": sum(infra_errors.values()),
        "infra_error_kinds": infra_errors,
        "model_errors": model_errors,
        "requests": stats.requests,
        "connection_drop_retries": sum(stats.failed_attempts[kind] for kind in CONNECTION_DROPS),
        "stale_connection_resends": stats.stale_connection_resends,
        "failed_attempts": dict(stats.failed_attempts),
        "throughput_rps": round(len(latencies) / elapsed, 1),
        **percentiles(latencies),
    }


def run_soak(url: str, corpus: Path, queries: list[str], args: argparse.Namespace) -> dict:
    print(f"(d) soak through the tool client at {args.soak_rate:g} req/s for {args.soak_seconds:g} s",
          flush=True)
    calls = request_mix(corpus, queries, int(args.soak_rate * args.soak_seconds), seed=7)
    # The server loads its query encoder at the first search: not part of a steady state.
    httpx.post(f"{url}/tools/search", json=wire("search", {"query": queries[0]}, 0), timeout=300)
    return asyncio.run(soak(url, calls, args.soak_rate))


# --- main --------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=60, help="seconds of the fixed-rate run")
    parser.add_argument("--rate", type=float, default=50, help="requests/s of the fixed-rate run")
    parser.add_argument("--max-rate-step-s", type=float, default=10, help="seconds per rate step")
    parser.add_argument("--max-rate", type=int, default=3200, help="highest rate step tried")
    parser.add_argument("--big-pages", type=int, default=100_000, help="pages of the big corpus")
    parser.add_argument("--big-max-seq-length", type=int, default=32,
                        help="tokens embedded per page of the big corpus")
    parser.add_argument("--max-seq-length", type=int, default=128,
                        help="tokens embedded per page of the demo corpus (the server default)")
    parser.add_argument("--queries", type=int, default=200, help="queries per latency run")
    parser.add_argument("--server-latency-ms", type=float, default=0,
                        help="fixed latency the server adds to every tool call")
    parser.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE_DIR.expanduser())
    parser.add_argument("--big-corpus-dir", type=Path, default=None,
                        help="keep the synthetic big corpus here and reuse it (default: a temporary one)")
    parser.add_argument("--soak-seconds", type=float, default=600,
                        help="seconds of the soak through the tool client (0 skips it)")
    parser.add_argument("--soak-rate", type=float, default=50, help="requests/s of the soak")
    parser.add_argument("--soak-only", action="store_true", help="run only the soak (d)")
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    args = parser.parse_args(argv)

    # other work on the machine shares its cores: the load average says how much
    results: dict = {"cpus": os.cpu_count(), "loadavg_start": os.getloadavg()[0],
                     "mix": dict(MIX), "search": {}}
    with tempfile.TemporaryDirectory(prefix="bench_tool_server_") as tmp_dir:
        tmp = Path(tmp_dir)
        corpus, questions = demo_corpus()
        queries = (questions * (args.queries // max(len(questions), 1) + 1))[: args.queries]

        if args.soak_only:
            with server_process(corpus, args.cache_dir, args.max_seq_length, args.server_latency_ms) as url:
                results["soak"] = run_soak(url, corpus, queries, args)
            results["loadavg_end"] = os.getloadavg()[0]
            print_soak(results)
            return write_json(results, args.json)

        print(f"(a) search latency: demo corpus {corpus}", flush=True)
        index = SearchIndex.from_corpus(
            corpus, cache_dir=args.cache_dir, max_seq_length=args.max_seq_length
        )
        demo = {"pages": len(index), "build_s": round(index.build_s, 2),
                "from_cache": index.from_cache, "max_seq_length": args.max_seq_length,
                "index": index_latency(index, queries)}
        del index
        with server_process(corpus, args.cache_dir, args.max_seq_length,
                            args.server_latency_ms) as url:
            demo["http"] = http_search_latency(url, queries)
            results["search"]["demo"] = demo

            print(f"(b) open loop at {args.rate:g} req/s for {args.duration:g} s", flush=True)
            calls = request_mix(corpus, queries, int(args.rate * args.duration))
            results["fixed_rate"] = asyncio.run(open_loop(url, calls, args.rate))
            results["fixed_rate"]["duration_s"] = args.duration

            print(f"(c) rate steps of {args.max_rate_step_s:g} s, target p99 < "
                  f"{P99_TARGET_MS:g} ms", flush=True)
            steps, best = max_sustained_rate(
                url, corpus, queries, args.max_rate_step_s, args.max_rate
            )
            results["rate_steps"] = steps
            results["max_rate_p99_under_200ms"] = best
            if args.soak_seconds > 0:
                results["soak"] = run_soak(url, corpus, queries, args)

        print(f"(a) search latency: synthetic {args.big_pages}-page corpus", flush=True)
        pages = list(synthetic_pages(args.big_pages))
        # Writing (and deleting) 100,000 files takes minutes on a busy machine: a kept
        # corpus is written once, its hidden `.complete` marker (not a page) saying that every page is there.
        big_root = args.big_corpus_dir or tmp / "big_corpus"
        start = time.perf_counter()
        if not (big_root / ".complete").is_file():
            write_pages(big_root, pages)
            if args.big_corpus_dir:
                (big_root / ".complete").write_text(f"{len(pages)}\n")
        write_s = time.perf_counter() - start
        print(f"  wrote {len(pages)} pages in {write_s:.1f} s; building the index "
              f"(max_seq_length {args.big_max_seq_length}; cached after the first run)",
              flush=True)
        big_index = SearchIndex.from_corpus(
            big_root, cache_dir=args.cache_dir, max_seq_length=args.big_max_seq_length
        )
        asked = synthetic_questions(pages, args.queries)
        big_queries = [question for question, _ in asked]
        recall = np.mean([
            gold in {hit.path for hit in big_index.search(question, 5)}
            for question, gold in asked
        ])
        big = {"pages": len(big_index), "build_s": round(big_index.build_s, 2),
               "from_cache": big_index.from_cache, "max_seq_length": args.big_max_seq_length,
               "write_pages_s": round(write_s, 2), "recall_at_5": round(float(recall), 3),
               "index": index_latency(big_index, big_queries)}
        del big_index
        with server_process(big_root, args.cache_dir, args.big_max_seq_length,
                            args.server_latency_ms) as url:
            big["http"] = http_search_latency(url, big_queries)
        results["search"]["big"] = big

    results["loadavg_end"] = os.getloadavg()[0]
    print_table(results)
    print_soak(results)
    return write_json(results, args.json)


def write_json(results: dict, path: Path | None) -> dict:
    if path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(results, indent=2) + "\n")
        print(f"wrote {path}")
    return results


def print_table(results: dict) -> None:
    print(f"\nFinQA tool server benchmark ({results['cpus']} CPUs, load average "
          f"{results['loadavg_start']:.1f} at start, {results['loadavg_end']:.1f} at end)")
    print("\n(a) search latency, ms        pages  build_s  cached     p50     p95")
    for name, s in results["search"].items():
        for via in ("index", "http"):
            print(f"    {name:<6} via {via:<14} {s['pages']:>7} {s['build_s']:>8} "
                  f"{'yes' if s['from_cache'] else 'no':>7} {s[via]['p50']:>7} {s[via]['p95']:>7}")
    if "recall_at_5" in results["search"].get("big", {}):
        print(f"    big corpus recall@5 of the synthetic questions: "
              f"{results['search']['big']['recall_at_5']}")
    print("\n(b)/(c) open loop      rate  sent    ok  errors  thr/s     p50     p95     p99")
    rows = [("fixed", results["fixed_rate"])] + [("step", s) for s in results["rate_steps"]]
    for label, r in rows:
        print(f"    {label:<14} {r['rate']:>8g} {r['sent']:>5} {r['ok']:>5} {r['errors']:>7} "
              f"{r['throughput_rps']:>6} {r['p50']:>7} {r['p95']:>7} {r['p99']:>7}")
    best = results["max_rate_p99_under_200ms"]
    print(f"\n    largest rate with p99 < {P99_TARGET_MS:g} ms and no errors: "
          f"{f'{best} req/s' if best else 'none (the first step failed)'}")


def print_soak(results: dict) -> None:
    r = results.get("soak")
    if r is None:
        return
    print(f"\n(d) soak through ToolClient ({results['cpus']} CPUs, load average {results['loadavg_start']:.1f} at "
          f"start, {results['loadavg_end']:.1f} at end)")
    print(f"    {r['sent']} calls at {r['rate']:g}/s in {r['seconds']} s: {r['ok']} answered, "
          f"{r['infra_errors']} infra errors, {r['model_errors']} model-fault (4xx) answers")
    print(f"    ReadError/RemoteProtocolError retries: {r['connection_drop_retries']}; stale-connection "
          f"resends: {r['stale_connection_resends']}; all failed attempts: {r['failed_attempts'] or 'none'}")
    print(f"    latency of whole calls, ms: p50 {r['p50']}, p95 {r['p95']}, p99 {r['p99']}")


if __name__ == "__main__":
    main()
