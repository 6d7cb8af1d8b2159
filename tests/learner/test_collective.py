"""Collective weight sync (`learner.weight_sync.kind: collective`) over gloo between real Ray actors:
the wire format, learner -> generators (transformers and vLLM) with identical outputs after the load,
a generator that joins mid-run, and a generator that dies in the middle of a transfer."""

from __future__ import annotations

import os
import time

import pytest
import ray
import torch

from common.config import CollectiveSyncConfig, LearnerConfig
from learner.packing import pack, packed_bytes, unpack
from learner.pool import LearnerPool
from learner.shape import TrainShape
from learner.weights import CollectiveWeightSource, WeightSyncTimeout, make_publisher, make_weight_source
from bench.batches import make_batch

NS = "exgrpo-test"
SYNC = CollectiveSyncConfig(timeout_s=20, bucket_mb=0.05)  # ~50 KiB buckets: the tiny model needs several


def test_pack_plan_and_round_trip():
    sd = {"w": torch.randn(3, 4), "h": torch.randn(5).bfloat16(), "empty": torch.zeros(0), "s": torch.tensor(2.5),
          "i": torch.arange(10)}
    p = pack(7, sd, bucket_bytes=64, device=torch.device("cpu"))
    # w: 48 B -> bucket 0; h: 10 B at offset 64 > 64 -> bucket 1 [0, 10); empty: offset 64, 0 B, fits (64 <= 64);
    # s: 4 B at 64 -> bucket 2; i: 80 B > 64 -> bucket 3 of its own
    assert [b.numel() for b in p.buckets] == [48, 64, 4, 80]
    out = unpack(bytes(p.meta.numpy()), p.buckets)
    assert list(out) == list(sd)
    assert all(torch.equal(out[k], sd[k]) and out[k].dtype == sd[k].dtype and out[k].shape == sd[k].shape for k in sd)


@ray.remote(num_cpus=0)
class Receiver:
    """A generator's weight path without an engine: newest announcement -> pull -> transformers model -> ack."""

    def __init__(self, source: CollectiveWeightSource, gid: str, model_path: str):
        from transformers import AutoModelForCausalLM

        self.source, self.gid = source, gid
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
        source.register(gid)

    def pull(self) -> int:
        ann = self.source.latest()
        self.model.load_state_dict(self.source.fetch(ann), strict=True)
        self.source.ack(self.gid, ann.version)
        return ann.version

    @torch.inference_mode()
    def logits(self, ids: list[int]) -> torch.Tensor:
        return self.model(input_ids=torch.tensor([ids])).logits[0]

    def die_mid_transfer(self) -> None:
        """Ask for the newest version, read the header, then exit before the buckets arrive."""
        from learner.collective import OP_PULL, ChannelClient

        ann = self.source.latest()
        c = ChannelClient(ann.location.removeprefix("collective:"), self.gid, self.source.cfg, 20, secret=ann.secret)
        c.channel.send(torch.tensor([OP_PULL, ann.version, -1, 0]), 20)
        c.channel.recv(torch.zeros(4, dtype=torch.int64), 20)
        os._exit(1)


