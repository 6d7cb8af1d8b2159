"""Shard snapshots: msgpack files written atomically, with a checksum, refused whole when damaged.

File layout: MAGIC (8 bytes) | blake2b-256 of the body (32 bytes) | body length (8 bytes, little
endian) | body = msgpack of the shard state (`ShardCore.state()`).

`write_snapshot` writes a temp file in the same folder, fsyncs it and renames it over the target, so a
crash leaves either the old or the new file. `read_snapshot` checks magic, length, checksum and
format before anything is built; the caller builds a NEW core from the result, so a refused file
leaves the running state untouched.
"""

from __future__ import annotations

import hashlib
import os
import struct
import tempfile
from pathlib import Path

import msgpack

MAGIC = b"EXGRPOB\x01"
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
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return len(data)


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
    """Write `core`'s state to `folder`/buffer-shard-<i>.msgpack."""
    path = snapshot_path(folder, core.shard)
    write_snapshot(path, core.state())
    return path


def load_core(cfg, questions, path: str | os.PathLike, *, batch_share: int | None = None):
    """A new ShardCore from a snapshot file; SnapshotError on anything wrong (no partial state)."""
    from buffer.core import ShardCore

    state = read_snapshot(path)
    try:
        return ShardCore.from_state(cfg, questions, state, batch_share=batch_share)
    except (KeyError, TypeError, ValueError) as e:
        raise SnapshotError(f"buffer snapshot {path} does not fit this shard: {type(e).__name__}: {e}") from None
