"""Relayed weight fan-out (`learner.weight_sync.relay_fanout` = k >= 1): generators forward each version to the
next ones in a pipelined tree, over the channels of `learner.collective`.

    relay = RelayReceiver(cfg, generator_id, 60, host, secret=ann.secret)  # in a generator, not a ChannelClient
    state_dict, base, source = relay.pull(address, version)  # from a generator before it in the tree, or rank 0

For each (version, held) a generator takes the next slot n on rank 0's store, publishes its own server's address
there and pulls from slot (n - 1) // k (slot 0: rank 0), a tree of fan-out k in arrival order. It serves the
version from the moment it asks for it: a child's request waits for each bucket to arrive, so buckets flow down the
tree as they come. A parent that dies, stalls past the timeout or gives up: the child resumes at rank 0 from its
first missing bucket; its own children never notice. A slot's address carries its MAC under the run's secret: one a
peer wrote into the open store (to send generators to its own weights) is refused, and the child goes to rank 0.
"""

from __future__ import annotations

import hmac
import logging
import socket

import torch

from common.config import CollectiveSyncConfig
from learner.collective import ChannelClient, ChannelServer, Payload, WeightSyncError, mac, read_key, receive
from learner.packing import host_device

log = logging.getLogger(__name__)

PROBE_TIMEOUT_S = 10.0  # a relay's port that does not accept a TCP connection in this long is taken for gone


def _check_reachable(address: str, timeout_s: float) -> None:
    """Raise RuntimeError unless `address` ("host:port") accepts a TCP connection. A dead relay's port refuses at
    once, where torch's TCPStore client would retry connecting for its whole timeout before giving up."""
    host, port = address.rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            pass
    except OSError as e:
        raise RuntimeError(f"{address} does not accept connections ({e})") from None


class RelayServer(ChannelServer):
    """A relaying generator's side: serves the newest version it received (or is receiving) to its children."""

    def __init__(self, cfg: CollectiveSyncConfig, *, timeout_s: float, host: str, cuda: bool, secret: str):
        super().__init__(cfg, timeout_s=timeout_s, host=host, port=0, cuda=cuda, secret=secret)
        self.payloads: dict[int, Payload] = {}

    def hold(self, p: Payload) -> None:
        """Serve `p` from now on (children asking before its buckets arrive wait for them); only the newest is
        kept: one packed copy of the model per relaying generator."""
        with self.lock:
            self.payloads = {p.version: p}

    def _lookup(self, version: int, held: int) -> Payload | None:
        with self.lock:
            p = self.payloads.get(version)
        if p is None or not p.wait(lambda: p.meta is not None, self.timeout_s):
            return None
        return p if p.base in (-1, held) else None  # a delta only to a child that holds its base


