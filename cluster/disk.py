"""Will the next checkpoint fit, and the one line a disk fault gets.

    need = folder_bytes(previous checkpoint) or first_checkpoint_bytes(params, dtype_bytes, master, buffer_bytes)
    if need > free_bytes(folder): DiskFault(step, folder, free, last, need=need)      # refused before writing
    except ...: DiskFault(step, folder, free, last, error=disk_error(e))             # a write failed anyway
    fault.line(): disk full / disk quota / I/O error / read-only: what, where, how much, the last complete one

What the driver then does (`checkpoint.on_full_disk`: stop with EXIT_DISK, or skip and train on) is
`cluster.checkpointer.Checkpointer`. Pure functions over paths and numbers: no Ray.
"""

from __future__ import annotations

import errno
import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path


def free_bytes(folder: str | os.PathLike) -> int | None:
    """Bytes a write into `folder` (or its nearest existing parent) may still use (statvfs f_bavail: what is
    left to ordinary users; root's reserve is not counted). None when the file system does not say (no size:
    f_blocks 0, as some network and FUSE file systems report): no checkpoint is refused on that account."""
    p = Path(folder).absolute()
    while not p.exists():
        p = p.parent
    st = os.statvfs(p)
    return st.f_bavail * st.f_frsize if st.f_blocks else None


def not_writable(folder: str | os.PathLike) -> OSError | None:
    """Why nothing can be written into `folder` (or its nearest existing parent), before trying: a read-only file
    system (EROFS, from statvfs's flags: a read-only mount still reports its free bytes), or a folder this user may
    not write (EACCES). None: writable as far as can be told without writing."""
    p = Path(folder).absolute()
    while not p.exists():
        p = p.parent
    if os.statvfs(p).f_flag & os.ST_RDONLY:
        return OSError(errno.EROFS, os.strerror(errno.EROFS), str(p))
    if not os.access(p, os.W_OK | os.X_OK):
        return OSError(errno.EACCES, os.strerror(errno.EACCES), str(p))
    return None


def folder_bytes(folder: str | os.PathLike) -> int:
    """Bytes of the files under `folder`, each file (inode) once. The estimate of the next checkpoint: buffer
    segments it will hard-link rather than write are counted too, so the estimate errs on the safe side."""
    seen, total = set(), 0
    for root, _, files in os.walk(folder):
        for name in files:
            try:
                st = os.lstat(os.path.join(root, name))
            except FileNotFoundError:
                continue
            if (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                total += st.st_size
    return total


def model_params(model_path: str | os.PathLike) -> int:
    """Parameters of a Hugging Face model folder, read from its safetensors headers (no tensor is loaded);
    without safetensors files, the weight files' bytes / 2 (at least the parameters of a 16-bit file)."""
    files = sorted(Path(model_path).glob("*.safetensors"))
    if not files:
        return sum(f.stat().st_size for f in Path(model_path).glob("*.bin")) // 2
    n = 0
    for f in files:
        with open(f, "rb") as fh:
            (size,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(size))
        for name, spec in header.items():
            if name != "__metadata__":
                count = 1
                for d in spec["shape"]:
                    count *= d
                n += count
    return n


def first_checkpoint_bytes(params: int, dtype_bytes: int, buffer_bytes: int) -> int:
    """The first checkpoint of a run, before any exists to measure: the model folder in the compute dtype
    (`dtype_bytes` per parameter), AdamW's two float32 moments (8), the float32 master weights when the
    compute dtype is lower (4), and the buffer's stored trajectories. E.g. 0.38M parameters in float32 with
    a 10 kB buffer: 380_000 * (4 + 8) + 10_000 = 4_570_000 bytes."""
    master = 4 if dtype_bytes < 4 else 0
    return params * (dtype_bytes + 8 + master) + buffer_bytes


@dataclass(frozen=True)
class DiskFault:
    """The checkpoint of `step` the disk refused: before writing (`need` > `free`) or while writing (`error`).
    `last`: the last complete checkpoint, the one a resume takes."""

    step: int
    folder: Path
    free: int | None
    last: Path | None
    need: int | None = None
    error: OSError | None = None
    before: bool = False  # `error` found before writing (`not_writable`): nothing was written

    @property
    def space(self) -> bool:
        """Space may come back (a full disk, a quota): checkpoint.on_full_disk=skip trains on. An I/O error or a
        read-only file system always stops."""
        return self.error is None or self.error.errno in (errno.ENOSPC, errno.EDQUOT)

    def line(self) -> str:
        """One line: what failed, where, how many bytes were needed and are free, and the last complete checkpoint."""
        last = f"the last complete checkpoint is {self.last}" if self.last else "no checkpoint is complete yet"
        if self.error is None:
            return (f"disk full: the checkpoint of step {self.step} needs ~{size_text(self.need or 0)} in "
                    f"{self.folder}, {size_text(self.free)} are free; {last}")
        e = self.error
        kind = {errno.ENOSPC: "disk full", errno.EDQUOT: "disk quota exceeded", errno.EIO: "disk I/O error",
                errno.EROFS: "read-only disk", errno.EACCES: "folder not writable"}.get(e.errno, "disk error")
        where = f" ({e.filename})" if e.filename else ""
        if self.before:
            return (f"{kind}: the checkpoint of step {self.step} cannot be written into {self.folder}: {e.strerror} "
                    f"[{errno.errorcode.get(e.errno, e.errno)}]{where}; nothing was written; {last}")
        free = "free space unknown" if self.free is None else f"{size_text(self.free)} free"
        return (f"{kind}: writing the checkpoint of step {self.step} into {self.folder} failed: {e.strerror} "
                f"[{errno.errorcode.get(e.errno, e.errno)}]{where}; {free}; the partial checkpoint was removed; "
                f"{last}")


def size_text(n: int) -> str:
    """`7.1 MB (7,100,243 bytes)`: readable and exact."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit} ({n:,} bytes)"
    return f"{n:,} bytes"
