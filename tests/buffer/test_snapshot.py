"""Snapshots: round trip of the whole shard state; damaged files refused whole."""

import msgpack
import pytest

from buffer.core import ShardCore
from buffer.snapshot import MAGIC, SnapshotError, load_core, read_snapshot, save_core, snapshot_path, write_snapshot
from tests.buffer.helpers import group_for, make_questions
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


def test_round_trip_restores_everything(tmp_path):
    core = busy_core()
    path = save_core(core, tmp_path)
    assert path == snapshot_path(tmp_path, 0)
    back = load_core(core.cfg, make_questions(30), path)
    assert back.state() == core.state()
    assert back.accounting() == core.accounting() and back.metrics() == core.metrics()
    # same future: the RNG, dataset cursor and leases came back too
    a = [(it.question.id, it.num_samples, it.replay) for it in core.lease("g", 4, now=NOW + 1)]
    b = [(it.question.id, it.num_samples, it.replay) for it in back.lease("g", 4, now=NOW + 1)]
    assert a == b
    for lid, x in core.leases.items():
        y = back.leases[lid]
        assert (y.replay, [r.tobytes() for r in y.candidates]) == (x.replay, [r.tobytes() for r in x.candidates])


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
    state = core.state()
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
    assert [p.name for p in tmp_path.iterdir()] == ["buffer-shard-0.msgpack"]
    assert snapshot_path(tmp_path, 0).read_bytes() != first
    assert msgpack.unpackb(first[48:], raw=False)["shard"] == 0
