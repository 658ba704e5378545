"""A job the API accepts carries its python graders' fence in its own config: the training
stage on another work pool (`training.deployment`), whose workers do not share the API's
environment, refuses to run them unfenced all the same."""

from __future__ import annotations

import json
import sys
import time

import openai
import pytest

from tests.flows.test_api_safety import KEY, REPO, _app
from tests.kernel_features import SUPPORTED, python_without
from trainer.graders import grade
from trainer.graders.python_grader import FENCE_ENV

PYTHON = {"type": "python", "name": "p", "source": "def grade(sample, item):\n    return 1.0\n"}


@pytest.mark.skipif(not SUPPORTED, reason="the kernel features are taken away on x86_64 Linux")
@pytest.mark.parametrize("allow_unfenced", [False, True])
def test_a_jobs_config_carries_the_fence_to_any_worker(tmp_path, monkeypatch, allow_unfenced):
    from envs.tool_server import serve_in_thread

    monkeypatch.delenv(FENCE_ENV, raising=False)
    app = _app(tmp_path, allow_unfenced_python_graders=allow_unfenced)
    # Rows no rollout can start from: the job is made (its record and parameters written), then
    # fails its file validation, so no flow run is started.
    rows = b"".join(json.dumps({"messages": [], "reference_answer": "1"}).encode() + b"\n" for _ in range(2))
    with serve_in_thread(app) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
        train = client.files.create(file=("t.jsonl", rows), purpose="fine-tune").id
        multi = {"type": "multi", "graders": {"p": PYTHON}, "calculate_output": "p"}
        job = client.fine_tuning.jobs.create(model=str(REPO / "envs" / "finqa" / "model"), training_file=train,
                                             validation_file=train,
                                             method={"type": "reinforcement", "reinforcement": {"grader": multi}})
        deadline = time.monotonic() + 30
        while client.fine_tuning.jobs.retrieve(job.id).status != "failed" and time.monotonic() < deadline:
            time.sleep(0.1)
    record = json.loads((tmp_path / "api" / "jobs" / f"{job.id}.json").read_text())
    # What the pipeline deployment, and through it the training deployment, is given
    grader = record["parameters"]["config"]["grader"]
    assert grader["graders"]["p"].get("fence") == (None if allow_unfenced else "required")
    assert record["method"]["reinforcement"]["grader"] == multi  # the job as it was sent, unchanged
    # A worker on a kernel without Landlock, with none of the API's environment
    monkeypatch.setattr(sys, "executable", str(python_without(tmp_path, "landlock")))
    result = grade(grader, {"output_text": "x"}, {})
    if allow_unfenced:
        assert result.reward == 1.0
    else:
        assert result.reward is None and "fence: required" in json.dumps(result.errors)
