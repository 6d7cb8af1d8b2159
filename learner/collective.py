"""Collective weight sync: learner rank 0 serves generators over 2-process channels, directly or through relays.

The `collective` backend of `learner.weight_sync` (`CollectiveSyncConfig`):

    server = CollectiveServer(cfg, timeout_s=60)            # learner rank 0, at publisher creation
    server.publish(version, state_dict)                      # packs buckets, swaps them in; never waits on anyone
    client = ChannelClient(address, generator_id, cfg, 60, secret=server.secret)  # in a generator (secret: via Ray)
    state_dict, base = client.pull(version)                  # KeyError when rank 0 no longer holds `version`
    relay = RelayReceiver(cfg, generator_id, 60, host, secret=...)  # instead, with cfg.relay_fanout = k >= 1

Authentication: the stores are plain TCPStores that any peer on the network can read and write (`list_keys` shows
every key, so hiding keys under a secret prefix would hide nothing). What a peer learns or writes there is therefore
never trusted: each channel starts with a mutual challenge proving both ends know the run's secret (`handshake`),
relay slots carry a MAC of the address they name, and every size or count read from a peer is bounded.

Rendezvous, the pull protocol, relays, failures, where versions are held, NCCL: docs/internals.md#learnercollectivepy
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import json
import logging
import secrets
import socket
import threading
import time
import uuid
from collections.abc import Iterable, Iterator

import torch
import torch.distributed as dist

from common.config import CollectiveSyncConfig
from learner.delta import DELTA_WORTH, DeltaEncoder
from learner.packing import Packed, Packer, dtype_named, host_device, packed_bytes, uint8_buffer, unpack

log = logging.getLogger(__name__)

OP_CLOSE, OP_PULL = 0, 1
IDLE_S = 7 * 86_400.0  # a channel's wait for its next request (ends early when the generator's socket closes)
MAX_NEW_CHANNELS = 256  # channels the acceptor takes in one poll; a larger jump of the count is refused, not served
MAX_KEY_BYTES = 256  # a channel id, generator id, backend or relay slot read from a store
MAX_META_BYTES = 64 << 20  # a version's plan (JSON) as a server announces it
MAX_BUCKETS = 1 << 20
NONCE_BYTES = 16


class WeightSyncError(RuntimeError):
    """A weight transfer on one channel failed (message names generator, version and address)."""


def new_secret() -> str:
    """A run's channel secret (128 bits): made on learner rank 0, carried to generators only by Ray calls."""
    return secrets.token_hex(16)


def mac(secret: str, *parts: str | bytes) -> str:
    """HMAC-SHA256 of `parts` (length-prefixed, so no two lists of parts collide) under `secret`, as hex."""
    h = hmac.new(secret.encode(), digestmod=hashlib.sha256)
    for part in parts:
        data = part.encode() if isinstance(part, str) else part
        h.update(len(data).to_bytes(8, "little") + data)
    return h.hexdigest()


def listening_store(host: str, port: int, timeout_s: float) -> dist.TCPStore:
    """A TCPStore server listening on `host` only (`port` 0: the OS picks one; read `store.port`). TCPStore binds
    its own socket to every interface whatever `host` says; a socket bound here and handed over as
    `master_listen_fd` keeps it to `host`, with no bind/close/re-bind race. The store owns that socket from then
    on and closes it when it goes (so Python's socket object lets go of it: no second close of a reused fd)."""
    family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.bind(addr)
        sock.listen(128)
        port = sock.getsockname()[1]
    except OSError:
        sock.close()
        raise
    return dist.TCPStore(host, port, is_master=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=timeout_s), master_listen_fd=sock.detach())


def read_key(store: dist.Store, key: str, wait_s: float) -> str | None:
    """A short text a peer wrote at `key`, or None when it is absent after `wait_s`, longer than MAX_KEY_BYTES or
    not UTF-8: a peer's value is bounded before it is used, and a missing one never blocks for the store's timeout."""
    try:
        if not store.check([key]):
            store.wait([key], datetime.timedelta(seconds=wait_s))
    except dist.DistStoreError:
        return None
    value = store.get(key)
    if len(value) > MAX_KEY_BYTES:
        return None
    try:
        return value.decode()
    except UnicodeDecodeError:
        return None


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


