"""The checkpoint size estimate and the one line a disk fault gets: numbers worked out by hand, real files."""

from __future__ import annotations

import errno
import json
import os
import shutil
import struct
import subprocess
from pathlib import Path

from cluster.disk import DiskFault, first_checkpoint_bytes, folder_bytes, free_bytes, model_params, size_text


def test_the_first_checkpoint_is_the_model_its_adam_moments_its_master_weights_and_the_buffer():
    # float32: 4 (model folder) + 8 (exp_avg, exp_avg_sq) per parameter; 1000 * 12 + 500
    assert first_checkpoint_bytes(1000, 4, 500) == 12_500
    # bfloat16: 2 (model folder) + 8 (moments) + 4 (float32 master weights); 1000 * 14 + 0
    assert first_checkpoint_bytes(1000, 2, 0) == 14_000


def test_model_params_are_read_from_the_safetensors_headers(tmp_path: Path):
    header = {"__metadata__": {"format": "pt"}, "a": {"dtype": "F32", "shape": [3, 4], "data_offsets": [0, 48]},
              "b": {"dtype": "F32", "shape": [5], "data_offsets": [48, 68]}}
    raw = json.dumps(header).encode()
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw + b"\0" * 68)
    assert model_params(tmp_path) == 3 * 4 + 5


def test_folder_bytes_counts_a_hard_linked_file_once(tmp_path: Path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "a.seg").write_bytes(b"x" * 1000)
    os.link(tmp_path / "a.seg", tmp_path / "sub" / "a.seg")
    (tmp_path / "sub" / "b").write_bytes(b"y" * 24)
    assert folder_bytes(tmp_path) == 1024
    assert free_bytes(tmp_path / "not" / "yet") == free_bytes(tmp_path)  # the nearest existing parent's


def test_the_line_says_what_where_how_much_and_the_last_complete_checkpoint():
    last = Path("/runs/r/checkpoints/step-000020")
    before = DiskFault(40, Path("/runs/r/checkpoints"), 5_900_000, last, need=7_100_243)
    assert before.line() == ("disk full: the checkpoint of step 40 needs ~7.1 MB (7,100,243 bytes) in "
                             "/runs/r/checkpoints, 5.9 MB (5,900,000 bytes) are free; the last complete checkpoint "
                             "is /runs/r/checkpoints/step-000020")
    assert before.space
    failed = DiskFault(40, Path("/runs/r/checkpoints"), 4096, None,
                       error=OSError(errno.ENOSPC, "No space left on device", "/runs/r/checkpoints/x"))
    assert failed.line() == ("disk full: writing the checkpoint of step 40 into /runs/r/checkpoints failed: No space "
                             "left on device [ENOSPC] (/runs/r/checkpoints/x); 4.1 kB (4,096 bytes) free; the partial "
                             "checkpoint was removed; no checkpoint is complete yet")
    assert failed.space
    read_only = DiskFault(40, Path("/c"), 10, last, error=OSError(errno.EROFS, "Read-only file system"))
    assert read_only.line().startswith("read-only disk: ") and not read_only.space
    assert not DiskFault(40, Path("/c"), 10, last, error=OSError(errno.EIO, "Input/output error")).space
    assert size_text(999) == "999 bytes" and size_text(91_000_000_000) == "91.0 GB (91,000,000,000 bytes)"


def test_a_log_file_on_a_full_disk_is_one_console_line_not_a_traceback_per_line(tmp_path, capsys):
    import logging

    from cluster.console import LogFile
    from tests.small_fs import fill, small_fs

    with small_fs(tmp_path / "fs", 4) as fs:
        handler = LogFile(fs / "driver.log")
        logger = logging.getLogger("exgrpo.test.logfile")
        logger.addHandler(handler)
        logger.propagate = False
        try:
            filler = fill(fs)
            for i in range(20):
                logger.error("line %d %s", i, "x" * 5000)
            err = capsys.readouterr().err
            assert err.count("cannot be written") == 1 and "Traceback" not in err, err
            filler.unlink()
            logger.error("the disk takes writes again")
            assert not handler.failing
        finally:
            logger.removeHandler(handler)
            handler.close()


