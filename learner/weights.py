"""Weight publication: learner rank 0 -> generators, through a backend chosen by config.

    publisher = make_publisher(cfg.weight_sync, run=run, namespace=ns, timeout_s=cfg.publish_timeout_s)
    ann = publisher.publish(version, full_state_dict)        # rank 0, after the gather; Hugging Face names
    source = make_weight_source(cfg.weight_sync, run=run, namespace=ns)   # in a generator
    source.register(generator_id); ann = source.latest()
    if ann is not None and ann.version > engine.version:
        engine.load_weights(source.fetch(ann), ann.version); source.ack(generator_id, ann.version)

Backends: the object store or `learner.collective`. Nothing waits without a timeout (`WeightSyncTimeout`).
Details (backends, LoRA adapter-only publications, acknowledgements): docs/internals.md#learnerweightspy
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Protocol

import numpy as np
import ray
import torch

from common.config import CollectiveSyncConfig, ObjectStoreSyncConfig, WeightSyncConfig
from common.interfaces import actor_name
from learner.delta import DELTA_WORTH
from learner.weight_store import get_or_create_store
from common.messages import AdapterPublication, WeightsAnnouncement


class WeightSyncTimeout(TimeoutError):
    """A publication or acknowledgement did not complete in time (the message names version and generators)."""


def to_wire(state_dict: dict[str, torch.Tensor]) -> dict[str, tuple[str, np.ndarray]]:
    """{name: (torch dtype name, numpy view of the CPU tensor's bytes)}: Ray writes numpy buffers into the
    object store without the intermediate copy that pickling a torch tensor makes (bfloat16, which numpy
    lacks, travels as its int16 bit pattern)."""
    out = {}
    for k, t in state_dict.items():
        t = t.detach().cpu().contiguous()
        raw = t.view(torch.int16) if t.dtype == torch.bfloat16 else t
        out[k] = (str(t.dtype).removeprefix("torch."), raw.numpy())
    return out


def from_wire(wire: dict[str, tuple[str, np.ndarray]]) -> dict[str, torch.Tensor]:
    """`to_wire` reversed, as writable tensors of their own (the object store's buffers are read-only)."""
    out = {}
    for k, (dtype, arr) in wire.items():
        t = torch.from_numpy(arr.copy())
        out[k] = t.view(torch.bfloat16) if dtype == "bfloat16" else t
    return out


def state_dict_bytes(state_dict: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state_dict.values())


def wait_for_acks(store: ray.actor.ActorHandle, version: int, timeout_s: float) -> None:
    """Raise `WeightSyncTimeout` naming the generators that did not acknowledge `version` within `timeout_s`."""
    missing = ray.get(store.wait_for_acks.remote(version, timeout_s), timeout=timeout_s + 30)
    if missing:
        raise WeightSyncTimeout(
            f"weights version {version} not acknowledged within {timeout_s:.1f}s by generator(s) {missing}; "
            "a removed generator must be unregistered (ObjectStoreWeightSource.unregister), a stuck one restarted, "
            "or learner.publish_timeout_s raised"
        )


class WeightPublisher(Protocol):
    """The sending side of a weight-sync backend (lives in learner rank 0).

        buckets = iter_flat_buckets(..., to_host=not publisher.takes_device_buckets, alloc=publisher.bucket_buffer)
        ann = publisher.publish(version, buckets, adapters=...)
        publisher.status()                         # what it serves ({}: nothing to say)
    """

    takes_device_buckets: bool  # the gather's buckets stay on the GPU (the backend sends them from there)
    # where the gather puts each bucket, a buffer the backend keeps (None: the gather's reused buffers, then copied)
    bucket_buffer: Callable[[int, torch.device], torch.Tensor] | None

    def publish(self, version: int, state_dict: dict[str, torch.Tensor] | Iterable[dict[str, torch.Tensor]],
                adapters: AdapterPublication | None = None) -> WeightsAnnouncement: ...

    def status(self) -> dict: ...

    def close(self) -> None: ...


class ObjectStorePublisher:
    """Publishes through Ray's object store and the run's `WeightStore` actor.

    The rank that calls `publish` owns the object (it must outlive the version's use: learner rank 0
    does); the store only borrows the reference, and dropping old versions frees them.
    """

    takes_device_buckets = False  # each bucket is put from the host
    bucket_buffer = None  # the gather's reused buffers: `ray.put` copies each bucket out before the next one

    def __init__(self, cfg: ObjectStoreSyncConfig, *, run: str, namespace: str | None, timeout_s: float):
        from learner.delta import DeltaEncoder

        self.cfg, self.timeout_s = cfg, timeout_s
        self.store = get_or_create_store(run, namespace)
        self.encoder = DeltaEncoder() if cfg.delta else None

    def publish(self, version: int, state_dict: dict[str, torch.Tensor] | Iterable[dict[str, torch.Tensor]],
                adapters: AdapterPublication | None = None) -> WeightsAnnouncement:
        """`state_dict`: the whole dict, or its buckets as an iterable (`learner.gather.iter_full_state`): each
        bucket is `ray.put` as its own object (a copy into the object store, made before the next bucket is taken:
        the gather's buckets are views into buffers it reuses), so the publishing rank holds about one bucket at a
        time. Generators merge the buckets in order (`ObjectStoreWeightSource.fetch`).
        With `delta`, each bucket's delta from the previous version is put beside it. `adapters`: the state is LoRA
        adapters only (said in the announcement; no delta: they travel whole)."""
        buckets = [state_dict] if isinstance(state_dict, dict) else state_dict
        whole = self.encoder is None or adapters is not None
        pairs = ((b, None) for b in buckets) if whole else self.encoder.tee(version, buckets)
        refs, delta_refs, num_bytes, delta_bytes = [], [], 0, 0
        for bucket, delta in pairs:
            refs.append(ray.put(to_wire(bucket)))  # numpy views: written straight into the object store
            num_bytes += state_dict_bytes(bucket)
            if delta is not None:
                delta_refs.append(ray.put(to_wire(delta)))
                delta_bytes += state_dict_bytes(delta)
            del bucket, delta
        if delta_bytes > DELTA_WORTH * num_bytes:  # nearly everything changed (a high learning rate): whole only
            delta_refs, delta_bytes = [], 0
        ann = WeightsAnnouncement(version=version, location="object_store", num_bytes=num_bytes,
                                  created_at=time.time(), delta_bytes=delta_bytes if delta_refs else 0,
                                  adapters=adapters)
        try:
            ray.get(self.store.put.remote(ann, refs, delta_refs or None), timeout=self.timeout_s)
        except ray.exceptions.GetTimeoutError as e:
            raise WeightSyncTimeout(f"weight store did not accept version {version} within {self.timeout_s:.1f}s "
                                    f"(is the actor {self.store} alive and responsive?)") from e
        return ann

    def status(self) -> dict:
        """Nothing of its own: the weight store holds the versions and their acknowledgements."""
        return {}

    def close(self) -> None:
        pass


class ObjectStoreWeightSource:
    """Receiving side of the object-store backend; a `common.interfaces.WeightSource`.

    Picklable: holds only `run`/`namespace` and looks the store up by name on first use, so it can be
    passed to generator actors and survives a store restart.
    """

    def __init__(self, run: str, namespace: str | None = None, timeout_s: float = 60.0, delta: bool = False):
        from learner.delta import HeldWeights

        self.run, self.namespace, self.timeout_s, self.delta = run, namespace, timeout_s, delta
        self._store = None
        self.held = HeldWeights() if delta else None

    def __getstate__(self) -> dict:
        return {"run": self.run, "namespace": self.namespace, "timeout_s": self.timeout_s, "delta": self.delta}

    def __setstate__(self, state: dict) -> None:
        self.__init__(**state)

    def _handle(self, required: bool = True):
        if self._store is None:
            try:
                self._store = ray.get_actor(actor_name(self.run, "weights"), namespace=self.namespace)
            except ValueError:
                if required:
                    raise LookupError(f"no weight store {actor_name(self.run, 'weights')!r} in namespace "
                                      f"{self.namespace!r}: has the learner pool started?") from None
                return None
        return self._store

    def _get(self, ref):
        return ray.get(ref, timeout=self.timeout_s)

    def latest(self) -> WeightsAnnouncement | None:
        """The newest announcement, or None when nothing was published yet (or no learner exists yet)."""
        store = self._handle(required=False)
        return None if store is None else self._get(store.latest.remote())

    def wait_newer(self, known: int, timeout_s: float) -> WeightsAnnouncement | None:
        """The newest announcement once its version differs from `known`, or after `timeout_s` (one call that
        waits at the store); None when nothing was published yet (or no learner exists yet)."""
        store = self._handle(required=False)
        if store is None:
            time.sleep(min(timeout_s, 1.0))  # no learner pool yet: ask again shortly
            return None
        return ray.get(store.wait_newer.remote(known, timeout_s), timeout=timeout_s + self.timeout_s)

    def fetch(self, ann: WeightsAnnouncement) -> dict[str, torch.Tensor]:
        """The state dict of `ann.version` (HF names, CPU tensors). KeyError when the store dropped it."""
        out: dict[str, torch.Tensor] = {}
        for bucket in self.fetch_buckets(ann):
            out.update(bucket)
        return out

    def fetch_buckets(self, ann: WeightsAnnouncement) -> Iterator[dict[str, torch.Tensor]]:
        """`ann.version` a published bucket at a time, each fetched only when the consumer asks for it (an
        engine loading bucket by bucket holds one beside its weights). KeyError at once when the store
        dropped the version; from then on the references held here keep every bucket in the object store.
        With `delta`: the delta from the version this source last loaded whole, when it is exactly one behind
        and the delta verifies (`learner.delta.HeldWeights`); else the full version."""
        held = self.held
        if held is not None and ann.delta_bytes and held.version == ann.version - 1:
            delta_refs = self._get(self._handle().get_delta.remote(ann.version))
            if delta_refs is not None and held.apply(ann.version, (from_wire(self._get(r)) for r in delta_refs)):
                return held.buckets()
        refs = self._get(self._handle().get.remote(ann.version))

        def buckets() -> Iterator[dict[str, torch.Tensor]]:
            for ref in refs:  # one object per bucket (a single one for a whole-dict publication)
                yield from_wire(self._get(ref))

        return buckets() if held is None else held.keep(ann.version, buckets())

    def transfer_stats(self) -> dict[str, int]:
        """Loads from a delta, full loads, and deltas that did not verify (`learner.delta.HeldWeights.stats`)."""
        return {} if self.held is None else self.held.stats()

    def ack(self, generator_id: str, version: int) -> None:
        """Record that `generator_id` now serves `version` (also registers it)."""
        self._get(self._handle().ack.remote(generator_id, version))

    def register(self, generator_id: str) -> None:
        """Count `generator_id` among the generators a publication waits for."""
        self._get(self._handle().register.remote(generator_id))

    def unregister(self, generator_id: str) -> None:
        """Stop waiting for `generator_id` (call when a generator is removed)."""
        self._get(self._handle().unregister.remote(generator_id))


class CollectivePublisher:
    """Sending side of the collective backend: a `learner.collective.CollectiveServer` on learner rank 0.

    `publish` packs the state dict into the server (no generator is waited for) and announces
    "collective:<host>:<port>" through the run's `WeightStore`, which keeps acknowledgements as for
    the object store. Generators then pull over their own channels. The announcement carries the server's secret
    (`WeightsAnnouncement.secret`): Ray's authenticated calls are its only way to the generators.
    """

    def __init__(self, cfg: CollectiveSyncConfig, *, run: str, namespace: str | None, timeout_s: float,
                 host: str | None = None):
        from learner.collective import CollectiveServer

        self.cfg, self.timeout_s = cfg, timeout_s
        self.store = get_or_create_store(run, namespace)
        self.server = CollectiveServer(cfg, timeout_s=timeout_s, host=host or ray.util.get_node_ip_address())

    def publish(self, version: int, state_dict: dict[str, torch.Tensor] | Iterable[dict[str, torch.Tensor]],
                adapters: AdapterPublication | None = None) -> WeightsAnnouncement:
        """`state_dict`: the whole dict or its buckets as they are gathered (packed as they come). `adapters`: the
        state is LoRA adapters only (said in the announcement; no delta: they travel whole)."""
        num_bytes, delta_bytes = self.server.publish(version, state_dict, delta=adapters is None)
        ann = WeightsAnnouncement(version=version, location=f"collective:{self.server.address}",
                                  num_bytes=num_bytes, created_at=time.time(), delta_bytes=delta_bytes,
                                  adapters=adapters, secret=self.server.secret)
        try:
            ray.get(self.store.put.remote(ann, []), timeout=self.timeout_s)
        except ray.exceptions.GetTimeoutError as e:
            raise WeightSyncTimeout(f"weight store did not accept version {version} within {self.timeout_s:.1f}s "
                                    f"(is the actor {self.store} alive and responsive?)") from e
        return ann

    @property
    def takes_device_buckets(self) -> bool:
        """Whether the gather's buckets should stay on the GPU (the server holds and sends the version from there)."""
        return self.server.takes_device_buckets

    def bucket_buffer(self, nbytes: int, device: torch.device) -> torch.Tensor:
        """Where the gather puts each bucket: a buffer the server keeps as the packed bucket (no copy)."""
        return self.server.bucket_buffer(nbytes, device)

    def status(self) -> dict:
        """Channels being served (channel id -> generator id), failed channels, completed transfers."""
        return self.server.status()

    def close(self) -> None:
        self.server.close()


class CollectiveWeightSource:
    """Receiving side of the collective backend; a `common.interfaces.WeightSource`.

    `latest`/`ack`/`register`/`unregister` go to the run's `WeightStore` (as for the object store);
    `fetch` pulls the announced version over this generator's own channel to learner rank 0, opened on
    first use and again whenever the announced address changes (a new learner pool) or a transfer
    failed. Picklable: the channel is not part of the state.
    """

    def __init__(self, cfg: CollectiveSyncConfig, run: str, namespace: str | None = None, timeout_s: float = 60.0):
        from learner.delta import HeldWeights

        self.cfg, self.run, self.namespace, self.timeout_s = cfg, run, namespace, timeout_s
        self.store = ObjectStoreWeightSource(run, namespace, timeout_s)
        self.generator_id: str | None = None
        self.client = None  # a ChannelClient to rank 0, or a RelayReceiver (relay_fanout)
        self.held = HeldWeights() if cfg.delta else None
        self.sources = {"root": 0, "relay": 0, "resumed": 0}  # relay_fanout: transfers by where they came from

    def __getstate__(self) -> dict:
        return {"cfg": self.cfg, "run": self.run, "namespace": self.namespace, "timeout_s": self.timeout_s}

    def __setstate__(self, state: dict) -> None:
        self.__init__(**state)

    def latest(self) -> WeightsAnnouncement | None:
        return self.store.latest()

    def wait_newer(self, known: int, timeout_s: float) -> WeightsAnnouncement | None:
        return self.store.wait_newer(known, timeout_s)

    def fetch(self, ann: WeightsAnnouncement) -> dict[str, torch.Tensor]:
        """The state dict of `ann.version` (`fetch_buckets` merged)."""
        out: dict[str, torch.Tensor] = {}
        for bucket in self.fetch_buckets(ann):
            out.update(bucket)
        return out

    def fetch_buckets(self, ann: WeightsAnnouncement) -> Iterator[dict[str, torch.Tensor]]:
        """`ann.version` bucket by bucket: from rank 0 each bucket is received only when the consumer asks for it
        (an engine loading bucket by bucket holds one beside its weights); through a relay the whole version
        arrives first (the relay keeps it for its children). KeyError at once when rank 0 no longer holds it;
        WeightSyncError (a RuntimeError: the generator retries at its next safe point) when the transfer failed,
        also part-way. With `delta`: pulled as a delta when this source holds `ann.version - 1` whole, applied and
        verified before anything is handed on (a mismatch pulls the version whole)."""
        held = self.held
        whole = None
        if held is not None and held.version is not None and held.version == ann.version - 1 and ann.delta_bytes:
            got, base = self._pull(ann, held.version)
            if base < 0:  # rank 0 no longer keeps that delta: it sent the version whole
                whole = iter([got])
            elif held.apply(ann.version, [got]):
                return held.buckets()
        if whole is None:
            whole = iter([self._pull(ann, -1)[0]]) if self.cfg.relay_fanout else self._stream(ann)
        return whole if held is None else held.keep(ann.version, whole)  # keep: the base of the next delta

    def _stream(self, ann: WeightsAnnouncement) -> Iterator[dict[str, torch.Tensor]]:
        """The whole version from rank 0, a bucket's tensors at a time (`ChannelClient.pull_buckets`)."""
        from learner.collective import WeightSyncError

        client = self._channel(ann)
        try:
            buckets = client.pull_buckets(ann.version)  # the header now: KeyError before anything is loaded
        except RuntimeError as e:
            self._drop(client)
            raise WeightSyncError(f"generator {client.generator_id}: pulling weights version {ann.version} from "
                                  f"learner rank 0 at {client.address} failed: {type(e).__name__}: {e}") from e

        def stream() -> Iterator[dict[str, torch.Tensor]]:
            done = False
            try:
                yield from buckets
                done = True
            except RuntimeError as e:
                raise WeightSyncError(f"generator {client.generator_id}: weights version {ann.version} from learner "
                                      f"rank 0 at {client.address} broke off: {type(e).__name__}: {e}") from e
            finally:
                if not done:  # the channel is in the middle of a transfer: it cannot carry the next request
                    self._drop(client)

        return stream()

    def _channel(self, ann: WeightsAnnouncement):
        """This source's channel to the rank 0 that published `ann` (opened, or reopened for a new address or secret:
        a new learner pool)."""
        from learner.collective import ChannelClient, WeightSyncError

        address = self._address(ann)
        if self.client is None or self.client.address != address or self.client.secret != ann.secret:
            self._close()
            gid = self.generator_id or f"pid{os.getpid()}"
            host = ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"
            try:
                self.client = ChannelClient(address, gid, self.cfg, self.timeout_s, host=host, secret=ann.secret)
            except RuntimeError as e:
                raise WeightSyncError(f"generator {gid}: opening a weight channel to learner rank 0 at {address} "
                                      f"failed: {type(e).__name__}: {e}") from e
        return self.client

    def _drop(self, client) -> None:
        """Forget a channel left mid-transfer (no goodbye: rank 0's thread for it ends when its socket closes)."""
        if self.client is client:
            self.client = None

    @staticmethod
    def _address(ann: WeightsAnnouncement) -> str:
        if not ann.location.startswith("collective:"):
            raise ValueError(f"announcement of version {ann.version} has location {ann.location!r}: the learner "
                             "publishes with another weight_sync kind than this generator's (collective)")
        return ann.location.removeprefix("collective:")

    def transfer_stats(self) -> dict[str, int]:
        """Loads from a delta, full loads, and deltas that did not verify (`learner.delta.HeldWeights.stats`); with
        relays, transfers from a relay, from rank 0, and relay transfers that rank 0 finished."""
        out = {} if self.held is None else self.held.stats()
        if self.cfg.relay_fanout:
            out.update({"from_relay": self.sources["relay"], "from_root": self.sources["root"],
                        "relay_resumed": self.sources["resumed"]})
        return out

    def _pull(self, ann: WeightsAnnouncement, held: int) -> tuple[dict[str, torch.Tensor], int]:
        """The whole payload of `ann.version` (or its delta from `held`): (state dict, base), through the relay tree
        with `relay_fanout`, else over this source's channel to rank 0."""
        from learner.collective import WeightSyncError
        from learner.relay import RelayReceiver

        address = self._address(ann)
        gid = self.generator_id or f"pid{os.getpid()}"
        host = ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"
        client = None if self.cfg.relay_fanout else self._channel(ann)
        try:
            if client is None:
                if self.client is not None and self.client.secret != ann.secret:  # a new learner pool
                    self._close()
                if self.client is None:
                    self.client = RelayReceiver(self.cfg, gid, self.timeout_s, host, secret=ann.secret)
                relay, resumed = self.client, self.client.resumed
                state_dict, base, source = relay.pull(address, ann.version, held)
                self.sources[source] += 1
                self.sources["resumed"] += relay.resumed - resumed  # (a receiver is replaced after a failure)
                return state_dict, base
            return client.pull(ann.version, held)
        except RuntimeError as e:  # gloo/NCCL/TCPStore errors and timeouts: drop the channel, reopen next time
            self._close()
            raise WeightSyncError(f"generator {gid}: pulling weights version {ann.version} from learner rank 0 at "
                                  f"{address} failed: {type(e).__name__}: {e}") from e

    def ack(self, generator_id: str, version: int) -> None:
        self.generator_id = self.generator_id or generator_id
        self.store.ack(generator_id, version)

    def register(self, generator_id: str) -> None:
        """Name this source's channel after `generator_id` and count it among the generators acked for."""
        self.generator_id = generator_id
        self.store.register(generator_id)

    def unregister(self, generator_id: str) -> None:
        """Close the channel (rank 0's thread for it ends) and stop being waited for."""
        self._close()
        self.store.unregister(generator_id)

    def _close(self) -> None:
        if self.client is not None:
            try:
                self.client.close()
            finally:
                self.client = None


def make_publisher(cfg: WeightSyncConfig, *, run: str, namespace: str | None, timeout_s: float) -> WeightPublisher:
    """The configured backend's sending side (learner rank 0)."""
    match cfg:
        case ObjectStoreSyncConfig():
            return ObjectStorePublisher(cfg, run=run, namespace=namespace, timeout_s=timeout_s)
        case CollectiveSyncConfig():
            return CollectivePublisher(cfg, run=run, namespace=namespace, timeout_s=timeout_s)
    raise TypeError(f"unknown weight_sync config {type(cfg).__name__}")


def make_weight_source(cfg: WeightSyncConfig, *, run: str, namespace: str | None, timeout_s: float = 60.0
                       ) -> ObjectStoreWeightSource | CollectiveWeightSource:
    """The configured backend's receiving side (picklable: pass it to generator actors)."""
    match cfg:
        case ObjectStoreSyncConfig():
            return ObjectStoreWeightSource(run, namespace, timeout_s, delta=cfg.delta)
        case CollectiveSyncConfig():
            return CollectiveWeightSource(cfg, run, namespace, timeout_s)
    raise TypeError(f"unknown weight_sync config {type(cfg).__name__}")
