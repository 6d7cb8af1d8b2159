"""`exgrpo train` with each policy loss other than ppo_clip (every other end-to-end run trains ppo_clip): two steps
each, on the transformers engine, replay from the first step (buffer.mixed_switch_accuracy=0), the loss's metrics
in MLflow. One run also takes GRPO's seq_mean_token_mean aggregation and the loss on replayed rows. Issue 46's
smoke test; `exgrpo experiment losses` compares them (docs/results.md). The runs join the module's Ray cluster
(test_cluster_nodes' fixture): one Ray start for the three. Each also checks what a run that joins a cluster made by
Ray's cluster utils must do (it finishes, no scheduling cancelled, the accounting balances)."""

from __future__ import annotations

import math

import pytest

from tests.cluster.runs import accounting, assert_balanced, history, mlflow_client, run_train, state
from tests.cluster.test_cluster_nodes import _env, nodes, runs_root  # noqa: F401 (module fixtures: one cluster here)

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("loss, extra", [
    ("gspo", ("generator.num_generators=2",)),
    ("cispo", ("learner.loss.loss_agg=seq_mean_token_mean", "learner.loss.replay_loss=policy_loss")),
    ("sapo", ()),
])
def test_two_steps_train_with_each_policy_loss(nodes, runs_root, loss, extra):
    r = run_train(runs_root, loss, f"cluster.address={nodes.address}", f"learner.loss.policy_loss={loss}", *extra,
                  "total_steps=2", "checkpoint.every_steps=0", "generator.engine.kind=transformers",
                  "buffer.mixed_switch_accuracy=0", "buffer.collect_before_mixed=true", "tracking.log_plots=false",
                  timeout_s=600, env=_env())
    assert r.returncode == 0, r.stdout[-4000:]
    assert "step 2/2" in r.stdout
    client = mlflow_client(runs_root)
    run_id = state(runs_root / loss)["mlflow_run_id"]
    # each run joins a cluster made by Ray's cluster utils (not `ray start`) as a user's shell does: no RAY_AUTH_MODE
    # chosen, a token in ~/.ray (Ray made one): the run asks the cluster (gspo's with 2 generators)
    assert "SchedulingCancelled" not in r.stdout and "Traceback" not in r.stdout, ("joining", r.stdout[-4000:])
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED", "joining"
    assert_balanced(accounting(run.data.metrics))
    assert client.get_run(run_id).data.params["learner.loss.policy_loss.kind"] == loss
    for key in ("learner/clip_frac", "learner/fresh_ratio_mean", "learner/loss"):
        values = [v for _, v in history(client, run_id, key)]
        assert len(values) == 2 and all(math.isfinite(v) for v in values), (key, values)
    assert all(0 <= v <= 1 for _, v in history(client, run_id, "learner/clip_frac"))
    assert [v for _, v in history(client, run_id, "learner/updates")] == [1.0, 1.0]
