"""ExperienceStore rules (DESIGN.md §2) with hand-worked cases."""

import random

import numpy as np
import pytest

from buffer.keys import trajectory_key
from buffer.sampling import GaussianBuckets, LowestEntropy
from buffer.records import record_entropy, record_to_rollout
from buffer.store import ExperienceStore
from tests.buffer.helpers import rollout


def make_store(max_per_question=8, max_total=1000) -> ExperienceStore:
    return ExperienceStore(8, GaussianBuckets(8), LowestEntropy(), max_per_question=max_per_question, max_total=max_total)


def correct(n, base=0, entropy=1.0):
    return [rollout([base, j], 1.0, entropy=entropy + j) for j in range(n)]


def test_stores_correct_rollouts_in_bucket_k():
    s = make_store()
    rs = correct(3)
    keys = s.observe("q1", 3, rs, collect=True)
    assert keys == [trajectory_key("q1", r.response_ids) for r in rs]
    assert s.total == 3 and "q1" in s.buckets[3] and s.entries["q1"].bucket == 3


def test_collect_false_stores_nothing():
    s = make_store()
    assert s.observe("q1", 3, correct(3), collect=False) == ["", "", ""]
    assert s.total == 0 and not s.entries


def test_dedup_by_response_ids():
    s = make_store()
    r = rollout([5, 6], 1.0)
    s.observe("q1", 2, [r, rollout([5, 6], 1.0)], collect=True)
    s.observe("q1", 1, [rollout([5, 6], 1.0, entropy=0.1)], collect=True)
    assert s.total == 1 and s.c.deduplicated == 2
    assert record_entropy(s.entries["q1"].recs[0]) == 1.0  # the first copy is kept


def test_a_duplicate_fresh_rollout_keeps_the_first_stored_logprobs():
    """Issue 44 (3): the learner's log-probs replace a stored trajectory's once, when its own group is trained; a
    later fresh rollout with the same tokens (its key is the same) does not overwrite them (the official pool
    keeps the first entry)."""
    s = make_store()
    key = s.observe("q1", 2, [rollout([5, 6], 1.0)], collect=True)[0]
    s.feedback([], [], version=1, fresh_keys=[key], fresh_entropies=[0.7], fresh_logprobs=[np.array([-1.0, -2.0])])
    assert s.observe("q1", 2, [rollout([5, 6], 1.0)], collect=True) == [key]  # the duplicate, known by its key
    s.feedback([], [], version=3, fresh_keys=[key], fresh_entropies=[0.4], fresh_logprobs=[np.array([-9.0, -9.0])])
    assert record_to_rollout(s.entries["q1"].recs[0], "q1").logprobs.tolist() == [-1.0, -2.0]
    assert s.c.logprobs_from_learner == 1
    assert s.entries["q1"].ents[0] == pytest.approx(0.4)  # its entropy is still re-measured


def test_all_correct_retires_and_deletes():
    s = make_store()
    s.observe("q1", 3, correct(3), collect=True)
    s.observe("q1", 8, correct(8), collect=True, retire=True)
    assert "q1" in s.retired and s.total == 0 and "q1" not in s.buckets[3] and s.c.deleted_on_retire == 3
    assert s.observe("q1", 2, correct(2), collect=True) == ["", ""]  # a late group of a retired question
    assert s.total == 0 and s.c.late_for_retired == 1


def test_k_zero_keeps_previous_bucket_and_k_moves_bucket():
    s = make_store()
    s.observe("q1", 5, correct(5), collect=True)
    s.observe("q1", 0, [], collect=True)
    assert s.entries["q1"].bucket == 5 and "q1" in s.buckets[5]
    s.observe("q1", 2, correct(2, base=9), collect=True)
    assert s.entries["q1"].bucket == 2 and "q1" in s.buckets[2] and "q1" not in s.buckets[5]
    assert s.total == 7
    s.observe("q2", 0, [], collect=True)  # never stored: nothing to keep
    assert "q2" not in s.entries