def test_logs_that_could_not_be_copied_are_one_line_that_says_where_they_still_are(tmp_path: Path):
    """A full disk as a run ends: shutil.copytree's error lists (source, destination, reason) for each of Ray's log
    files (~10 KB printed before issue 45); the line counts them, gives the reason once, and where they are."""
    import shutil

    from cluster.runtime import log_copy_failure

    src, dst = tmp_path / "session_latest" / "logs", tmp_path / "run" / "logs" / "ray"
    full = shutil.Error([(f"{src}/worker-{i}.err", f"{dst}/worker-{i}.err",
                          f"[Errno 28] No space left on device: '{dst}/worker-{i}.err'") for i in range(1000)])
    line = log_copy_failure(full, src, dst)
    assert line == (f"Ray's logs: 1000 files not copied to {dst} ([Errno 28] No space left on device); they are still "
                    f"in {src}, left in place for you (remove that folder when done)")
    (src / "a").mkdir(parents=True)  # a real copytree failure: named pipes are not copied
    for i in range(3):
        os.mkfifo(src / "a" / f"p{i}")
    try:
        shutil.copytree(src, dst, dirs_exist_ok=True)
    except shutil.Error as e:
        line = log_copy_failure(e, src, dst)
    assert line.startswith("Ray's logs: 3 files not copied") and "is a named pipe" in line
    assert len(line) < 250 + 3 * len(str(tmp_path)), line  # one line: the folders and one reason, not one per file
    assert "Errno 28" in log_copy_failure(OSError(errno.ENOSPC, "No space left on device"), src, dst)


def test_a_read_only_checkpoint_folder_is_named_read_only_not_full(tmp_path: Path):
    """A read-only mount reports its free bytes (a 1 MB tmpfs: 1 MB free): the check before a checkpoint says
    read-only (issue 45: it said "disk full ... 1.0 MB free"), and a write that meets EROFS says so too."""
    from cluster.disk import not_writable
    from tests.small_fs import small_fs

    with small_fs(tmp_path / "ro", 1) as fs:
        (fs / "checkpoints").mkdir()
        assert not_writable(fs / "checkpoints" / "step-000002") is None
        subprocess.run(["mount", "-o", "remount,ro", str(fs)], check=True)
        try:
            e = not_writable(fs / "checkpoints" / "step-000002")  # not there yet: its nearest existing parent
            assert e is not None and e.errno == errno.EROFS and e.filename == str(fs / "checkpoints")
            line = DiskFault(2, fs / "checkpoints", free_bytes(fs), None, error=e, before=True).line()
            assert line == (f"read-only disk: the checkpoint of step 2 cannot be written into {fs / 'checkpoints'}: "
                            f"Read-only file system [EROFS] ({fs / 'checkpoints'}); nothing was written; no checkpoint "
                            "is complete yet"), line
            assert "disk full" not in line and not DiskFault(2, fs, 0, None, error=e, before=True).space
        finally:
            subprocess.run(["mount", "-o", "remount,rw", str(fs)], check=False)


def test_checkpoints_deleted_from_outside_are_named_and_forgotten(tmp_path: Path):
    from cluster.runtime import RunDir

    run = RunDir(tmp_path / "r")
    run.path.mkdir()
    ckpts = [run.checkpoint_dir(s) for s in (10, 20)]
    for c in ckpts:
        c.mkdir(parents=True)
        (c / "driver.json").write_text("{}")
    run.write_state({"name": "r", "mlflow_run_id": None, "checkpoints": [run.entry(c) for c in ckpts]})
    assert run.forget_vanished_checkpoints() is None
    shutil.rmtree(ckpts[0])
    assert run.forget_vanished_checkpoints() == (f"1 earlier checkpoint(s) of this run vanished while it ran "
                                                 f"({ckpts[0]}: deleted from outside?); left to resume from: {ckpts[1]}")
    assert run.read_state()["checkpoints"] == ["checkpoints/step-000020"]  # relative to the run folder
    shutil.rmtree(run.path / "checkpoints")  # the whole folder
    assert run.forget_vanished_checkpoints().endswith("nothing is left to resume from until the checkpoint being "
                                                      "written is complete")
    assert run.read_state()["checkpoints"] == []
