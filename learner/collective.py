"""Collective weight sync: learner rank 0 serves each generator over its own 2-process channel.

The `collective` backend of `learner.weight_sync` (`CollectiveSyncConfig`). Both ends:

    server = CollectiveServer(cfg, timeout_s=60)            # learner rank 0, at publisher creation
    server.publish(version, state_dict)                      # packs buckets, swaps them in; never waits on anyone
    ...
    client = ChannelClient(address, generator_id, cfg, 60)   # in a generator, when it first needs weights
    state_dict = client.pull(version)                        # KeyError when rank 0 no longer holds `version`

Rendezvous: rank 0 hosts a `torch.distributed.TCPStore` (its `host:port` goes into every
announcement's location, "collective:host:port"). A generator opens a channel by writing
`<cid>/gen` and `<cid>/backend` under a fresh channel id, then appending the id to the store's channel
list (`add("channels", 1)` -> n, `index/<n>` = cid). Rank 0's acceptor thread sees the counter grow
and starts one serving thread per channel; each side builds a standalone 2-rank process group
(`ProcessGroupGloo` or `ProcessGroupNCCL`) on `PrefixStore(cid, store)` - rank 0 is the learner,
rank 1 the generator. No world-wide group exists, so generators join and leave at any time.

Pull protocol on a channel (all tensors; int64 unless said):
    generator -> rank 0   request [3]: (OP_PULL, version, version it holds or -1) or (OP_CLOSE, 0, -1)
    rank 0 -> generator   header  [4]: (version or -1 when not held, meta bytes, buckets, base)
                          base = the held version when a delta follows (`weight_sync.delta`), else -1
    rank 0 -> generator   meta    uint8 [meta bytes]: JSON plan (name, shape, dtype, bucket, offset, nbytes)
    rank 0 -> generator   bucket  uint8 [size] for each bucket (`bucket_mb`; tensors 64-byte aligned)

Because every generator pulls on its own thread of rank 0, a publication never waits for a generator,
a slow generator delays only itself, and a dead one makes only its own thread fail (logged with the
generator id and version, recorded in `status()["failures"]`, the channel dropped). Every send/receive
of a transfer waits at most `timeout_s`; the serving thread's wait for the next request is unbounded
only in the sense that it ends when the peer's socket closes (gloo reports a closed connection).

NCCL (`backend: nccl`, or `auto` when both ends see CUDA): the same protocol on a `ProcessGroupNCCL`
of 2 with CUDA tensors; UNTESTED here (no GPU on this machine).
"""

from __future__ import annotations

import datetime
import json
import logging
import threading
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from common.config import CollectiveSyncConfig
from learner.delta import DELTA_WORTH, DeltaEncoder

log = logging.getLogger(__name__)

OP_CLOSE, OP_PULL = 0, 1
ALIGN = 64  # bytes; every tensor starts at a multiple of this inside its bucket (so `.view(dtype)` works)
IDLE_S = 7 * 86_400.0  # a channel's wait for its next request (ends early when the generator's socket closes)


class WeightSyncError(RuntimeError):
    """A weight transfer on one channel failed (message names generator, version and address)."""


@dataclass(frozen=True, slots=True)
class Packed:
    """One published version as the wire carries it: a JSON plan and flat uint8 buckets."""

    version: int
    meta: torch.Tensor  # [M] uint8, JSON: {"tensors": [[name, shape, dtype, bucket, offset, nbytes], ...]}
    buckets: list[torch.Tensor]  # each [size] uint8


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name.removeprefix("torch."))