def test_per_question_cap_keeps_the_lowest_measured_entropy():
    s = make_store(max_per_question=2)
    keys = s.observe("q1", 4, [rollout([j], 1.0, entropy=1.0) for j in range(4)], collect=True)
    assert s.total == 4 and s.c.evicted == 0  # unmeasured: nothing to rank them by yet
    s.feedback(keys, [0.7, 0.1, 0.9, 0.3], version=1)  # the learner measured them
    assert sorted(record_entropy(r) for r in s.entries["q1"].recs) == pytest.approx([0.1, 0.3])
    assert s.total == 2 and s.c.evicted == 2 and s.c.evicted_measured == 2


def test_unmeasured_trajectories_are_capped_at_a_group_by_their_estimates():
    s = make_store(max_per_question=2)  # group_size 8
    s.observe("q1", 5, [rollout([j], 1.0, entropy=0.1 * j) for j in range(5)], collect=True)
    s.observe("q1", 5, [rollout([10 + j], 1.0, entropy=0.05 + 0.1 * j) for j in range(5)], collect=True)
    assert s.total == 8 and s.c.evicted == 2  # 10 pending > 8: the two highest estimates (0.4, 0.45) go
    assert max(record_entropy(r) for r in s.entries["q1"].recs) == pytest.approx(0.35)


def test_a_new_correct_rollout_competes_with_measured_ones_once_measured():
    """The issue's reproduction: 8 stored and measured by a replay, then new correct rollouts arrive. Before,
    each was evicted in the very call that stored it (unmeasured < measured); now it waits for the learner's
    measurement (its fresh group's training) and is kept when its entropy is lower."""
    s = make_store(max_per_question=8)
    old = s.observe("q1", 7, [rollout([j], 1.0, entropy=1.0) for j in range(7)], collect=True)
    old += s.observe("q1", 1, [rollout([7], 1.0, entropy=1.0)], collect=True)
    s.feedback(old, [1.0 + 0.1 * j for j in range(8)], version=1, chosen=[old[0]])  # a replay measured all 8
    new = s.observe("q1", 6, [rollout([20 + j], 1.0, entropy=0.01) for j in range(6)], collect=True)
    assert all(new) and s.total == 14 and s.c.evicted == 0  # kept, waiting for their measurement
    s.feedback(new, [0.5, 0.5, 0.5, 2.0, 2.0, 2.0], version=2)  # the learner trained their group
    kept = sorted(record_entropy(r) for r in s.entries["q1"].recs)
    assert s.total == 8 and s.c.evicted == 6  # the 3 higher new ones and the 3 highest old ones
    assert kept == pytest.approx([0.5, 0.5, 0.5, 1.0, 1.1, 1.2, 1.3, 1.4])


def test_total_cap_evicts_least_recently_refreshed_question():
    s = make_store(max_total=4)
    s.observe("a", 2, correct(2), collect=True)
    s.observe("b", 2, correct(2), collect=True)
    s.observe("a", 0, [], collect=True)  # refreshes a: b is now least recent
    s.observe("c", 1, correct(1), collect=True)
    assert set(s.entries) == {"a", "c"} and s.total == 3 and s.c.evicted_questions == 1
    assert "b" not in s.buckets[2]


def test_byte_limit_evicts_least_recently_refreshed_questions_and_reports_them():
    """A record is 8 int32 of header + 2 per token: a 1,000-token trajectory is 8,032 bytes."""
    s = ExperienceStore(8, GaussianBuckets(8), LowestEntropy(), max_per_question=8, max_total=1000,
                        max_bytes=3 * 8032)
    long = lambda base, n: [rollout(list(range(base + j, base + j + 1000)), 1.0) for j in range(n)]  # noqa: E731
    s.observe("a", 2, long(0, 2), collect=True)
    assert s.bytes == 2 * 8032 and s.metrics()["stored_bytes"] == 2 * 8032
    s.observe("b", 1, long(10, 1), collect=True)
    assert s.bytes == 3 * 8032 and s.c.evicted == 0  # at the limit, not past it
    s.observe("b", 1, [], collect=True)  # refreshes b: a is now least recent
    s.observe("c", 1, long(20, 1), collect=True)
    assert set(s.entries) == {"b", "c"} and s.bytes == 2 * 8032 and s.total == 2
    m = s.metrics()
    assert m["evicted_for_bytes"] == 2 and m["evicted_questions"] == 1 and m["stored_bytes_max"] == 2 * 8032
    s.observe("c", 8, [], collect=True, retire=True)  # c retires (all 8 correct): its bytes go with it
    assert s.bytes == 8032


