"""Relayed weight fan-out (`learner.weight_sync.relay_fanout`): generators forward each version to the next ones in
a pipelined tree. Exact copies through a chain and a tree, rank 0 sending one copy per version instead of N, deltas
through the relay, and a relay that dies in the middle of a transfer: its child resumes at rank 0 from the first
missing bucket and the child's own child, served from the child as it fills, never notices. Nothing waits past the
channel timeout."""

from __future__ import annotations

import socket
import threading
import time

import pytest
import ray
import torch

from common.config import CollectiveSyncConfig
from learner.collective import OP_PULL, ChannelClient, CollectiveServer, Payload, mac
from learner.relay import RelayReceiver, RelayServer

TIMEOUT = 20.0


def state_dict(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    sd = {f"layer{i}.weight": torch.randn(64, 96, generator=g).bfloat16() for i in range(8)}
    sd["norm"] = torch.randn(96, generator=g)
    return sd  # ~100 KB: 10+ buckets of 8 KiB


def pull_all(receivers: list[RelayReceiver], address: str, version: int, held: int = -1) -> dict[int, tuple]:
    """Every receiver pulls `version` at once (each in its own thread, as generators do); {index: (sd, base, src)}."""
    out: dict[int, tuple] = {}
    errors: list[BaseException] = []

    def one(i: int) -> None:
        try:
            out[i] = receivers[i].pull(address, version, held)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(receivers))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(3 * TIMEOUT)
    assert not errors and len(out) == len(receivers), (errors, sorted(out))
    return out


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return list(a) == list(b) and all(torch.equal(a[k], b[k]) and a[k].dtype == b[k].dtype for k in a)


@pytest.mark.parametrize("fanout", [1, 2])
def test_a_version_reaches_every_generator_exactly_while_rank_0_sends_it_fanout_times(fanout):
    cfg = CollectiveSyncConfig(bucket_mb=8 / 1024, relay_fanout=fanout, timeout_s=TIMEOUT)
    root = CollectiveServer(cfg, timeout_s=TIMEOUT)
    receivers = [RelayReceiver(cfg, f"gen-{i}", TIMEOUT, secret=root.secret) for i in range(6)]
    try:
        for version in (1, 2):
            sd = state_dict(version)
            root.publish(version, sd)
            out = pull_all(receivers, root.address, version)
            assert all(same(got, sd) and base == -1 for got, base, _ in out.values())
            # the first `fanout` arrivals hang off rank 0, the others off a relay
            assert sorted(src for _, _, src in out.values()) == ["relay"] * (6 - fanout) + ["root"] * fanout
            assert root.status()["served"] <= fanout * version  # (counted once the last send returned)
        # a relay counts a transfer once its last send returned, which may be just after its child has it all
        deadline = time.monotonic() + TIMEOUT
        while (sum(served := [r.status()["served"] for r in receivers]) < 2 * (6 - fanout)
               or root.status()["served"] < 2 * fanout):
            assert time.monotonic() < deadline, (served, root.status())
            time.sleep(0.01)
        assert sum(served) == 2 * (6 - fanout) and max(served) <= 2 * fanout, served
        assert root.status()["served"] == 2 * fanout  # a star: 2 * 6
        assert all(r.resumed == 0 for r in receivers)
    finally:
        for r in receivers:
            r.close()
        root.close()


def test_deltas_travel_the_relay_to_generators_that_hold_the_base_and_whole_versions_to_the_others():
    cfg = CollectiveSyncConfig(bucket_mb=8 / 1024, relay_fanout=1, timeout_s=TIMEOUT, delta=True)
    root = CollectiveServer(cfg, timeout_s=TIMEOUT)
    receivers = [RelayReceiver(cfg, f"gen-{i}", TIMEOUT, secret=root.secret) for i in range(3)]
    try:
        v1 = state_dict(1)
        root.publish(1, v1)
        pull_all(receivers, root.address, 1)
        v2 = {k: t.clone() for k, t in v1.items()}
        v2["layer3.weight"][5, :7] += 1  # a few weights change
        root.publish(2, v2)
        out = pull_all(receivers, root.address, 2, held=1)
        assert all(base == 1 for _, base, _ in out.values())  # deltas from version 1, down the chain
        assert sorted(src for _, _, src in out.values()) == ["relay", "relay", "root"]
        delta = out[0][0]
        assert "layer3.weight@v" in delta and "layer0.weight" not in delta
        late = RelayReceiver(cfg, "late", TIMEOUT, secret=root.secret)  # joins now: holds nothing, takes 2 whole
        receivers.append(late)
        got, base, src = late.pull(root.address, 2, -1)
        assert base == -1 and src == "root" and same(got, v2)
        assert RelayServer._lookup(receivers[0].server, 2, -1) is None  # a relay holding a delta: not for joiners
    finally:
        for r in receivers:
            r.close()
        root.close()


