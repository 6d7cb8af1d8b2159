"""Disk errors are recognised behind every wrapper a writer puts around them, on a real small file system:
DCP's CheckpointException around torch's zip-writer RuntimeError, Ray's RayTaskError, a read-only remount."""

from __future__ import annotations

import errno
import os
import pickle
import stat

import pytest
import torch

from common.disk import atomic_write_bytes, disk_error, plain_disk_errors
from tests.small_fs import fill, remount, small_fs


@pytest.fixture
def fs(tmp_path):
    with small_fs(tmp_path / "fs", 4) as path:
        yield path


def _dcp_save_on_a_full_disk(fs):
    import torch.distributed.checkpoint as dcp

    fill(fs, leave=200_000)
    with pytest.raises(BaseException) as info:
        dcp.save({"w": torch.zeros(1000, 1000)}, checkpoint_id=str(fs / "optimizer"))  # 4 MB into 0.2 MB
    return info.value


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_full_disk_under_dcp_and_torch_wrappers_is_enospc_and_crosses_ray_as_a_plain_oserror(fs):
    from ray.exceptions import RayTaskError

    e = _dcp_save_on_a_full_disk(fs)
    # what the issue saw: no errno on the surface, only "[enforce fail at inline_container.cc] unexpected pos"
    assert type(e).__name__ == "CheckpointException" and not isinstance(e, OSError)
    assert disk_error(e).errno == errno.ENOSPC

    # a rank converts it before it leaves; pickling (Ray's transport) keeps errno, text and the folder
    with pytest.raises(OSError) as plain:
        with plain_disk_errors(fs / "optimizer"):
            raise e
    crossed = pickle.loads(pickle.dumps(plain.value))
    assert (crossed.errno, crossed.filename) == (errno.ENOSPC, str(fs / "optimizer"))
    # and the driver finds it inside the RayTaskError that ray.get raises
    wrapped = RayTaskError("LearnerRank.save", "Traceback ...", crossed).as_instanceof_cause()
    assert disk_error(wrapped).errno == errno.ENOSPC


def test_a_read_only_disk_is_erofs_and_other_errors_are_not_the_disks(fs):
    remount(fs, "ro")
    try:
        with pytest.raises(OSError) as info:
            (fs / "driver.json").write_text("{}")
        assert disk_error(info.value).errno == errno.EROFS
    finally:
        remount(fs, "rw")
    assert disk_error(FileNotFoundError(errno.ENOENT, "No such file or directory", "x")) is None
    assert disk_error(ValueError("unexpected pos 704 vs 598")) is None
    with pytest.raises(ValueError):  # not a disk error: passes unchanged
        with plain_disk_errors(fs):
            raise ValueError("a bug")


def test_an_errno_flattened_to_text_is_still_found():
    e = RuntimeError("remote task failed: OSError: [Errno 122] Disk quota exceeded: '/ckpt/x'")
    assert disk_error(e).errno == errno.EDQUOT
    assert disk_error(RuntimeError("[Errno 2] No such file or directory")) is None


def test_an_atomic_write_fsyncs_the_file_then_its_folder_and_a_failed_one_leaves_the_old_file(tmp_path, monkeypatch):
    """Chunks are written as they come, the file is fsynced, renamed over the old one, then the folder is fsynced
    (so the rename survives a power cut); the file's mode is the umask's, as a plain open makes it. A write that
    fails part-way leaves the old file and no temp file."""
    synced, fsync = [], os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(stat.S_ISDIR(os.fstat(fd).st_mode)), fsync(fd))[1])
    path = tmp_path / "state.msgpack"
    path.write_bytes(b"old")
    old_umask = os.umask(0o027)
    try:
        assert atomic_write_bytes(path, (c for c in [b"ne", b"w"])) == 3
    finally:
        os.umask(old_umask)
    assert path.read_bytes() == b"new" and synced == [False, True]
    assert stat.S_IMODE(path.stat().st_mode) == 0o640

    def cut_short():
        yield b"half"
        raise OSError(errno.ENOSPC, "no space left on the device")

    with pytest.raises(OSError):
        atomic_write_bytes(path, cut_short())
    assert path.read_bytes() == b"new" and [p.name for p in tmp_path.iterdir()] == ["state.msgpack"]


def test_the_hf_export_and_state_json_on_a_full_disk_are_enospc_and_leave_the_old_state(fs):
    from common.disk import atomic_write_text
    from learner.checkpoint import SafetensorsWriter

    (fs / "state.json").write_text('{"checkpoints": ["step-000002"]}')
    fill(fs, leave=100_000)
    specs = {"w": (torch.float32, (1000, 1000))}  # 4 MB into 0.1 MB
    with pytest.raises(BaseException) as info:
        writer = SafetensorsWriter(fs / "model.safetensors", specs)
        try:
            writer.write({"w": torch.ones(1000, 1000)})
        finally:
            writer.close()
    assert disk_error(info.value).errno == errno.ENOSPC
    with pytest.raises(OSError) as info:
        atomic_write_text(fs / "state.json", '{"checkpoints": ["step-000002", "step-000004"]}' + " " * 200_000)
    assert disk_error(info.value).errno == errno.ENOSPC
    assert (fs / "state.json").read_text() == '{"checkpoints": ["step-000002"]}'
    assert sorted(p.name for p in fs.iterdir()) == ["filler", "model.safetensors", "state.json"]



@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_full_disk_whose_errno_was_lost_across_ranks_is_found_by_a_probe_write(fs):
    """With 2 ranks DCP gathers each rank's failure with all_gather_object: pickling drops the OSError behind
    torch's "unexpected pos", and where only rank 0 failed nothing else names the disk (what CI saw from a
    2-rank learner). The probe write beside the failed one finds the cause."""
    gathered = pickle.loads(pickle.dumps(_dcp_save_on_a_full_disk(fs)))  # what all_gather_object hands back
    assert disk_error(gathered) is None  # nothing on it names the disk any more
    with pytest.raises(OSError) as plain:
        with plain_disk_errors(fs / "optimizer"):
            raise gathered
    assert (plain.value.errno, plain.value.filename) == (errno.ENOSPC, str(fs / "optimizer"))
    assert not list(fs.glob(".exgrpo-disk-probe-*"))  # the probe leaves nothing behind
    (fs / "filler").unlink()  # with space again, the same error is not the disk's: it passes unchanged
    with pytest.raises(type(gathered)):
        with plain_disk_errors(fs / "optimizer"):
            raise gathered
