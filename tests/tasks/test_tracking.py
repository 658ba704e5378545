"""MLflow's fluent API inside a process that has used another experiment before."""

from __future__ import annotations

from pathlib import Path

import mlflow
import pytest

from tasks.tracking import fluent_run, mlflow_client, use_mlflow_store


def test_a_run_of_another_experiment_than_the_active_one_is_logged_to(tmp_path: Path) -> None:
    """`mlflow.set_experiment` is process-wide (a scorer or an earlier job sets it), and
    `mlflow.start_run(run_id=...)` refuses a run of another experiment: the pipeline's own
    runs are logged to all the same."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    use_mlflow_store(uri)
    client = mlflow_client(uri)
    mlflow.set_experiment("someone-else")
    run_id = client.create_run(client.create_experiment("pipeline")).info.run_id
    with pytest.raises(mlflow.exceptions.MlflowException, match="active experiment ID does not match"):
        with mlflow.start_run(run_id=run_id):  # what the helper avoids
            pass
    with fluent_run(run_id):
        mlflow.log_param("logged", "yes")
    assert client.get_run(run_id).data.params == {"logged": "yes"}