def handshake(ch: Channel, secret: str, cid: str, rank: int, timeout_s: float) -> bool:
    """Whether the peer proved it knows `secret`, each end proving it to the other before anything else crosses
    the channel: the generator (rank 1) sends a nonce, the server answers its own nonce and its MAC of both,
    the generator checks it and answers its MAC. So a peer that opened a channel through the open store pulls no
    weights, and a generator sent to a peer's address (a forged slot, a rendezvous key overwritten) takes no
    weights from it. A peer relaying both ends' messages (a man in the middle of the rendezvous) is not caught."""
    if rank == 1:
        mine = secrets.token_bytes(NONCE_BYTES)
        ch.send(_tensor(mine, ch.device), timeout_s)
        reply = _received(ch, NONCE_BYTES + 64, timeout_s)  # [server's nonce, its hex MAC]
        both = mine + reply[:NONCE_BYTES]
        if not hmac.compare_digest(reply[NONCE_BYTES:], mac(secret, "server", cid, both).encode()):
            return False
        ch.send(_tensor(mac(secret, "generator", cid, both).encode(), ch.device), timeout_s)
        return True
    mine = secrets.token_bytes(NONCE_BYTES)
    both = _received(ch, NONCE_BYTES, timeout_s) + mine
    ch.send(_tensor(mine + mac(secret, "server", cid, both).encode(), ch.device), timeout_s)
    return hmac.compare_digest(_received(ch, 64, timeout_s), mac(secret, "generator", cid, both).encode())


def _received(ch: Channel, nbytes: int, timeout_s: float) -> bytes:
    t = torch.zeros(nbytes, dtype=torch.uint8, device=ch.device)
    ch.recv(t, timeout_s)
    return bytes(t.cpu().numpy())


def _tensor(data: bytes, device: torch.device) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)


class Payload:
    """A packed version as a channel server serves it: complete on learner rank 0 (`Payload.of`), or filling
    bucket by bucket on a relay while it is already being served onwards (`begin`, `arrived`, `fail`)."""

    def __init__(self, version: int, device: torch.device | None = None):
        self.version, self.base = version, -1  # base: the version a delta applies to, -1 for a whole version
        self.device = device  # where the buckets go when they arrive (None: the channel's device)
        self.meta: torch.Tensor | None = None
        self.buckets: list[torch.Tensor] = []  # what is served: on the device or the host
        self.host: list[torch.Tensor] | None = None  # the buckets in host memory (the same list when they are there)
        self.count = 0  # buckets arrived (in order)
        self.failed = False
        self.cond = threading.Condition()

    @classmethod
    def of(cls, packed: Packed, base: int = -1) -> Payload:
        p = cls(packed.version)
        p.base, p.meta, p.buckets, p.count = base, packed.meta, list(packed.buckets), len(packed.buckets)
        if all(b.device.type == "cpu" for b in p.buckets):
            p.host = p.buckets
        return p

    def bucket_for(self, i: int, device: torch.device) -> torch.Tensor:
        """Bucket `i` on `device` (a channel's): the served bucket, its host copy, or (neither there) a copy."""
        b = self.buckets[i]
        if b.device == device:
            return b
        host = self.host
        if host is not None and host[i].device == device:
            return host[i]
        return b.to(device)  # an NCCL channel from a host bucket, or a gloo one from a device bucket (no host copy)

    def begin(self, base: int, meta: torch.Tensor, n: int, device: torch.device) -> None:
        """The header and plan arrived: allocate the `n` buckets the plan describes."""
        sizes = [size for size, _ in _bucket_plan(meta, n)]
        with self.cond:
            self.base, self.meta = base, meta
            self.buckets = [uint8_buffer(max(s, 1), device) for s in sizes]
            self.cond.notify_all()

    def arrived(self, i: int) -> None:
        with self.cond:
            self.count = i + 1
            self.cond.notify_all()

    def fail(self) -> None:
        """The transfer into this payload gave up: whoever is served from it is told so."""
        with self.cond:
            self.failed = True
            self.cond.notify_all()

    def wait(self, ready, timeout_s: float) -> bool:
        """True once `ready()` holds; False when the payload failed or `timeout_s` passed first."""
        with self.cond:
            return self.cond.wait_for(lambda: ready() or self.failed, timeout_s) and not self.failed

    def state_dict(self) -> dict[str, torch.Tensor]:
        return unpack(bytes(self.meta.cpu().numpy()), self.buckets)


