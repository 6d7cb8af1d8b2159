"""What a device call brings back, within the device tool's limits: pack $OUT at a call's end, unpack it here.

    python3 scripts/device_out.py pack OUT [--keep NAME ...] [--cache FOLDER] [--cache-first PREFIX ...]
    python3 scripts/device_out.py unpack FILES_AT DEST [--cache-to FOLDER]

The device tool brings back at most 8 files from $OUT, 16 MiB each and 64 MiB together, no more than 2 folders
down (/work/.library/device/README.md, "Limits"); whatever else is there is left out. A bench lease writes a JSON
and a log per part (12 and more files) and inductor's compiled artifacts (49.7 MB for the 1.5B defaults alone, one
file): unpacked, most of it never comes back, the artifacts least of all. So the lease scripts
(scripts/device_bench.sh, scripts/device_e2e.sh) call `pack` last, which leaves in OUT:

    the --keep files     as they are (the summary JSON, the console log: readable without unpacking)
    results.tar.gz       everything else but the cache folder, gzip'd
    compile-cache.tar    the --cache folder: each artifact file gzip'd (.bin.gz), the small files as they are;
                         artifacts whose prefix is given first with --cache-first (the defaults' build) go in first,
                         each further one only while it fits what is left of the 8 files and 64 MiB, and the
                         CARRY_ROOM the next call can carry beside the tree and the wheels
    NAME.000of002, ...   any of these over 16 MiB, in pieces of 15 MiB

and prints one line per file brought back and per file left out, with the reason. `unpack` joins the pieces,
extracts both archives into DEST, and with --cache-to merges the cache folder (artifacts still gzip'd, which
`learner.compile_cache.load_compile_cache` reads) into the folder the next call carries. Standard library only: it
runs on the device image's python3.
"""

from __future__ import annotations

import argparse
import gzip
import io
import re
import shutil
import sys
import tarfile
import time
from pathlib import Path

MAX_FILES = 8  # what one call brings back from $OUT
MAX_FILE = 16 * 2**20
MAX_TOTAL = 64 * 2**20
CHUNK = 15 * 2**20  # a piece, under MAX_FILE
CARRY_ROOM = 52 * 2**20  # the cache travels back in: 64 MiB a call, less the tree (~3 MB) and wheels/ (~3 MB)
RESULTS = "results.tar.gz"
CACHE = "compile-cache.tar"
PIECE = re.compile(r"^(?P<name>.+)\.(?P<index>\d{3})of(?P<count>\d{3})$")
NAME_OK = re.compile(r"^[A-Za-z0-9._-]+$")


def _mb(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 1024:.1f} kB" if n >= 1024 else f"{n} B"


def _pieces(path: Path) -> list[Path]:
    """`path` itself when it fits one returned file, else NAME.000of003, NAME.001of003, ... of CHUNK bytes (it is
    removed): each piece says how many there are, so a missing last one is found."""
    size = path.stat().st_size
    if size <= MAX_FILE:
        return [path]
    n, out = _n_pieces(size), []
    with open(path, "rb") as f:
        for i in range(n):
            piece = path.with_name(f"{path.name}.{i:03d}of{n:03d}")
            piece.write_bytes(f.read(CHUNK))
            out.append(piece)
    path.unlink()
    return out