def test_sample_ships_candidates_and_feedback_counts_replays():
    s = make_store()
    rs = [rollout([j], 1.0, entropy=e) for j, e in enumerate([0.5, 0.2, 0.9])]
    keys = s.observe("q1", 3, rs, collect=True)
    [(qid, prob, recs)] = s.sample(1, random.Random(0))
    assert qid == "q1" and prob == 1.0 and len(recs) == 3  # every candidate travels; nothing counted yet
    replayed = record_to_rollout(recs[1], "q1")
    assert replayed.replayed and replayed.key == keys[1]
    np.testing.assert_array_equal(replayed.logprobs, rs[1].logprobs)
    np.testing.assert_array_equal(replayed.response_ids, rs[1].response_ids)
    assert s.sample(1, random.Random(0), exclude={"q1"}) == []  # a question with a live replay is not drawn
    assert "q1" in s.buckets[3]  # ... and is back in its bucket afterwards
    assert s.metrics()["times_replayed_0"] == 3
    # the learner measured all three under version 3 and trained trajectory 0 (the lowest)
    s.feedback(keys, [0.05, 0.3, 0.7], version=3, chosen=[keys[0]])
    assert [record_entropy(r) for r in s.entries["q1"].recs] == pytest.approx([0.05, 0.3, 0.7])
    s.feedback([keys[0]], [0.9], version=2)  # older policy than the stored value: skipped
    assert s.c.feedback_older == 1 and s.c.feedback_applied == 3
    s.observe("q1", 8, [], collect=True, retire=True)  # retire
    s.feedback([keys[0], "bad-key"], [0.1, 0.1], version=4, chosen=[keys[1]])
    assert s.c.feedback_ignored == 2 and s.c.chosen_gone == 1
    m = s.metrics()
    assert m["chosen"] == 1 and m["entropy_chosen_sum"] == pytest.approx(0.05)
    assert m["entropy_available_sum"] == pytest.approx(0.35)
    assert m["retired"] == 1 and m["stored_trajectories"] == 0


def test_times_replayed_histogram():
    s = make_store()
    [key] = s.observe("q1", 1, correct(1), collect=True)
    for _ in range(5):
        s.feedback([], [], version=0, chosen=[key])
    m = s.metrics()
    assert m["times_replayed_4plus"] == 1 and m["times_replayed_0"] == 0


def test_a_record_keeps_the_reasoning_check():
    from buffer.keys import response_digest
    from buffer.records import pack_record

    for valid in (-1, 0, 1):
        for finish in ("stop", "length"):
            r = rollout([1, 2, 3], 1.0)
            r.valid, r.finish_reason = valid, finish
            back = record_to_rollout(pack_record(r, response_digest(r.response_ids)), "q")
            assert (back.valid, back.finish_reason) == (valid, finish)


def test_entropy_available_mean_counts_the_scored_candidates_only():
    """Issue 35 (6): a replay step also measures the fresh correct rows it trained, of the same question; the
    metric averages the candidates the learner chose among. Candidates at 0.3 and 0.5, a fresh row at 0.9: 0.4
    (it was 0.567 with the fresh row mixed in)."""
    s = make_store()
    cands = s.observe("q1", 2, [rollout([1], 1.0, entropy=0.3), rollout([2], 1.0, entropy=0.5)], collect=True)
    [fresh] = s.observe("q1", 2, [rollout([3], 1.0, entropy=0.9)], collect=True)
    s.feedback(cands, [0.3, 0.5], version=1, chosen=[cands[0]], fresh_keys=[fresh], fresh_entropies=[0.9])
    m = s.metrics()
    assert m["chosen_measured"] == 1 and m["entropy_chosen_sum"] == pytest.approx(0.3)
    assert m["entropy_available_sum"] == pytest.approx(0.4)
    assert record_entropy(s.entries["q1"].recs[2]) == pytest.approx(0.9)  # the fresh row's measurement applied