class ChannelServer:
    """A rendezvous `TCPStore`, an acceptor thread and one serving thread per channel, answering pull requests
    from `_lookup(version, held)` (a `Payload`, possibly still arriving). Learner rank 0 (`CollectiveServer`)
    and every relaying generator (`RelayServer`) run one, listening on `host` only. A channel is served only to a
    peer that proves `secret` (`handshake`); one that does not, and counts or names out of bounds, are refused,
    logged and counted (`status()["refused"]`)."""

    def __init__(self, cfg: CollectiveSyncConfig, *, timeout_s: float, host: str, port: int, cuda: bool, secret: str):
        self.cfg, self.host, self.timeout_s = cfg, host, min(timeout_s, cfg.timeout_s)
        self.cuda = cuda  # channels may be NCCL; what the server holds stays in host memory (host_device)
        self.device = host_device()
        self.secret = secret
        self.store = listening_store(host, port, self.timeout_s)
        self.store.set("server/cuda", "1" if cuda else "0")
        self.address = f"{host}:{self.store.port}"
        self.lock = threading.Lock()
        self.channels: dict[str, str] = {}  # channel id -> generator id, while its thread serves
        self.failures: list[dict] = []  # {"generator", "channel", "version", "error", "at"}
        self.served = 0  # transfers completed
        self.refused = 0  # channels refused: out-of-bounds counts or names, peers that did not prove the secret
        self.unproven = threading.BoundedSemaphore(MAX_NEW_CHANNELS)  # channels not yet past their handshake
        self.closed = threading.Event()
        threading.Thread(target=self._accept, name="weights-acceptor", daemon=True).start()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.address})"  # never the secret

    def _lookup(self, version: int, held: int) -> Payload | None:
        raise NotImplementedError

    def status(self) -> dict:
        with self.lock:
            return {"address": self.address, "channels": dict(self.channels), "failures": list(self.failures),
                    "served": self.served, "refused": self.refused}

    def _refuse(self, what: str, cid: str | None = None) -> None:
        with self.lock:
            self.refused += 1
        log.error("weight server %s: refused %s (%s)", self.address, f"channel {cid!r}" if cid else "a channel", what)

    def close(self) -> None:
        """Stop accepting; serving threads are daemons blocked on their peers and end with the process."""
        self.closed.set()

    def _accept(self) -> None:
        """Start a serving thread per new channel. The count and the names come from the open store, so nothing
        read there blocks or grows without bound: a jump of the count past MAX_NEW_CHANNELS waiting channels is
        refused whole; a channel whose name is not written within the timeout, is too long or was served before is
        refused alone; waiting for one never holds up the others."""
        seen, started, waiting = 0, set(), {}  # waiting: index -> when it is given up
        while not self.closed.wait(0.02):
            n = self.store.add("channels", 0)
            if n - seen + len(waiting) > MAX_NEW_CHANNELS or n < seen:
                self._refuse(f"the channel count went from {seen} to {n}; those channels are not served")
                seen = max(seen, n)
                continue
            waiting.update((k, time.monotonic() + self.timeout_s) for k in range(seen + 1, n + 1))
            seen = n
            for k, deadline in list(waiting.items()):
                key = f"index/{k}"
                if not self.store.check([key]):
                    if time.monotonic() > deadline:
                        del waiting[k]
                        self._refuse(f"{key} was not written within {self.timeout_s:.0f}s")
                    continue
                del waiting[k]
                cid = read_key(self.store, key, self.timeout_s)
                if cid is None or cid in started:
                    self._refuse(f"{key} is too long, not text, or names a channel served before", cid)
                    continue
                if not self.unproven.acquire(blocking=False):  # a thread each: as many as that, and no more
                    self._refuse(f"{MAX_NEW_CHANNELS} channels are already waiting for their handshake", cid)
                    continue
                started.add(cid)
                threading.Thread(target=self._serve, args=(cid,), name=f"weights-{cid[:64]}", daemon=True).start()

    def _serve(self, cid: str) -> None:
        try:
            proved = self._open(cid)
        finally:
            self.unproven.release()
        if proved is not None:
            self._requests(cid, *proved)

    def _open(self, cid: str) -> tuple[str, Channel] | None:
        """(generator id, channel) once the peer proved the secret; None (refused, counted) otherwise."""
        gen, backend = read_key(self.store, f"{cid}/gen", self.timeout_s), None
        if gen is not None:
            backend = read_key(self.store, f"{cid}/backend", self.timeout_s)
        if gen is None or backend not in ("gloo", "nccl"):
            return self._refuse(f"generator {gen!r}, backend {backend!r}", cid)
        try:
            ch = Channel(self.store, cid, 0, backend, self.host, self.timeout_s)
            proved = handshake(ch, self.secret, cid, 0, self.timeout_s)
        except RuntimeError as e:  # the peer left or stalled before proving anything (it may be a generator
            proved = False  # that found this server is not the run's): refused all the same
            log.info("weight channel %s: handshake broke off (%s)", cid, str(e)[:200])
        if not proved:
            return self._refuse(f"peer {gen!r} did not prove the run's secret", cid)
        return gen, ch

    def _requests(self, cid: str, gen: str, ch: Channel) -> None:
        """Answer the channel's requests until the generator leaves or the channel fails."""
        version = None
        with self.lock:
            self.channels[cid] = gen
        try:
            req = torch.zeros(4, dtype=torch.int64, device=ch.device)  # [op, version, version held or -1, start]
            while not self.closed.is_set():
                ch.recv(req, IDLE_S)
                op, version, held, start = req.tolist()
                if op == OP_CLOSE:
                    log.info("weight channel %s: generator %s left", cid, gen)
                    return
                if op != OP_PULL or not 0 <= start < MAX_BUCKETS:
                    return self._refuse(f"request {req.tolist()} of generator {gen!r}", cid)
                self._reply(ch, version, held, start)
        except RuntimeError as e:  # gloo/NCCL: closed connection or timeout; only this channel is affected
            with self.lock:
                self.failures.append({"generator": gen, "channel": cid, "version": version, "error": str(e)[:500],
                                      "at": time.time()})
            log.warning("weight channel %s of generator %s failed while serving version %s (%s: %s); channel closed",
                        cid, gen, version, type(e).__name__, str(e)[:300])
        finally:
            with self.lock:
                self.channels.pop(cid, None)

    def _reply(self, ch: Channel, version: int, held: int, start: int) -> None:
        """Buckets `start`.. of `version` (whole, or its delta when the generator holds `version - 1`), each sent as
        soon as it is here; a payload that fails or stalls past the timeout sends status 0 instead of a bucket."""
        p = self._lookup(version, held)
        if p is None or not p.wait(lambda: p.meta is not None, self.timeout_s):
            ch.send(torch.tensor([-1, 0, 0, -1], dtype=torch.int64, device=ch.device), self.timeout_s)
            return
        n = len(p.buckets)
        start = min(start, n)
        ch.send(torch.tensor([version, p.meta.numel(), n, p.base], dtype=torch.int64).to(ch.device), self.timeout_s)
        ch.send(p.meta.to(ch.device), self.timeout_s)
        ok, bad = torch.ones(1, dtype=torch.int64, device=ch.device), torch.zeros(1, dtype=torch.int64,
                                                                                  device=ch.device)
        for i in range(start, n):
            if not p.wait(lambda: p.count > i, self.timeout_s):
                ch.send(bad, self.timeout_s)
                return
            ch.send(ok, self.timeout_s)
            ch.send(p.bucket_for(i, ch.device), self.timeout_s)
        with self.lock:
            self.served += 1


