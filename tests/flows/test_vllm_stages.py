"""A pipeline stage on a vLLM server the stage launches, under the pipeline's real load.

The baseline stage (Prefect's test harness, MLflow, the real tool server) evaluates the
taught model on a launched vLLM server with 64 seeded rollouts at once, while the
pipeline's own services hold their memory: the server is sized to the machine and takes
seeded requests at that concurrency (vLLM's CPU build cannot when it prefills prompts in
chunks). Its gate is set to fail, so the run stops after the baseline.
"""

from __future__ import annotations

import pytest

from tasks.tracking import mlflow_client
from tests.pipeline_world import micro
from tests.vllm_env import VLLM_MARKS, VLLM_PYTHON

pytestmark = VLLM_MARKS


def test_the_baseline_stage_runs_64_seeded_rollouts_at_once_on_a_launched_server(
        harness, world, endpoints, taught_model, monkeypatch):
    from flows.pipeline import agent_rft_pipeline, pipeline_parameters

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # one process: half the start-up
    store = {"tracking_uri": f"sqlite:///{world / 'vllm-stages.db'}", "experiment": "micro-vllm"}
    config = micro(
        world, endpoints, taught_model, mlflow=store,
        rollout={"max_concurrent_rollouts": 64, "backend": "vllm", "vllm": {
            "launch": True, "python": str(VLLM_PYTHON),
            # no prefix cache: the 64 prompts are then prefilled whole, as a real dataset's
            # distinct prompts are, and overflow one step's token budget (vLLM's CPU default
            # is 2048), which is where chunked prefill used to kill the engine
            "extra_args": ["--dtype", "float32", "--enforce-eager", "--distributed-executor-backend=uni",
                           "--no-enable-prefix-caching"]}},
        # 2 validation items x 32: 64 rollouts in flight; a gate no model passes ends the run there
        baseline={"k": 32, "min_nonzero_share": 0.0, "min_headroom": 1.0},
    )
    state = agent_rft_pipeline(**pipeline_parameters(config), return_state=True)
    assert state.is_failed()
    with pytest.raises(Exception, match="baseline gate failed"):
        state.result()
    client = mlflow_client(store["tracking_uri"])
    experiment = client.get_experiment_by_name("micro-vllm").experiment_id
    [baseline] = client.search_runs([experiment], filter_string="attributes.run_name = 'baseline'")
    metrics = baseline.data.metrics
    assert metrics["baseline/rollouts"] == 64 and metrics["baseline/infra_error_rate"] == 0
    assert metrics["baseline/grader_error_rate"] == 0
