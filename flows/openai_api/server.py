"""Starting `agentrft api`: the Prefect server it runs jobs on (`PREFECT_API_URL`, or one on
loopback), the pipeline deployment served in a child process, and uvicorn for the app.

The children (the Prefect server it starts, the deployment runner, and what they start:
flow runs, trainers, vLLM servers) run under guards (trainer/lifeline.py), so they die with
this process whatever kills it, SIGKILL and the OOM killer included: nothing runs jobs with
no API in front of it, and nothing holds the ports afterwards.

Stopping (SIGTERM, SIGINT): uvicorn stops taking requests (at most 1 s for the ones in
flight); every queued or running job is paused as the pause route pauses it (its flow run
cancelled, an event saying the server stopped); then the runner and the Prefect server are
signalled together and killed with their trees past a 2 s grace. It exits within 5 s.

Starting: the ports are checked first (a holder is named with its pid). Then what the last
server left is taken up from the job records (files) and Prefect: a job the stop paused is
resumed; a job whose flow run was left Pending or Running (the server was killed: no
runner is left) has that run marked Crashed and is resumed; a job killed while its files
were validated is validated again. A resumed job is a new run of the deployment, from the
cached stages and the training's last checkpoint (as the resume route does), and its events
say so.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections import deque
from pathlib import Path
from typing import Any

import trainer.lifeline as lifeline
from flows.openai_api.app import create_api_app
from flows.openai_api.jobs import PIPELINE_DEPLOYMENT_NAME, add_event
from flows.openai_api.runs import release_model_lock, start_flow_run
from flows.openai_api.service import outbound_policy
from trainer.config.pipeline import PipelineConfig
from trainer.errors import AgentRFTError
from trainer.graders.python_grader import FENCE_ENV

ROOT = Path(__file__).resolve().parents[2]
GRACE_S = 2.0  # a child's time between SIGTERM and SIGKILL (its whole tree)
PORT_WAIT_S = 5.0  # how long a port a dying predecessor holds is waited for


def _tail(lines: deque) -> str:
    return "\n".join(lines) or "(no output)"


def _log_tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) or "(no output)"
    except OSError:
        return "(no output)"


def _pump(process: subprocess.Popen, tail: deque) -> None:
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


def _bindable(host: str, port: int) -> bool:
    """Whether a listening socket could be bound at host:port now (as uvicorn binds it)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror:
        return True  # uvicorn names a bad host itself
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(address)
        except OSError:
            return False
    return True


def _holder(port: int) -> str:
    """The process that listens on `port`, in words."""
    import psutil

    try:
        connections = psutil.net_connections(kind="inet")
    except psutil.Error:
        connections = []
    for connection in connections:
        if connection.status == psutil.CONN_LISTEN and connection.laddr and connection.laddr.port == port:
            if connection.pid is None:
                return "a process this user cannot see"
            try:
                return f"process {connection.pid} ({' '.join(psutil.Process(connection.pid).cmdline())[:200]})"
            except psutil.Error:
                return f"process {connection.pid}"
    return "another process"


def _claim_port(host: str, port: int, what: str, remedy: str) -> None:
    """Return once host:port is free; a predecessor's tree being killed is waited for a few
    seconds, anything else holding it is an error naming it."""
    deadline = time.monotonic() + PORT_WAIT_S
    while not _bindable(host, port):
        if time.monotonic() >= deadline:
            raise AgentRFTError(f"port {port} ({what}) is held by {_holder(port)}; {remedy}")
        time.sleep(0.2)


def _start_prefect_server(port: int) -> tuple[subprocess.Popen, str]:
    """A Prefect server on loopback (with its SQLite database in the user's Prefect home),
    under a guard."""
    url = f"http://127.0.0.1:{port}/api"
    process = lifeline.start([sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1",
                              "--port", str(port)], grace=GRACE_S, stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True)
    tail: deque = deque(maxlen=20)
    _pump(process, tail)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AgentRFTError(f"the Prefect server exited with status {process.returncode}:\n{_tail(tail)}")
        if _answers(url):
            return process, url
        time.sleep(1)
    lifeline.stop(process)
    raise AgentRFTError(f"the Prefect server did not answer on {url} within 180 s:\n{_tail(tail)}")


