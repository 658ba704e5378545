"""Starting `agentrft api`: the Prefect server it runs jobs on (`PREFECT_API_URL`, or one on
loopback), the pipeline deployment served in a child process, and uvicorn for the app.

What outlives a crash: job records, uploads and the MLflow store are files; a job's state is
read back from Prefect. The deployment server writes its log to a file and its pid beside
it (`<work_dir>/api/deployment.pid`), so when the API server is killed (kill -9) the flow
runs it was running go on, and the restarted API server finds it still serving and reads
its jobs back instead of starting a second one. A Prefect server it started and that still
answers on its port is taken up the same way.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections import deque
from pathlib import Path

from flows.openai_api.app import create_api_app
from flows.openai_api.jobs import PIPELINE_DEPLOYMENT_NAME
from trainer.config.pipeline import PipelineConfig
from trainer.errors import AgentRFTError
from trainer.graders.python_grader import FENCE_ENV

ROOT = Path(__file__).resolve().parents[2]


def _tail(lines: deque) -> str:
    return "\n".join(lines) or "(no output)"


def _log_tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) or "(no output)"
    except OSError:
        return "(no output)"


def _pump(process: subprocess.Popen, tail: deque) -> None:
    import threading

    def read() -> None:
        for line in process.stderr:
            tail.append(line.rstrip())
            print(line, end="", file=sys.stderr)

    threading.Thread(target=read, daemon=True).start()


def _answers(url: str) -> bool:
    import httpx

    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _start_prefect_server(port: int) -> tuple[subprocess.Popen, str]:
    """A Prefect server on loopback (with its SQLite database in the user's Prefect home)."""
    url = f"http://127.0.0.1:{port}/api"
    process = subprocess.Popen([sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1",
                                "--port", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    tail: deque = deque(maxlen=20)
    _pump(process, tail)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AgentRFTError(f"the Prefect server exited with status {process.returncode}:\n{_tail(tail)}")
        if _answers(url):
            return process, url
        time.sleep(1)
    process.terminate()
    raise AgentRFTError(f"the Prefect server did not answer on {url} within 180 s:\n{_tail(tail)}")


def _serving(pid_file: Path) -> int | None:
    """The pid of a deployment server a previous API server left running, else None."""
    try:
        pid = int(pid_file.read_text())
        command = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except (OSError, ValueError):
        return None
    return pid if b"flows.cli" in command and b"serve" in command else None


def _serve_deployment(config_path: Path, overrides: list[str], env: dict[str, str], work_dir: Path) -> int:
    """`agentrft serve` as a child: the pipeline deployment, ready to run jobs; its pid. One a
    previous API server left running is taken up as it is."""
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    pid_file, log = work_dir / "deployment.pid", work_dir / "deployment.log"
    running = _serving(pid_file)
    if running is not None:
        print(f"the pipeline deployment is still served by process {running}: taken up", file=sys.stderr)
        return running
    # In this process's folder, as `agentrft serve` would be: the config's relative paths mean
    # the same to the jobs' runs as to this server. Its log is a file, so it may outlive us.
    env = {**env, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))}
    work_dir.mkdir(parents=True, exist_ok=True)
    with log.open("ab") as output:
        process = subprocess.Popen([sys.executable, "-m", "flows.cli", "serve", "--config", str(config_path),
                                    *(f"--set={o}" for o in overrides)], env=env, stdout=subprocess.DEVNULL,
                                   stderr=output, start_new_session=True)
    pid_file.write_text(str(process.pid))
    deadline = time.monotonic() + 300
    with get_client(sync_client=True) as client:
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise AgentRFTError(f"serving the pipeline deployment failed (status {process.returncode}); "
                                    f"{log}:\n{_log_tail(log)}")
            try:
                client.read_deployment_by_name(PIPELINE_DEPLOYMENT_NAME)
                return process.pid
            except ObjectNotFound:
                time.sleep(1)
    process.terminate()
    raise AgentRFTError(f"the pipeline deployment did not appear within 300 s; {log}:\n{_log_tail(log)}")


def _stop(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGTERM)
        for _ in range(300):
            os.kill(pid, 0)
            time.sleep(0.1)
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        os.waitpid(pid, os.WNOHANG)  # our own child: reap it
    except ChildProcessError:
        pass


def serve_api(config_path: Path, overrides: list[str], config: PipelineConfig, *, host: str, port: int,
              api_key: str | None, prefect_port: int) -> None:
    """Serve the API until interrupted, with the deployment (and a Prefect server unless
    PREFECT_API_URL names one)."""
    import uvicorn
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from tasks.tracking import mlflow_client, resolve_tracking_uri

    tracking_uri = resolve_tracking_uri(config.mlflow.tracking_uri)
    # The store's schema is made here, once: made by this server's first read while a job's
    # flow run makes it too, SQLite migrations collide.
    mlflow_client(tracking_uri)
    # uvicorn re-raises SIGTERM after its shutdown with the handler it found: make that one
    # an exit, so the `finally` below still stops the children.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    work_dir = Path(config.work_dir).resolve() / "api"
    prefect_server, deployment = None, None
    try:
        url = PREFECT_API_URL.value()
        if not url:
            url = f"http://127.0.0.1:{prefect_port}/api"
            if _answers(url):
                print(f"a Prefect server already answers on {url}: taken up", file=sys.stderr)
            else:
                prefect_server, url = _start_prefect_server(prefect_port)
            print(f"Prefect server (UI): {url.removesuffix('/api')}", file=sys.stderr)
        os.environ["PREFECT_API_URL"] = url  # threads that do not copy the context read it from here
        # Graders of jobs arrive over the network: a python grader runs fenced or not at all.
        fence = "best_effort" if config.api.allow_unfenced_python_graders else "required"
        with temporary_settings({PREFECT_API_URL: url}):
            deployment = _serve_deployment(config_path, overrides,
                                           {**os.environ, "PREFECT_API_URL": url, FENCE_ENV: fence}, work_dir)
            config = config.model_copy(update={"mlflow": config.mlflow.model_copy(
                update={"tracking_uri": tracking_uri})})
            app = create_api_app(config, work_dir=work_dir, api_key=api_key)
            print(f"fine-tuning API: http://{host}:{port}/v1 (jobs run the deployment "
                  f"{PIPELINE_DEPLOYMENT_NAME} on {url})", file=sys.stderr)
            uvicorn.run(app, host=host, port=port, log_level="warning")
    finally:
        if deployment is not None:
            _stop(deployment)
            (work_dir / "deployment.pid").unlink(missing_ok=True)
        if prefect_server is not None:
            prefect_server.terminate()
            try:
                prefect_server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                prefect_server.kill()
