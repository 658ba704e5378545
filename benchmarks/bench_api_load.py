"""Load `agentrft api` holds: uploads, a burst of jobs, polling while a job trains, a burst
of chat completions, and a kill -9 of the server mid-job.

Measured on the real server processes, on loopback, with the micro preset of the pipeline
tests (tests/pipeline_world.py) and the taught model of benchmarks/taught_world.py:

1. upload: a 300 MB JSONL file to the API app alone (no Prefect needed to take files); the
   server process's resident memory before and at its peak (the server of issue 46 held
   such a file about six times over);
2. jobs: 20 jobs created at once on one registered model through `agentrft api` (its own
   Prefect server and deployment); each must be recorded with a flow run, none lost or
   half-made (they then run one at a time: the registered model's lock);
3. polling: 100 concurrent `jobs.retrieve` and `jobs.list_events` while the first job
   trains: their latency (p50, p95);
4. chat: 50 concurrent chat completions on a served model (`agentrft serve-model`'s app, 8
   slots and a queue of 16): answered or refused with 429, nothing else, and the memory;
5. restart: the API server killed (SIGKILL) while a job trains, started again: seconds
   until it answers and the job's status as it reads it back, then the job's end.

    python -m benchmarks.bench_api_load [--json out.json] [--upload-mb 300]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import psutil

from benchmarks.taught_world import REPO, taught_world

KEY = "sk-bench"


def _port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class Peak:
    """The peak resident memory of a process while the block runs."""

    def __init__(self, pid: int):
        self.process = psutil.Process(pid)
        self.before = self.peak = self.process.memory_info().rss
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def _watch(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.process.memory_info().rss)
            self._stop.wait(0.02)

    def __enter__(self) -> Peak:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()


def _wait(check: Any, timeout: float, what: str, process: subprocess.Popen | None = None) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"{what}: the server exited with {process.returncode}")
        try:
            value = check()
        except (httpx.HTTPError, openai.APIConnectionError):  # not answering yet
            value = None
        if value:
            return value
        time.sleep(0.5)
    raise RuntimeError(f"timed out waiting for {what}")


def upload_memory(tmp: Path, megabytes: int) -> dict[str, Any]:
    config = tmp / "files.yaml"
    config.write_text(json.dumps({"work_dir": str(tmp / "files-runs"), "model": {"base_model": "tiny"},
                                  "grader": {"type": "string_check", "name": "s", "input": "{{sample.output_text}}",
                                             "reference": "{{item.answer}}", "operation": "eq"},
                                  "mlflow": {"tracking_uri": f"sqlite:///{tmp / 'files.db'}"}}))
    script = tmp / "files_app.py"
    script.write_text(textwrap.dedent(f"""
        import sys, uvicorn
        from pathlib import Path
        from flows.openai_api.app import create_api_app
        from trainer.config.loading import load_config
        app = create_api_app(load_config({str(config)!r}), work_dir=Path({str(tmp / 'files-api')!r}))
        uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
    """))
    port = _port()
    server = subprocess.Popen([sys.executable, str(script), str(port)], cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        url = f"http://127.0.0.1:{port}"
        _wait(lambda: httpx.get(f"{url}/v1/files").status_code == 200, 120, "the files app", server)
        line = json.dumps({"messages": [{"role": "user", "content": "x" * 900}], "answer": "1"}).encode() + b"\n"
        path = tmp / "big.jsonl"
        with path.open("wb") as handle:
            for _ in range(megabytes * 1_000_000 // len(line)):
                handle.write(line)
        size = path.stat().st_size

        def body() -> Any:
            boundary = "agentrftbench"
            yield (f"--{boundary}\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nfine-tune\r\n"
                   f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"big.jsonl\"\r\n"
                   "Content-Type: application/jsonl\r\n\r\n").encode()
            with path.open("rb") as handle:
                while chunk := handle.read(1 << 20):
                    yield chunk
            yield f"\r\n--{boundary}--\r\n".encode()

        started = time.perf_counter()
        with Peak(server.pid) as peak:
            answer = httpx.post(f"{url}/v1/files", content=body(), timeout=600,
                                headers={"Content-Type": "multipart/form-data; boundary=agentrftbench"})
        seconds = time.perf_counter() - started
        assert answer.status_code == 200 and answer.json()["bytes"] == size, answer.text[:300]
        path.unlink()
        return {"file_mb": size / 1e6, "rss_before_mib": peak.before / 2**20, "rss_peak_mib": peak.peak / 2**20,
                "seconds": seconds}
    finally:
        server.terminate()
        server.wait(timeout=60)


def start_api(config_file: Path, port: int, prefect_url: str, env: dict[str, str]) -> subprocess.Popen:
    log = (config_file.parent / "api.log").open("a")  # its tail is printed when a step fails
    return subprocess.Popen([sys.executable, "-m", "flows.cli", "api", "--config", str(config_file), "--port", str(port),
                             "--api-key", KEY], cwd=REPO, env={**env, "PREFECT_API_URL": prefect_url},
                            stdout=log, stderr=subprocess.STDOUT)


def jobs_polling_restart(tmp: Path) -> dict[str, Any]:
    import yaml

    from benchmarks.bench_pipeline import pipeline_world
    from envs.finqa.local import local_tool_endpoints
    from tests.pipeline_world import micro
    from tests.taught_model import GRADER, OUTPUT_CHARS

    world = taught_world()
    root = pipeline_world(tmp / "world", world)
    env = {**os.environ, "PREFECT_HOME": str(tmp / "prefect-home"), "PYTHONPATH": str(REPO)}
    prefect_port, port = _port(), _port()
    prefect = subprocess.Popen([sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port",
                                str(prefect_port)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                               start_new_session=True)
    prefect_url = f"http://127.0.0.1:{prefect_port}/api"
    results: dict[str, Any] = {}
    with local_tool_endpoints(REPO / "data" / "corpus", max_output_chars=OUTPUT_CHARS) as endpoints:
        config = micro(root, endpoints, world.model, work_dir=str(tmp / "runs"))
        config_file = tmp / "api.yaml"
        config_file.write_text(yaml.safe_dump(config.model_dump(mode="json")))
        server = None
        try:
            _wait(lambda: httpx.get(f"{prefect_url}/health").status_code == 200, 300, "the Prefect server")
            server = start_api(config_file, port, prefect_url, env)
            client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY, max_retries=0)
            _wait(lambda: client.models.list() is not None, 600, "the API", server)
            files = {split: client.files.create(file=open(root / "data" / f"{split}.jsonl", "rb"),
                                                purpose="fine-tune").id for split in ("train", "validation", "test")}
            rft = {"grader": GRADER, "max_episode_steps": 3,
                   "tools": [{"name": e.name, "server_url": e.server_url} for e in endpoints],
                   "hyperparameters": {"batch_size": 2, "compute_multiplier": 0.5, "eval_interval": 3,
                                       "eval_samples": 2, "n_epochs": 3}}
            body = {"model": str(world.model), "training_file": files["train"], "validation_file": files["validation"],
                    "suffix": "bench", "metadata": {"test_file": files["test"]},
                    "method": {"type": "reinforcement", "reinforcement": rft}}

            async def create_all() -> list[tuple[float, int, dict]]:
                async with httpx.AsyncClient(timeout=120, headers={"Authorization": f"Bearer {KEY}"}) as http:
                    async def one() -> tuple[float, int, dict]:
                        started = time.perf_counter()
                        answer = await http.post(f"http://127.0.0.1:{port}/v1/fine_tuning/jobs", json=body)
                        return time.perf_counter() - started, answer.status_code, answer.json()
                    return await asyncio.gather(*(one() for _ in range(20)))

            created = asyncio.run(create_all())
            ids = [job["id"] for _, code, job in created if code == 200]
            queued = _wait(lambda: (lambda jobs: jobs if all(j.prefect_flow_run_ids for j in jobs) else None)(
                [client.fine_tuning.jobs.retrieve(i) for i in ids]), 300, "every job's flow run", server)
            statuses: dict[str, int] = {}
            for job in queued:
                statuses[job.status] = statuses.get(job.status, 0) + 1
            records = list((tmp / "runs" / "api" / "jobs").glob("ftjob-*.json"))
            results["jobs"] = {"requested": 20, "accepted": len(ids), "recorded": len(records),
                               "with_flow_run": sum(1 for j in queued if j.prefect_flow_run_ids),
                               "create_p50_s": _percentile([c[0] for c in created], 0.5),
                               "create_p95_s": _percentile([c[0] for c in created], 0.95), "statuses": statuses}
            first = ids[0]
            _wait(lambda: client.fine_tuning.jobs.retrieve(first).status == "running", 600, "the first job", server)

            async def poll_all() -> list[float]:
                async with httpx.AsyncClient(timeout=120, headers={"Authorization": f"Bearer {KEY}"}) as http:
                    async def one(index: int) -> float:
                        started = time.perf_counter()
                        path = f"/v1/fine_tuning/jobs/{first}" + ("/events" if index % 2 else "")
                        answer = await http.get(f"http://127.0.0.1:{port}{path}")
                        assert answer.status_code == 200, answer.text[:200]
                        return time.perf_counter() - started
                    return await asyncio.gather(*(one(i) for i in range(100)))

            latencies = asyncio.run(poll_all())
            results["polling"] = {"requests": 100, "p50_s": statistics.median(latencies),
                                  "p95_s": _percentile(latencies, 0.95), "max_s": max(latencies)}
            # kill -9 mid-job, then start it again
            for job in ids[1:]:  # the rest would run for an hour one after another
                client.fine_tuning.jobs.cancel(job)
            os.kill(server.pid, signal.SIGKILL)
            server.wait()
            started = time.perf_counter()
            server = start_api(config_file, port, prefect_url, env)
            _wait(lambda: client.models.list() is not None, 600, "the restarted API", server)
            answering = time.perf_counter() - started
            read_back = client.fine_tuning.jobs.retrieve(first).status
            done = _wait(lambda: (lambda j: j if j.status in ("succeeded", "failed", "cancelled") else None)(
                client.fine_tuning.jobs.retrieve(first)), 1800, "the job's end", server)
            results["restart"] = {"answering_s": answering, "status_read_back": read_back, "final_status": done.status,
                                  "error": done.error.message if done.error else None}
        finally:
            if server is not None:
                server.terminate()
                server.wait(timeout=120)
            os.killpg(prefect.pid, signal.SIGTERM)
            prefect.wait(timeout=60)
    return results


def chat_burst(tmp: Path) -> dict[str, Any]:
    script = tmp / "serve.py"
    model = REPO / "envs" / "finqa" / "model"
    script.write_text(textwrap.dedent(f"""
        import sys, uvicorn
        from trainer.generation.policy import load_policy
        from trainer.serving.model_server import create_model_app
        policy = load_policy({str(model)!r}, device="cpu", dtype="float32")
        app = create_model_app(policy, model_name="demo", max_slots=8, max_len=1024, max_queue=16)
        uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
    """))
    port = _port()
    server = subprocess.Popen([sys.executable, str(script), str(port)], cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        url = f"http://127.0.0.1:{port}"
        _wait(lambda: httpx.get(f"{url}/v1/models").status_code == 200, 300, "serve-model", server)

        async def burst() -> list[tuple[int, float]]:
            async with httpx.AsyncClient(timeout=600) as http:
                async def one() -> tuple[int, float]:
                    started = time.perf_counter()
                    answer = await http.post(f"{url}/v1/chat/completions", json={
                        "messages": [{"role": "user", "content": "What was ACME's net revenue in 2019?"}],
                        "max_tokens": 64})
                    return answer.status_code, time.perf_counter() - started
                return await asyncio.gather(*(one() for _ in range(50)))

        with Peak(server.pid) as peak:
            answers = asyncio.run(burst())
        codes: dict[str, int] = {}
        for code, _ in answers:
            codes[str(code)] = codes.get(str(code), 0) + 1
        served = [seconds for code, seconds in answers if code == 200]
        return {"requests": 50, "codes": codes, "served_p95_s": _percentile(served, 0.95) if served else None,
                "rss_before_mib": peak.before / 2**20, "rss_peak_mib": peak.peak / 2**20, "alive": server.poll() is None}
    finally:
        server.terminate()
        server.wait(timeout=60)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--upload-mb", type=int, default=300)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench_api_") as tmp_dir:
        tmp = Path(tmp_dir)
        try:
            result = {"upload": upload_memory(tmp, args.upload_mb), "chat": chat_burst(tmp),
                      **jobs_polling_restart(tmp)}
        except Exception:
            log = tmp / "api.log"
            if log.is_file():
                print("the API server's log, last lines:\n" + "\n".join(log.read_text().splitlines()[-60:]),
                      file=sys.stderr)
            raise
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