def _n_pieces(size: int) -> int:
    return 1 if size <= MAX_FILE else -(-size // CHUNK)


def _cache_members(folder: Path, first: list[str]) -> tuple[list[tuple[str, bytes]], list[tuple[str, bytes]]]:
    """(small files as they are, artifacts gzip'd in the order they are wanted). An artifact saved this call
    (X.bin) replaces the one carried in (X.bin.gz)."""
    small, artifacts = [], []
    files = sorted(p for p in folder.iterdir() if p.is_file())
    fresh = {p.name for p in files if p.name.endswith(".bin")}
    for p in files:
        if p.name.endswith(".bin"):
            artifacts.append((p.name + ".gz", gzip.compress(p.read_bytes(), compresslevel=6)))
        elif p.name.endswith(".bin.gz"):
            if p.name[:-3] not in fresh:
                artifacts.append((p.name, p.read_bytes()))
        else:
            small.append((p.name, p.read_bytes()))

    def rank(item: tuple[str, bytes]) -> tuple[int, str]:
        hits = [i for i, prefix in enumerate(first) if item[0].startswith(prefix)]
        return (hits[0] if hits else len(first), item[0])

    return small, sorted(artifacts, key=rank)


def _tar_bytes(members: list[tuple[str, bytes]], root: str) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data in members:
            info = tarfile.TarInfo(f"{root}/{name}")
            info.size, info.mtime = len(data), int(time.time())
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def _inside(p: Path, folder: Path | None) -> bool:
    return folder is not None and (p.resolve() == folder.resolve() or folder.resolve() in p.resolve().parents)


def _pack_results(out: Path, kept: list[Path], cache: Path | None) -> Path:
    """Every file of `out` but the kept ones and the cache folder's into RESULTS (gzip'd tar), then removed, with
    the folders they leave empty."""
    rest = sorted(p for p in out.rglob("*") if p.is_file() and p not in kept and not _inside(p, cache))
    results, tmp = out / RESULTS, out / (RESULTS + ".tmp")
    with tarfile.open(tmp, "w:gz", compresslevel=6) as tar:
        for p in rest:
            tar.add(p, arcname=str(p.relative_to(out)))
    for p in rest:
        p.unlink()
    for d in sorted((p for p in out.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True):
        if not _inside(d, cache) and not any(d.iterdir()):
            d.rmdir()
    tmp.replace(results)
    return results


def _pack_cache(out: Path, cache: Path, first: list[str], files: int, size: int, carry_room: int) -> list[str]:
    """The cache folder into CACHE (`_cache_members`: small files, then artifacts in the order wanted while the
    whole still fits `files` more returned files, `size` more bytes and `carry_room`), the folder removed; the
    lines saying what went in and what was left out."""
    small, artifacts = _cache_members(cache, first)
    taken, lines = [], []
    for name, data in artifacts:
        whole = len(_tar_bytes(small + taken + [(name, data)], cache.name))
        if _n_pieces(whole) <= files and whole <= min(size, carry_room):
            taken.append((name, data))
        else:
            lines.append(f"{cache.name}/{name} ({_mb(len(data))} gzip'd): LEFT OUT, over what comes back "
                         f"({MAX_FILES} files, {_mb(MAX_TOTAL)}; the next call carries at most {_mb(carry_room)} of "
                         "cache): the next lease compiles it cold")
    shutil.rmtree(cache)
    if small + taken:
        (out / CACHE).write_bytes(_tar_bytes(small + taken, cache.name))
    return [f"{cache.name}/{name}: in {CACHE} ({_mb(len(data))})" for name, data in small + taken] + lines


def pack(out: Path, keep: list[str], cache: Path | None, first: list[str], carry_room: int = CARRY_ROOM) -> list[str]:
    """Leave in `out` only what the device tool brings back (module docstring); returns the lines it prints."""
    lines: list[str] = []
    kept = [out / k for k in keep if (out / k).is_file()]
    for k in list(kept):
        if k.stat().st_size > CHUNK or not NAME_OK.match(k.name):
            kept.remove(k)
            lines.append(f"{k.name}: into {RESULTS} (too large or oddly named to come back as it is)")
    cache = cache if cache is not None and cache.is_dir() else None
    results = _pack_results(out, kept, cache)
    if cache is not None:
        used = [*kept, results]
        lines += _pack_cache(out, cache, first, MAX_FILES - sum(_n_pieces(p.stat().st_size) for p in used),
                             MAX_TOTAL - sum(p.stat().st_size for p in used), carry_room)
    back = [p for f in [*kept, results, out / CACHE] if f.is_file() for p in _pieces(f)]
    total = sum(p.stat().st_size for p in back)
    lines = [f"back: {p.name} ({_mb(p.stat().st_size)})" for p in back] + lines
    if len(back) > MAX_FILES or total > MAX_TOTAL:
        lines.append(f"WARNING: {len(back)} files, {_mb(total)}: over what one call brings back ({MAX_FILES} files, "
                     f"{_mb(MAX_TOTAL)}); the device tool leaves the last out")
    return ["device_out: " + line for line in lines]


def _join_pieces(src: Path, dest: Path) -> list[Path]:
    """Copy the files of `src` into `dest`, joining NAME.000of002, NAME.001of002 into NAME; the files it wrote."""
    groups: dict[str, list[tuple[int, int, Path]]] = {}
    wrote = []
    for p in sorted(src.iterdir()):
        if not p.is_file():
            continue
        m = PIECE.match(p.name)
        if m:
            groups.setdefault(m["name"], []).append((int(m["index"]), int(m["count"]), p))
        else:
            shutil.copyfile(p, dest / p.name)
            wrote.append(dest / p.name)
    for name, parts in groups.items():
        count = parts[0][1]
        missing = sorted(set(range(count)) - {i for i, _, _ in parts})
        if missing or any(c != count for _, c, _ in parts):
            raise SystemExit(f"device_out: {name} is missing piece(s) {missing} of {count} in {src}: the call did "
                             "not bring them back (its files_left_out says why); rerun with less under $OUT")
        with open(dest / name, "wb") as f:
            for _, _, p in sorted(parts):
                f.write(p.read_bytes())
        wrote.append(dest / name)
    return wrote


def unpack(src: Path, dest: Path, cache_to: Path | None) -> list[str]:
    """Join, extract and (with `cache_to`) merge what `pack` left; returns the lines it prints."""
    dest.mkdir(parents=True, exist_ok=True)
    lines, cache_roots = [], set()
    for p in _join_pieces(src, dest):
        if p.name in (RESULTS, CACHE):
            with tarfile.open(p) as tar:
                if p.name == CACHE:
                    cache_roots |= {m.name.split("/")[0] for m in tar.getmembers()}
                tar.extractall(dest, filter="data")
            p.unlink()
            lines.append(f"device_out: {p.name} extracted into {dest}")
        else:
            lines.append(f"device_out: {p.relative_to(dest)}")
    if cache_to is None:
        return lines
    if not cache_roots:
        lines.append(f"device_out: no {CACHE} came back: {cache_to} left as it was")
    for root in sorted(cache_roots):
        cache_to.mkdir(parents=True, exist_ok=True)
        for f in sorted((dest / root).iterdir()):
            if f.name.endswith(".bin.gz"):  # this lease's build of it replaces the last one's, either form
                (cache_to / f.name[:-3]).unlink(missing_ok=True)
            shutil.copyfile(f, cache_to / f.name)
            lines.append(f"device_out: {root}/{f.name} -> {cache_to}/ (carry that folder with the next call)")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="verb", required=True)
    p = sub.add_parser("pack", help="at a device call's end: leave in OUT only what comes back")
    p.add_argument("out", type=Path)
    p.add_argument("--keep", nargs="*", default=[], help="files of OUT brought back as they are")
    p.add_argument("--cache", type=Path, help="the compile-cache folder (its *.bin gzip'd into compile-cache.tar)")
    p.add_argument("--cache-first", nargs="*", default=[], help="artifact name prefixes, the most wanted first")
    p.add_argument("--carry-room-mib", type=float, default=CARRY_ROOM / 2**20,
                   help="the most cache the next call can carry beside the tree and the rest of its carry")
    u = sub.add_parser("unpack", help="here: join the pieces and extract what a call brought back")
    u.add_argument("files_at", type=Path, help="the call's files_at folder")
    u.add_argument("dest", type=Path)
    u.add_argument("--cache-to", type=Path, help="merge the compile cache into this folder (the next call's carry)")
    a = ap.parse_args(argv)
    if a.verb == "pack":
        if not a.out.is_dir():
            print(f"device_out: no folder {a.out}", file=sys.stderr)
            return 2
        lines = pack(a.out, a.keep, a.cache, a.cache_first, int(a.carry_room_mib * 2**20))
    else:
        if not a.files_at.is_dir():
            print(f"device_out: no folder {a.files_at}: pass the call's files_at", file=sys.stderr)
            return 2
        lines = unpack(a.files_at, a.dest, a.cache_to)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
