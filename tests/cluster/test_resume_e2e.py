"""A run that loses its learner ranks restarts itself from its last checkpoint, and after `kill -9` of its driver
`exgrpo train --resume` finishes it with nothing lost: `exgrpo train` as a subprocess with an embedded Ray of its
own (the ranks are found among its driver's children, never another run's), real FSDP ranks over gloo, a real
MLflow store. The lever drill (compile and fused AdamW made to fail their trial) rides along.
"""

from __future__ import annotations

import json
import os
import re
import signal
from pathlib import Path

import pytest
import yaml

from tests.cluster.runs import (
    accounting, assert_balanced, history, mlflow_client, read_log, run_train, state, train_process, wait_for,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def runs_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("runs")


def _run_id(runs_root: Path, name: str) -> str:
    return state(runs_root / name)["mlflow_run_id"]


def _learner_ranks(driver_pid: int) -> list:
    """The learner rank processes of the driver's embedded Ray (never another run's on this machine)."""
    import psutil

    found = []
    for q in psutil.Process(driver_pid).children(recursive=True):
        try:
            if any("ray::LearnerRank" in part for part in q.cmdline()):
                found.append(q)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            pass
    return found


def test_learner_rank_death_restarts_the_run_and_resume_after_kill_9_loses_nothing(runs_root):
    """Two failures of one run: its learner ranks are killed after the first checkpoint (the run restarts
    itself from it), then, after a checkpoint of the restarted attempt, the driver is killed with kill -9
    and `exgrpo train --resume RUN total_steps=N` finishes the run. The run is far longer than the test
    (it cannot end before the kill on a fast machine); the resume sets where it ends."""
    run_dir = runs_root / "resume"
    # the lever drill rides along: compile and fused AdamW on, both made to fail their trial at the first start
    drill = {**os.environ, "EXGRPO_LEVER_FAULTS": "compile,fused_optimizer"}
    with train_process(runs_root, "resume", "total_steps=100000", "checkpoint.every_steps=4",
                       "checkpoint.keep_last=10", "cluster.max_restarts=2", "learner.optim.lr_schedule=linear",
                       "learner.optim.warmup_steps=3", "learner.optim.lr_decay_steps=20", "learner.levers.compile=true",
                       "learner.levers.compile_backend=aot_eager", "learner.levers.fused_optimizer=true", env=drill) as p:
        wait_for(lambda: len(state(run_dir).get("checkpoints", [])) >= 1 or p.poll() is not None, 600,
                 "the first checkpoint")
        ranks = _learner_ranks(p.pid)
        assert ranks, "no learner rank process found"
        for q in ranks:
            q.kill()
        # the restarted attempt says which checkpoint it resumed; a checkpoint after that one is its own (the
        # first attempt may still commit one between the kill and its detection: counting them would race)
        resumed = r"resumed the buffer of step-(\d+)"
        wait_for(lambda: re.search(resumed, read_log(runs_root, "resume")) or p.poll() is not None, 300,
                 "the restarted attempt's resume")
        assert p.poll() is None, read_log(runs_root, "resume")
        resumed_step = int(re.search(resumed, read_log(runs_root, "resume"))[1])
        wait_for(lambda: max(int(Path(c).name.removeprefix("step-")) for c in state(run_dir)["checkpoints"])
                 > resumed_step or p.poll() is not None, 600, "a checkpoint of the restarted attempt")
        assert p.poll() is None, read_log(runs_root, "resume")
        os.kill(p.pid, signal.SIGKILL)  # kill -9 the driver only
        p.wait(30)
    first_log = read_log(runs_root, "resume")
    assert "restarting from the last checkpoint (1/2)" in first_log
    # the levers that failed their trial: said once, off for the run, kept off by the restart and the resume
    assert re.search(r"learner levers off for this run .*learner\.compile: InjectedLeverFault.*"
                     r"learner\.fused_optimizer: InjectedLeverFault", first_log), first_log[-4000:]
    assert "learner levers kept off from the run's first start: compile" in first_log  # the restart
    # the restart, too, ended exactly the leases its checkpoint held
    restarted = re.search(r"resumed the buffer of (step-\d+): the (\d+) lease\(s\) it held outstanding", first_log)
    assert restarted, first_log[-4000:]
    at_restart = json.loads((run_dir / "checkpoints" / restarted[1] / "driver.json").read_text())["accounting"]
    assert int(restarted[2]) == at_restart["outstanding"]
    ckpts = state(run_dir)["checkpoints"]
    ckpt_step = int(Path(ckpts[-1]).name.removeprefix("step-"))
    run_id = _run_id(runs_root, "resume")
    client = mlflow_client(runs_root)
    logged = max(s for s, _ in history(client, run_id, "train/reward_mean"))  # may be past the checkpoint
    total = max(logged, ckpt_step) + 4
    at_ckpt = json.loads((run_dir / ckpts[-1] / "driver.json").read_text())["accounting"]
    assert_balanced(at_ckpt)

    assert set(json.loads((run_dir / ckpts[-1] / "driver.json").read_text())["levers_off"]) == {"compile",
                                                                                          "fused_optimizer"}
    _save_under_old_names(run_dir / "config.yaml")  # as a release before the learner's sections wrote it
    # the user moves the folder before resuming: it resumes from its own checkpoints (state.json lists them relative
    # to the folder) and continues its MLflow run
    assert all(not Path(c).is_absolute() for c in ckpts), ckpts
    moved = runs_root / "resume-moved"
    run_dir.rename(moved)
    run_dir = moved
    r = run_train(runs_root, "resume", f"total_steps={total}", resume=run_dir, log_name="resumed")  # no drill now
    assert r.returncode == 0, r.stdout[-4000:]
    assert f"resume: {moved} was moved from {runs_root / 'resume'}; it continues there" in r.stdout
    assert "config.yaml was saved under older names, read as learner.lr -> learner.optim.lr" in r.stdout
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["learner"]["optim"]["lr_schedule"] == "linear"
    assert "learner levers kept off from the run's first start: compile" in r.stdout, r.stdout[-4000:]
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"  # the same MLflow run continued
    assert {s for s, _ in history(client, run_id, "train/reward_mean")} == set(range(1, total + 1))
    # the schedule goes on exactly where the checkpoint left it (a pure function of the restored version)
    from common.config import LearnerConfig
    from learner.schedule import learning_rate

    lc = LearnerConfig(optim=dict(lr_schedule="linear", warmup_steps=3, lr_decay_steps=20))
    lrs = history(client, run_id, "learner/lr")
    assert {s for s, _ in lrs} == set(range(1, total + 1))
    assert all(v == pytest.approx(learning_rate(lc.optim, s - 1)) for s, v in lrs), lrs
    assert {v for _, v in history(client, run_id, "learner/levers_off")} == {2.0}
    acc = accounting(run.data.metrics)
    assert_balanced(acc)
    # Everything the checkpoint held is accounted for after the resume. driver.json holds the counts of
    # exactly the buffer states the checkpoint wrote (taken under each shard's lock with its state; before,
    # they were read in a second call while generators went on leasing, and could disagree with the
    # snapshot). The resume ends exactly the checkpoint's outstanding leases as expired and reissues their
    # questions; its ready groups are trained, queued or dropped as stale (and reissued).
    assert (f"resumed the buffer of {Path(ckpts[-1]).name}: the {at_ckpt['outstanding']} lease(s) it held "
            "outstanding were ended as expired") in r.stdout, r.stdout[-4000:]
    assert acc["issued"] >= at_ckpt["issued"] and acc["trained"] > at_ckpt["trained"]
    assert acc["expired"] >= at_ckpt["expired"] + at_ckpt["outstanding"]


def _save_under_old_names(path: Path) -> None:
    """Rewrite a run's config.yaml with the learner's fields flat (`learner.lr`), as before its sections."""
    saved = yaml.safe_load(path.read_text())
    for section in ("optim", "batching", "levers", "loss"):
        saved["learner"].update(saved["learner"].pop(section))
    path.write_text(yaml.safe_dump(saved))


def test_resume_of_a_copied_run_whose_checkpoints_carry_payloads_refuses_and_runs_none(runs_root):
    """A run folder from someone else: a copy of the run above with a pickle payload (`touch MARKER`) planted in
    every checkpoint, in a different file of each (the DCP metadata, a param_group entry, a tensor entry, meta.json,
    the RNG state, the weights, driver.json; config.json in all, which a resume never reads). `--resume` refuses
    before Ray starts, naming each checkpoint's planted file, with no traceback, and the marker never appears."""
    import shutil

    from tests.learner.test_checkpoint_format import plant_entry, plant_file

    copy = runs_root / "resume-planted"
    shutil.copytree(runs_root / "resume-moved", copy)  # the run above, where its user moved it; left as it is
    marker = runs_root / "MARKER"

    def whole(rel):
        return lambda ckpt: (plant_file(ckpt / rel, marker), ckpt / rel)[1]

    plants = [whole("learner/optimizer/.metadata"),
              lambda ckpt: plant_entry(ckpt / "learner" / "optimizer", marker, tensor=False),
              lambda ckpt: plant_entry(ckpt / "learner" / "optimizer", marker, tensor=True),
              whole("learner/meta.json"), whole("learner/rng/rank0.json"), whole("learner/model/model.safetensors"),
              whole("driver.json")]
    ckpts = sorted(c for c in (copy / "checkpoints").glob("step-*") if c.is_dir())  # the copy's own
    assert len(ckpts) >= 2, ckpts
    planted = {}
    for i, ckpt in enumerate(reversed(ckpts)):  # the newest first: a reader trusting pickle would run its payload
        plant_file(ckpt / "learner" / "model" / "config.json", marker)
        planted[ckpt.name] = plants[i % len(plants)](ckpt)

    r = run_train(runs_root, "resume-planted", "total_steps=100000", resume=copy, log_name="planted", timeout_s=300)
    assert r.returncode != 0, r.stdout[-4000:]
    assert f"{copy} has no usable checkpoint" in r.stdout, r.stdout[-4000:]
    for name, file in planted.items():  # each checkpoint refused for its own planted file
        assert re.search(rf"{name}: .*{re.escape(str(file))}", r.stdout), (name, file, r.stdout[-4000:])
    assert "posix.system, which is not checkpoint data: refused" in r.stdout
    assert "Traceback" not in r.stdout, r.stdout[-4000:]
    assert not marker.exists()
    assert sorted(c for c in (copy / "checkpoints").glob("step-*") if c.is_dir()) == ckpts  # nothing renamed
