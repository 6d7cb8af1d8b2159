"""The run's weight store: a named asyncio actor holding the newest published versions (references into Ray's object
store) and the generators' acknowledgements. In a module of its own, without torch, so that its worker process
starts in a fraction of a second (learner.weights, which publishes and fetches, imports torch)."""

from __future__ import annotations

import asyncio
import time

import ray

from common.interfaces import actor_name, near_caller
from common.messages import WeightsAnnouncement


@ray.remote(num_cpus=0, max_restarts=0)
class WeightStore:
    """Named actor holding the newest published versions (references into Ray's object store).

    An asyncio actor: `wait_for_acks` awaits without blocking `put`, `ack` or `latest`.
    """

    def __init__(self, keep_versions: int = 2):
        if keep_versions < 1:
            raise ValueError(f"keep_versions must be >= 1, got {keep_versions}")
        self.keep = keep_versions
        self.versions: dict[int, tuple[WeightsAnnouncement, list]] = {}
        self.deltas: dict[int, list] = {}  # version -> refs of its delta from version - 1 (weight_sync.delta)
        self.calls: dict[str, int] = {"latest": 0, "wait_newer": 0}  # generators' version queries answered
        self.acked: dict[str, int] = {}  # generator id -> newest acknowledged version (-1: none yet)
        self.changed = asyncio.Condition()

    async def put(self, ann: WeightsAnnouncement, refs: list, delta_refs: list | None = None) -> None:
        """Store `refs` (the object store: an ObjectRef per bucket of the state dict) as version `ann.version`,
        and `delta_refs` (its delta from the previous version, when published)."""
        newest = max(self.versions, default=-1)
        if ann.version <= newest:
            raise ValueError(f"version {ann.version} published after version {newest}: versions must increase")
        self.versions[ann.version] = (ann, refs)
        if delta_refs:
            self.deltas[ann.version] = delta_refs
        for v in sorted(self.versions)[:-self.keep]:
            del self.versions[v]
            self.deltas.pop(v, None)
        async with self.changed:
            self.changed.notify_all()

    async def reset(self) -> None:
        """Forget published versions and acknowledgements (a new learner pool starts, e.g. after a resume)."""
        self.versions.clear()
        self.deltas.clear()
        self.acked = {g: -1 for g in self.acked}
        async with self.changed:
            self.changed.notify_all()

    async def latest(self) -> WeightsAnnouncement | None:
        self.calls["latest"] += 1
        return self._newest()

    def _newest(self) -> WeightsAnnouncement | None:
        return self.versions[max(self.versions)][0] if self.versions else None

    async def wait_newer(self, known: int, timeout_s: float) -> WeightsAnnouncement | None:
        """The newest announcement as soon as its version differs from `known` (newer, or lower after a `reset`),
        else the newest after `timeout_s` (None: nothing published). A long-poll: awaiting costs no thread."""
        self.calls["wait_newer"] += 1

        def unchanged() -> bool:
            ann = self._newest()
            return (ann.version if ann is not None else -1) == known

        await self._wait_while(unchanged, timeout_s)
        return self._newest()

    async def get(self, version: int) -> list:
        if version not in self.versions:
            raise KeyError(f"weights version {version} is no longer (or not yet) held by the weight store; "
                           f"held: {sorted(self.versions)}; call latest() again")
        return self.versions[version][1]

    async def get_delta(self, version: int) -> list | None:
        """The refs of `version`'s delta from `version - 1`; None when none is held (the caller takes `get`)."""
        return self.deltas.get(version)

    async def register(self, generator_id: str) -> None:
        self.acked.setdefault(generator_id, -1)

    async def unregister(self, generator_id: str) -> None:
        self.acked.pop(generator_id, None)
        async with self.changed:
            self.changed.notify_all()

    async def ack(self, generator_id: str, version: int) -> None:
        self.acked[generator_id] = max(version, self.acked.get(generator_id, -1))
        async with self.changed:
            self.changed.notify_all()

    async def wait_for_acks(self, version: int, timeout_s: float) -> list[str]:
        """Wait until every registered generator acknowledged `version` or newer; return the ones that did not."""

        def missing() -> list[str]:
            return sorted(g for g, v in self.acked.items() if v < version)

        await self._wait_while(missing, timeout_s)
        return missing()

    async def _wait_while(self, pending, timeout_s: float) -> None:
        """Await `changed` while `pending()` is truthy, at most `timeout_s` in all (the caller reads the outcome)."""
        deadline = time.monotonic() + timeout_s
        async with self.changed:
            while pending() and (left := deadline - time.monotonic()) > 0:
                try:
                    await asyncio.wait_for(self.changed.wait(), timeout=left)
                except TimeoutError:
                    break

    async def status(self) -> dict:
        return {"versions": sorted(self.versions), "acked": dict(self.acked), "calls": dict(self.calls)}


def get_or_create_store(run: str, namespace: str | None) -> ray.actor.ActorHandle:
    """The run's weight store, created if absent (detached from no one: lives as long as its creator's job)."""
    return WeightStore.options(name=actor_name(run, "weights"), namespace=namespace, get_if_exists=True,
                               lifetime=None, **near_caller()).remote()
