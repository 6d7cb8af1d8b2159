"""Delta weight publications (`learner.weight_sync.delta`): the encoding is bit-exact, a generator one version
behind loads the delta, a joiner or one that skipped a version gets the whole version, and a delta that does not
verify falls back to the whole version. Both backends, through their real publisher and source (a Ray weight
store actor; the collective channel over gloo)."""

from __future__ import annotations

import pytest
import ray
import torch

from common.config import CollectiveSyncConfig, ObjectStoreSyncConfig
from learner.delta import DeltaEncoder, HeldWeights, checksum, encode
from learner.weights import make_publisher, make_weight_source

NS = "exgrpo-test"


def _versions(n: int, seed: int = 0, frac: float = 0.01) -> list[dict[str, torch.Tensor]]:
    """n versions of a small bf16 + fp32 state dict, each changing ~`frac` of the elements of the one before (plus a
    tensor that changes everywhere, which goes whole)."""
    g = torch.Generator().manual_seed(seed)
    sd = {"embed": torch.randn(500, 64, generator=g).bfloat16(), "norm": torch.ones(64),
          "head": torch.randn(64, 300, generator=g).bfloat16(), "dense": torch.randn(10, 10, generator=g)}
    out = [sd]
    for _ in range(n - 1):
        nxt = {}
        for k, t in out[-1].items():
            t = t.clone()
            if k == "dense":
                t += 1.0
            else:
                flat = t.reshape(-1)
                idx = torch.randperm(flat.numel(), generator=g)[: max(1, int(frac * flat.numel()))]
                flat[idx] = flat[idx] + 0.5
            nxt[k] = t
        out.append(nxt)
    return out


def _equal_bits(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and
                                        torch.equal(a[k].view(-1).view(torch.uint8), b[k].view(-1).view(torch.uint8))
                                        for k in a)


def test_encoding_is_bit_exact_sparse_where_it_pays_and_verified():
    v0, v1 = _versions(2)
    d = encode(v0, v1)
    assert "embed@i" in d and "head@i" in d and "dense" in d  # sparse where few changed, whole where all did
    full = sum(t.numel() * t.element_size() for t in v1.values())
    assert sum(t.numel() * t.element_size() for t in d.values()) < 0.2 * full
    held = HeldWeights()
    for _ in held.keep(0, [{k: t.clone() for k, t in v0.items()}]):
        pass
    assert held.apply(1, [d]) and held.version == 1 and _equal_bits(held.tensors, v1)
    # a held copy that is not the base the delta was made from: the checksum catches it, nothing is usable
    v2 = _versions(3)[2]
    held.tensors["embed"].view(-1)[0] += 1
    assert not held.apply(2, [encode(v1, v2)]) and held.version is None and held.mismatches == 1
    assert not held.apply(3, [encode(v1, v2)])  # no base any more: the caller takes the whole version
    assert checksum(v1["embed"]) != checksum(v2["embed"])


def test_encoder_makes_a_delta_only_from_the_version_it_holds():
    enc, versions = DeltaEncoder(), _versions(3)
    assert [d for _, d in enc.tee(0, [versions[0]])] == [None]  # nothing to compare with
    assert [d is not None for _, d in enc.tee(1, [versions[1]])] == [True]
    assert [d for _, d in enc.tee(5, [versions[2]])] == [None]  # version 4 was never seen
    assert enc.version == 5


@pytest.mark.parametrize("sync", [ObjectStoreSyncConfig(delta=True, bucket_mb=0.01),
                                  CollectiveSyncConfig(delta=True, timeout_s=20, bucket_mb=0.01)],
                         ids=["object_store", "collective"])
def test_generators_load_deltas_and_whole_versions_exactly(ray_cluster, sync):
    run = f"delta-{sync.kind}"
    pub = make_publisher(sync, run=run, namespace=NS, timeout_s=20)
    steady = make_weight_source(sync, run=run, namespace=NS, timeout_s=20)
    try:
        versions = _versions(5)
        chunks = lambda sd: [{k: sd[k]} for k in sd]  # noqa: E731  (one bucket per tensor, as the gather streams)

        def load(src, ann) -> dict:
            out = {}
            for b in src.fetch_buckets(ann):
                out.update({k: v.clone() for k, v in b.items()})
            return out

        anns = []
        for v in range(3):
            anns.append(pub.publish(v, chunks(versions[v])))
            assert _equal_bits(load(steady, anns[-1]), versions[v])
        assert anns[0].delta_bytes == 0 and 0 < anns[1].delta_bytes < 0.3 * anns[1].num_bytes
        assert steady.transfer_stats() == {"delta_loads": 2, "full_loads": 1, "delta_mismatches": 0}
        # a generator that joins now gets the whole version
        joiner = make_weight_source(sync, run=run, namespace=NS, timeout_s=20)
        assert _equal_bits(load(joiner, anns[2]), versions[2])
        assert joiner.transfer_stats()["full_loads"] == 1
        # one that skips a version gets the whole of the next it asks for
        anns.append(pub.publish(3, chunks(versions[3])))
        anns.append(pub.publish(4, chunks(versions[4])))
        assert _equal_bits(load(joiner, anns[4]), versions[4])
        assert joiner.transfer_stats() == {"delta_loads": 0, "full_loads": 2, "delta_mismatches": 0}
        # a held copy that went wrong: the delta does not verify, the whole version loads instead
        assert _equal_bits(load(steady, anns[3]), versions[3])
        steady.held.tensors["head"].view(-1)[7] += 1
        assert _equal_bits(load(steady, anns[4]), versions[4])
        assert steady.transfer_stats() == {"delta_loads": 3, "full_loads": 2, "delta_mismatches": 1}
        # everything changed (a high learning rate): no delta is offered, the version goes whole
        v5 = {k: t + 1 for k, t in versions[4].items()}
        ann = pub.publish(5, chunks(v5))
        assert ann.delta_bytes == 0 and _equal_bits(load(steady, ann), v5)
        assert steady.transfer_stats() == {"delta_loads": 3, "full_loads": 3, "delta_mismatches": 1}
    finally:
        pub.close()
        ray.kill(pub.store)


def test_a_generator_waits_at_the_store_for_the_next_version(ray_cluster):
    """`wait_newer` (generator.weight_wait_s): answers at once when the store's version differs from the one known,
    and otherwise when the next one is published; with none, after its bound."""
    import threading

    run = "wait-newer"
    pub = make_publisher(ObjectStoreSyncConfig(), run=run, namespace=NS, timeout_s=20)
    src = make_weight_source(ObjectStoreSyncConfig(), run=run, namespace=NS, timeout_s=20)
    try:
        assert src.wait_newer(-1, 0.2) is None  # nothing published: None after the bound
        pub.publish(0, {"w": torch.zeros(2)})
        assert src.wait_newer(-1, 120).version == 0  # differs from what the caller knows: at once
        assert src.wait_newer(0, 0.2).version == 0  # nothing newer within the bound
        got = []
        waiter = threading.Thread(target=lambda: got.append(src.wait_newer(0, 120)))
        waiter.start()
        calls = lambda: ray.get(pub.store.status.remote())["calls"]["wait_newer"]  # noqa: E731
        while calls() < 4:  # driven by progress: the waiting call reached the store
            waiter.join(0.05)
        pub.publish(1, {"w": torch.ones(2)})
        waiter.join(120)
        assert not waiter.is_alive() and got[0].version == 1
    finally:
        pub.close()
        ray.kill(pub.store)
