"""`cluster.autoscale` with Ray's own autoscaler (the fake multi-node provider: tests/cluster/autoscaling_cluster.py).

The head has room for the learner and one generator. With `cluster.autoscale.grow_cluster`, the run asks for a
second generator although no CPU is free; the pending generator makes Ray's autoscaler add a node, and the
generator runs there. `exgrpo scale --max-generators 1` then lowers the running job's bound: the driver removes
that generator, the node is left idle, and the autoscaler removes it. Everything follows the run's metrics and the
cluster's node list, never the clock; SIGTERM ends the run with balanced accounting."""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import tempfile

import pytest

from tests.cluster.autoscaling_cluster import AutoscalingCluster
from tests.cluster.runs import (
    ROOT, accounting, assert_balanced, history, mlflow_client, or_exited, read_log, state, train_process, wait_for,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster():
    temp = tempfile.mkdtemp(prefix="exgrpo-ray-", dir="/tmp")
    c = AutoscalingCluster(temp, head_cpus=2, worker_cpus=1, max_workers=1, idle_timeout_s=5)
    try:
        yield c
    finally:
        c.stop()
        shutil.rmtree(temp, ignore_errors=True)


def test_pending_generators_make_ray_add_a_node_and_the_idle_node_is_removed_after_a_scale_down(cluster, tmp_path):
    assert len(cluster.nodes()) == 1
    client, name = mlflow_client(tmp_path), "grow"

    def last(key: str) -> float | None:
        rid = state(tmp_path / name).get("mlflow_run_id")
        h = history(client, rid, key) if rid else []
        return h[-1][1] if h else None

    with train_process(tmp_path, name, f"cluster.address={cluster.address}", "total_steps=100000",
                       "generator.num_generators=1", "generator.engine.kind=transformers",
                       "checkpoint.every_steps=0", "tracking.log_plots=false",
                       "cluster.autoscale.enabled=true", "cluster.autoscale.grow_cluster=true",
                       "cluster.autoscale.min_generators=1", "cluster.autoscale.max_generators=2",
                       "cluster.autoscale.cooldown_steps=1", "cluster.autoscale.learner_wait_fraction_up=0",
                       "cluster.autoscale.generator_wait_fraction_down=1") as p:
        alive = or_exited(p)
        wait_for(alive(lambda: last("driver/generators") == 2), 600, "a second generator, on a node Ray added")
        assert p.poll() is None, read_log(tmp_path, name)
        assert last("cluster/nodes") == 2 and len(cluster.nodes()) == 2
        assert "autoscale: generators 1 -> 2" in read_log(tmp_path, name)

        bad = subprocess.run([sys.executable, "-m", "cluster.cli", "scale", "--run", name, "--min-generators", "3",
                              "--runs-root", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert bad.returncode == 2 and "min_generators 3 would exceed max_generators 2" in bad.stderr, bad.stderr
        out = subprocess.run([sys.executable, "-m", "cluster.cli", "scale", "--run", name, "--max-generators", "1",
                              "--runs-root", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0 and "max_generators=1" in out.stdout, out.stdout + out.stderr
        wait_for(alive(lambda: last("driver/generators") == 1), 600, "back to one generator")
        wait_for(alive(lambda: last("cluster/nodes") == 1), 600, "Ray removing the idle node")
        assert p.poll() is None, read_log(tmp_path, name)
        assert len(cluster.nodes()) == 1
        p.send_signal(signal.SIGTERM)
        assert p.wait(300) == 0, read_log(tmp_path, name)
    log = read_log(tmp_path, name)
    assert "autoscale: generators 2 -> 1" in log and "autoscale bounds set to {'max_generators': 1}" in log
    run = client.get_run(state(tmp_path / name)["mlflow_run_id"])
    assert_balanced(accounting(run.data.metrics))
    nodes = [v for _, v in history(client, run.info.run_id, "cluster/nodes")]
    assert nodes[0] == 1 and 2 in nodes and nodes[-1] == 1, nodes


def test_the_bounds_of_a_run_that_is_not_running_are_refused(tmp_path):
    out = subprocess.run([sys.executable, "-m", "cluster.cli", "scale", "--run", "nope", "--runs-root", str(tmp_path)],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "needs --generators N, or --min-generators/--max-generators" in out.stderr