def wait_until_refused(address: str, bound_s: float = 60.0) -> None:
    host, port = address.rsplit(":", 1)
    deadline = time.monotonic() + bound_s
    while time.monotonic() < deadline:
        try:
            socket.create_connection((host, int(port)), timeout=1).close()
        except OSError:
            return
        time.sleep(0.05)
    raise AssertionError(f"{address} still accepts connections {bound_s}s after its process was killed")


@ray.remote(num_cpus=0)
class BrokenRelay:
    """Takes slot 1 of a version's chain like a generator, serves what it has received, but stops after
    `buckets` buckets (as a relay whose process stalls); the test then kills it mid-transfer."""

    def __init__(self, cfg: CollectiveSyncConfig, address: str, secret: str):
        self.cfg, self.address, self.secret = cfg, address, secret

    def take_slot_and_stall(self, version: int, buckets: int) -> int:
        root = ChannelClient(self.address, "broken", self.cfg, TIMEOUT, secret=self.secret)
        self.server = RelayServer(self.cfg, timeout_s=TIMEOUT, host="127.0.0.1", cuda=False, secret=self.secret)
        p = Payload(version)
        self.server.hold(p)
        key = f"relay/{version}/-1"
        slot = root.store.add(f"{key}/n", 1)
        here = self.server.address
        root.store.set(f"{key}/at/{slot}", f"{here} {mac(self.secret, key, str(slot), here)}")
        ch = root.channel  # the pull protocol by hand, stopping after `buckets` buckets
        ch.send(torch.tensor([OP_PULL, version, -1, 0]), TIMEOUT)
        header = torch.zeros(4, dtype=torch.int64)
        ch.recv(header, TIMEOUT)
        meta = torch.empty(int(header[1]), dtype=torch.uint8)
        ch.recv(meta, TIMEOUT)
        p.begin(int(header[3]), meta, int(header[2]), torch.device("cpu"))
        status = torch.zeros(1, dtype=torch.int64)
        for i in range(buckets):
            ch.recv(status, TIMEOUT)
            ch.recv(p.buckets[i], TIMEOUT)
            p.arrived(i)
        self.root = root  # keep the channel open: rank 0 is left mid-transfer too
        return slot


def test_a_relay_that_dies_mid_transfer_its_child_resumes_at_rank_0_and_the_grandchild_never_notices(ray_cluster):
    cfg = CollectiveSyncConfig(bucket_mb=8 / 1024, relay_fanout=1, timeout_s=TIMEOUT)
    root = CollectiveServer(cfg, timeout_s=TIMEOUT)
    child, grandchild = (RelayReceiver(cfg, gid, TIMEOUT, secret=root.secret) for gid in ("child", "grandchild"))
    broken = BrokenRelay.remote(cfg, root.address, root.secret)
    try:
        sd = state_dict(7)
        root.publish(7, sd)
        n_buckets = len(root.versions[7].buckets)
        assert n_buckets > 6
        assert ray.get(broken.take_slot_and_stall.remote(7, 3), timeout=60) == 1
        results: dict[str, tuple] = {}
        threads = [threading.Thread(target=lambda r=r: results.__setitem__(r.generator_id, r.pull(root.address, 7)))
                   for r in (child, grandchild)]
        threads[0].start()
        # progress, not time: the child (slot 2) has the broken relay's 3 buckets and waits for the 4th
        deadline = time.monotonic() + 60
        while not (child.server and 7 in child.server.payloads and child.server.payloads[7].count == 3):
            assert time.monotonic() < deadline, "the child never received the relay's first buckets"
            time.sleep(0.01)
        threads[1].start()  # slot 3: served by the child as its payload fills
        ray.kill(broken)  # the relay dies mid-transfer
        for t in threads:
            t.join(3 * TIMEOUT)
        assert set(results) == {"child", "grandchild"}, "a transfer did not finish"
        got, base, src = results["child"]
        assert same(got, sd) and src == "root" and child.resumed == 1  # buckets 3.. came from rank 0
        got, base, src = results["grandchild"]
        assert same(got, sd) and src == "relay" and grandchild.resumed == 0
        # the root counts a transfer served after its last send, which the child may have received first
        deadline = time.monotonic() + TIMEOUT
        while root.status()["served"] < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert root.status()["served"] == 1  # the child's resumed transfer: buckets 3.. only
    finally:
        child.close()
        grandchild.close()
        root.close()


