"""Writes that fail for a disk reason, recognised the same way by every writer (learner ranks, buffer shards,
the driver) whatever wraps the error on its way.

    err = disk_error(exc)               # the OSError (ENOSPC, EDQUOT, EIO, EROFS) behind exc, or None
    with plain_disk_errors(folder):     # in a Ray actor: raise it again as a plain OSError
        dcp.save(...)

The errno hides in different places: torch's zip writer turns a failed write into `RuntimeError: [enforce fail
at inline_container.cc:672] . unexpected pos 704 vs 598` whose `__context__` is the OSError; DCP wraps that
in a `CheckpointException` (a BaseException) holding each rank's exception in `failures`; Ray wraps an actor's
exception in a `RayTaskError` holding it in `cause`, and pickling drops `__context__` and `__cause__`. So an
actor converts the error to a plain OSError before it leaves (`plain_disk_errors`), and the driver still walks
every link (`disk_error`).
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


@contextmanager
def plain_disk_errors(folder: str | os.PathLike) -> Iterator[None]:
    """A disk error raised inside is raised again as a plain `OSError(errno, strerror, filename)` (the file, or
    `folder` when the error did not name one), which crosses Ray whole; any other error passes unchanged."""
    try:
        yield
    except BaseException as e:
        err = disk_error(e)
        if err is None or err is e and err.filename:
            raise
        raise OSError(err.errno, err.strerror or os.strerror(err.errno), err.filename or str(folder)) from e
