"""Snapshots: round trip of the whole shard state; incremental segments; damaged files refused whole."""

import os
import shutil

import msgpack
import numpy as np
import pytest

from buffer.core import ShardCore
from buffer.snapshot import (MAGIC, SnapshotError, check_snapshot, load_core, read_snapshot, save_core, segment_target,
                             snapshot_path, write_snapshot)
from buffer.keys import make_key
from buffer.records import record_digest, record_to_rollout
from buffer.segments import SEGMENT_MAGIC
from tests.buffer.helpers import group_for, make_questions, rollout
from tests.buffer.test_core import NOW, cfg


def busy_core() -> ShardCore:
    """A shard with stored experience, retired questions, outstanding replay leases and ready groups."""
    core = ShardCore(cfg(collect_before_mixed=True, max_lag=3, batch_questions=4), make_questions(30))
    core.set_mixed_mode()
    items = core.lease("g", 8, now=NOW)
    core.submit([group_for(it, n) for it, n in zip(items, [1, 2, 3, 4, 0, 2, 1, 3])], now=NOW)
    core.take(0, 4, 0)
    later = core.lease("g", 6, now=NOW)
    core.submit([group_for(later[0], 2, version=1, seed=3)], now=NOW)
    assert core.leases and core.ready_fresh and core.store.retired and core.store.total
    assert any(x.replay for x in core.leases.values())
    return core


def view(core: ShardCore) -> tuple:
    """Everything a core holds, comparable: its state without the store, and the store's contents."""
    store = [(q, e.bucket, [r.tobytes() for r in e.recs], list(e.ents), list(e.evers), list(e.times))
             for q, e in core.store.entries.items()]
    return core.state({}), store, core.store.total, core.store.bytes, core.store.replay_hist, core.store.retired


def segments(folder) -> list[str]:
    return sorted(p.name for p in folder.glob("*.seg"))


def test_round_trip_restores_everything(tmp_path):
    core = busy_core()
    path = save_core(core, tmp_path)
    assert path == snapshot_path(tmp_path, 0)
    back = load_core(core.cfg, make_questions(30), path)
    assert view(back) == view(core)
    assert back.accounting() == core.accounting() and back.metrics() == core.metrics()
    # same future: the RNG, dataset cursor and leases came back too
    a = [(it.question.id, it.num_samples, it.replay) for it in core.lease("g", 4, now=NOW + 1)]
    b = [(it.question.id, it.num_samples, it.replay) for it in back.lease("g", 4, now=NOW + 1)]
    assert a == b
    for lid, x in core.leases.items():
        y = back.leases[lid]
        assert (y.replay, [r.tobytes() for r in y.candidates]) == (x.replay, [r.tobytes() for r in x.candidates])


def big_store_core(questions: int = 200, per_question: int = 4, tokens: int = 300) -> ShardCore:
    core = ShardCore(cfg(group_size=8, max_traj_per_question=8), make_questions(questions))
    for q in range(questions):
        rs = [rollout([q, j] + [7] * tokens, 1.0, entropy=0.1 * j) for j in range(per_question)]
        core.store.observe(f"q{q}", per_question, rs, collect=True)
    return core


def test_a_snapshot_writes_only_what_changed_and_restores_exactly(tmp_path):
    core = big_store_core()
    save_core(core, tmp_path)
    full = sum(p.stat().st_size for p in tmp_path.iterdir())
    first = segments(tmp_path)
    # 1% of the trajectories change: new ones for two questions, learner feedback and replays for others
    core.store.observe("q3", 5, [rollout([3, 99] + [5] * 300, 1.0, entropy=0.01)], collect=True)
    core.store.observe("q4", 5, [rollout([4, 99] + [5] * 300, 1.0, entropy=0.02)], collect=True)
    keys = [make_key(f"q{q}", record_digest(core.store.entries[f"q{q}"].recs[0])) for q in range(10, 20)]
    core.store.feedback(keys, [0.5] * len(keys), version=3, chosen=keys[:4])
    before = {p.name: p.stat().st_ino for p in tmp_path.glob("*.seg")}
    save_core(core, tmp_path)
    new = [n for n in segments(tmp_path) if n not in first]
    assert len(new) == 1 and set(first) <= set(segments(tmp_path))
    assert all(tmp_path.joinpath(n).stat().st_ino == before[n] for n in first)  # old segments untouched
    delta = tmp_path.joinpath(new[0]).stat().st_size
    assert delta == len(SEGMENT_MAGIC) + 2 * (4 + 4 * (8 + 2 * 302))  # exactly the two new records
    manifest = snapshot_path(tmp_path, 0).stat().st_size
    assert delta + manifest < 0.1 * full  # the manifest is ~40 bytes per record: small beside the records
    back = load_core(core.cfg, make_questions(200), snapshot_path(tmp_path, 0))
    assert view(back) == view(core)


def test_sparse_segments_are_compacted_and_their_files_removed(tmp_path):
    core = big_store_core()
    save_core(core, tmp_path)
    (first,) = segments(tmp_path)
    for q in range(0, 150):  # three quarters of the store goes: its segment is now mostly dead bytes
        core.store.observe(f"q{q}", 8, [], collect=True, retire=True)
    save_core(core, tmp_path)
    assert first not in segments(tmp_path) and len(segments(tmp_path)) == 1
    live = sum(4 + r.nbytes for e in core.store.entries.values() for r in e.recs)
    assert tmp_path.joinpath(segments(tmp_path)[0]).stat().st_size == len(SEGMENT_MAGIC) + live
    assert view(load_core(core.cfg, make_questions(200), snapshot_path(tmp_path, 0))) == view(core)