def _serve_deployment(config_path: Path, overrides: list[str], env: dict[str, str],
                      work_dir: Path) -> subprocess.Popen:
    """`agentrft serve` as a child under a guard: the pipeline deployment, ready to run jobs."""
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    # In this process's folder, as `agentrft serve` would be: the config's relative paths mean
    # the same to the jobs' runs as to this server.
    env = {**env, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))}
    work_dir.mkdir(parents=True, exist_ok=True)
    (work_dir / "deployment.pid").unlink(missing_ok=True)  # an older server's take-up file
    log = work_dir / "deployment.log"
    with log.open("ab") as output:
        process = lifeline.start([sys.executable, "-m", "flows.cli", "serve", "--config", str(config_path),
                                  *(f"--set={o}" for o in overrides)], grace=GRACE_S, env=env,
                                 stdout=subprocess.DEVNULL, stderr=output)
    deadline = time.monotonic() + 300
    with get_client(sync_client=True) as client:
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise AgentRFTError(f"serving the pipeline deployment failed (status {process.returncode}); "
                                    f"{log}:\n{_log_tail(log)}")
            try:
                client.read_deployment_by_name(PIPELINE_DEPLOYMENT_NAME)
                return process
            except ObjectNotFound:
                time.sleep(1)
    lifeline.stop(process)
    raise AgentRFTError(f"the pipeline deployment did not appear within 300 s; {log}:\n{_log_tail(log)}")


def pause_in_flight(api: Any) -> list[str]:
    """Every queued or running job paused as the pause route pauses it, its flow run
    cancelled at once (the runner and the runs go next), and marked to resume at the next
    start; the ids paused."""
    from prefect.client.orchestration import get_client
    from prefect.states import Cancelled

    paused = []
    # A request still running may hold the lock; records are replaced whole either way.
    locked = api.jobs.lock.acquire(timeout=1)
    try:
        with get_client(sync_client=True) as client:
            for record in api.jobs.list():
                if record["error"] or record["paused"] or record["cancelled"] or not record["flow_run_ids"]:
                    continue
                run_id = record["flow_run_ids"][-1]
                run = client.read_flow_run(uuid.UUID(run_id))
                if run.state is None or run.state.is_final():
                    continue
                client.set_flow_run_state(run.id, Cancelled(message="paused: the API server stopped"), force=True)
                record["paused"], record["resume_on_start"] = True, True
                add_event(record, f"Job paused: the API server stopped; its flow run {run_id} is cancelled, and the "
                                  "job resumes from the finished stages and the last training checkpoint when the "
                                  "server starts again")
                api.jobs.save(record)
                paused.append(record["id"])
    finally:
        if locked:
            api.jobs.lock.release()
    return paused


def take_up(api: Any) -> list[str]:
    """What the last server left, taken up (see the module's docstring); the ids resumed."""
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound
    from prefect.states import Cancelled, Crashed

    to_resume = []
    with api.jobs.lock, get_client(sync_client=True) as client:
        # First every run left behind is marked, so that no model lock seems held by one.
        for record in reversed(api.jobs.list()):  # oldest first
            if record["error"]:
                continue
            if not record["flow_run_ids"]:
                if not record["cancelled"]:
                    add_event(record, "The API server stopped while the job's files were validated: validating "
                                      "them again")
                    api.jobs.save(record)
                    config = PipelineConfig.model_validate(record["parameters"]["config"])
                    api.validating.submit(api._validate_and_queue, record["id"], config)
                continue
            run_id = record["flow_run_ids"][-1]
            try:
                run = client.read_flow_run(uuid.UUID(run_id))
            except ObjectNotFound:
                continue
            if run.state is not None and not run.state.is_final() and not run.state.is_scheduled():
                if record["paused"] or record["cancelled"]:
                    client.set_flow_run_state(run.id, Cancelled(
                        message=f"{'paused' if record['paused'] else 'cancelled'}; the API server that ran it was "
                                "killed"), force=True)
                else:
                    # Recorded first: should this start fail before the resume below, the next resumes it.
                    record["paused"], record["resume_on_start"] = True, True
                    add_event(record, f"The API server was killed while the job ran: its flow run {run_id} was left "
                                      f"{run.state.name} with no runner; marked Crashed", level="warn")
                    api.jobs.save(record)
                    client.set_flow_run_state(run.id, Crashed(
                        message="the API server that ran it was killed: no runner is left"), force=True)
            if record.get("resume_on_start") and record["paused"] and not record["cancelled"]:
                to_resume.append(record["id"])
        for job_id in to_resume:
            record = api.jobs.get(job_id)
            if release_model_lock(record):
                add_event(record, "Released the registered model's lock that the stopped run held")
            record["flow_run_ids"].append(start_flow_run(record))
            record["paused"] = False
            record.pop("resume_on_start", None)
            add_event(record, f"Job resumed as the API server started again (Prefect flow run "
                              f"{record['flow_run_ids'][-1]}): from the finished stages and the last training "
                              "checkpoint")
            api.jobs.save(record)
    return to_resume