class RelayReceiver:
    """A generator's weight path through the relay tree (`learner.weight_sync.relay_fanout` = k >= 1).

    For each (version, held) a generator takes the next slot n on rank 0's store, writes its own relay address
    there and pulls from slot (n - 1) // k (slot 0 is rank 0): a tree of fan-out k in arrival order (k = 1 is a
    chain). Buckets are forwarded as they arrive, so the tree is pipelined: a version reaches the last generator
    about one transfer plus one bucket per level after the first. When the parent dies, stalls past the timeout
    or gives up, the transfer resumes at rank 0 from the first missing bucket (and the children, served from this
    generator's payload as it fills, do not notice). `pull` returns (state dict, base, "relay" | "root").
    `secret`: the run's (carried by Ray); a slot whose address does not carry its MAC under it is not followed.
    """

    def __init__(self, cfg: CollectiveSyncConfig, generator_id: str, timeout_s: float, host: str = "127.0.0.1", *,
                 secret: str):
        self.cfg, self.generator_id, self.host = cfg, generator_id, host
        self.timeout_s = min(timeout_s, cfg.timeout_s)
        self.secret = secret
        self.root: ChannelClient | None = None
        self.parent: ChannelClient | None = None
        self.server: RelayServer | None = None
        self.resumed = 0  # transfers a parent did not finish, completed at rank 0
        self.forged = 0  # slots whose address did not carry its MAC (written by a peer without the secret)

    def __repr__(self) -> str:
        return f"RelayReceiver({self.generator_id})"  # never the secret

    def pull(self, root_address: str, version: int, held: int = -1) -> tuple[dict[str, torch.Tensor], int, str]:
        if self.root is None or self.root.address != root_address:
            self.close()
            self.root = ChannelClient(root_address, self.generator_id, self.cfg, self.timeout_s, self.host,
                                      secret=self.secret)
        if self.server is None:
            self.server = RelayServer(self.cfg, timeout_s=self.timeout_s, host=self.host,
                                      cuda=self.root.channel.device.type == "cuda", secret=self.secret)
        p = Payload(version, host_device())  # held for the children: host memory, also on GPU machines
        self.server.hold(p)
        key = f"relay/{version}/{held}"
        slot = self.root.store.add(f"{key}/n", 1)
        here = self.server.address
        self.root.store.set(f"{key}/at/{slot}", f"{here} {mac(self.secret, key, str(slot), here)}")
        up = (slot - 1) // self.cfg.relay_fanout
        try:
            if up > 0 and self._from_parent(key, up, p, version, held):
                return p.state_dict(), p.base, "relay"
            if not receive(self.root.channel, p, version, held, self.timeout_s):
                raise KeyError(f"weights version {version} is no longer held by learner rank 0 ({root_address}); "
                               "call latest() again")
        except BaseException:
            p.fail()
            raise
        return p.state_dict(), p.base, "root"

    def _from_parent(self, key: str, up: int, p: Payload, version: int, held: int) -> bool:
        """True when the parent at slot `up` of `key` delivered all of `p`; False (logged) when rank 0 must finish it
        (also when the parent never wrote its address: it died between taking the slot and writing; and when the
        slot holds an address without its MAC: counted in `forged`)."""
        address = f"{key}/at/{up}"
        try:
            value = read_key(self.root.store, address, min(self.timeout_s, PROBE_TIMEOUT_S))
            if value is None:
                raise WeightSyncError(f"slot {up} of {key} was not written within {PROBE_TIMEOUT_S:g}s")
            address, _, tag = value.partition(" ")
            if not hmac.compare_digest(tag.encode(), mac(self.secret, key, str(up), address).encode()):
                self.forged += 1
                log.error("generator %s: slot %d of %s names %s without its MAC under the run's secret (written by a "
                          "process outside the run); not followed, pulling from learner rank 0", self.generator_id,
                          up, key, address[:100])
                return False
            if self.parent is None or self.parent.address != address:
                self._drop_parent()
                _check_reachable(address, min(self.timeout_s, PROBE_TIMEOUT_S))
                self.parent = ChannelClient(address, self.generator_id, self.cfg, self.timeout_s, self.host,
                                            secret=self.secret)
            if receive(self.parent.channel, p, version, held, self.timeout_s):
                return True
            log.info("generator %s: relay %s no longer holds version %d; pulling from learner rank 0",
                     self.generator_id, address, version)
        except RuntimeError as e:  # dead, stalled or failed parent (gloo/NCCL/TCPStore errors, timeouts)
            log.warning("generator %s: relay %s failed at bucket %d of version %d (%s: %s); resuming at learner "
                        "rank 0", self.generator_id, address, p.count, version, type(e).__name__, str(e)[:200])
            self._drop_parent()  # best effort: a dead parent cannot be told
        if p.meta is not None and p.count:
            self.resumed += 1
        return False

    def status(self) -> dict:
        return {} if self.server is None else self.server.status()

    def _drop_parent(self) -> None:
        if self.parent is not None and self.parent.channel is not None:
            self.parent.close()
        self.parent = None

    def close(self) -> None:
        self._drop_parent()
        if self.root is not None:
            self.root.close()
            self.root = None
        if self.server is not None:
            self.server.close()
            self.server = None