class Packer:
    """Streams state-dict chunks into uint8 buckets of up to `bucket_bytes` (a larger tensor gets a bucket of its
    own): a bucket is allocated and filled when it closes, so the packer holds the packed buckets plus the open
    bucket's tensors, never a whole second copy of the model. `add` chunks, then `finish`."""

    def __init__(self, version: int, bucket_bytes: int, device: torch.device):
        self.version, self.bucket_bytes, self.device = version, bucket_bytes, device
        self.plan: list[list] = []
        self.buckets: list[torch.Tensor] = []
        self.pending: list[tuple[torch.Tensor, int, int]] = []  # the open bucket's (tensor, offset, bytes)
        self.size: int | None = None  # bytes used in the open bucket; None: none open

    def _close(self) -> None:
        buf = torch.empty(max(self.size, 1), dtype=torch.uint8, device=self.device)
        for t, off, nbytes in self.pending:
            if nbytes:
                buf[off:off + nbytes].copy_(t.detach().contiguous().reshape(-1).view(torch.uint8))
        self.buckets.append(buf)
        self.pending.clear()
        self.size = None

    def add(self, chunk: dict[str, torch.Tensor]) -> None:
        for name, t in chunk.items():
            nbytes = t.numel() * t.element_size()
            offset = 0 if self.size is None else -(-self.size // ALIGN) * ALIGN
            if self.size is not None and offset + nbytes > self.bucket_bytes and self.size > 0:
                self._close()
                offset = 0
            self.plan.append([name, list(t.shape), str(t.dtype).removeprefix("torch."), len(self.buckets), offset,
                              nbytes])
            self.pending.append((t, offset, nbytes))
            self.size = offset + nbytes

    def finish(self) -> Packed:
        if self.size is not None:
            self._close()
        meta = torch.frombuffer(bytearray(json.dumps({"tensors": self.plan}).encode()), dtype=torch.uint8)
        return Packed(self.version, meta.to(self.device), self.buckets)


def pack(version: int, state_dict: dict[str, torch.Tensor] | Iterable[dict[str, torch.Tensor]], bucket_bytes: int,
         device: torch.device) -> Packed:
    """Copy `state_dict` (a dict, or its chunks as they come: `learner.gather.iter_full_state`) into uint8 buckets
    of up to `bucket_bytes` (see `Packer`)."""
    packer = Packer(version, bucket_bytes, device)
    for chunk in ([state_dict] if isinstance(state_dict, dict) else state_dict):
        packer.add(chunk)
    return packer.finish()


def packed_bytes(p: Packed) -> int:
    """The payload bytes of a packed version (its tensors, without alignment padding)."""
    return sum(entry[5] for entry in json.loads(bytes(p.meta.cpu().numpy()))["tensors"])


def unpack(meta: bytes, buckets: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """The state dict a `Packed` carries: views into the received buckets (no copy)."""
    out = {}
    for name, shape, dtype, b, off, nbytes in json.loads(meta)["tensors"]:
        out[name] = buckets[b][off:off + nbytes].view(_dtype(dtype)).reshape(shape)
    return out


def choose_backend(configured: str, server_has_cuda: bool) -> str:
    """The channel's backend: `auto` is nccl when this process and rank 0 both see CUDA, else gloo."""
    here = torch.cuda.is_available()
    if configured == "nccl" and not (here and server_has_cuda):
        raise WeightSyncError("learner.weight_sync.backend=nccl needs CUDA on learner rank 0 and on the generator "
                              f"(generator: {here}, learner: {server_has_cuda}); use backend: auto or gloo")
    if configured == "auto":
        return "nccl" if here and server_has_cuda else "gloo"
    return configured


class Channel:
    """One end of a 2-process group: rank 0 is learner rank 0, rank 1 a generator."""

    def __init__(self, store: dist.Store, cid: str, rank: int, backend: str, host: str, timeout_s: float):
        prefix = dist.PrefixStore(f"{cid}/pg/", store)
        td = datetime.timedelta(seconds=timeout_s)
        if backend == "gloo":
            opts = dist.ProcessGroupGloo._Options()
            opts._timeout = td
            opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
            self.pg, self.device = dist.ProcessGroupGloo(prefix, rank, 2, opts), torch.device("cpu")
        elif backend == "nccl":  # UNTESTED here (no GPU)
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = td
            self.pg = dist.ProcessGroupNCCL(prefix, rank, 2, opts)
            self.device = torch.device("cuda", torch.cuda.current_device())
        else:
            raise ValueError(f"unknown channel backend {backend!r}")
        self.peer, self.backend = 1 - rank, backend

    def send(self, t: torch.Tensor, timeout_s: float) -> None:
        self.pg.send([t], self.peer, 0).wait(datetime.timedelta(seconds=timeout_s))

    def recv(self, t: torch.Tensor, timeout_s: float) -> None:
        self.pg.recv([t], self.peer, 0).wait(datetime.timedelta(seconds=timeout_s))


class CollectiveServer:
    """Rank 0's side: the TCPStore, an acceptor thread, and one serving thread per generator channel.

    `publish` packs the new version and swaps it in (the newest `cfg.keep_versions` are held, so a
    generator that read the announcement just before the next publication still gets its version).
    """

    def __init__(self, cfg: CollectiveSyncConfig, *, timeout_s: float, host: str = "127.0.0.1"):
        self.cfg, self.host, self.timeout_s = cfg, host, min(timeout_s, cfg.timeout_s)
        self.cuda = torch.cuda.is_available() and cfg.backend != "gloo"
        self.device = torch.device("cuda", torch.cuda.current_device()) if self.cuda else torch.device("cpu")
        self.store = dist.TCPStore(host, cfg.port, is_master=True, wait_for_workers=False,
                                   timeout=datetime.timedelta(seconds=self.timeout_s))
        self.store.set("server/cuda", "1" if self.cuda else "0")
        self.address = f"{host}:{self.store.port}"
        self.lock = threading.Lock()
        self.versions: dict[int, Packed] = {}
        self.deltas: dict[int, Packed] = {}  # version -> its delta from version - 1 (cfg.delta)
        self.encoder = DeltaEncoder() if cfg.delta else None
        self.channels: dict[str, str] = {}  # channel id -> generator id, while its thread serves
        self.failures: list[dict] = []  # {"generator", "channel", "version", "error", "at"}
        self.served = 0  # transfers completed
        self.closed = threading.Event()
        threading.Thread(target=self._accept, name="weights-acceptor", daemon=True).start()

    def publish(self, version: int, state_dict: dict[str, torch.Tensor] | Iterable[dict[str, torch.Tensor]]
                ) -> tuple[int, int]:
        """Pack `version` (a dict or its chunks, packed as they come) and hold it for the channels, with its delta
        from the previous version when `cfg.delta`; returns (payload bytes, delta payload bytes or 0)."""
        chunks = [state_dict] if isinstance(state_dict, dict) else state_dict
        bucket_bytes = int(self.cfg.bucket_mb * (1 << 20))
        full, delta = Packer(version, bucket_bytes, self.device), Packer(version, bucket_bytes, self.device)
        has_delta = False
        pairs = ((c, None) for c in chunks) if self.encoder is None else self.encoder.tee(version, chunks)
        for chunk, d in pairs:
            full.add(chunk)
            if d is not None:
                delta.add(d)
                has_delta = True
        packed, packed_delta = full.finish(), delta.finish() if has_delta else None
        if packed_delta is not None and packed_bytes(packed_delta) > DELTA_WORTH * packed_bytes(packed):
            packed_delta = None  # nearly everything changed (a high learning rate): whole only
        with self.lock:
            if self.versions and version <= max(self.versions):
                raise ValueError(f"version {version} published after {max(self.versions)}: versions must increase")
            self.versions[version] = packed
            if packed_delta is not None:
                self.deltas[version] = packed_delta
            for v in sorted(self.versions)[:-self.cfg.keep_versions]:
                del self.versions[v]
                self.deltas.pop(v, None)
        return packed_bytes(packed), packed_bytes(packed_delta) if packed_delta is not None else 0

    def status(self) -> dict:
        with self.lock:
            return {"address": self.address, "versions": sorted(self.versions), "channels": dict(self.channels),
                    "failures": list(self.failures), "served": self.served}

    def close(self) -> None:
        """Stop accepting; serving threads are daemons blocked on their peers and end with the process."""
        self.closed.set()

    def _accept(self) -> None:
        seen = 0
        while not self.closed.wait(0.02):
            n = self.store.add("channels", 0)
            for k in range(seen + 1, n + 1):
                cid = self.store.get(f"index/{k}").decode()
                threading.Thread(target=self._serve, args=(cid,), name=f"weights-{cid}", daemon=True).start()
            seen = n

    def _serve(self, cid: str) -> None:
        gen, version = self.store.get(f"{cid}/gen").decode(), None
        with self.lock:
            self.channels[cid] = gen
        try:
            ch = Channel(self.store, cid, 0, self.store.get(f"{cid}/backend").decode(), self.host, self.timeout_s)
            req = torch.zeros(3, dtype=torch.int64, device=ch.device)  # [op, version, version held or -1]
            while not self.closed.is_set():
                ch.recv(req, IDLE_S)
                op, version, held = req.tolist()
                if op == OP_CLOSE:
                    log.info("weight channel %s: generator %s left", cid, gen)
                    return
                self._reply(ch, version, held)
        except RuntimeError as e:  # gloo/NCCL: closed connection or timeout; only this channel is affected
            with self.lock:
                self.failures.append({"generator": gen, "channel": cid, "version": version, "error": str(e)[:500],
                                      "at": time.time()})
            log.warning("weight channel %s of generator %s failed while serving version %s (%s: %s); channel closed",
                        cid, gen, version, type(e).__name__, str(e)[:300])
        finally:
            with self.lock:
                self.channels.pop(cid, None)

    def _reply(self, ch: Channel, version: int, held: int) -> None:
        """`version` whole, or its delta when the generator holds `version - 1` and the delta is kept."""
        with self.lock:
            packed, base = self.versions.get(version), -1
            if packed is not None and held == version - 1 and version in self.deltas:
                packed, base = self.deltas[version], held
        if packed is None:
            ch.send(torch.tensor([-1, 0, 0, -1], dtype=torch.int64, device=ch.device), self.timeout_s)
            return
        header = torch.tensor([version, packed.meta.numel(), len(packed.buckets), base], dtype=torch.int64)
        ch.send(header.to(ch.device), self.timeout_s)
        ch.send(packed.meta.to(ch.device), self.timeout_s)
        for b in packed.buckets:  # a gloo channel of a CUDA-packed version sends host copies
            ch.send(b if b.device == ch.device else b.to(ch.device), self.timeout_s)
        with self.lock:
            self.served += 1


class ChannelClient:
    """A generator's side of one channel to rank 0 at `address` ("host:port")."""

    def __init__(self, address: str, generator_id: str, cfg: CollectiveSyncConfig, timeout_s: float,
                 host: str = "127.0.0.1"):
        self.address, self.generator_id, self.timeout_s = address, generator_id, min(timeout_s, cfg.timeout_s)
        server_host, port = address.rsplit(":", 1)
        td = datetime.timedelta(seconds=self.timeout_s)
        self.store = dist.TCPStore(server_host, int(port), is_master=False, timeout=td)
        backend = choose_backend(cfg.backend, self.store.get("server/cuda") == b"1")
        self.cid = f"{generator_id}@{uuid.uuid4().hex[:8]}"
        self.store.set(f"{self.cid}/gen", generator_id)
        self.store.set(f"{self.cid}/backend", backend)
        self.store.set(f"index/{self.store.add('channels', 1)}", self.cid)
        self.channel = Channel(self.store, self.cid, 1, backend, host, self.timeout_s)

    def pull(self, version: int, held: int = -1) -> tuple[dict[str, torch.Tensor], int]:
        """(the state dict of `version`, -1) or, when this generator holds `held` = version - 1 and rank 0 kept a
        delta, (the delta, `held`): views into fresh buckets on the channel's device. KeyError if not held."""
        ch, t = self.channel, self.timeout_s
        ch.send(torch.tensor([OP_PULL, version, held], dtype=torch.int64, device=ch.device), t)
        header = torch.zeros(4, dtype=torch.int64, device=ch.device)  # [version, meta bytes, buckets, base]
        ch.recv(header, t)
        got, meta_len, n, base = header.tolist()
        if got < 0:
            raise KeyError(f"weights version {version} is no longer held by learner rank 0 ({self.address}); "
                           "call latest() again")
        meta = torch.empty(meta_len, dtype=torch.uint8, device=ch.device)
        ch.recv(meta, t)
        plan = json.loads(bytes(meta.cpu().numpy()))["tensors"]
        sizes = [0] * n
        for _, _, _, b, off, nbytes in plan:
            sizes[b] = max(sizes[b], off + nbytes)
        buckets = [torch.empty(max(s, 1), dtype=torch.uint8, device=ch.device) for s in sizes]
        for b in buckets:
            ch.recv(b, t)
        return unpack(bytes(meta.cpu().numpy()), buckets), base

    def close(self) -> None:
        """Tell rank 0 this generator leaves (best effort: a dead rank 0 cannot be told)."""
        try:
            self.channel.send(torch.tensor([OP_CLOSE, 0, -1], dtype=torch.int64, device=self.channel.device), 5.0)
        except RuntimeError as e:
            log.info("generator %s: closing weight channel %s: %s", self.generator_id, self.cid, e)
        self.channel = None
