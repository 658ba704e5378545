"""The Prefect UI in a real browser: headless Chromium (Debian's `chromium`) driven by
Playwright opens the served pipeline deployment, starts a custom run from the parameter
form, and the flow run completes.

Prefect's test harness serves no UI, so this test starts `prefect server start` (UI on) on
a free loopback port with its own SQLite home, serves the deployments against it with
`agentrft serve`, and clicks through the UI as a user would.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

from tests.pipeline_world import micro

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait(predicate, timeout: float, what: str, every: float = 1.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture(scope="module")
def prefect_server(tmp_path_factory: pytest.TempPathFactory):
    home = tmp_path_factory.mktemp("prefect-home")
    port = _free_port()
    api = f"http://127.0.0.1:{port}/api"
    env = {**os.environ, "PREFECT_HOME": str(home), "PREFECT_API_URL": api, "PREFECT_UI_ENABLED": "true",
           "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    server = subprocess.Popen([sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1",
                               "--port", str(port)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

    def healthy() -> bool:
        assert server.poll() is None, server.stderr.read().decode()[-2000:]
        try:
            return httpx.get(f"{api}/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        _wait(healthy, 180, "the Prefect server")
        yield f"http://127.0.0.1:{port}", api, env
    finally:
        server.terminate()
        server.wait(timeout=60)


@pytest.mark.skipif(CHROMIUM is None and not os.environ.get("CI"), reason="chromium is not installed (.ci/run installs Debian's chromium)")
def test_custom_run_from_the_ui_form_completes(prefect_server, world, endpoints, taught_model):
    from playwright.sync_api import expect, sync_playwright

    ui, api, env = prefect_server
    # Results stored where the other pipeline tests keep theirs: the stages are served from cache.
    env = {**env, "PREFECT_LOCAL_STORAGE_PATH": str(world / "prefect-results")}
    config_file = world / "browser.yaml"
    config = micro(world, endpoints, taught_model, name="browser")
    config_file.write_text(yaml.safe_dump(config.model_dump(mode="json")))
    served = subprocess.Popen([sys.executable, "-m", "flows.cli", "serve", "--config", str(config_file)],
                              cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        def deployment():
            assert served.poll() is None, served.stderr.read().decode()[-2000:]
            answer = httpx.get(f"{api}/deployments/name/agent-rft-pipeline/scheduled", timeout=5)
            return answer.json() if answer.status_code == 200 else None

        dep = _wait(deployment, 180, "the served deployment")
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
            page = browser.new_page()
            try:
                page.goto(f"{ui}/deployments/deployment/{dep['id']}", wait_until="networkidle")
                page.get_by_role("button", name="Run", exact=True).click()
                page.get_by_text("Custom run", exact=True).click()
                expect(page).to_have_url(re.compile(r"/deployment/[0-9a-f-]+/run(\?|$)"), timeout=60_000)  # client-side routing
                # The form shows the config's fields with their descriptions; this custom run
                # renames the job (the config's first field).
                expect(page.get_by_text("Job name.", exact=True)).to_be_visible(timeout=60_000)
                name = page.locator("xpath=(//*[normalize-space(text())='Name (Optional)'])[1]/following::textarea[1]")
                expect(name).to_have_value("browser")
                name.fill("browser-from-ui")
                page.get_by_role("button", name="Submit", exact=True).click()
                # Back on the deployment's page, the new run is listed.
                expect(page.get_by_text("1 Flow run")).to_be_visible(timeout=60_000)
            except Exception:
                page.screenshot(path=str(world / "browser-failure.png"), full_page=True)
                raise
            finally:
                browser.close()

        def finished():
            # The cron also schedules future runs: ours is the one the form renamed.
            runs = httpx.post(f"{api}/flow_runs/filter", timeout=5,
                              json={"deployments": {"id": {"any_": [dep["id"]]}}}).json()
            ours = [r for r in runs if r["parameters"]["config"].get("name") == "browser-from-ui"]
            assert len(ours) <= 1, ours
            done = ("COMPLETED", "FAILED", "CRASHED", "CANCELLED")
            return ours[0] if ours and ours[0]["state"]["type"] in done else None

        run = _wait(finished, 900, "the flow run", every=3)
        assert run["state"]["type"] == "COMPLETED", run["state"]
        assert run["deployment_id"] == dep["id"]
        assert run["parameters"]["config"]["name"] == "browser-from-ui"
        assert run["parameters"]["config"]["model"]["base_model"] == str(taught_model)  # the rest as served
    finally:
        served.terminate()
        served.wait(timeout=60)
