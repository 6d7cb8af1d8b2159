"""`exgrpo train` with the collective weight sync (gloo on CPU): the driver builds both ends from the
config, generators pull every version over their channels, the run finishes (slow: about 2 minutes)."""

from __future__ import annotations

import pytest

from tests.cluster.runs import history, mlflow_client, run_train, state

pytestmark = pytest.mark.slow


def test_collective_weight_sync_run_end_to_end(tmp_path):
    r = run_train(tmp_path, "coll", "learner.weight_sync.kind=collective", "total_steps=4", timeout_s=600)
    assert r.returncode == 0, r.stdout[-4000:]
    assert "step 4/4" in r.stdout
    client = mlflow_client(tmp_path)
    run_id = state(tmp_path / "coll")["mlflow_run_id"]
    assert client.get_run(run_id).data.params["learner.weight_sync.kind"] == "collective"
    assert len(history(client, run_id, "driver/weight_publish_s")) == 4
