"""Writes that fail for a disk reason, recognised the same way by every writer (learner ranks, buffer shards,
the driver) whatever wraps the error on its way.

    err = disk_error(exc)               # the OSError (ENOSPC, EDQUOT, EIO, EROFS) behind exc, or None
    with plain_disk_errors(folder):     # in a Ray actor: raise it again as a plain OSError
        dcp.save(...)

An actor converts the error to a plain OSError before it leaves; the driver walks every link of what arrives;
when no errno is found the disk itself is asked (`probe_disk`).
Where torch, DCP and Ray hide the errno: docs/internals.md#commondiskpy
"""

from __future__ import annotations

import errno
import os
import re
from collections.abc import Iterator
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
