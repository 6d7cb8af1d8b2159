"""Shard snapshots: a manifest written atomically plus append-only segment files, all checksummed, refused
whole when damaged.

A shard's snapshot in a folder is `buffer-shard-<i>.msgpack` (the manifest) and `buffer-shard-<i>.<name>.seg`
files (the trajectory records); a snapshot writes only the records added since the last one, and every folder
is complete on its own. `write_snapshot` replaces the manifest whole (`common.disk.atomic_write_bytes`: a crash
leaves the old or the new file); `read_snapshot` checks magic, length, checksum and format before anything is
built.

Details (the manifest layout, hard-linked segments, refusal): docs/internals.md#buffersnapshotpy
"""

from __future__ import annotations

import errno
import hashlib
import mmap
import os
import re
import shutil
import struct
from pathlib import Path

import msgpack

from common.disk import atomic_write_bytes

MAGIC = b"EXGRPOB\x02"
"""The last byte is the file format version."""
_HEADER = len(MAGIC) + 32 + 8


class SnapshotError(ValueError):
    """A snapshot file is missing, truncated, corrupt or of another format version."""


def snapshot_path(folder: str | os.PathLike, shard: int) -> Path:
    return Path(folder) / f"buffer-shard-{shard}.msgpack"


def write_snapshot(path: str | os.PathLike, state: dict) -> int:
    """Atomically write `state` to `path`; returns the file size in bytes."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    body = msgpack.packb(state, use_bin_type=True)
    data = MAGIC + hashlib.blake2b(body, digest_size=32).digest() + struct.pack("<Q", len(body)) + body
    return atomic_write_bytes(path, data)


def read_snapshot(path: str | os.PathLike) -> dict:
    """Read and validate a snapshot file; raises SnapshotError saying what is wrong."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise SnapshotError(f"no buffer snapshot at {path}") from None
    if len(data) < _HEADER:
        raise SnapshotError(f"buffer snapshot {path} is truncated ({len(data)} bytes, header alone is {_HEADER})")
    if data[: len(MAGIC) - 1] != MAGIC[:-1]:
        raise SnapshotError(f"{path} is not a buffer snapshot (bad magic bytes)")
    if data[len(MAGIC) - 1] != MAGIC[-1]:
        raise SnapshotError(f"buffer snapshot {path} has format version {data[len(MAGIC) - 1]}, "
                            f"this build reads version {MAGIC[-1]}")
    digest = data[len(MAGIC) : len(MAGIC) + 32]
    (n,) = struct.unpack("<Q", data[len(MAGIC) + 32 : _HEADER])
    body = data[_HEADER:]
    if len(body) != n:
        raise SnapshotError(f"buffer snapshot {path} is truncated or padded: body has {len(body)} bytes, header says {n}")
    if hashlib.blake2b(body, digest_size=32).digest() != digest:
        raise SnapshotError(f"buffer snapshot {path} is corrupt (checksum mismatch)")
    try:
        state = msgpack.unpackb(body, raw=False, strict_map_key=False)
    except Exception as e:  # msgpack raises many types; the checksum passed, so this is a writer bug
        raise SnapshotError(f"buffer snapshot {path} does not decode: {type(e).__name__}: {e}") from None
    if not isinstance(state, dict):
        raise SnapshotError(f"buffer snapshot {path} does not hold a shard state")
    return state


def save_core(core, folder: str | os.PathLike) -> Path:
    """Snapshot `core` into `folder` (single-threaded use: plan, write, mark). Returns the manifest's path."""
    target = segment_target(folder, core.shard)
    state, plan = core.snapshot_state(target)
    written = write_shard_snapshot(folder, core.shard, state, plan)
    core.store.mark_written(plan, written, target)
    return snapshot_path(folder, core.shard)


def segment_target(folder: str | os.PathLike, shard: int):
    """segment name -> its file in `folder` (shard `shard`); SnapshotError for a name that is not a segment's (a
    manifest read from disk never leads outside its folder)."""
    folder = Path(folder)

    def target(name) -> Path:
        if not isinstance(name, str) or not _SEGMENT_NAME.fullmatch(name) or type(shard) is not int:
            raise SnapshotError(f"buffer snapshot in {folder} names segment {name!r}, which is not a segment's name")
        return folder / f"buffer-shard-{shard}.{name}.seg"

    return target


_SEGMENT_NAME = re.compile(r"[0-9a-f]{1,32}-[0-9]{1,12}")
"""`ExperienceStore`'s segment names: its hex prefix and the segment id."""