def test_a_relay_gone_before_its_child_connects_sends_the_child_to_rank_0(ray_cluster):
    cfg = CollectiveSyncConfig(bucket_mb=8 / 1024, relay_fanout=1, timeout_s=TIMEOUT)
    root = CollectiveServer(cfg, timeout_s=TIMEOUT)
    child = RelayReceiver(cfg, "orphan", TIMEOUT, secret=root.secret)
    broken = BrokenRelay.remote(cfg, root.address, root.secret)
    try:
        sd = state_dict(8)
        root.publish(8, sd)
        assert ray.get(broken.take_slot_and_stall.remote(8, 0), timeout=60) == 1  # slot 1, nothing received yet
        ray.kill(broken)  # its address stays in slot 1: the child's parent refuses connections
        gone = root.store.get("relay/8/-1/at/1").decode().split()[0]
        wait_until_refused(gone)  # the process is gone (ray.kill returns before it is): a port that refuses is
        # skipped at once (a TCPStore client would retry connecting to it for its whole timeout)
        got, base, src = child.pull(root.address, 8)
        assert same(got, sd) and base == -1 and src == "root" and child.resumed == 0
    finally:
        child.close()
        root.close()


# ------------------------------------------------------------------------- peers outside the run
# The stores listen on the cluster's network without authentication: anyone there can connect, list, read and write
# keys. These peers do exactly that, without the run's secret (which travels only in Ray calls).


def peer(address: str):
    import datetime

    import torch.distributed as dist

    host, port = address.rsplit(":", 1)
    return dist.TCPStore(host, int(port), is_master=False, timeout=datetime.timedelta(seconds=TIMEOUT))


def wait_for(cond, what: str, bound_s: float = TIMEOUT) -> None:
    deadline = time.monotonic() + bound_s
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def test_a_peer_without_the_secret_takes_no_weights_and_redirects_no_generator():
    from learner.collective import WeightSyncError

    cfg = CollectiveSyncConfig(bucket_mb=8 / 1024, relay_fanout=1, timeout_s=TIMEOUT)
    root = CollectiveServer(cfg, timeout_s=TIMEOUT)
    evil = CollectiveServer(cfg, timeout_s=TIMEOUT)  # a peer's own server, holding its own weights
    honest = RelayReceiver(cfg, "honest", TIMEOUT, secret=root.secret)
    try:
        sd = state_dict(3)
        root.publish(3, sd)
        evil.publish(3, state_dict(666))
        with pytest.raises(WeightSyncError, match="did not prove the run's secret"):  # a channel: no weights
            ChannelClient(root.address, "intruder", cfg, TIMEOUT, secret=evil.secret)
        wait_for(lambda: root.status()["refused"] == 1, "rank 0 did not refuse the intruder's channel")
        assert root.status()["served"] == 0
        store = peer(root.address)  # what the open store shows a peer: no secret among keys or values
        assert not any(root.secret in k or root.secret in store.get(k).decode(errors="replace")
                       for k in store.list_keys())
        with pytest.raises(WeightSyncError, match="did not prove the run's secret"):  # a server that is not the run's
            ChannelClient(evil.address, "honest", cfg, TIMEOUT, secret=root.secret)
        # a forged relay slot 1: the old format (an address alone), then with a MAC under another secret
        for forged in (evil.address, f"{evil.address} {mac(evil.secret, 'relay/3/-1', '1', evil.address)}"):
            store.set("relay/3/-1/at/1", forged)
            store.add("relay/3/-1/n", 1)  # the honest generator takes slot 2: its parent is slot 1
            got, base, src = honest.pull(root.address, 3)
            assert same(got, sd) and src == "root"  # not followed: the version came whole from rank 0
            store.delete_key("relay/3/-1/n")
        assert honest.forged == 2 and evil.status()["served"] == 0
    finally:
        honest.close()
        root.close()
        evil.close()


def test_counts_and_names_a_peer_writes_are_bounded_and_refused():
    from learner.collective import MAX_NEW_CHANNELS, WeightSyncError, _bucket_plan

    cfg = CollectiveSyncConfig(bucket_mb=8 / 1024, timeout_s=TIMEOUT)
    root = CollectiveServer(cfg, timeout_s=TIMEOUT)
    try:
        sd = state_dict(4)
        root.publish(4, sd)
        store = peer(root.address)
        store.add("channels", 10**12)  # a count no acceptor could ever walk: refused whole, nothing allocated
        wait_for(lambda: root.status()["refused"] == 1, "the oversized channel count was not refused")
        n = store.add("channels", 1)  # one channel more, its name far over MAX_KEY_BYTES
        store.set(f"index/{n}", "x" * 100_000)
        wait_for(lambda: root.status()["refused"] == 2, "the oversized channel name was not refused")
        client = ChannelClient(root.address, "honest", cfg, TIMEOUT, secret=root.secret)  # still served at once
        got, base = client.pull(4)
        assert same(got, sd) and base == -1 and root.status()["refused"] == 2
        client.close()
    finally:
        root.close()
    assert MAX_NEW_CHANNELS < 10**12
    for bad in (b"not json", b'{"tensors": [["w", [2], "float32", 5, 0, 8]]}', b'{"tensors": [["w", [2]]]}',
                b'{"tensors": [["w", [2], "float32", 0, -8, 8]]}', b"\xff\xfe"):
        with pytest.raises(WeightSyncError, match="not one"):
            _bucket_plan(torch.frombuffer(bytearray(bad), dtype=torch.uint8), 1)
