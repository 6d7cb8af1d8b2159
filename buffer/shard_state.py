"""A buffer shard's leases and ready groups (`Lease`, `Ready`) and their msgpack-ready forms for snapshots
(STATE_VERSION names the format; `ShardCore.state` / `ShardCore.from_state` write and read the whole shard). The
files a snapshot writes: buffer/snapshot.py and buffer/segments.py.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np

from buffer.records import record_from_bytes
from common import codec
from common.messages import TrainGroup

STATE_VERSION = 3


@dataclass(slots=True)
class Lease:
    lease_id: str
    question_id: str
    num_samples: int
    deadline: float
    generator_id: str
    replay: bool = False
    candidates: list[np.ndarray] = field(default_factory=list)  # replay: stored records at issue (used if evicted since)
    version: int = 0  # the shard's version when it was issued


@dataclass(slots=True)
class Ready:
    group: TrainGroup
    version: int  # oldest policy version among its fresh rollouts


def encode_leases(leases: dict[str, Lease]) -> list:
    return [[x.lease_id, x.question_id, x.num_samples, x.deadline, x.generator_id, x.replay,
             [r.tobytes() for r in x.candidates], x.version] for x in leases.values()]


def decode_leases(rows: list, questions) -> dict[str, Lease]:
    """Leases from `encode_leases`; ValueError when one is for a question not in `questions`."""
    leases = {}
    for lid, qid, ns, dl, gid, replay, recs, *issued in rows:  # (issued: absent from older snapshots)
        if qid not in questions:
            raise ValueError(f"snapshot lease {lid} refers to unknown question {qid!r}")
        leases[lid] = Lease(lid, qid, int(ns), float(dl), gid, bool(replay), [record_from_bytes(r) for r in recs],
                            int(issued[0]) if issued else 0)
    return leases


def encode_ready(q: deque[Ready]) -> bytes:
    return codec.encode_list([x.group for x in q], TrainGroup)


def decode_ready(data: bytes) -> deque[Ready]:
    return deque(Ready(g, min(r.version for r in g.rollouts)) for g in codec.decode_list(data, TrainGroup))


def check_state_version(state: dict) -> None:
    if state.get("state_version") != STATE_VERSION:
        raise ValueError(f"shard state version {state.get('state_version')!r} is not {STATE_VERSION}")
