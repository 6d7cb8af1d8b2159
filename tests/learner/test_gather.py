"""The bucketed gather's bookkeeping (the collective itself runs in test_pool on 2 real ranks)."""

import torch

from learner.gather import _buckets, shard_rows


def test_shard_rows_follow_fsdp2_even_chunking():
    # 5 rows on 2 ranks: chunks of ceil(5/2) = 3 -> 3 + 2; 2 rows on 4 ranks: 1, 1, 0, 0
    assert [shard_rows(5, 2, r) for r in range(2)] == [3, 2]
    assert [shard_rows(2, 4, r) for r in range(4)] == [1, 1, 0, 0]
    assert [shard_rows(7, 3, r) for r in range(3)] == [3, 3, 1]
    assert sum(shard_rows(1001, 8, r) for r in range(8)) == 1001


def test_buckets_split_by_size_and_dtype():
    f = [(f"f{i}", torch.zeros(256)) for i in range(3)]  # 1 KiB each
    h = [("h0", torch.zeros(10, dtype=torch.bfloat16))]
    got = _buckets(f + h + f[:1], bucket_bytes=2048)
    assert [[n for n, _ in b] for b in got] == [["f0", "f1"], ["f2"], ["h0"], ["f0"]]
    assert [[n for n, _ in b] for b in _buckets([("big", torch.zeros(4096))], 16)] == [["big"]]
