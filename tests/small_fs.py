"""A real small file system for disk-fault tests: a tmpfs of a few MB mounted by the test (a loop-mounted ext4
image where tmpfs cannot be mounted), and ways to fill it. Tests skip, saying why, where the machine allows
neither (not root, no mount in a container)."""

from __future__ import annotations

import os
import shutil
import subprocess
from contextlib import contextmanager
from pathlib import Path

import pytest


def _run(*cmd: str) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True)


@contextmanager
def small_fs(path: Path, mb: int):
    """Mount a file system of `mb` MB at `path` for the block; pytest.skip when this machine cannot."""
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a small file system needs root and mount(8)")
    image = None
    r = _run("mount", "-t", "tmpfs", "-o", f"size={mb}m", "tmpfs", str(path))
    if r.returncode != 0:
        image = path.with_name(path.name + ".img")
        with open(image, "wb") as f:
            f.truncate(mb << 20)
        made = _run("mkfs.ext4", "-q", "-m", "0", str(image))
        r = _run("mount", "-o", "loop", str(image), str(path)) if made.returncode == 0 else made
        if r.returncode != 0:
            image.unlink(missing_ok=True)
            pytest.skip(f"cannot mount a small file system here (tmpfs, then a loop-mounted ext4 image): "
                        f"{r.stderr.strip()[:200]}")
    try:
        yield path
    finally:
        _run("umount", "-l", str(path))
        if image is not None:
            image.unlink(missing_ok=True)


def free(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def fill(path: Path, leave: int = 0, name: str = "filler") -> Path:
    """Fill the file system of `path` until at most `leave` bytes are free (whatever else writes meanwhile)."""
    filler = path / name
    with open(filler, "ab") as f:
        block = b"\0" * (64 << 10)
        while free(path) > leave:
            want = min(len(block), free(path) - leave)
            try:
                f.write(block[:want])
                f.flush()
            except OSError:
                break
        os.fsync(f.fileno())
    return filler


def remount(path: Path, mode: str) -> None:
    """`mode`: "ro" or "rw"."""
    r = _run("mount", "-o", f"remount,{mode}", str(path))
    assert r.returncode == 0, r.stderr
