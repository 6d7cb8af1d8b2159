"""Reward worker processes never outlive their parent: a SIGKILLed generator leaves no stray worker."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil

from tests.cluster.runs import ROOT

PARENT = """
import sys
from common.config import RewardConfig
from common.rewards import RewardPool, ScoreRequest
pool = RewardPool(RewardConfig(name="tests.common.reward_fns:hangs", timeout_s=3600))
pool.score([ScoreRequest("q0", "a", "")])
print(" ".join(str(w.proc.pid) for w in pool._workers if w is not None), flush=True)
pool.score([ScoreRequest(f"q{i}", "hang", "") for i in range(len(pool._workers))])  # never returns
"""


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_reward_workers_die_with_a_sigkilled_parent():
    parent = subprocess.Popen([sys.executable, "-c", PARENT], cwd=ROOT, stdout=subprocess.PIPE, text=True,
                              env=dict(os.environ, PYTHONPATH=str(ROOT)))
    try:
        workers = [int(p) for p in parent.stdout.readline().split()]
        assert workers, "the parent started no reward worker"
        time.sleep(0.5)  # the workers are inside the hanging call now
        assert not any(_gone(w) for w in workers)
        parent.send_signal(signal.SIGKILL)
        parent.wait(30)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not all(_gone(w) for w in workers):
            time.sleep(0.2)
        assert all(_gone(w) for w in workers), f"reward workers {workers} outlived their SIGKILLed parent"
    finally:
        if parent.poll() is None:
            parent.kill()
        for w in workers if "workers" in locals() else []:
            if not _gone(w):
                os.kill(w, signal.SIGKILL)