class CollectiveServer(ChannelServer):
    """Learner rank 0's side: `publish` packs the new version and swaps it in (the newest `cfg.keep_versions` are
    held, so a generator that read the announcement just before the next publication still gets its version).
    Its store also hands out the relay slots (`RelayReceiver`). Where the versions live: the module docstring."""

    def __init__(self, cfg: CollectiveSyncConfig, *, timeout_s: float, host: str = "127.0.0.1"):
        super().__init__(cfg, timeout_s=timeout_s, host=host, port=cfg.port,
                         cuda=torch.cuda.is_available() and cfg.backend != "gloo", secret=new_secret())
        self.versions: dict[int, Payload] = {}
        self.deltas: dict[int, Payload] = {}  # version -> its delta from version - 1 (cfg.delta)
        self.encoder = DeltaEncoder() if cfg.delta else None
        self.holding: threading.Thread | None = None  # the newest version's host copy being made
        self.hold_error: BaseException | None = None
        self.hold_s = 0.0  # how long the last host copy took after `publish` returned (0: none needed)

    @staticmethod
    def bucket_buffer(nbytes: int, device: torch.device) -> torch.Tensor:
        """A buffer the gather fills with one bucket (`iter_flat_buckets(alloc=...)`): the packer keeps it as the
        held bucket, so a publication costs no staging buffer and no copy on rank 0."""
        return uint8_buffer(max(nbytes, 1), device)[:nbytes]

    @property
    def takes_device_buckets(self) -> bool:
        """Whether `publish` wants the gather's buckets left on the GPU (they are sent from there over NCCL)."""
        return self.cuda

    def publish(self, version: int, state_dict: dict[str, torch.Tensor] | Iterable[dict[str, torch.Tensor]],
                delta: bool = True) -> tuple[int, int]:
        """Pack `version` (a dict or its chunks, packed as they come: `learner.gather.FlatBucket`s are copied at
        once, dicts must stay valid until the end) and hold it for the channels, with its delta from the previous
        version when `cfg.delta` and `delta` (False: whole only, as LoRA adapters travel); returns (payload bytes,
        delta payload bytes or 0). A version packed on the GPU gets its host copy in the background (see the module
        docstring)."""
        self._settle()
        chunks = [state_dict] if isinstance(state_dict, dict) else state_dict
        bucket_bytes = int(self.cfg.bucket_mb * (1 << 20))
        full, delta = Packer(version, bucket_bytes, self.device), Packer(version, bucket_bytes, self.device)
        has_delta = False
        pairs = ((c, None) for c in chunks) if self.encoder is None or not delta else self.encoder.tee(version, chunks)
        for chunk, d in pairs:
            full.add(chunk)
            if d is not None:
                delta.add(d)
                has_delta = True
        packed, packed_delta = full.finish(), delta.finish() if has_delta else None
        if packed_delta is not None and packed_bytes(packed_delta) > DELTA_WORTH * packed_bytes(packed):
            packed_delta = None  # nearly everything changed (a high learning rate): whole only
        payload = Payload.of(packed)
        with self.lock:
            if self.versions and version <= max(self.versions):
                raise ValueError(f"version {version} published after {max(self.versions)}: versions must increase")
            self.versions[version] = payload
            if packed_delta is not None:
                self.deltas[version] = Payload.of(packed_delta, version - 1)
            for v in sorted(self.versions)[:-self.cfg.keep_versions]:
                del self.versions[v]
                self.deltas.pop(v, None)
                self._forget_slots(v)
        if payload.host is None and self.cfg.keep_versions > 1:  # on the GPU, and it must outlive the next version
            ready = torch.cuda.Event()
            ready.record()  # the packing's copies, on this thread's stream, come first
            self.holding = threading.Thread(target=self._hold_on_host, args=(payload, ready),
                                            name=f"weights-hold-{version}", daemon=True)
            self.holding.start()
        return packed_bytes(packed), packed_bytes(packed_delta) if packed_delta is not None else 0

    def _hold_on_host(self, p: Payload, ready) -> None:
        """A host copy of `p`'s GPU buckets (pinned, on a side stream), made after `publish` returned."""
        t0 = time.monotonic()
        try:
            device = p.buckets[0].device
            torch.cuda.set_device(device)
            stream = torch.cuda.Stream(device=device)
            host = [uint8_buffer(b.numel(), host_device()) for b in p.buckets]
            with torch.cuda.stream(stream):
                stream.wait_event(ready)
                for h, b in zip(host, p.buckets):
                    h.copy_(b, non_blocking=True)
            stream.synchronize()
            p.host = host
            self.hold_s = time.monotonic() - t0
        except BaseException as e:  # raised by the next publish (`_settle`): the learner sees it
            log.error("weights version %d: the host copy of the GPU-held version failed (%s: %s)", p.version,
                      type(e).__name__, e)
            self.hold_error = e

    def _settle(self) -> None:
        """Before a new version is packed: wait for the last host copy (normally done long ago), then serve every
        held version from its host copy and drop its GPU buckets (one packed version on the GPU at a time)."""
        if self.holding is not None:
            self.holding.join(self.timeout_s)
            if self.holding.is_alive():
                raise WeightSyncError(f"the host copy of the last published version did not finish within "
                                      f"{self.timeout_s:.0f}s")
            self.holding = None
        if self.hold_error is not None:
            e, self.hold_error = self.hold_error, None
            raise WeightSyncError(f"the host copy of the last published version failed: {type(e).__name__}: {e}") from e
        with self.lock:
            for p in self.versions.values():
                if p.host is not None:
                    p.buckets = p.host

    def _lookup(self, version: int, held: int) -> Payload | None:
        with self.lock:
            if held == version - 1 and version in self.deltas:
                return self.deltas[version]
            return self.versions.get(version)

    def _forget_slots(self, version: int) -> None:
        """Drop the relay slots handed out for a version no longer held (`RelayReceiver.pull`)."""
        for held in (-1, version - 1):
            key = f"relay/{version}/{held}"
            n = min(self.store.add(f"{key}/n", 0), MAX_NEW_CHANNELS)  # a count a peer inflated: its keys are none
            for k in range(1, n + 1):
                self.store.delete_key(f"{key}/at/{k}")
            self.store.delete_key(f"{key}/n")

    def status(self) -> dict:
        out = super().status()
        with self.lock:
            out["versions"] = sorted(self.versions)
            out["on_device"] = sorted(v for v, p in self.versions.items() if p.buckets[0].device.type != "cpu")
        out["hold_s"] = self.hold_s
        return out


