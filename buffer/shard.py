"""The buffer shard Ray actor: a `ShardCore` behind one lock, with periodic snapshots.

Threaded actor (`max_concurrency` threads): lease, submit, batch and feedback calls run concurrently
and are serialised on the core by a lock; `wait_ready` blocks on a condition without holding it.
Every method takes and returns msgpack bytes (`common.codec` for messages, plain msgpack for
counters) or plain scalars — no pickled data crosses the boundary.

On a crash Ray restarts the actor (`max_restarts`) with the same constructor arguments; `__init__`
then restores the latest snapshot in `snapshot_dir` (written every `snapshot_every_s` and on
`snapshot()`), so the shard loses at most the work since that snapshot: leases issued after it are
unknown to the restored shard (their late submissions are counted and dropped, their questions come
round again from the restored dataset cursor), and groups trained after it may be trained again.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import msgpack
import ray

from buffer.core import ShardCore, new_incarnation
from buffer.snapshot import load_core, segment_target, snapshot_path, write_shard_snapshot
from buffer.store import Counters
from common import codec
from common.config import BufferConfig
from common.disk import atomic_write_bytes
from common.interfaces import near_caller
from common.messages import LearnerFeedback, Question, ScoredGroup, TrainGroup, WorkItem

log = logging.getLogger(__name__)


def pack(obj) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def unpack(data: bytes):
    return msgpack.unpackb(data, raw=False)


@dataclass(slots=True)
class ShardCalls(Counters):
    """Generator-side calls a shard answered, logged as buffer/calls_<name>."""

    lease: int = 0
    lease_wait: int = 0
    submit: int = 0


class BufferShard:
    """One shard. Create with `make_shard_actor` (named `actor_name(run, "buffer", i)`)."""

    def __init__(self, cfg: dict, questions: bytes | str, shard: int, shares: list[int], snapshot_dir: str | None):
        """`questions`: this shard's questions (`codec.encode_list`), or the path of a file holding them (what
        `make_shard_actor` passes with a snapshot folder: a restart reads it again)."""
        self.cfg = BufferConfig(**cfg)
        if isinstance(questions, str):
            questions = Path(questions).read_bytes()
        self.questions = codec.decode_list(questions, Question)
        self.shard, self.shares, self.snapshot_dir = shard, shares, snapshot_dir
        self.batch_share = batch_share = shares[shard]
        self.lock = threading.Lock()
        self.cond = threading.Condition(self.lock)
        self.restored_from = ""
        self.snapshot_errors = 0
        self.snapshot_lock = threading.Lock()  # one snapshot at a time (periodic and checkpoint ones)
        self.last_snapshot = {"snapshot_last_s": 0.0, "snapshot_last_bytes": 0.0, "snapshots": 0.0}
        path = snapshot_path(snapshot_dir, shard) if snapshot_dir else None
        if path is not None and path.exists():
            self.core = load_core(self.cfg, self.questions, path, batch_share=batch_share, shares=shares)
            self.core.incarnation = new_incarnation()  # its counters may be behind what a client has seen
            self.restored_from = str(path)
            log.warning("buffer shard %d restored from %s", shard, path)
        else:
            self.core = ShardCore(self.cfg, self.questions, shard=shard, batch_share=batch_share, shares=shares)
        self._stop = threading.Event()
        self.calls = ShardCalls()  # generator-side calls answered
        if snapshot_dir:
            threading.Thread(target=self._snapshot_loop, name=f"buffer-{shard}-snapshots", daemon=True).start()

    def _snapshot_loop(self) -> None:
        while not self._stop.wait(self.cfg.snapshot_every_s):
            try:
                self.snapshot(self.snapshot_dir)
            except OSError as e:  # disk full, folder gone: keep serving, count, retry next period
                self.snapshot_errors += 1
                log.error("buffer shard %d: periodic snapshot to %s failed: %s", self.shard, self.snapshot_dir, e)

    # ------------------------------------------------------------------------------ generator side

    def lease(self, generator_id: str, max_items: int) -> bytes:
        with self.lock:
            self.calls.lease += 1
            items = self.core.lease(generator_id, max_items)
        return codec.encode_list(items, WorkItem)

    @ray.method(concurrency_group="lease_wait")
    def lease_wait(self, generator_id: str, max_items: int, wait_s: float) -> bytes:
        """`lease`, but with nothing to lease wait up to `wait_s` for work (a long-poll: woken when the learner
        takes a batch, a version advances, groups come in or leases come back; on its own threads)."""
        deadline = time.monotonic() + wait_s
        with self.cond:
            self.calls.lease_wait += 1
            while True:
                items = self.core.lease(generator_id, max_items)
                left = deadline - time.monotonic()
                if items or left <= 0 or self._stop.is_set():
                    return codec.encode_list(items, WorkItem)
                self.cond.wait(min(left, 0.25))  # also wakes to see leases expire

    def submit(self, groups: bytes) -> bytes:
        decoded = codec.decode_list(groups, ScoredGroup)
        with self.cond:
            self.calls.submit += 1
            out = self.core.submit(decoded)
            self.cond.notify_all()
        return pack(out)

    def return_leases(self, lease_ids: list[str]) -> int:
        with self.cond:
            n = self.core.return_leases(list(lease_ids))
            self.cond.notify_all()
            return n

    def end_leases_of(self, generator_id: str) -> int:
        with self.cond:
            n = self.core.end_leases_of(generator_id)
            self.cond.notify_all()  # the window they held is open again
            return n

    # -------------------------------------------------------------------------------- learner side

    def wait_ready(self, version: int, want: int, wait_s: float, hold: bool = True) -> list[int]:
        """[fresh, mixed, fresh versions, mixed versions, zero_signal_fresh, zero_signal_fresh_correct, mixed_mode,
        incarnation, in_flight_last] at `version` (zero_signal_*: cumulative counts of fresh groups kept out as
        zero-signal; incarnation: the state's id, new after a restart from a snapshot; in_flight_last: outstanding
        leases that a batch of `version` is the last to be able to train, `ShardCore.last_chance_in_flight`); waits
        up to `wait_s` for `want` groups and (`hold`) for those leases' groups."""
        deadline = time.monotonic() + wait_s
        with self.cond:
            while True:
                summary = self.core.ready_summary(version)
                last = self.core.last_chance_in_flight(version)
                left = deadline - time.monotonic()
                if (summary[0] + summary[1] >= want and not (hold and last)) or left <= 0:
                    return [*summary, self.core.n.zero_signal_fresh, self.core.n.zero_signal_fresh_correct,
                            int(self.core.mixed_mode), self.core.incarnation, last]
                self.cond.wait(min(left, 0.05))  # also wakes to expire leases and see new versions

    def take(self, version: int, n_fresh: int, n_mixed: int, exclude: list[str] = ()) -> bytes:
        with self.cond:
            groups = self.core.take(version, n_fresh, n_mixed, frozenset(exclude))
            self.cond.notify_all()  # the back-pressure window opened: long-poll leases may find work
        return codec.encode_list(groups, TrainGroup)

    def feedback(self, fb: bytes) -> None:
        decoded = codec.decode(fb, LearnerFeedback)
        with self.lock:
            self.core.feedback(decoded)

    def set_version(self, version: int) -> None:
        with self.cond:
            self.core.set_version(version)
            self.cond.notify_all()

    def end_step(self, fb: bytes | None, version: int) -> bytes:
        """After a learner step, in one call: its feedback for this shard (None: none), the new version, then
        the shard's metrics."""
        decoded = None if fb is None else codec.decode(fb, LearnerFeedback)
        with self.cond:
            if decoded is not None:
                self.core.feedback(decoded)
            self.core.set_version(version)
            self.cond.notify_all()
        return self.metrics()

    def set_mixed_mode(self) -> None:
        with self.lock:
            self.core.set_mixed_mode()

    # ------------------------------------------------------------------------------- observability

    def metrics(self) -> bytes:
        with self.lock:
            m = self.core.metrics()
        m["snapshot_errors"] = float(self.snapshot_errors)
        m.update(self.calls.as_metrics("calls_"))
        m.update(self.last_snapshot)
        m["restored"] = float(bool(self.restored_from))
        return pack(m)

    def accounting(self) -> bytes:
        with self.lock:
            return pack(self.core.accounting())

    def snapshot(self, folder: str | None = None) -> bytes:
        """Write the shard's state to `folder`; returns the accounting of that very state (msgpack), taken
        under the same lock, so that a checkpoint records the counts its snapshot holds (generators keep
        leasing and submitting while a checkpoint is written)."""
        folder = folder or self.snapshot_dir
        if not folder:
            raise ValueError(f"buffer shard {self.shard} has no snapshot_dir; pass a folder to snapshot()")
        target = segment_target(folder, self.shard)
        with self.snapshot_lock:
            t0 = time.perf_counter()
            with self.lock:
                core = self.core
                state, plan = core.snapshot_state(target)
                counts = core.accounting()
            written = write_shard_snapshot(folder, self.shard, state, plan)
            with self.lock:
                core.store.mark_written(plan, written, target)  # a core replaced meanwhile is simply dropped
            self.last_snapshot["snapshot_last_s"] = time.perf_counter() - t0
            self.last_snapshot["snapshot_last_bytes"] = float(snapshot_path(folder, self.shard).stat().st_size
                                                              + sum(v[1] for v in written.values()))
            self.last_snapshot["snapshots"] += 1
        return pack(counts)

    def restore(self, folder: str, expire_leases: bool = False) -> int:
        """Replace the state with the snapshot in `folder`; returns how many of its outstanding leases were
        ended as expired (`expire_leases`; 0 otherwise)."""
        core = load_core(self.cfg, self.questions, snapshot_path(folder, self.shard), batch_share=self.batch_share,
                         shares=self.shares)
        expired = core.expire(all_leases=True) if expire_leases else 0  # their generators are gone: reissue now
        with self.cond:
            self.core = core
            self.cond.notify_all()
        return expired

    def ping(self) -> int:
        return self.shard

    def stop(self) -> None:
        self._stop.set()


def make_shard_actor(cfg: BufferConfig, questions: list[Question], *, shard: int, shares: list[int], name: str,
                     namespace: str | None, snapshot_dir: str | None):
    """Start one named shard actor (restarts from its snapshot up to `cfg.max_restarts` times).

    With a snapshot folder the questions go into a file there (`questions-shard-<i>.msgpack`) and the actor gets
    its path: constructor arguments stay small, so a restart never depends on an object in Ray's object store
    (the shard runs on this node, see `near_caller`)."""
    actor_cls = ray.remote(concurrency_groups={"lease_wait": cfg.lease_wait_threads})(BufferShard)
    data: bytes | str = codec.encode_list(questions, Question)
    if snapshot_dir:
        path = Path(snapshot_dir) / f"questions-shard-{shard}.msgpack"
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(path, data)
        data = str(path)
    return actor_cls.options(
        name=name, namespace=namespace, max_restarts=cfg.max_restarts, max_task_retries=0,
        max_concurrency=cfg.max_concurrency, num_cpus=0, lifetime=None, **near_caller(),
    ).remote(cfg.model_dump(), data, shard, shares, snapshot_dir)

