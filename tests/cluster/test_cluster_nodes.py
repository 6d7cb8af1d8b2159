"""`exgrpo train` on a multi-node Ray cluster made with Ray's own test utility (`ray.cluster_utils.Cluster`,
run in a process of its own: tests/cluster/cluster_nodes.py), as a user joins a cluster with `cluster.address`:

- a run joins a cluster that was not started by `ray start` (no token authentication) and trains (asserted by the
  runs of tests/cluster/test_losses_e2e.py, which join this module's cluster);
- a process in token mode is told at once that the cluster runs without it (Ray itself would cancel every actor
  it creates: the cluster cannot call back into a driver that demands a token);
- a worker node lost mid-run (its raylet and workers killed) is reported, the run trains on with what is left,
  and when a new node joins, the lost generators run again there;
- generators pinned to a node group (`generator.node_labels`) wait, reported, while no node of the group exists,
  though the head has room, and run once one joins.
The faults follow the run's checkpoints and log lines, never the clock.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import shutil
import tempfile
from pathlib import Path

import pytest

from tests.cluster.runs import (
    ROOT, ClusterHelper, accounting, assert_balanced, mlflow_client, or_exited, read_log, state, train_cmd, train_process,
    wait_for,
)

pytestmark = pytest.mark.slow

HEAD_CPUS = 3  # the learner rank (1 CPU) and 2 generators; a 4-generator run needs a worker node for the rest


class Nodes(ClusterHelper):
    """The cluster helper process: `add(cpus)` a worker node, `remove()` the newest one (a node loss)."""

    def __init__(self, temp_dir: str):
        env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
        super().__init__("tests.cluster.cluster_nodes", str(HEAD_CPUS), temp_dir, env=env)

    def add(self, cpus: int, labels: dict[str, str] | None = None) -> str:
        return self._ask(f"add {cpus}" + (f" {json.dumps(labels)}" if labels else ""), "added")

    def remove(self) -> str:
        return self._ask("remove", "removed")


@pytest.fixture(scope="module")
def nodes():
    temp = tempfile.mkdtemp(prefix="exgrpo-ray-", dir="/tmp")
    n = Nodes(temp)
    try:
        yield n
    finally:
        n.close()
        shutil.rmtree(temp, ignore_errors=True)


@pytest.fixture(scope="module")
def runs_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("runs")


def _env(**kv: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    return dict(env, PYTHONUNBUFFERED="1", **kv)


def test_token_mode_against_a_cluster_without_authentication_says_what_to_change(nodes, runs_root):
    r = subprocess.run(train_cmd(runs_root, "token", f"cluster.address={nodes.address}"), cwd=ROOT,
                       env=_env(RAY_AUTH_MODE="token"), capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "runs without token authentication" in r.stderr and "unset RAY_AUTH_MODE" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
    assert not (runs_root / "token").exists()  # refused before anything was created


def _checkpointed(run_dir: Path) -> int:
    return max((int(Path(c).name.removeprefix("step-")) for c in state(run_dir).get("checkpoints", [])), default=0)


def test_a_lost_worker_node_is_reported_and_its_generators_run_again_on_a_node_that_joins(nodes, runs_root):
    name = "nodeloss"
    nodes.add(2)
    run_dir = runs_root / name
    with train_process(runs_root, name, f"cluster.address={nodes.address}", "total_steps=100000",
                       "generator.num_generators=4", "generator.engine.kind=transformers",
                       "checkpoint.every_steps=10", "checkpoint.keep_last=3", "cluster.stall_report_s=5",
                       # a lost generator's leases are ended when the pool sees it go, not at their deadline: an
                       # hour here, which the waits below (10 minutes) would run into (before, the run stood still
                       # for the default 120 s once the lost node's leases filled the back-pressure window)
                       "buffer.lease_timeout_s=3600", env=_env()) as p:
        alive = or_exited(p)

        wait_for(alive(lambda: _checkpointed(run_dir)), 600, "the first checkpoint")
        assert p.poll() is None, read_log(runs_root, name)[-4000:]
        before = len(read_log(runs_root, name))
        lost = nodes.remove()
        # the generators of the lost node are reported as waiting (Ray restarts them, or the pool replaces them)
        wait_for(alive(lambda: re.search(r"generators: .*(restarting|pending)",
                                         read_log(runs_root, name)[before:])), 600,
                 f"the report of generators lost with node {lost[:8]}")
        done = _checkpointed(run_dir)
        wait_for(alive(lambda: _checkpointed(run_dir) > done), 600, "a checkpoint with a node lost")
        mark = len(read_log(runs_root, name))
        nodes.add(2)
        # the head holds 2 generators beside the learner rank, so 2 ran on the lost node
        wait_for(alive(lambda: len(re.findall(r"generator \S+ is running again", read_log(runs_root, name)[mark:])) >= 2),
                 600, "both lost generators running again on the new node")
        done = _checkpointed(run_dir)
        wait_for(alive(lambda: _checkpointed(run_dir) > done), 600, "a checkpoint after the node joined")
        assert p.poll() is None, read_log(runs_root, name)[-4000:]
        p.send_signal(signal.SIGTERM)
        rc = p.wait(600)
    log = read_log(runs_root, name)
    assert rc == 0, log[-4000:]
    assert "restarting from the last checkpoint" not in log, log[-4000:]  # the run itself never restarted
    run = mlflow_client(runs_root).get_run(state(run_dir)["mlflow_run_id"])
    assert run.info.status == "KILLED"  # stopped by SIGTERM, with a final checkpoint
    acc = accounting(run.data.metrics)
    assert_balanced(acc)
    assert acc["trained"] > 0
    m = run.data.metrics
    assert m["generator/generators"] == 4, {k: v for k, v in m.items() if k.startswith("generator/generators")}


def test_generators_pinned_to_a_node_group_wait_for_a_node_of_it(nodes, runs_root):
    name = "groups"
    with train_process(runs_root, name, f"cluster.address={nodes.address}", "total_steps=100000",
                       "generator.num_generators=1", "generator.engine.kind=transformers",
                       "generator.node_labels={group: rollout}", "checkpoint.every_steps=5", "cluster.stall_report_s=5",
                       env=_env()) as p:
        alive = or_exited(p)

        # the head and the worker left by the test above have room, but no node is of the group: pending, said so
        wait_for(alive(lambda: "pending (each needs 1 CPU on a node labelled group=rollout"
                       in read_log(runs_root, name)), 600, "the report of a generator waiting for its node group")
        assert p.poll() is None and not _checkpointed(runs_root / name), read_log(runs_root, name)[-4000:]
        nodes.add(1, {"group": "rollout"})
        wait_for(alive(lambda: _checkpointed(runs_root / name)), 600, "a checkpoint once a node of the group joined")
        assert p.poll() is None, read_log(runs_root, name)[-4000:]
        p.send_signal(signal.SIGTERM)
        assert p.wait(600) == 0, read_log(runs_root, name)[-4000:]
    run = mlflow_client(runs_root).get_run(state(runs_root / name)["mlflow_run_id"])
    assert_balanced(accounting(run.data.metrics))
