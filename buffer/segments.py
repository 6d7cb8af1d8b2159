"""The files of a buffer snapshot. A snapshot is a small manifest (buckets, header columns, where each record lies,
counters) plus append-only segment files of records (SEGMENT_MAGIC, then each record's uint32 word count and its
words). Records never change once written (their mutable header words travel in the manifest), so a snapshot writes
only the records added since the last one and links the segments it still references into its folder; a segment
under half live, or one no folder holds any more, is compacted into the new one. A snapshot costs what changed plus
the manifest (~40 bytes per record). Planned by `ExperienceStore.plan_snapshot`, written by buffer/snapshot.py.
"""

from __future__ import annotations

import os
from array import array
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

SEGMENT_MAGIC = b"EXGRPOS\x01"
"""A segment file: these 8 bytes, then records, each a little-endian uint32 word count and the record."""
SEGMENT_BYTES = 256 << 20
"""New records are written into segments of at most this size (a loaded snapshot maps one at a time)."""
MAX_SEGMENTS = 64
"""Past this many segments a snapshot merges the smallest into its new one."""
LEN = 4  # the word-count prefix of a record in a segment


@dataclass
class Segment:
    name: str
    size: int  # file size in bytes
    digest: str  # blake2b-256 of the file, hex
    live: int  # bytes of the records still stored (prefix included)
    paths: list[str]  # files that hold a copy (one per snapshot folder it was written or linked into)


@dataclass
class SnapshotPlan:
    """See `ExperienceStore.plan_snapshot`."""

    keep: dict[int, str | None]  # old segment -> a copy to link from, None when already in the folder
    names: dict[int, str] = field(default_factory=dict)  # new segment -> name
    new: dict[int, list[np.ndarray]] = field(default_factory=dict)  # new segment -> its records, in order
    moves: list[tuple[str, np.ndarray, int, int]] = field(default_factory=list)  # (question, record, segment, offset)
    placed: dict[str, tuple[array, array]] = field(default_factory=dict)  # question -> planned (segs, offs)
    rows: list = field(default_factory=list)


def segments_to_keep(segments: dict[int, Segment], target: Callable[[str], Path]
                     ) -> tuple[dict[int, str | None], set[int]]:
    """(kept segment -> a copy to link from, None when already in the target folder; the segments to rewrite).
    Rewritten: those under half live, those no folder holds any more, and past MAX_SEGMENTS the smallest."""
    keep: dict[int, str | None] = {}
    rewrite: set[int] = set()
    for sid, g in segments.items():
        if g.live <= 0:
            continue
        if 2 * g.live < g.size:
            rewrite.add(sid)
            continue
        there = target(g.name)
        if there.is_file() and there.stat().st_size == g.size:
            keep[sid] = None
            continue
        src = next((p for p in g.paths if os.path.isfile(p) and os.path.getsize(p) == g.size), None)
        if src is None:
            rewrite.add(sid)
        else:
            keep[sid] = src
    for sid in sorted(keep, key=lambda x: segments[x].size)[: max(0, len(keep) - MAX_SEGMENTS + 1)]:
        del keep[sid]  # too many segments: the smallest are merged into the new one
        rewrite.add(sid)
    return keep, rewrite