def _bucket_plan(meta: torch.Tensor, n: int) -> list[tuple[int, list]]:
    """Per bucket of a plan: (its size in bytes, its tensors' plan entries). WeightSyncError for a plan that is
    not one (entries of the wrong shape, a bucket index outside 0..n-1, negative offsets or sizes)."""
    out: list[tuple[int, list]] = [(0, []) for _ in range(n)]
    try:
        for entry in json.loads(bytes(meta.cpu().numpy()))["tensors"]:
            name, shape, dtype, b, off, nbytes = entry
            if not (isinstance(b, int) and isinstance(off, int) and isinstance(nbytes, int)
                    and 0 <= b < n and off >= 0 and nbytes >= 0):
                raise ValueError(f"entry {str(entry)[:200]}")
            size, members = out[b]
            out[b] = (max(size, off + nbytes), members + [entry])
    except (ValueError, TypeError, KeyError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise WeightSyncError(f"the server sent a plan of {meta.numel()} bytes that is not one ({e})") from None
    return out


def _request(ch: Channel, version: int, held: int, start: int, timeout_s: float
             ) -> tuple[int, torch.Tensor, int] | None:
    """Ask for buckets `start`.. of `version`: (base, meta, buckets) from the header, or None when not held."""
    ch.send(torch.tensor([OP_PULL, version, held, start], dtype=torch.int64, device=ch.device), timeout_s)
    header = torch.zeros(4, dtype=torch.int64, device=ch.device)  # [version, meta bytes, buckets, base]
    ch.recv(header, timeout_s)
    got, meta_len, n, base = header.tolist()
    if got < 0:
        return None
    if got != version or not 0 < meta_len <= MAX_META_BYTES or not 0 <= n <= MAX_BUCKETS or base < -1:
        raise WeightSyncError(f"asked for version {version}, the server answered a header out of bounds "
                              f"{header.tolist()} (at most {MAX_META_BYTES} plan bytes, {MAX_BUCKETS} buckets)")
    meta = torch.empty(meta_len, dtype=torch.uint8, device=ch.device)
    ch.recv(meta, timeout_s)
    return base, meta, n


def _expect_bucket(ch: Channel, status: torch.Tensor, version: int, i: int, n: int, timeout_s: float) -> None:
    """Read the status before bucket `i`; WeightSyncError when the server gave up instead."""
    ch.recv(status, timeout_s)
    if status.item() != 1:
        raise WeightSyncError(f"the server gave up sending version {version} at bucket {i} of {n} "
                              "(its own transfer failed or stalled)")


def receive(ch: Channel, into: Payload, version: int, held: int, timeout_s: float) -> bool:
    """Pull `version` over `ch` into `into`, from its first missing bucket on (a transfer that broke resumes where
    it stopped, from any server holding the same payload); False when the server does not hold it. Raises
    WeightSyncError when the server gives up part-way or sends another payload than the one being resumed."""
    start = into.count if into.meta is not None else 0
    reply = _request(ch, version, held, start, timeout_s)
    if reply is None:
        return False
    base, meta, n = reply
    if into.meta is None:
        into.begin(base, meta, n, into.device or ch.device)
    elif base != into.base or n != len(into.buckets) or not torch.equal(meta.cpu(), into.meta.cpu()):
        raise WeightSyncError(f"resuming version {version}: the server sent another payload (base {base}, {n} "
                              f"buckets) than the one begun (base {into.base}, {len(into.buckets)} buckets)")
    status = torch.zeros(1, dtype=torch.int64, device=ch.device)
    for i in range(start, n):
        _expect_bucket(ch, status, version, i, n, timeout_s)
        dst = into.buckets[i]
        if dst.device == ch.device:
            ch.recv(dst, timeout_s)
        else:  # a relay keeps its copy in host memory: an NCCL channel receives into a device bucket first
            staged = torch.empty_like(dst, device=ch.device)
            ch.recv(staged, timeout_s)
            dst.copy_(staged)
        into.arrived(i)
    return True


class ChannelClient:
    """A generator's side of one channel to the channel server at `address` ("host:port"). `secret`: the run's
    (`CollectiveServer.secret`, carried by Ray in the announcement); WeightSyncError when the server does not prove
    it knows it (another process at that address)."""

    def __init__(self, address: str, generator_id: str, cfg: CollectiveSyncConfig, timeout_s: float,
                 host: str = "127.0.0.1", *, secret: str):
        self.address, self.generator_id, self.timeout_s = address, generator_id, min(timeout_s, cfg.timeout_s)
        self.secret = secret
        server_host, port = address.rsplit(":", 1)
        td = datetime.timedelta(seconds=self.timeout_s)
        self.store = dist.TCPStore(server_host, int(port), is_master=False, timeout=td)
        backend = choose_backend(cfg.backend, self.store.get("server/cuda") == b"1")
        self.cid = f"{generator_id[:128]}@{uuid.uuid4().hex}"
        self.store.set(f"{self.cid}/gen", generator_id[:128])
        self.store.set(f"{self.cid}/backend", backend)
        self.store.set(f"index/{self.store.add('channels', 1)}", self.cid)
        self.channel = Channel(self.store, self.cid, 1, backend, host, self.timeout_s)
        if not handshake(self.channel, secret, self.cid, 1, self.timeout_s):
            self.channel = None
            raise WeightSyncError(f"generator {generator_id}: the weight server at {address} did not prove the run's "
                                  "secret; nothing was taken from it")

    def __repr__(self) -> str:
        return f"ChannelClient({self.address}, {self.cid})"

    def pull(self, version: int, held: int = -1) -> tuple[dict[str, torch.Tensor], int]:
        """(the state dict of `version`, -1) or, when this generator holds `held` = version - 1 and the server kept a
        delta, (the delta, `held`): views into fresh buckets on the channel's device. KeyError if not held."""
        p = Payload(version)
        if not receive(self.channel, p, version, held, self.timeout_s):
            raise KeyError(f"weights version {version} is no longer held by learner rank 0 ({self.address}); "
                           "call latest() again")
        return p.state_dict(), p.base

    def pull_buckets(self, version: int) -> Iterator[dict[str, torch.Tensor]]:
        """The whole `version`, a bucket's tensors at a time: the header is exchanged now (KeyError if not held),
        each bucket is received when the iterator is advanced, so the caller holds one bucket (plus what it keeps).
        The iterator must be run to its end before the channel carries another request."""
        ch, t = self.channel, self.timeout_s
        reply = _request(ch, version, -1, 0, t)
        if reply is None:
            raise KeyError(f"weights version {version} is no longer held by learner rank 0 ({self.address}); "
                           "call latest() again")
        _, meta, n = reply
        plan = _bucket_plan(meta, n)

        def buckets() -> Iterator[dict[str, torch.Tensor]]:
            status = torch.zeros(1, dtype=torch.int64, device=ch.device)
            for i, (size, members) in enumerate(plan):
                _expect_bucket(ch, status, version, i, n, t)
                buf = torch.empty(max(size, 1), dtype=torch.uint8, device=ch.device)
                ch.recv(buf, t)
                yield {name: buf[off:off + nbytes].view(dtype_named(dtype)).reshape(shape)
                       for name, shape, dtype, _, off, nbytes in members}

        return buckets()

    def close(self) -> None:
        """Tell the server this generator leaves (best effort: a dead server cannot be told)."""
        try:
            self.channel.send(torch.tensor([OP_CLOSE, 0, -1, 0], dtype=torch.int64, device=self.channel.device), 5.0)
        except RuntimeError as e:
            log.info("generator %s: closing weight channel %s: %s", self.generator_id, self.cid, e)
        self.channel = None
