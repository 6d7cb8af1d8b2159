"""`exgrpo train` on real small file systems (two tmpfs the test mounts; skipped, saying why, where the machine
cannot): the run folders on one, the MLflow SQLite store on the other.

1. A run (checkpoint.on_full_disk=stop) whose disk is filled once its first checkpoint exists stops at its
   next checkpoint with one line (folder, bytes needed and free, the last complete checkpoint), exit code 4
   and state FAILED naming the cause; no partial folder is left.
2. `--resume` with checkpoint.on_full_disk=skip on the same full disk, its store filled too once it runs:
   checkpoints are skipped (a warning each) while training goes on; the store's fault is one warning and no
   traceback; once the run disk is freed the next checkpoint is written (its driver.json counts the metric
   points kept out of the store); SIGTERM stops it; the accounting balances; `exgrpo track --replay` then puts
   the kept points into the store and the run's metric history is complete from step 1.

The faults follow the run's progress (its checkpoints and console lines), never the clock.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cluster.runs import ROOT, assert_balanced, history, state, train_cmd, wait_for
from tests.small_fs import fill, small_fs

pytestmark = pytest.mark.slow

NAME = "full"
STEPS = 100_000  # never reached: the disk stops the first run, SIGTERM the second


@pytest.fixture(scope="module")
def disks(tmp_path_factory):
    base = tmp_path_factory.mktemp("disks")
    with small_fs(base / "runs", 32) as runs, small_fs(base / "store", 8) as store:
        yield runs, store, base


def _start(base: Path, runs: Path, log_name: str, *overrides: str, resume: Path | None = None) -> subprocess.Popen:
    """`exgrpo train` with its console in `base` (not on the small disks it fills)."""
    out = open(base / f"{log_name}.log", "w")
    return subprocess.Popen(train_cmd(runs, NAME, *overrides, resume=resume), cwd=ROOT, stdout=out,
                            stderr=subprocess.STDOUT, env=dict(os.environ, PYTHONUNBUFFERED="1"),
                            start_new_session=True)


def _console(base: Path, log_name: str) -> str:
    p = base / f"{log_name}.log"
    return p.read_text() if p.exists() else ""


def _checkpoints(run_dir: Path) -> list[Path]:
    return [run_dir / c for c in state(run_dir).get("checkpoints", [])]  # listed relative to the run folder


def _stop(p: subprocess.Popen) -> None:
    if p.poll() is None:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait(60)


def _no_partial(run_dir: Path) -> None:
    leftovers = [p for p in (run_dir / "checkpoints").rglob("*") if ".partial" in p.name or ".tmp-" in p.name]
    assert not leftovers, leftovers


@pytest.fixture(scope="module")
def stopped(disks):
    """Run 1: the run disk is filled (half a checkpoint left) once the first checkpoint is listed."""
    from cluster.disk import folder_bytes

    runs, store, base = disks
    run_dir = runs / NAME
    p = _start(base, runs, "stop", f"total_steps={STEPS}", "checkpoint.every_steps=2", "checkpoint.keep_last=10",
               f"tracking.uri=sqlite:///{store}/mlflow.db")
    try:
        wait_for(lambda: _checkpoints(run_dir) or p.poll() is not None, 900, "the first checkpoint")
        assert p.poll() is None, _console(base, "stop")[-4000:]
        fill(runs, leave=folder_bytes(_checkpoints(run_dir)[-1]) // 2)
        rc = p.wait(900)
    finally:
        _stop(p)
    return rc, _console(base, "stop"), _checkpoints(run_dir)


def test_a_full_disk_at_a_checkpoint_is_one_line_a_clean_stop_and_no_partial_folder(disks, stopped):
    from cluster.preflight import checkpoint_problem

    runs, _, _ = disks
    rc, console, ckpts = stopped
    assert rc == 4, console[-4000:]
    said = [ln for ln in console.splitlines() if ln.startswith("[exgrpo] disk full: ")]
    assert len(said) == 1, console[-4000:]
    line = said[0]
    # before writing: needs/free; or, when a checkpoint was being written during the fill, the write that failed
    assert re.search(r"needs ~[\d.]+ [kMG]B \([\d,]+ bytes\) in \S+, [\d.]+ [kMG]B \([\d,]+ bytes\) are free", line) \
        or "failed: No space left on device [ENOSPC]" in line, line
    assert f"the last complete checkpoint is {ckpts[-1]}" in line and "stopping (checkpoint.on_full_disk=stop)" in line
    assert "Traceback" not in console, console[-4000:]
    s = state(runs / NAME)
    assert s["status"] == "FAILED" and s["cause"].startswith("disk full: ")
    _no_partial(runs / NAME)
    assert all(checkpoint_problem(c, 1) is None for c in ckpts)  # every listed one is complete


def test_resume_skips_checkpoints_on_a_full_disk_keeps_store_faults_quiet_and_replay_completes_history(disks, stopped):
    from mlflow.tracking import MlflowClient

    from cluster.tracking import UNSENT_FILE, count_unsent

    runs, store, base = disks
    run_dir = runs / NAME
    last = stopped[2][-1]
    p = _start(base, runs, "skip", "checkpoint.on_full_disk=skip", resume=run_dir)
    console = lambda: _console(base, "skip")  # noqa: E731
    running = lambda pred: (lambda: pred() or p.poll() is not None)  # noqa: E731
    try:
        wait_for(running(lambda: f"run {NAME} in " in console()), 600, "the resumed run's MLflow start")
        fill(store)  # the store's disk is full from now on
        wait_for(running(lambda: console().count("skipped (checkpoint.on_full_disk=skip") >= 2
                         and "stopped taking writes" in console()), 900, "two skipped checkpoints, the store failing")
        assert p.poll() is None, console()[-4000:]
        (runs / "filler").unlink()  # space again: the next checkpoint is written
        wait_for(running(lambda: _checkpoints(run_dir)[-1] != last), 600, "a checkpoint once space came back")
        assert p.poll() is None, console()[-4000:]
        written = json.loads((_checkpoints(run_dir)[-1] / "driver.json").read_text())
        p.send_signal(signal.SIGTERM)
        rc = p.wait(600)
    finally:
        _stop(p)
    out = console()
    assert rc == 0, out[-4000:]
    assert f"resumed the buffer of {last.name}" in out  # the last complete checkpoint of the stopped run
    assert written["checkpoints_skipped"] >= 2 and written["metrics_unsent"] > 0, written
    assert_balanced(written["accounting"])
    assert "Traceback" not in out and "sqlalchemy" not in out.lower(), out[-4000:]
    assert out.count("stopped taking writes") >= 1
    _no_partial(run_dir)
    s = state(run_dir)
    assert s["status"] == "KILLED" and s["cause"] is None
    unsent = count_unsent(run_dir / UNSENT_FILE)
    assert unsent == s["metrics_unsent"] > 0 and s["metrics_lost"] == 0, s
    assert f"{unsent} metric points never reached the store" in out and "exgrpo track --replay" in out
    final = json.loads((_checkpoints(run_dir)[-1] / "driver.json").read_text())
    assert_balanced(final["accounting"])

    (store / "filler").unlink()
    r = subprocess.run([sys.executable, "-m", "cluster.cli", "track", "--replay", str(run_dir)], cwd=ROOT,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and f"sent {unsent} metric points" in r.stdout, r.stdout + r.stderr
    client = MlflowClient(tracking_uri=f"sqlite:///{store}/mlflow.db")
    run_id = s["mlflow_run_id"]
    # the files the run's end could not send go too, and state.json no longer counts the points as unsent
    assert state(run_dir)["metrics_unsent"] == 0
    assert "prompt_example.txt" in {a.path for a in client.list_artifacts(run_id)}
    assert {st for st, _ in history(client, run_id, "train/reward_mean")} == set(range(1, s["step"] + 1))
    assert max(v for _, v in history(client, run_id, "checkpoint/skipped")) >= 2
