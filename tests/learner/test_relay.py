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
from learner.collective import OP_PULL, ChannelClient, CollectiveServer, Payload
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
    receivers = [RelayReceiver(cfg, f"gen-{i}", TIMEOUT) for i in range(6)]
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
    receivers = [RelayReceiver(cfg, f"gen-{i}", TIMEOUT) for i in range(3)]
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
        late = RelayReceiver(cfg, "late", TIMEOUT)  # joins now: holds nothing, takes version 2 whole
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

    def __init__(self, cfg: CollectiveSyncConfig, address: str):
        self.cfg, self.address = cfg, address

    def take_slot_and_stall(self, version: int, buckets: int) -> int:
        root = ChannelClient(self.address, "broken", self.cfg, TIMEOUT)
        self.server = RelayServer(self.cfg, timeout_s=TIMEOUT, host="127.0.0.1", cuda=False)
        p = Payload(version)
        self.server.hold(p)
        slot = root.store.add(f"relay/{version}/-1/n", 1)
        root.store.set(f"relay/{version}/-1/at/{slot}", self.server.address)
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
    child, grandchild = RelayReceiver(cfg, "child", TIMEOUT), RelayReceiver(cfg, "grandchild", TIMEOUT)
    broken = BrokenRelay.remote(cfg, root.address)
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
    child = RelayReceiver(cfg, "orphan", TIMEOUT)
    broken = BrokenRelay.remote(cfg, root.address)
    try:
        sd = state_dict(8)
        root.publish(8, sd)
        assert ray.get(broken.take_slot_and_stall.remote(8, 0), timeout=60) == 1  # slot 1, nothing received yet
        ray.kill(broken)  # its address stays in slot 1: the child's parent refuses connections
        gone = root.store.get("relay/8/-1/at/1").decode()
        wait_until_refused(gone)  # the process is gone (ray.kill returns before it is): a port that refuses is
        # skipped at once (a TCPStore client would retry connecting to it for its whole timeout)
        got, base, src = child.pull(root.address, 8)
        assert same(got, sd) and base == -1 and src == "root" and child.resumed == 0
    finally:
        child.close()
        root.close()
