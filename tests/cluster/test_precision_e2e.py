"""`exgrpo train` on the path a GPU run takes, on CPU: bfloat16 end to end (FSDP2 mixed precision in the
learner, the transformers engine in bfloat16, train/inference mismatch metrics in MLflow, a bfloat16
model folder in the checkpoint) with the collective weight sync (gloo here: the driver builds both ends
from the config, generators pull every version over their channels), and every mismatch correction at once
(TIS, IcePop, sequence-level MIS) with overlong filtering. One run: about 2 minutes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.cluster.runs import history, mlflow_client, run_train, state

pytestmark = pytest.mark.slow


def test_bfloat16_run_with_collective_weight_sync_end_to_end(tmp_path):
    r = run_train(tmp_path, "bf16", "model.dtype=bfloat16", "total_steps=3", "generator.engine.kind=transformers",
                  "learner.tis_cap=2", "learner.icepop_band=[0.25,4]", "learner.mis=truncate", "learner.mis_cap=4",
                  "learner.overlong=mask", "learner.weight_sync.kind=collective", timeout_s=600)
    assert r.returncode == 0, r.stdout[-4000:]
    assert "step 3/3" in r.stdout
    run_dir = tmp_path / "bf16"
    model = Path(state(run_dir)["checkpoints"][-1]) / "learner" / "model"
    assert json.loads((model / "config.json").read_text())["dtype"] == "bfloat16"
    client = mlflow_client(tmp_path)
    run_id = state(run_dir)["mlflow_run_id"]
    assert client.get_run(run_id).data.params["generator.dtype"] == "bfloat16"  # resolved from model.dtype
    # every step measures the gap on its first mini-batch; both sides compute in bfloat16 but with
    # different kernels (FSDP full forward vs the engine's cached decoding), so it is small, not 0
    gaps = [v for _, v in history(client, run_id, "learner/logprob_diff_mean")]
    assert len(gaps) == 3 and all(0 < g < 0.5 for g in gaps), gaps
    assert all(0.5 < v <= 2.0 for _, v in history(client, run_id, "learner/tis_weight_mean"))
    # IcePop, MIS and overlong filtering on the same start-of-step log-probs: measured every step
    assert all(0 <= v < 0.5 for _, v in history(client, run_id, "learner/icepop_masked_frac"))
    assert all(0 < v <= 4.0 for _, v in history(client, run_id, "learner/mis_weight_mean"))
    assert len(history(client, run_id, "learner/overlong_masked")) == 3
    assert client.get_run(run_id).data.params["learner.weight_sync.kind"] == "collective"
    assert len(history(client, run_id, "driver/weight_publish_s")) == 3