def write_shard_snapshot(folder: str | os.PathLike, shard: int, state: dict, plan) -> dict[int, tuple[str, int, str]]:
    """Write what `plan` (`ExperienceStore.plan_snapshot`) asks into `folder`: its new segments (fsynced),
    links (or copies, across file systems) of the old segments it keeps, then the manifest `state`
    atomically, then remove this shard's segments the manifest no longer references. A crash at any point
    leaves the previous manifest and every segment it references; a failed write (a full disk) also removes
    the new segments, and no segment cut short ever has a segment's name (`_write_segment`). Returns new
    segment id -> (name, size, digest), for `ExperienceStore.mark_written`."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    target = segment_target(folder, shard)
    written: dict[int, tuple[str, int, str]] = {}
    try:
        for sid, recs in plan.new.items():
            written[sid] = (plan.names[sid], *_write_segment(target(plan.names[sid]), recs))
        for sid, src in plan.keep.items():
            if src is not None:
                _link(src, target(state["store"]["segments"][sid][0]))
        state["store"]["segments"].update({sid: list(v) for sid, v in written.items()})
        write_snapshot(snapshot_path(folder, shard), state)
    except BaseException:  # (a full disk): the folder keeps its previous manifest and what that references
        for name, _, _ in written.values():
            target(name).unlink(missing_ok=True)
        raise
    referenced = {target(v[0]).name for v in state["store"]["segments"].values()}
    for f in folder.glob(f"buffer-shard-{shard}.*.seg"):
        if f.name not in referenced:
            f.unlink(missing_ok=True)
    return written


def _write_segment(path: Path, recs) -> tuple[int, str]:
    """Write a segment under a temporary name, fsync it, then give it its name: a write cut short (a full disk,
    an I/O error) leaves no file under a segment's name, so none can be kept or linked into a later snapshot."""
    from buffer.segments import SEGMENT_MAGIC

    h = hashlib.blake2b(digest_size=32)

    def hashed():
        for chunk in _segment_chunks(SEGMENT_MAGIC, recs):
            h.update(chunk)
            yield chunk

    size = atomic_write_bytes(path, hashed())
    return size, h.hexdigest()


def _segment_chunks(magic: bytes, recs, chunk_bytes: int = 4 << 20):
    """The segment's bytes in chunks of ~4 MiB (one write and hash call per chunk, not per record)."""
    buf = bytearray(magic)
    for r in recs:
        buf += struct.pack("<I", r.size)
        buf += r.tobytes()
        if len(buf) >= chunk_bytes:
            yield bytes(buf)
            buf.clear()
    if buf:
        yield bytes(buf)


def _link(src: str, dst: Path) -> None:
    if dst.is_file() and dst.stat().st_size == os.path.getsize(src):
        return  # same name, same content: written once, linked since
    tmp = dst.with_name(dst.name + f".{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)
    try:
        try:
            os.link(src, tmp)
        except OSError as e:  # another file system (or no hard links): copy
            if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EROFS):
                raise
            shutil.copyfile(src, tmp)
        os.replace(tmp, dst)
    except BaseException:
        tmp.unlink(missing_ok=True)  # a copy cut short never takes the segment's name
        raise


def open_segment(path: Path, size: int, digest: str) -> mmap.mmap:
    """A segment file mapped read-only, after checking its size, magic bytes and checksum."""
    from buffer.segments import SEGMENT_MAGIC

    try:
        actual = path.stat().st_size
    except FileNotFoundError:
        raise SnapshotError(f"buffer snapshot segment {path} is missing (the snapshot folder was copied "
                            "without its .seg files?)") from None
    if actual != size:
        raise SnapshotError(f"buffer snapshot segment {path} has {actual} bytes, its manifest says {size} "
                            "(truncated or overwritten)")
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    if mm[: len(SEGMENT_MAGIC)] != SEGMENT_MAGIC or hashlib.blake2b(mm, digest_size=32).hexdigest() != digest:
        mm.close()
        raise SnapshotError(f"buffer snapshot segment {path} is corrupt (bad magic bytes or checksum mismatch)")
    return mm


def check_snapshot(folder: str | os.PathLike, shard: int) -> None:
    """Cheap validation (manifest checksum, every referenced segment present at its size); SnapshotError."""
    path = snapshot_path(folder, shard)
    state = read_snapshot(path)
    target = segment_target(folder, shard)
    try:
        segments = state["store"]["segments"].values()
    except (KeyError, AttributeError, TypeError):
        raise SnapshotError(f"buffer snapshot {path} does not hold a shard state") from None
    for name, size, _ in segments:
        seg = target(name)
        if not seg.is_file() or seg.stat().st_size != size:
            raise SnapshotError(f"buffer snapshot segment {seg} is missing or has the wrong size")


def load_core(cfg, questions, path: str | os.PathLike, *, batch_share: int | None = None,
              shares: list[int] | None = None):
    """A new ShardCore from a snapshot manifest and its segments; SnapshotError on anything wrong (no
    partial state)."""
    from buffer.core import ShardCore

    path = Path(path)
    state = read_snapshot(path)
    target = segment_target(path.parent, state.get("shard"))
    try:
        core = ShardCore.from_state(cfg, questions, state, batch_share=batch_share, shares=shares,
                                    open_segment=lambda name, size, digest: open_segment(target(name), size, digest))
    except (KeyError, TypeError, ValueError, struct.error) as e:
        if isinstance(e, SnapshotError):
            raise
        raise SnapshotError(f"buffer snapshot {path} does not fit this shard: {type(e).__name__}: {e}") from None
    core.store.opened_from(target)
    return core
