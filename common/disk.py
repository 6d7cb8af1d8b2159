"""Writes that fail for a disk reason, recognised the same way by every writer (learner ranks, buffer shards,
the driver) whatever wraps the error on its way; and the one way a file is replaced whole.

    err = disk_error(exc)               # the OSError (ENOSPC, EDQUOT, EIO, EROFS) behind exc, or None
    with plain_disk_errors(folder):     # in a Ray actor: raise it again as a plain OSError
        dcp.save(...)
    atomic_write_text(path, text)       # path holds the old text or the new one, never a part

An actor converts the error to a plain OSError before it leaves; the driver walks every link of what arrives;
when no errno is found the disk itself is asked (`probe_disk`).
Where torch, DCP and Ray hide the errno: docs/internals.md#commondiskpy
"""

from __future__ import annotations

import errno
import os
import re
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

DISK_ERRNOS = {
    errno.ENOSPC: "no space left on the device",
    errno.EDQUOT: "disk quota exceeded",
    errno.EIO: "I/O error",
    errno.EROFS: "read-only file system",
}
"""The errors that mean the disk, not the program, refused a write."""

_ERRNO_TEXT = re.compile(r"\[Errno (\d+)\]")


def disk_error(exc: BaseException) -> OSError | None:
    """The OSError with a DISK_ERRNOS errno behind `exc` (itself, its cause or context, a RayTaskError's
    `cause`, a DCP CheckpointException's `failures`), or one rebuilt from an `[Errno N]` in a message whose
    exception was flattened to text on its way; None when the failure is not the disk's."""
    todo, seen = [exc], set()
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in DISK_ERRNOS:
            return e
        todo += [e.__cause__, e.__context__, getattr(e, "cause", None)]
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict):
            todo += [f[0] if isinstance(f, tuple) else f for f in failures.values()]
        m = _ERRNO_TEXT.search(str(e))
        if m and int(m[1]) in DISK_ERRNOS:
            n = int(m[1])
            return OSError(n, os.strerror(n))
    return None


PROBE_BYTES = 1 << 20


def probe_disk(folder: str | os.PathLike, size: int = PROBE_BYTES) -> OSError | None:
    """The disk error met writing (and fsyncing) `size` bytes in `folder`, or its nearest existing parent, or
    None when the disk takes them; the probe file is removed either way."""
    folder = os.path.abspath(folder)
    while not os.path.isdir(folder) and os.path.dirname(folder) != folder:
        folder = os.path.dirname(folder)
    path = os.path.join(folder, f".exgrpo-disk-probe-{os.getpid()}-{os.urandom(4).hex()}")
    made = False
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)  # a new file of ours, never another's
        made = True
        try:
            block = b"\0" * min(size, 1 << 16)
            left = size
            while left > 0:
                left -= os.write(fd, block[:left])
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as e:
        return e if e.errno in DISK_ERRNOS else None
    finally:
        if made:
            try:
                os.unlink(path)
            except OSError:
                pass
    return None


@contextmanager
def plain_disk_errors(folder: str | os.PathLike) -> Iterator[None]:
    """A disk error raised inside is raised again as a plain `OSError(errno, strerror, filename)` (the file, or
    `folder` when the error did not name one), which crosses Ray whole; any other error passes unchanged. An
    error that carries no errno counts as the disk's when the disk then refuses a probe write (`probe_disk`)."""
    try:
        yield
    except BaseException as e:  # DCP's CheckpointException is a BaseException
        if isinstance(e, (KeyboardInterrupt, SystemExit, GeneratorExit)):
            raise
        err = disk_error(e)
        if err is None and (probed := probe_disk(folder)) is not None:
            err = OSError(probed.errno, probed.strerror, str(folder))
        if err is None or err is e and err.filename:
            raise
        raise OSError(err.errno, err.strerror or os.strerror(err.errno), err.filename or str(folder)) from e


def atomic_write_bytes(path: str | os.PathLike, data: bytes | Iterable[bytes]) -> int:
    """Replace `path` with `data` (bytes, or chunks written as an iterable yields them) whole: after a crash or a
    failed write `path` holds its old content or the new, never a part. The bytes go to a temp file beside it
    (`.NAME.PID-RANDOM.tmp`, made with `O_EXCL` and the process's umask, as a plain open makes a file), which is
    fsynced, renamed over `path` (`os.replace`), then the folder is fsynced so that the rename itself is on disk.
    A failure (a full disk) removes the temp file and raises. Returns the bytes written."""
    path = os.path.abspath(path)
    folder, name = os.path.split(path)
    tmp = os.path.join(folder, f".{name}.{os.getpid()}-{os.urandom(4).hex()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    size = 0
    try:
        with os.fdopen(fd, "wb") as f:
            for chunk in (data,) if isinstance(data, (bytes, bytearray, memoryview)) else data:
                size += f.write(chunk)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    fsync_folder(folder)
    return size


def atomic_write_text(path: str | os.PathLike, text: str) -> int:
    """`atomic_write_bytes` of `text` in UTF-8."""
    return atomic_write_bytes(path, text.encode())


def fsync_folder(folder: str | os.PathLike) -> None:
    """Put a folder's entries (a file renamed or made in it) on disk. A file system that cannot sync a folder
    (EINVAL, ENOTSUP) is left as it is; a disk error is raised."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno not in (errno.EINVAL, errno.ENOTSUP):
            raise
    finally:
        os.close(fd)
