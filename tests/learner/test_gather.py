"""The bucketed gather: its layout, the buffers it reuses, tied heads, and 3 real FSDP2 ranks over gloo (the Ray
pool runs it too, in test_pool)."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from learner.gather import (Staging, _plans, gather_full_state, iter_flat_buckets, iter_full_state, shard_rows,
                            tied_aliases)
from tests.ports import rendezvous_store


def test_shard_rows_follow_fsdp2_even_chunking():
    # 5 rows on 2 ranks: chunks of ceil(5/2) = 3 -> 3 + 2; 2 rows on 4 ranks: 1, 1, 0, 0
    assert [shard_rows(5, 2, r) for r in range(2)] == [3, 2]
    assert [shard_rows(2, 4, r) for r in range(4)] == [1, 1, 0, 0]
    assert [shard_rows(7, 3, r) for r in range(3)] == [3, 3, 1]
    assert sum(shard_rows(1001, 8, r) for r in range(8)) == 1001


def tiny_tied(seed: int = 3):
    from common.modeling import TinyQwen2

    return TinyQwen2(vocab_size=300, hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, seed=seed,
                     max_positions=256).build()


def unique_bytes(model, dtype) -> int:
    """Bytes of every distinct parameter and persistent buffer, cast to `dtype` where floating."""
    return sum(t.numel() * (dtype.itemsize if t.is_floating_point() else t.element_size())
               for t in {id(t): t for t in model.state_dict(keep_vars=True).values()}.values())


def test_plans_align_every_tensor_and_split_by_size_not_dtype():
    items = [("a", torch.zeros(10), torch.float32), ("b", torch.zeros(3), torch.bfloat16),
             ("c", torch.zeros(40), torch.float32), ("big", torch.zeros(100), torch.float32)]
    plans = _plans(items, bucket_bytes=128, world=1)
    # a: 40 bytes at 0; b: 6 bytes at 64 (aligned); c: 160 bytes would end at 288 > 128 -> a bucket of its own;
    # big: 400 bytes, larger than a bucket -> alone
    assert [[(e.name, e.offset, e.nbytes) for e in p.entries] for p in plans] == [
        [("a", 0, 40), ("b", 64, 6)], [("c", 0, 160)], [("big", 0, 400)]]
    assert [p.nbytes for p in plans] == [70, 160, 400]


def test_tied_head_travels_once_and_gather_full_state_restores_it():
    model = tiny_tied()
    assert tied_aliases(model) == {"lm_head.weight": "model.embed_tokens.weight"}
    names = [n for b in iter_full_state(model, 0, 1, bucket_bytes=1 << 14) for n in b]
    assert "lm_head.weight" not in names and "model.embed_tokens.weight" in names
    assert len(names) == len(model.state_dict()) - 1
    full = gather_full_state(model, 0, 1, bucket_bytes=1 << 14)
    assert list(full) == list(model.state_dict())
    assert full["lm_head.weight"] is full["model.embed_tokens.weight"]
    assert all(torch.equal(full[k], v) for k, v in model.state_dict().items())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_publication_reuses_one_host_buffer_and_allocates_nothing_per_tensor(dtype):
    """A plain (unsharded) model on one rank, as a float32 learner holds it: two publications through one Staging.
    Every yielded tensor lives in the one host buffer (on the CPU nothing overlaps, so one serves; CUDA keeps two,
    pinned), the second publication allocates no host memory at all (the profiler sees every CPU allocation), and the bytes published are the unique bytes (tied head once)."""
    from torch.profiler import ProfilerActivity, profile

    model = tiny_tied()
    staging = Staging()
    ref = {k: v.to(dtype) if v.is_floating_point() else v for k, v in model.state_dict().items()}

    def publish() -> tuple[int, set[int]]:
        sent, storages = 0, set()
        for bucket in iter_flat_buckets(model, 0, 1, bucket_bytes=1 << 14, dtype=dtype, staging=staging):
            for name, t in bucket.items():
                assert torch.equal(t, ref[name]) and t.dtype == ref[name].dtype, name
                storages.add(t.untyped_storage().data_ptr())
            sent += bucket.nbytes
        return sent, storages

    first, storages = publish()
    assert first == unique_bytes(model, dtype) < sum(t.numel() * dtype.itemsize for t in ref.values())
    assert len(storages) == 1 and staging.allocations == 1
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        second, again = publish()
    allocated = [(e.name, e.cpu_memory_usage) for e in prof.events() if e.cpu_memory_usage > 0]
    assert second == first and again == storages and staging.allocations == 1
    assert allocated == [], allocated[:5]


def test_a_bucket_is_valid_until_the_next_one_is_asked_for():
    """The contract consumers rely on: on the CPU bucket k's buffer is rewritten by bucket k + 1 (on CUDA by
    k + 2); a consumer that keeps data past the next bucket copies it."""
    model = tiny_tied()
    buckets = iter_flat_buckets(model, 0, 1, bucket_bytes=1 << 12, staging=Staging())
    first = next(buckets)
    snapshot = first.data.clone()
    second = next(buckets)
    assert second.data.data_ptr() == first.data.data_ptr() and not torch.equal(first.data[:len(second.data)],
                                                                              snapshot[:len(second.data)])


FSDP_GATHER = textwrap.dedent("""
    import os, sys, torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.profiler import ProfilerActivity, profile
    sys.path.insert(0, os.getcwd())
    from learner.gather import Staging, gather_full_state, iter_flat_buckets
    from tests.learner.test_gather import tiny_tied

    rank, world, port, out = int(sys.argv[1]), 3, sys.argv[2], sys.argv[3]
    dist.init_process_group("gloo", store=dist.TCPStore("127.0.0.1", int(port), is_master=False), rank=rank,
                            world_size=world)
    torch.set_num_threads(1)
    model = tiny_tied()
    mesh = init_device_mesh("cpu", (world,))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    staging = Staging()
    result = {"full": gather_full_state(model, rank, world, bucket_bytes=1 << 14, dtype=torch.bfloat16),
              "full32": gather_full_state(model, rank, world, bucket_bytes=1 << 14)}

    def in_gloo(e):  # gloo's gather allocates its own flat receive buffer, once per call (seen in the op, its
        # child, or on gloo's worker thread)
        return e.thread != main or e.name == "c10d::gather_" or (e.cpu_parent and e.cpu_parent.name == "c10d::gather_")

    for i in range(2):  # two publications: the second must allocate nothing on the host beside gloo's buffer
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            buckets = [b.nbytes for b in iter_flat_buckets(model, rank, world, 1 << 14, torch.bfloat16,
                                                           staging=staging)]
        main = next(e.thread for e in prof.events() if e.name == "c10d::gather_")
        ours = [(e.name, e.cpu_memory_usage, e.thread) for e in prof.events() if e.cpu_memory_usage > 0 and not in_gloo(e)]
        gathers = sum(e.name == "c10d::gather_" for e in prof.events())
        result[i] = (sum(buckets), ours, staging.allocations, gathers, len(buckets))
    if rank == 0:
        torch.save(result, out)
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # as in test_token_stats: skip C++ static destructors of gloo's threads
""")


def test_three_fsdp_ranks_gather_exactly_and_reuse_their_buffers(tmp_path):
    """3 FSDP2 ranks over gloo (uneven shards: 32 key/value rows are 11 + 11 + 10, 64 rows 22 + 22 + 20): rank 0's
    state equals the model's, cast to bf16, tied head included; a second publication allocates no host memory on
    rank 0 (but for the receive buffer gloo's `gather` makes itself, once per bucket: NCCL's makes none) and its
    bytes are the unique bytes."""
    store = rendezvous_store()  # held until the ranks are done
    port = store.port
    out = tmp_path / "rank0.pt"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-c", FSDP_GATHER, str(r), str(port), str(out)], cwd=os.getcwd(),
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(3)]
    logs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], logs
    got = torch.load(out)
    model = tiny_tied()
    want = {k: v.bfloat16() for k, v in model.state_dict().items()}
    assert list(got["full"]) == list(want)
    assert all(torch.equal(got["full"][k], v) for k, v in want.items())
    # float32: the evenly split embedding (300 rows = 3 x 100) is sent as each rank's shard and received in place
    assert all(torch.equal(got["full32"][k], v) for k, v in model.state_dict().items())
    (sent0, _, allocs0, _, _), (sent1, ours, allocs1, gathers, buckets) = got[0], got[1]
    assert sent0 == sent1 == unique_bytes(model, torch.bfloat16)
    assert ours == [] and allocs1 == allocs0, ours
    assert gathers == buckets > 3  # one collective per bucket, not per tensor
