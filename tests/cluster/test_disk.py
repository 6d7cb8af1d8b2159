"""The checkpoint size estimate and the one line a disk fault gets: numbers worked out by hand, real files."""

from __future__ import annotations

import errno
import json
import os
import struct
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