def _stop(children: list[subprocess.Popen]) -> None:
    """SIGTERM to every guard first, then each waited for: their graces overlap."""
    for child in children:
        if child.poll() is None:
            child.send_signal(signal.SIGTERM)
    for child in children:
        lifeline.stop(child, timeout=GRACE_S + 2)


def serve_api(config_path: Path, overrides: list[str], config: PipelineConfig, *, host: str, port: int,
              api_key: str | None, prefect_port: int) -> None:
    """Serve the API until interrupted, with the deployment (and a Prefect server unless
    PREFECT_API_URL names one)."""
    import uvicorn
    from prefect.context import refresh_global_settings_context
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from tasks.tracking import mlflow_client, resolve_tracking_uri

    # uvicorn re-raises SIGTERM and SIGINT after its shutdown with the handlers it found: make
    # those an exit, so the `finally` below stops the children (before uvicorn runs too).
    stopped_by: list[int] = []

    def on_stop(signum: int, _frame: Any) -> None:
        stopped_by.append(signum)
        sys.exit(0)

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, on_stop)
    url = PREFECT_API_URL.value()
    _claim_port(host, port, "the fine-tuning API", "stop it, or give --port another one")
    if not url:
        _claim_port("127.0.0.1", prefect_port, "the Prefect server this API starts",
                    f"stop it, give --prefect-port another one, or run the jobs on a Prefect server that "
                    f"already runs there with PREFECT_API_URL=http://127.0.0.1:{prefect_port}/api")
    tracking_uri = resolve_tracking_uri(config.mlflow.tracking_uri)
    # The store's schema is made here, once: made by this server's first read while a job's
    # flow run makes it too, SQLite migrations collide.
    mlflow_client(tracking_uri)
    work_dir = Path(config.work_dir).resolve() / "api"
    children: list[subprocess.Popen] = []
    api = None
    try:
        if not url:
            prefect_server, url = _start_prefect_server(prefect_port)
            children.append(prefect_server)
            print(f"Prefect server (UI): {url.removesuffix('/api')}", file=sys.stderr)
        # The process's own setting from here on: a thread that does not copy the context (the
        # files' validation starts the jobs' runs) would otherwise start an ephemeral Prefect
        # server of its own, a child no guard holds.
        os.environ["PREFECT_API_URL"] = url
        refresh_global_settings_context()
        # Graders of jobs arrive over the network: a python grader runs fenced or not at all.
        fence = "best_effort" if config.api.allow_unfenced_python_graders else "required"
        with temporary_settings({PREFECT_API_URL: url}):
            children.insert(0, _serve_deployment(config_path, overrides,
                                                 {**os.environ, "PREFECT_API_URL": url, FENCE_ENV: fence}, work_dir))
            config = config.model_copy(update={"mlflow": config.mlflow.model_copy(
                update={"tracking_uri": tracking_uri})})
            app = create_api_app(config, work_dir=work_dir, api_key=api_key)
            api = app.state.api
            resumed = take_up(api)
            if resumed:
                print(f"resumed {len(resumed)} job(s) the last server left: {', '.join(resumed)}", file=sys.stderr)
            policy = outbound_policy(config)
            print("outbound: --allow-any-host: jobs' tools and graders may call ANY host this machine reaches"
                  if policy is None else f"outbound: jobs' tools and graders may call only {policy.shown()} "
                  "(api.allowed_hosts; --allow-any-host opens it)", file=sys.stderr)
            print(f"fine-tuning API: http://{host}:{port}/v1 (jobs run the deployment "
                  f"{PIPELINE_DEPLOYMENT_NAME} on {url})", file=sys.stderr)
            uvicorn.run(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=1)
    finally:
        for signum in (signal.SIGTERM, signal.SIGINT):  # a second signal must not cut the stop short
            signal.signal(signum, signal.SIG_IGN)
        started = time.monotonic()
        if api is not None:
            try:
                with temporary_settings({PREFECT_API_URL: url}):
                    paused = pause_in_flight(api)
                if paused:
                    print(f"paused {len(paused)} job(s) in flight, resumed at the next start: {', '.join(paused)}",
                          file=sys.stderr)
            except Exception as exc:  # the next start marks them instead
                print(f"could not pause the jobs in flight ({exc}); the next start marks and resumes them",
                      file=sys.stderr)
        _stop(children)
        print(f"stopped in {time.monotonic() - started:.1f} s", file=sys.stderr)
        if stopped_by:
            # Stopped by a signal, with everything it started stopped: the interpreter's teardown
            # of its modules (3 to 4 s measured here, in C, after the last atexit handler) is
            # skipped, so the stop holds to its 5 s.
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)