@torch.inference_mode()
def learner_logits(pool: LearnerPool, model_path: str, ids: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    model.load_state_dict(pool.state_dict())
    return model(input_ids=torch.tensor([ids])).logits[0]


def make_pool(model_dir, run: str, ranks: int) -> LearnerPool:
    cfg = LearnerConfig(num_ranks=ranks, publish_timeout_s=30, weight_sync=SYNC,
                        batching=dict(micro_batch_rows=3, mini_batches=2), optim=dict(lr=1e-3))
    return LearnerPool(cfg, str(model_dir), TrainShape(max_new_tokens=12), run=run, namespace=NS)


def test_config_union_builds_both_ends(ray_cluster):
    src = make_weight_source(SYNC, run="ends", namespace=NS, timeout_s=5)
    assert isinstance(src, CollectiveWeightSource) and src.latest() is None  # no learner yet: nothing published
    pub = make_publisher(SYNC, run="ends", namespace=NS, timeout_s=5)
    try:
        ann = pub.publish(0, {"w": torch.ones(2)})
        assert ann.location == f"collective:{pub.server.address}" and src.latest() == ann
        assert torch.equal(src.fetch(ann)["w"], torch.ones(2))
        with pytest.raises(KeyError, match="version 5 is no longer held"):
            src.fetch(type(ann)(version=5, location=ann.location, num_bytes=8, created_at=0.0, secret=ann.secret))
        assert ann.secret and ann.secret not in repr(ann)  # carried by Ray, never shown
    finally:
        pub.close()
        ray.kill(pub.store)


def test_two_rank_learner_to_joining_and_dying_generators(ray_cluster, tiny_model_dir):
    """2 learner ranks publish over the collective backend. A generator present from version 1 and one
    that joins at version 2 compute logits identical to the learner's; a third dies in the middle of
    version 3's transfer: version 4 is published and pulled by the others at once, the dead one is
    named in rank 0's status and by the ack timeout, and nothing hangs."""
    ids = [1, 5, 9, 13, 17, 21, 3]
    pool = make_pool(tiny_model_dir, "coll", 2)
    source = make_weight_source(pool.cfg.weight_sync, run="coll", namespace=NS, timeout_s=20)
    gens = []
    try:
        pool.step(make_batch(1))
        assert pool.publish().location.startswith("collective:")
        gens.append(Receiver.remote(source, "gen-a", str(tiny_model_dir)))
        assert ray.get(gens[0].pull.remote(), timeout=60) == 1
        assert torch.equal(ray.get(gens[0].logits.remote(ids)), learner_logits(pool, tiny_model_dir, ids))

        pool.step(make_batch(2))
        pool.publish()
        gens.append(Receiver.remote(source, "gen-b", str(tiny_model_dir)))  # joins mid-run
        assert ray.get([g.pull.remote() for g in gens], timeout=60) == [2, 2]
        expected = learner_logits(pool, tiny_model_dir, ids)
        for g in gens:
            assert torch.equal(ray.get(g.logits.remote(ids)), expected)
        pool.wait_for_acks(timeout_s=5)

        pool.step(make_batch(3))
        pool.publish()
        doomed = Receiver.remote(source, "gen-dead", str(tiny_model_dir))
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(doomed.die_mid_transfer.remote(), timeout=60)
        pool.step(make_batch(4))
        assert pool.publish().version == 4  # would raise WeightSyncTimeout if it waited on the dead channel
        assert ray.get([g.pull.remote() for g in gens], timeout=60) == [4, 4]
        deadline = time.monotonic() + 120
        while not (failures := pool.weight_sync_status()["failures"]) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert [f["generator"] for f in failures] == ["gen-dead"] and failures[0]["version"] == 3, failures
        status = pool.weight_sync_status()
        assert sorted(status["channels"].values()) == ["gen-a", "gen-b"] and status["served"] >= 5
        with pytest.raises(WeightSyncTimeout, match=r"version 4 .*\['gen-dead'\]"):
            pool.wait_for_acks(timeout_s=1.0)
        source.unregister("gen-dead")  # what the generator pool does for a generator that is gone
        pool.wait_for_acks(timeout_s=5.0)
    finally:
        for g in gens:
            ray.kill(g)
        pool.shutdown()


@pytest.mark.vllm
def test_vllm_generator_loads_collective_weights(ray_cluster, tiny_model_dir):
    """A real vLLM generator actor: it starts on the published version (before leasing work), loads
    the next version in flight, and its behaviour log-probs equal the learner's weights' (teacher forced)."""
    from transformers import AutoModelForCausalLM

    from actors.generator import Generator, GeneratorSpec, actor_options
    from common.config import GeneratorConfig, VllmEngineConfig
    from common.interfaces import actor_name
    from tests.actors.engine_checks import check_rollout_logprobs
    from tests.actors.test_generator_ray import K, REWARD_CFG, make_buffer
    from tests.conftest import vllm_available

    if not vllm_available():
        pytest.skip("vllm is not importable on this machine")
    run = "collvllm"
    cfg = GeneratorConfig(engine=VllmEngineConfig(max_model_len=128, block_size=32, cpu_kv_cache_gb=0.0625),
                          max_new_tokens=8, questions_per_lease=8, num_cpus=1, idle_sleep_s=0.05)
    buffer = make_buffer(tiny_model_dir, run)
    pool = make_pool(tiny_model_dir, run, 1)
    gid = actor_name(run, "generator", 0)
    gen = None
    try:
        states = {}
        pool.step(make_batch(1))
        buffer.set_version(1)
        pool.publish()
        states[1] = pool.state_dict()
        source = make_weight_source(pool.cfg.weight_sync, run=run, namespace=NS, timeout_s=20)
        spec = GeneratorSpec(cfg, REWARD_CFG, str(tiny_model_dir), "arithmetic")
        gen = Generator.options(name=gid, **actor_options(cfg)).remote(gid, spec, buffer, source)
        assert ray.get(gen.start.remote(), timeout=600)["version"] == 1.0
        pool.step(make_batch(2))
        buffer.set_version(2)
        pool.publish()
        states[2] = pool.state_dict()
        rollouts = []
        for _ in range(4):  # the first batch may still come from version 1's leases
            batch = buffer.get_batch(2, timeout_s=300)
            assert batch is not None
            rollouts += [(g, r) for g in batch.groups for r in g.rollouts]
            if any(r.version == 2 for _, r in rollouts):
                break
        assert {r.version for _, r in rollouts} <= {1, 2} and any(r.version == 2 for _, r in rollouts)
        refs = {}
        for v, sd in states.items():
            refs[v] = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
            refs[v].load_state_dict(sd)
        for g, r in rollouts:  # a rollout generating while version 2 landed has tokens of both (partial rollout)
            assert len(g.rollouts) == K
            check_rollout_logprobs(refs, g.prompt_ids, r)
        m = ray.get(gen.stop.remote(drain=True), timeout=120)
        assert m["weight_loads"] == 2
        assert list(pool.weight_sync_status()["channels"].values()) == []  # stop() unregistered: channel closed
    finally:
        if gen is not None:
            ray.kill(gen, no_restart=True)
        buffer.shutdown()
        pool.shutdown()


def test_pack_streams_chunks_into_the_same_layout():
    """Packed as the gather's chunks come (learner.gather.iter_full_state), the version is laid out exactly as the
    whole dict would be: rank 0 never holds the state dict and its packed copy at once."""
    sd = {"w": torch.randn(3, 4), "h": torch.randn(5).bfloat16(), "empty": torch.zeros(0), "s": torch.tensor(2.5),
          "i": torch.arange(10)}
    whole = pack(7, sd, bucket_bytes=64, device=torch.device("cpu"))
    items = list(sd.items())
    streamed = pack(7, iter([dict(items[:2]), dict(items[2:4]), dict(items[4:])]), bucket_bytes=64,
                    device=torch.device("cpu"))
    assert bytes(streamed.meta.numpy()) == bytes(whole.meta.numpy())  # the same plan: buckets, offsets
    assert [b.numel() for b in streamed.buckets] == [b.numel() for b in whole.buckets]
    out = unpack(bytes(streamed.meta.numpy()), streamed.buckets)  # (alignment gaps are left uninitialised)
    assert all(torch.equal(out[k], sd[k]) and out[k].dtype == sd[k].dtype for k in sd)
    assert packed_bytes(whole) == 48 + 10 + 0 + 4 + 80


def test_a_whole_version_streams_bucket_by_bucket_and_an_abandoned_stream_drops_only_its_channel():
    from common.messages import WeightsAnnouncement
    from learner.collective import CollectiveServer

    cfg = CollectiveSyncConfig(timeout_s=20, bucket_mb=8 / 1024)
    root = CollectiveServer(cfg, timeout_s=20)
    g = torch.Generator().manual_seed(3)
    sd = {f"w{i}": torch.randn(40, 64, generator=g).bfloat16() for i in range(6)} | {"norm": torch.randn(64)}
    try:
        root.publish(1, sd)
        src = CollectiveWeightSource(cfg, run="stream")
        ann = WeightsAnnouncement(version=1, location=f"collective:{root.address}", num_bytes=0, created_at=0.0,
                                  secret=root.secret)
        chunks = list(src.fetch_buckets(ann))
        assert len(chunks) == len(root.versions[1].buckets) > 3  # a bucket's tensors at a time
        merged = {k: v for c in chunks for k, v in c.items()}
        assert list(merged) == list(sd) and all(torch.equal(merged[k], sd[k]) for k in sd)
        stream = src.fetch_buckets(ann)
        next(stream)
        stream.close()  # the engine stopped part-way: the channel is mid-transfer and is dropped
        assert src.client is None
        again = {k: v for c in src.fetch_buckets(ann) for k, v in c.items()}  # a new channel, the whole version
        assert all(torch.equal(again[k], sd[k]) for k in sd)
        with pytest.raises(KeyError, match="version 9 is no longer held"):
            src.fetch_buckets(WeightsAnnouncement(version=9, location=ann.location, num_bytes=0, created_at=0.0,
                                                 secret=root.secret))
    finally:
        root.close()


def test_buckets_gathered_into_the_servers_buffers_are_held_without_a_copy_or_a_staging_buffer():
    """The pool passes the publisher's `bucket_buffer` as the gather's `alloc`: every bucket lands in a buffer the
    server keeps as the held bucket (no staging buffer, no copy), and pulls still get the exact version."""
    from common.messages import WeightsAnnouncement
    from common.modeling import TinyQwen2
    from learner.collective import CollectiveServer
    from learner.gather import Staging, iter_flat_buckets
    from learner.weights import CollectivePublisher

    # what learner/pool.py reads from the publisher (with getattr: a forwarding left out would go unnoticed)
    assert isinstance(CollectivePublisher.takes_device_buckets, property) and callable(CollectivePublisher.bucket_buffer)
    cfg = CollectiveSyncConfig(timeout_s=20, bucket_mb=16 / 1024, keep_versions=1)
    root = CollectiveServer(cfg, timeout_s=20)
    model = TinyQwen2(vocab_size=300, hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1,
                      max_positions=256).build()
    staging, given = Staging(), []

    def alloc(nbytes, device):
        given.append(root.bucket_buffer(nbytes, device))
        return given[-1]

    try:
        want = {k: v.bfloat16() for k, v in model.state_dict().items() if k != "lm_head.weight"}
        root.publish(1, iter_flat_buckets(model, 0, 1, int(cfg.bucket_mb * (1 << 20)), torch.bfloat16,
                                          staging=staging, alloc=alloc))
        held = root.versions[1].buckets
        assert len(held) == len(given) > 3 and staging.allocations == 0
        assert [b.data_ptr() for b in held] == [b.data_ptr() for b in given]
        ann = WeightsAnnouncement(version=1, location=f"collective:{root.address}", num_bytes=0, created_at=0.0,
                                  secret=root.secret)
        got = CollectiveWeightSource(cfg, run="owned").fetch(ann)
        assert list(got) == list(want) and all(torch.equal(got[k], v) for k, v in want.items())
    finally:
        root.close()


def test_versions_packed_from_the_gathers_buckets_survive_the_buffers_reuse():
    """Rank 0 packs the gather's flat buckets (views into one reused host buffer on the CPU) as they come: each becomes
    one held bucket in the same layout, copied at once, so version 1 pulled after version 2 reused the buffers is still
    version 1, and a tied head travels once."""
    from common.messages import WeightsAnnouncement
    from common.modeling import TinyQwen2
    from learner.collective import CollectiveServer
    from learner.gather import Staging, iter_flat_buckets

    cfg = CollectiveSyncConfig(timeout_s=20, bucket_mb=16 / 1024, keep_versions=2)
    root = CollectiveServer(cfg, timeout_s=20)
    model = TinyQwen2(vocab_size=300, hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1,
                      max_positions=256).build()
    staging, states = Staging(), {}
    try:
        for version in (1, 2):
            states[version] = {k: v.bfloat16().clone() for k, v in model.state_dict().items() if k != "lm_head.weight"}
            buckets = iter_flat_buckets(model, 0, 1, int(cfg.bucket_mb * (1 << 20)), torch.bfloat16, staging=staging)
            num_bytes, _ = root.publish(version, buckets)
            assert num_bytes == sum(v.numel() * 2 for v in states[version].values())
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(1.0)
        assert len(root.versions[1].buckets) > 3 and staging.allocations == 1
        src = CollectiveWeightSource(cfg, run="flat")
        for version in (1, 2):
            ann = WeightsAnnouncement(version=version, location=f"collective:{root.address}", num_bytes=0,
                                      created_at=0.0, secret=root.secret)
            got = src.fetch(ann)
            assert list(got) == list(states[version])
            assert all(torch.equal(got[k], v) for k, v in states[version].items()), version
    finally:
        root.close()


def test_the_stores_listen_on_their_host_only():
    """TCPStore would listen on every interface whatever its host; `listening_store` keeps it to the one given."""
    import socket

    from learner.collective import listening_store

    other = ray.util.get_node_ip_address()
    if other.startswith("127."):
        pytest.skip("this machine has no address besides the loopback")
    store = listening_store("127.0.0.1", 0, 5)
    socket.create_connection(("127.0.0.1", store.port), timeout=5).close()
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection((other, store.port), timeout=5)
