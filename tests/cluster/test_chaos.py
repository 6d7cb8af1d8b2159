"""Chaos: `exgrpo train` while generator processes are killed with SIGKILL 20 times (the first ones
while the generators are still starting) and a buffer shard process once. Ray restarts a killed
generator (`generator.max_restarts=1`), the pool replaces one whose restarts are used up, the shard
comes back from its snapshot or the run from its checkpoint; the run goes on training, SIGTERM stops it
cleanly, and its accounting balances: every issued question was trained, dropped with a reason, or
reissued.

The faults follow the run's progress, never the clock: after each kill while training, the next waits
for a new checkpoint (one every 2 learner steps); the run is far longer than the faults (it cannot finish first on a fast
machine), and the test stops it with SIGTERM once they are done (a slow machine only takes longer).
"""

from __future__ import annotations

import random
import re
import signal
import time
from pathlib import Path

import psutil
import pytest

from tests.cluster.runs import (
    accounting, assert_balanced, mlflow_client, or_exited, read_log, state, train_process, wait_for,
)

pytestmark = pytest.mark.slow

KILLS = 20
START_KILLS = 3  # of them while no step has run yet (more would only delay the start)
STEPS = 100_000  # never reached: SIGTERM ends the run once the faults are done


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


def _started(log: str) -> bool:
    """A learner step has run (the console prints the first step at once, later ones every 10 s)."""
    return re.search(rf"step \d+/{STEPS}", log) is not None


def _checkpointed(run_dir: Path) -> int:
    """The step of the newest checkpoint (one every 2 steps): the run's progress, read from its state."""
    return max((int(Path(c).name.removeprefix("step-")) for c in state(run_dir).get("checkpoints", [])), default=0)


def test_generators_killed_20_times_and_a_shard_once_the_run_trains_on_and_balances(tmp_path: Path):
    runs_root, name = tmp_path, "chaos"
    rng = random.Random(0)
    kills = kills_at_start = 0
    shard_killed = False
    with train_process(runs_root, name, f"total_steps={STEPS}", "generator.num_generators=2",
                       "generator.num_cpus=0.5", "generator.engine.kind=transformers", "generator.max_restarts=1",
                       "generator.replace_budget=50", "buffer.lease_timeout_s=10", "checkpoint.every_steps=2",
                       "checkpoint.keep_last=10", "cluster.stall_report_s=15") as p:
        alive = or_exited(p)

        wait_for(alive(lambda: _processes(p.pid, "ray::GeneratorWorker")), 600, "the first generator process")
        run_dir = runs_root / name
        while p.poll() is None and kills < KILLS:
            started, done = _started(read_log(runs_root, name)), _checkpointed(run_dir)
            victims = _processes(p.pid, "ray::GeneratorWorker")
            if not started and kills_at_start == START_KILLS or not victims:
                time.sleep(0.2)  # the first step, or a generator process to kill, is yet to come
                continue
            victim = rng.choice(victims)
            try:
                victim.kill()
                victim.wait(60)  # gone before the next victim is chosen
            except psutil.NoSuchProcess:
                continue  # it died on its own meanwhile: not our kill
            kills += 1
            kills_at_start += not started
            if started:  # the next fault waits until the run trained on
                wait_for(alive(lambda: _checkpointed(run_dir) > done), 600,
                         f"a checkpoint after generator kill {kills}")
            if not shard_killed and _checkpointed(run_dir):
                shards = _processes(p.pid, "ray::BufferShard")
                if shards:
                    shards[0].kill()
                    shard_killed = True
        # the run trains on after the last fault, then stops cleanly on SIGTERM
        done = _checkpointed(run_dir)
        wait_for(alive(lambda: _checkpointed(run_dir) > done), 600, "a checkpoint after the faults")
        assert p.poll() is None, read_log(runs_root, name)[-4000:]
        p.send_signal(signal.SIGTERM)
        rc = p.wait(900)
    log = read_log(runs_root, name)
    assert kills == KILLS and kills_at_start == START_KILLS and shard_killed, (kills, kills_at_start, shard_killed,
                                                                              log[-3000:])
    assert rc == 0, log[-4000:]
    client = mlflow_client(runs_root)
    run = client.get_run(state(runs_root / name)["mlflow_run_id"])
    assert run.info.status == "KILLED"  # stopped by SIGTERM, with a final checkpoint
    acc = accounting(run.data.metrics)
    assert_balanced(acc)
    assert acc["trained"] > 0
    assert acc["reissued"] >= acc["expired"] + acc["returned"]  # every lease of a killed process was reissued
    print(f"chaos: {kills} generator kills ({kills_at_start} while starting), 1 buffer shard kill, "
          f"{_checkpointed(runs_root / name)} steps checkpointed; generator deaths replaced: "
          f"{run.data.metrics.get('generator/deaths', 0):.0f}; accounting {acc}")
