"""A snapshot that a full disk cuts short leaves no segment under a segment's name, so nothing of it is kept or
linked by a later snapshot; once there is space, the next snapshot is complete and restores exactly. On a
real small tmpfs (skipped, saying why, where the machine cannot mount one)."""

from __future__ import annotations

import errno

import pytest

from buffer.snapshot import check_snapshot, load_core, save_core, snapshot_path
from tests.buffer.helpers import make_questions, rollout
from tests.buffer.test_snapshot import big_store_core, view
from tests.small_fs import fill, free, small_fs

QUESTIONS = 50


@pytest.fixture
def fs(tmp_path):
    with small_fs(tmp_path / "fs", 4) as path:
        yield path


def _grow(core, n: int) -> None:
    """New trajectories for `n` questions: the next snapshot writes a new segment of ~n * 1.3 kB."""
    for q in range(n):
        core.store.observe(f"q{q}", 5, [rollout([q, 77] + [6] * 300, 1.0, entropy=0.05)], collect=True)


@pytest.mark.parametrize("cut", ["new segment", "copy of a kept segment"])
def test_a_snapshot_cut_short_by_a_full_disk_is_never_linked_into_a_later_one(tmp_path, fs, cut):
    core = big_store_core(questions=QUESTIONS)
    save_core(core, tmp_path / "step-2")  # another file system: kept segments are copied into fs, not linked
    kept = sum(p.stat().st_size for p in (tmp_path / "step-2").glob("*.seg"))
    _grow(core, QUESTIONS)
    # "new segment": no room even for the new records; "copy...": room for them, not for the kept segments too
    filler = fill(fs, leave=20_000 if cut == "new segment" else kept // 2 + 70_000)
    with pytest.raises(OSError) as info:
        save_core(core, fs / "step-4")
    assert info.value.errno == errno.ENOSPC
    assert not list((fs / "step-4").glob("*.seg")), "a cut-short segment kept a segment's name"
    assert not list((fs / "step-4").glob("*.tmp")) and not snapshot_path(fs / "step-4", 0).exists()
    assert not any("step-4" in p for g in core.store.segments.values() for p in g.paths)

    filler.unlink()
    assert free(fs) > 2 * kept
    for folder in (fs / "step-4", fs / "step-6"):  # the same folder again, and a new one
        save_core(core, folder)
        check_snapshot(folder, 0)  # every referenced segment present at its size
        back = load_core(core.cfg, make_questions(QUESTIONS), snapshot_path(folder, 0))  # checksums verified
        assert view(back) == view(core)