def test_every_folder_is_complete_on_its_own(tmp_path):
    """Checkpoints go to a new folder each time (then renamed): segments are linked, never shared by path."""
    core = big_store_core(questions=40)
    live, ckpt = tmp_path / "live", tmp_path / "step-1.partial"
    save_core(core, live)
    core.store.observe("q1", 5, [rollout([1, 99] + [5] * 300, 1.0)], collect=True)
    save_core(core, ckpt)
    for name in segments(live):  # the live folder's segment is linked, not copied
        assert ckpt.joinpath(name).stat().st_ino == live.joinpath(name).stat().st_ino
    ckpt.rename(tmp_path / "step-1")  # the driver commits a checkpoint by renaming its folder
    core.store.observe("q2", 5, [rollout([2, 99] + [5] * 300, 1.0)], collect=True)
    save_core(core, live)  # the renamed folder's new segment is gone from its known path: rewritten here
    for folder in (live, tmp_path / "step-1"):
        check_snapshot(folder, 0)
    assert view(load_core(core.cfg, make_questions(40), snapshot_path(live, 0))) == view(core)
    shutil.rmtree(live)  # deleting one folder never breaks another
    back = load_core(core.cfg, make_questions(40), snapshot_path(tmp_path / "step-1", 0))
    assert back.store.total == core.store.total - 1
    save_core(back, tmp_path / "step-2")  # a restored store links the segments it was loaded from
    assert all(os.path.samefile(p, tmp_path / "step-1" / p.name) for p in (tmp_path / "step-2").glob("*.seg")
               if (tmp_path / "step-1" / p.name).exists())


def test_a_damaged_or_missing_segment_is_refused(tmp_path):
    core = big_store_core(questions=20)
    save_core(core, tmp_path)
    (seg,) = tmp_path.glob("*.seg")
    data = bytearray(seg.read_bytes())
    data[100] ^= 0xFF
    seg.write_bytes(bytes(data))
    with pytest.raises(SnapshotError, match="corrupt"):
        load_core(core.cfg, make_questions(20), snapshot_path(tmp_path, 0))
    seg.write_bytes(bytes(data[:-10]))
    for check in (lambda: check_snapshot(tmp_path, 0),
                  lambda: load_core(core.cfg, make_questions(20), snapshot_path(tmp_path, 0))):
        with pytest.raises(SnapshotError, match="wrong size|manifest says"):
            check()
    seg.unlink()
    with pytest.raises(SnapshotError, match="missing"):
        load_core(core.cfg, make_questions(20), snapshot_path(tmp_path, 0))


def _corrupt(path, fn):
    data = bytearray(path.read_bytes())
    path.write_bytes(bytes(fn(data)))


@pytest.mark.parametrize("damage,message", [
    (lambda d: d[: len(d) // 2], "truncated"),
    (lambda d: d[:20], "truncated"),
    (lambda d: d[:-1] + bytes([d[-1] ^ 0xFF]), "checksum"),
    (lambda d: b"NOTASNAP" + d[8:], "bad magic"),
    (lambda d: MAGIC[:-1] + bytes([MAGIC[-1] + 1]) + d[8:], "format version"),
])
def test_damaged_snapshot_is_refused_with_a_clear_error(tmp_path, damage, message):
    core = busy_core()
    path = save_core(core, tmp_path)
    _corrupt(path, damage)
    with pytest.raises(SnapshotError, match=message):
        load_core(core.cfg, make_questions(30), path)


def test_wrong_state_version_or_other_dataset_is_refused(tmp_path):
    core = busy_core()
    state, _ = core.snapshot_state(segment_target(tmp_path, 0))
    state["state_version"] = 99
    write_snapshot(tmp_path / "v.msgpack", state)
    with pytest.raises(SnapshotError, match="state version 99"):
        load_core(core.cfg, make_questions(30), tmp_path / "v.msgpack")
    path = save_core(core, tmp_path)
    with pytest.raises(SnapshotError, match="different question set"):
        load_core(core.cfg, make_questions(31), path)
    with pytest.raises(SnapshotError, match="no buffer snapshot"):
        read_snapshot(tmp_path / "missing.msgpack")


def test_write_is_atomic_and_leaves_no_temp_files(tmp_path):
    core = busy_core()
    save_core(core, tmp_path)
    first = snapshot_path(tmp_path, 0).read_bytes()
    core.lease("g", 1, now=NOW)
    save_core(core, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.endswith(".seg")) == ["buffer-shard-0.msgpack"]
    assert not list(tmp_path.glob("*.tmp"))
    assert snapshot_path(tmp_path, 0).read_bytes() != first
    assert msgpack.unpackb(first[48:], raw=False, strict_map_key=False)["shard"] == 0


def test_learner_logprobs_replacing_written_records_reach_the_next_snapshot(tmp_path):
    """A stored trajectory whose log-probs the learner replaced (learner.loss.store_learner_logprobs) after it was
    written is written again by the next snapshot (as a new record: the old segment no longer counts it), and a
    restore holds the learner's log-probs."""
    core = big_store_core(questions=20)
    save_core(core, tmp_path)
    keys = [make_key(f"q{q}", record_digest(core.store.entries[f"q{q}"].recs[1])) for q in range(3)]
    lps = [np.full(302, -0.25 * (q + 1), np.float32) for q in range(3)]
    core.store.feedback([], [], version=1, fresh_keys=keys, fresh_entropies=[0.5] * 3, fresh_logprobs=lps)
    assert core.store.c.logprobs_from_learner == 3
    save_core(core, tmp_path)
    back = load_core(core.cfg, make_questions(20), snapshot_path(tmp_path, 0))
    assert view(back) == view(core)
    for q in range(3):
        rec = back.store.entries[f"q{q}"].recs[1]
        np.testing.assert_array_equal(record_to_rollout(rec, f"q{q}").logprobs, lps[q])
