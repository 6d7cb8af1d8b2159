"""A buffer shard's state: its leases and ready groups (`Lease`, `Ready`), and the whole shard as msgpack-ready plain
data for snapshots (`encode_shard`, `decode_into`; STATE_VERSION names the format). The shard's logic is
buffer/core.py; the files a snapshot writes, buffer/snapshot.py and buffer/segments.py.
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


def encode_shard(core, store: dict) -> dict:
    """`core` (a ShardCore) as plain data, with `store` (a store manifest) inside."""
    rs = core.rng.getstate()
    return {
        "state_version": STATE_VERSION, "shard": core.shard, "fingerprint": core.fingerprint,
        "group_size": core.K, "epoch": core.epoch, "cursor": core.cursor, "reissue": list(core.reissue),
        "reissue_replay": list(core.reissue_replay),
        "next_lease": core.next_lease, "version": core.version, "mixed_mode": core.mixed_mode,
        "taken_at_version": core.taken_at_version, "incarnation": core.incarnation,
        "counters": dict(core.n), "rng": [rs[0], list(rs[1]), rs[2]],
        "leases": [[x.lease_id, x.question_id, x.num_samples, x.deadline, x.generator_id, x.replay,
                    [r.tobytes() for r in x.candidates], x.version] for x in core.leases.values()],
        "ready_fresh": codec.encode_list([x.group for x in core.ready_fresh], TrainGroup),
        "ready_mixed": codec.encode_list([x.group for x in core.ready_mixed], TrainGroup),
        "fresh_out": sorted(core.fresh_out), "tracked": {q: list(v) for q, v in core.tracked.items()},
        "store": store,
    }


def check_state_version(state: dict) -> None:
    if state.get("state_version") != STATE_VERSION:
        raise ValueError(f"shard state version {state.get('state_version')!r} is not {STATE_VERSION}")


def decode_into(core, state: dict, open_segment) -> None:
    """Fill a new `core` built for `state`'s shard with it; ValueError when the state does not fit that shard."""
    if state["fingerprint"] != core.fingerprint:
        raise ValueError(f"snapshot of shard {state['shard']} was taken with a different question set "
                         "(dataset or num_shards changed); restore it with the same data and shard count")
    if state["group_size"] != core.K:
        raise ValueError(f"snapshot has group_size {state['group_size']}, config has {core.K}")
    core.epoch, core.cursor = int(state["epoch"]), int(state["cursor"])
    core._order = core._epoch_order(core.epoch)
    core.reissue = deque(state["reissue"])
    core.reissue_replay = deque(state["reissue_replay"])
    core.next_lease, core.version = int(state["next_lease"]), int(state["version"])
    core.mixed_mode = bool(state["mixed_mode"])
    core.taken_at_version = int(state.get("taken_at_version", 0))
    core.incarnation = int(state.get("incarnation", core.incarnation))
    core.n.update({k: int(v) for k, v in state["counters"].items() if k in core.n})
    v, internal, gauss = state["rng"]
    core.rng.setstate((v, tuple(internal), gauss))
    for lid, qid, ns, dl, gid, replay, recs, *issued in state["leases"]:  # (issued: absent from older snapshots)
        if qid not in core.questions:
            raise ValueError(f"snapshot lease {lid} refers to unknown question {qid!r}")
        core.leases[lid] = Lease(lid, qid, int(ns), float(dl), gid, bool(replay),
                                 [record_from_bytes(r) for r in recs], int(issued[0]) if issued else 0)
    for name in ("ready_fresh", "ready_mixed"):
        for g in codec.decode_list(state[name], TrainGroup):
            getattr(core, name).append(Ready(g, min(r.version for r in g.rollouts)))
    core.fresh_out = set(state.get("fresh_out", ()))  # (absent from older snapshots)
    core.tracked = {q: [bool(x) for x in v] for q, v in state.get("tracked", {}).items()}
    core.store.load_state(state["store"], open_segment)
