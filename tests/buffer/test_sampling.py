"""Replay sampling strategies, with hand-worked numbers."""

import math
import random

import pytest

from buffer.keys import shard_of, split_key, trajectory_key
from buffer.sampling import (AdvantagePrioritised, GaussianBuckets, IndexedSet, LowestEntropy, LowestStoredEntropy,
                             RandomTrajectory, UniformQuestions, bucket_probabilities)
from common.messages import int32_array


def test_bucket_probabilities_k8_all_buckets():
    # z = (b/8 - 0.5) / 0.125 = b - 4; weights exp(-z^2/2) = e^-4.5, e^-2, e^-0.5, 1, ... ; sum = 1 + 2(...)
    p = bucket_probabilities(range(1, 8), 8)
    total = 1 + 2 * (math.exp(-4.5) + math.exp(-2) + math.exp(-0.5))
    assert p[4] == pytest.approx(1 / total)
    assert [round(p[b], 3) for b in range(1, 8)] == [0.004, 0.054, 0.242, 0.399, 0.242, 0.054, 0.004]
    assert sum(p.values()) == pytest.approx(1.0)


def test_bucket_probabilities_renormalise_over_nonempty():
    # buckets 2 and 4 of K=8: weights e^-2 and 1 -> p2 = e^-2 / (1 + e^-2) = 0.1192
    p = bucket_probabilities({2, 4}, 8)
    assert p == pytest.approx({2: 0.11920292, 4: 0.88079708})


def test_bucket_probabilities_other_group_size():
    # K=4: z = (b/4 - 0.5)/0.125 = -2, 0, 2 -> weights e^-2, 1, e^-2
    p = bucket_probabilities([1, 2, 3], 4)
    assert p[2] == pytest.approx(1 / (1 + 2 * math.exp(-2)))
    assert p[1] == pytest.approx(p[3])


def test_bucket_probabilities_refuses_bad_buckets():
    with pytest.raises(ValueError, match="outside 1..7"):
        bucket_probabilities([8], 8)
    assert bucket_probabilities([], 8) == {}


def _buckets(spec: dict[int, list[str]]):
    buckets = {b: IndexedSet() for b in range(1, 8)}
    allq = IndexedSet()
    for b, qs in spec.items():
        for q in qs:
            buckets[b].add(q)
            allq.add(q)
    return buckets, allq


def test_gaussian_sampler_frequencies_and_probability():
    # buckets 3 (one question) and 4 (two): P(bucket 3) = e^-0.5 / (1 + e^-0.5) = 0.3775
    buckets, allq = _buckets({3: ["a"], 4: ["b", "c"]})
    s, rng = GaussianBuckets(8), random.Random(0)
    counts = {"a": 0, "b": 0, "c": 0}
    for _ in range(20000):
        [(q, prob)] = s.sample(buckets, 1, rng)
        counts[q] += 1
        p3 = math.exp(-0.5) / (1 + math.exp(-0.5))
        assert prob == pytest.approx(p3 if q == "a" else (1 - p3) / 2)
    assert counts["a"] / 20000 == pytest.approx(0.3775, abs=0.015)
    assert counts["b"] / 20000 == pytest.approx(0.3112, abs=0.015)


def test_gaussian_sampler_without_replacement_within_request():
    buckets, allq = _buckets({3: ["a"], 4: ["b", "c"], 6: ["d"]})
    picks = GaussianBuckets(8).sample(buckets, 10, random.Random(1))
    assert sorted(q for q, _ in picks) == ["a", "b", "c", "d"]


def test_uniform_sampler_distinct():
    buckets, allq = _buckets({1: ["a"], 7: ["b", "c"]})
    picks = UniformQuestions().sample(buckets, 5, random.Random(0))
    assert sorted(q for q, _ in picks) == ["a", "b", "c"]
    assert picks[0][1] == pytest.approx(1 / 3)


def test_advantage_sampler_by_hand():
    # K = 8: a correct trajectory of a question in bucket b had |A| = 1 - b/8: "a" (bucket 1) 0.875, "b" and "c"
    # (bucket 4) 0.5 each; total 1.875: P(a) = 0.875 / 1.875 = 0.4667, P(b) = P(c) = 0.5 / 1.875 = 0.2667
    buckets, _ = _buckets({1: ["a"], 4: ["b", "c"]})
    s, rng = AdvantagePrioritised(8), random.Random(0)
    counts = {"a": 0, "b": 0, "c": 0}
    for _ in range(20000):
        [(q, prob)] = s.sample(buckets, 1, rng)
        counts[q] += 1
        assert prob == pytest.approx(0.875 / 1.875 if q == "a" else 0.5 / 1.875)
    assert counts["a"] / 20000 == pytest.approx(0.4667, abs=0.015)
    assert counts["b"] / 20000 == pytest.approx(0.2667, abs=0.015)
    # without replacement: two draws never repeat; the second is over what is left. P(a not among 2) = P(b, c or
    # c, b) = 2 x (0.5 / 1.875) x (0.5 / 1.375) = 0.1939
    pairs = [s.sample(buckets, 2, rng) for _ in range(20000)]
    assert all(len({q for q, _ in p}) == 2 for p in pairs)
    assert sum(all(q != "a" for q, _ in p) for p in pairs) / 20000 == pytest.approx(0.1939, abs=0.012)
    assert sorted(q for q, _ in s.sample(buckets, 10, rng)) == ["a", "b", "c"]
    assert s.sample(_buckets({})[0], 3, rng) == []


def test_indexed_set_swap_remove():
    s = IndexedSet()
    for x in "abcd":
        s.add(x)
    s.discard("b")
    s.discard("zz")
    assert sorted(s.items) == ["a", "c", "d"] and all(s.items[i] == x for x, i in s.pos.items())


def test_selectors():
    # lowest_entropy ships every stored trajectory: the learner ranks them under its current policy
    assert LowestEntropy().candidates([0.9, 0.2, 0.2, 0.5], [True] * 4, random.Random(0)) == [0, 1, 2, 3]
    seen = {tuple(RandomTrajectory().candidates([1.0, 2.0, 3.0], [True] * 3, random.Random(i))) for i in range(50)}
    assert seen == {(0,), (1,), (2,)}
    # lowest_stored_entropy ships one: the lowest learner-measured entropy; the generator's estimates only without one
    assert LowestStoredEntropy().candidates([0.9, 0.1, 0.3, 0.5], [True, False, True, True], random.Random(0)) == [2]
    assert LowestStoredEntropy().candidates([0.9, 0.1, 0.3], [False] * 3, random.Random(0)) == [1]


def test_keys_and_stable_shards():
    ids = int32_array([1, 2, 3])
    key = trajectory_key("q#7", ids)
    qid, digest = split_key(key)
    assert qid == "q#7" and len(digest) == 8 and len(key.rpartition("#")[2]) == 16
    # blake2b, not hash(): the same in every process; spreads questions over shards
    assert shard_of("q0", 4) == shard_of("q0", 4)
    assert len({shard_of(f"q{i}", 4) for i in range(100)}) == 4
    with pytest.raises(ValueError, match="16 hex"):
        split_key("no-digest")
