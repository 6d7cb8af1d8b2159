"""Chaos: `exgrpo train` while generator processes are killed with SIGKILL at least 20 times (the first
ones while the generators are still starting) and a buffer shard process once. Ray restarts a
killed generator (`generator.max_restarts=1`), the pool replaces one whose restarts are used up, the
shard comes back from its snapshot or the run from its checkpoint; the run completes its steps and
its accounting balances: every issued question was trained, dropped with a reason, or reissued."""

from __future__ import annotations

import random
import time
from pathlib import Path

import psutil
import pytest

from tests.cluster.runs import (
    accounting, assert_balanced, mlflow_client, read_log, state, train_process, wait_for,
)

pytestmark = pytest.mark.slow

KILLS = 20
START_KILLS = 3  # of them while no step has run yet (more would only delay the start)
STEPS = 30


def _processes(root_pid: int, title: str) -> list[psutil.Process]:
    """Descendants of the driver (its embedded Ray's workers) whose process title starts with `title`."""
    try:
        children = psutil.Process(root_pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    found = []
    for c in children:
        try:
            if c.cmdline() and c.cmdline()[0].startswith(title):
                found.append(c)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            pass
    return found


def test_generators_killed_20_times_and_a_shard_once_the_run_completes_and_balances(tmp_path: Path):
    runs_root, name = tmp_path, "chaos"
    rng = random.Random(0)
    kills = kills_at_start = 0
    shard_killed = False
    with train_process(runs_root, name, f"total_steps={STEPS}", "generator.num_generators=2",
                       "generator.num_cpus=0.5", "generator.engine.kind=transformers", "generator.max_restarts=1",
                       "generator.replace_budget=50", "buffer.lease_timeout_s=10", "checkpoint.every_steps=2",
                       "checkpoint.keep_last=10", "cluster.stall_report_s=15") as p:
        # the first checkpoint comes early, so the shard kill and the restart it causes overlap the generator kills
        wait_for(lambda: _processes(p.pid, "ray::GeneratorWorker") or p.poll() is not None, 600,
                 "the first generator process")
        while p.poll() is None and (kills < KILLS or not shard_killed):
            started = "step 1/" in read_log(runs_root, name)
            victims = _processes(p.pid, "ray::GeneratorWorker")
            if victims and kills < KILLS and (started or kills_at_start < START_KILLS):
                rng.choice(victims).kill()
                kills += 1
                kills_at_start += not started
            if not shard_killed and state(runs_root / name).get("checkpoints"):
                shards = _processes(p.pid, "ray::BufferShard")
                if shards:
                    shards[0].kill()
                    shard_killed = True
            time.sleep(rng.uniform(1.5, 3.5))
        rc = p.wait(900)
    log = read_log(runs_root, name)
    assert kills >= KILLS and kills_at_start == START_KILLS and shard_killed, (kills, kills_at_start, shard_killed, log[-3000:])
    assert rc == 0, log[-4000:]
    assert f"step {STEPS}/{STEPS}" in log
    client = mlflow_client(runs_root)
    run = client.get_run(state(runs_root / name)["mlflow_run_id"])
    assert run.info.status == "FINISHED"
    acc = accounting(run.data.metrics)
    assert_balanced(acc)
    assert acc["reissued"] >= acc["expired"] + acc["returned"]  # every lease of a killed process was reissued
    print(f"chaos: {kills} generator kills ({kills_at_start} while starting), 1 buffer shard kill; "
          f"generator deaths replaced: {run.data.metrics.get('generator/deaths', 0):.0f}; accounting {acc}")
