"""A run's checkpoints: one consistent cut of the learner (model, optimizer, version), every buffer shard and the
driver's state, written to a `.partial` folder and renamed, the last `checkpoint.keep_last` listed in state.json.
A checkpoint the disk cannot take leaves no partial folder; per `checkpoint.on_full_disk` it stops the run
(EXIT_DISK) or is skipped while space may come back. Sizes and disk faults: cluster/disk.py; docs/faults.md.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

from cluster.liveness import EXIT_DISK, RunStopped
from cluster.state import PreparedRun, rng_state
from cluster.step_metrics import prefixed

log = logging.getLogger("exgrpo")


class Checkpointer:
    """Writes the checkpoints of one attempt of `run` (`tracking`: the run's LateStart)."""

    def __init__(self, run: PreparedRun, learner, buffer, tracking):
        self.cfg, self.run_dir, self.state, self.model_path, _ = run
        self.learner, self.buffer, self.tracking = learner, buffer, tracking
        self.buffer_bytes = 0.0  # the buffer's stored trajectories at the last step (the first one's size estimate)
        self._params: int | None = None  # the model's parameters (the first checkpoint's size estimate)

    def save(self) -> Path | None:
        """The checkpoint of the current step; its folder, or None when the disk refused it and it was skipped.
        Its size (`_bytes`) is compared with the free space first; a write that fails for the disk (no space,
        quota, I/O error, read-only: `common.disk`) is said in one line (the trace goes to logs/driver.log)."""
        from cluster import disk
        from common.disk import disk_error

        final = self.run_dir.checkpoint_dir(self.state.step)
        tmp = final.with_name(final.name + ".partial")
        vanished = self.run_dir.forget_vanished_checkpoints()
        if vanished:
            log.warning("%s", vanished)
        fault = lambda free, **kw: disk.DiskFault(self.state.step, final.parent, free,  # noqa: E731
                                                  self.run_dir.latest_checkpoint(), **kw)
        need, free = self._bytes(), disk.free_bytes(final.parent)
        blocked = disk.not_writable(final.parent)
        if blocked is not None:  # a read-only mount still reports free bytes: say read-only, not "disk full"
            return self._refused(fault(free, error=blocked, before=True))
        if free is not None and need > free:
            return self._refused(fault(free, need=need))
        try:
            return self._write(final, tmp)
        except BaseException as e:
            err, free = disk_error(e), disk.free_bytes(final.parent)
            shutil.rmtree(tmp, ignore_errors=True)
            if final.exists() and final not in self.run_dir.checkpoints():
                shutil.rmtree(final, ignore_errors=True)  # complete, but state.json could not list it
            if err is None:
                raise
            log.debug("the checkpoint of step %d failed", self.state.step, exc_info=e)
            return self._refused(fault(free, error=err))

    def _write(self, final: Path, tmp: Path) -> Path:
        tracker = self.tracking()
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
        self.learner.save_checkpoint(tmp / "learner")
        # the counts of exactly the states written: generators keep leasing and submitting meanwhile
        self.state.accounting = self.buffer.snapshot(str(tmp / "buffer"))
        self.state.rng = rng_state()
        tracker.log_metrics(prefixed("accounting/", self.state.accounting), self.state.step)
        # The metrics of the steps up to this one reach MLflow (or, when it refuses them, the run folder's
        # metrics-unsent.jsonl) before the checkpoint exists: a run killed right after it resumes from the next
        # step and would never log them again.
        tracker.flush_or_keep()
        self.state.__dict__.update(tracker.counts())
        (tmp / "driver.json").write_text(json.dumps(self.state.__dict__, default=str))
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
        ckpts = [c for c in self.run_dir.checkpoints() if c != final] + [final]  # each inside the run folder
        keep = self.cfg.checkpoint.keep_last
        self.run_dir.update_state(checkpoints=[self.run_dir.entry(c) for c in ckpts[-keep:]], **tracker.counts())
        for old in ckpts[:-keep]:  # after state.json stopped listing them
            shutil.rmtree(old, ignore_errors=True)
        log.info("checkpoint %s", final)
        return final

    def _bytes(self) -> int:
        """The next checkpoint's size: the last one's, or, before any, the model's and the buffer's bytes."""
        from cluster import disk

        last = self.run_dir.latest_checkpoint()
        if last is not None and last.is_dir():
            return disk.folder_bytes(last)
        if self._params is None:
            self._params = disk.model_params(self.model_path)
        return disk.first_checkpoint_bytes(self._params, 4 if self.cfg.model.dtype == "float32" else 2,
                                           int(self.buffer_bytes))

    def _refused(self, fault) -> None:
        """Skipped (checkpoint.on_full_disk=skip, while space may come back), or the run stops with EXIT_DISK."""
        if self.cfg.checkpoint.on_full_disk == "skip" and fault.space:
            self.state.checkpoints_skipped += 1
            log.warning("%s; skipped (checkpoint.on_full_disk=skip, %d so far): training goes on and tries again at "
                        "the next checkpoint", fault.line(), self.state.checkpoints_skipped)
            self.tracking().log_metrics({"checkpoint/skipped": float(self.state.checkpoints_skipped)}, self.state.step)
            return None
        why = "checkpoint.on_full_disk=stop" if fault.space else "the disk refuses writes"
        raise RunStopped(f"{fault.line()}; stopping ({why}): free space, then `exgrpo train --resume "
                         f"{self.run_dir.path}` continues from the last complete checkpoint", EXIT_DISK,
                         checkpoint=False)
