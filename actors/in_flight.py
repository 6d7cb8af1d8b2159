"""A generator's leased work, in one object that keeps its own invariant: every leased item not submitted yet is in
exactly one place, and `unsubmitted` counts the complete ones.

    work = InFlight()
    start_now = work.add(items, engine_version, now)   # the rest are held until their weights load
    work.due(engine_version, now)                     # held items to start now
    work.finished(lease_id, j, sample)                # a sample back from the engine; a complete group is queued
    batch = work.next_batch()                         # (scorer thread) the queued groups, oldest first
    work.scored(batch)                                # submitted or returned: no longer unsubmitted

The places: in the engine (`_groups`, not held), held for its version's weights (`_groups` and `_held`), queued for
the scorer (`_queue`), being scored and submitted (`_scoring`). The engine thread and the scorer thread share it; the
lock guards every move between places.
"""

from __future__ import annotations

import queue
import threading

from actors.scoring import Group
from common.messages import WorkItem


class InFlight:
    def __init__(self):
        self._lock = threading.Lock()
        self._groups: dict[str, Group] = {}  # in the engine or held, by lease id
        self._held: dict[str, float] = {}  # lease id -> unix time until which it waits for its version's weights
        self._queue: queue.SimpleQueue[Group | None] = queue.SimpleQueue()  # complete, waiting for the scorer
        self._scoring: list[Group] = []  # being scored and submitted
        self.unsubmitted = 0  # complete but not submitted yet (queued or being scored)

    # ------------------------------------------------------------------------------------ engine thread

    def in_engine(self) -> int:
        """Groups leased and not complete (held ones included)."""
        return len(self._groups)

    @property
    def holding(self) -> bool:
        return bool(self._held)

    def add(self, items: list[WorkItem], engine_version: int, now: float) -> list[WorkItem]:
        """Take newly leased items; those whose weights the engine has are returned to start now, the others are
        held until they load or half their lease's time has passed."""
        start = []
        with self._lock:
            for it in items:
                self._groups[it.lease_id] = Group(it, [None] * it.num_samples, it.num_samples)
                if it.min_weights > engine_version:
                    self._held[it.lease_id] = now + max(0.0, it.deadline - now) / 2
                else:
                    start.append(it)
        return start

    def due(self, engine_version: int, now: float) -> list[WorkItem]:
        """Held items whose weights the engine has now, or whose wait is over; they leave the held set."""
        if not self._held:
            return []
        with self._lock:
            due = [lid for lid, until in self._held.items()
                   if self._groups[lid].item.min_weights <= engine_version or now >= until]
            for lid in due:
                del self._held[lid]
            return [self._groups[lid].item for lid in due]

    def pop_held(self) -> list[WorkItem]:
        """Take the held items out (never started: their leases go back)."""
        with self._lock:
            items = [self._groups.pop(lid).item for lid in self._held]
            self._held = {}
        return items

    def pop_in_engine(self) -> list[Group]:
        """Take every group out of the engine's place (a stop that returns them)."""
        with self._lock:
            groups, self._groups, self._held = list(self._groups.values()), {}, {}
        return groups

    def finished(self, lease_id: str, j: int, sample) -> None:
        """Sample j of a group is back from the engine; the group goes to the scorer once all are."""
        g = self._groups[lease_id]
        g.samples[j] = sample
        g.left -= 1
        if g.left == 0:
            self.complete(lease_id)

    def complete(self, lease_id: str) -> None:
        with self._lock:
            g = self._groups.pop(lease_id)
            self.unsubmitted += 1
        self._queue.put(g)

    def close(self) -> None:
        """No more groups: the scorer's `next_batch` returns None after the queued ones."""
        self._queue.put(None)

    def reopen(self) -> None:
        """A new queue for a new start (after `close`)."""
        self._queue = queue.SimpleQueue()

    def unfinished(self) -> list[WorkItem]:
        """Take out every leased item not submitted yet: in the engine, held, queued or being scored."""
        queued = []
        while True:
            try:
                g = self._queue.get_nowait()
            except queue.Empty:
                break
            if g is not None:
                queued.append(g)
        with self._lock:
            groups = list(self._groups.values()) + queued + list(self._scoring)
            self._groups, self._scoring, self._held = {}, [], {}
        return [g.item for g in groups]

    # ------------------------------------------------------------------------------------ scorer thread

    def next_batch(self) -> list[Group] | None:
        """(Blocking) the next queued group and everything queued beside it, now being scored; [] when only the
        end came; None after `close` once nothing is left."""
        g = self._queue.get()
        if g is None:
            return None
        batch = [g]
        while True:
            try:
                more = self._queue.get_nowait()
            except queue.Empty:
                break
            if more is None:
                self._queue.put(None)  # (seen again by the next call: the end)
                break
            batch.append(more)
        with self._lock:
            self._scoring = batch
        return batch

    def abandon(self, batch: list[Group]) -> bool:
        """A stop gave up on scoring `batch`: True when its leases are still this object's to return (a stop's
        `unfinished` did not take them already)."""
        with self._lock:
            mine, self._scoring = self._scoring is batch, []
        return mine

    def scored(self, batch: list[Group]) -> None:
        """`batch` was submitted, returned or abandoned: it is no longer in flight."""
        with self._lock:
            self._scoring = []
            self.unsubmitted -= len(batch)
