"""ShardCore: issuing, leases, back-pressure, ready queues, batches, switch, accounting."""

import random

import pytest

from buffer.client import batch_shares
from buffer.batch_plan import MixedSwitch, mixed_shares, mixed_target, plan_take
from buffer.core import ShardCore
from buffer.keys import shard_of
from learner.batching import batch_rows, split_mini_batches
from learner.replay_choice import complete_groups
from common.config import BufferConfig
from common.messages import LearnerFeedback, TrainingBatch, float32_array
from tests.buffer.helpers import group_for, make_questions

NOW = 1000.0


def cfg(**kw) -> BufferConfig:
    base = dict(group_size=4, batch_questions=4, replay_ratio=0.5, max_lag=1,
                mixed_switch_accuracy=0.35, lease_timeout_s=10.0, seed=0)
    base.update(kw)
    return BufferConfig(**base)


def balanced(core: ShardCore) -> dict:
    a = core.accounting()
    assert a["balance"] == 0, a
    return a


def test_epoch_issues_every_question_once_then_reshuffles():
    core = ShardCore(cfg(batch_questions=100, max_lag=0), make_questions(10))
    items = core.lease("g", 10, now=NOW)
    assert all(it.num_samples == 4 and it.replay is None for it in items)
    first = [it.question.id for it in items]
    assert sorted(first) == sorted(f"q{i}" for i in range(10))
    second = [it.question.id for it in core.lease("g", 10, now=NOW)]
    assert sorted(second) == sorted(first) and second != first  # epoch 2, new order
    again = ShardCore(cfg(batch_questions=100, max_lag=0), make_questions(10))
    assert [it.question.id for it in again.lease("g", 10, now=NOW)] == first  # seeded


def test_work_items_name_the_oldest_weights_that_keep_them_trainable():
    """A lease at version v may be trained a batch later (v + 1): rollouts of weights w are stale there unless
    v + 1 - w <= max_lag, so the item asks for weights v + 1 - max(max_lag, 1) or newer (a generator on older
    weights holds it until they load; with max_lag >= 2 the previous weights still do and nothing waits)."""
    for max_lag, want in ((0, 5), (1, 5), (2, 4), (4, 2)):
        core = ShardCore(cfg(max_lag=max_lag, batch_questions=100), make_questions(10))
        core.set_version(5)
        items = core.lease("g", 3, now=NOW)
        assert items and all(it.version == 5 and it.min_weights == want for it in items), (max_lag, items[0])


def test_back_pressure_limits_live_work():
    # share 4, max_lag 1 -> at most 8 leases + ready groups
    core = ShardCore(cfg(), make_questions(20))
    items = core.lease("g", 100, now=NOW)
    assert len(items) == 8 and core.lease("g", 1, now=NOW) == []
    core.submit([group_for(it, 2) for it in items[:4]], now=NOW)
    assert core.lease("g", 100, now=NOW) == []  # 4 ready + 4 outstanding
    assert len(core.take(0, 4, 0)) == 4
    # batch 0 is taken: the 4 outstanding leases are for batch 1, the last one that version-0 work can
    # reach with max_lag 1; more work waits for version 1
    assert core.lease("g", 100, now=NOW) == []
    core.set_version(1)
    assert len(core.lease("g", 100, now=NOW)) == 4
    balanced(core)


def test_synchronous_mode_leases_nothing_between_batch_and_new_version():
    core = ShardCore(cfg(max_lag=0), make_questions(20))
    items = core.lease("g", 100, now=NOW)
    assert len(items) == 4
    core.submit([group_for(it, 2) for it in items], now=NOW)
    assert len(core.take(0, 4, 0)) == 4
    assert core.lease("g", 100, now=NOW) == []  # would be generated with version 0 and be stale
    core.set_version(1)
    assert len(core.lease("g", 100, now=NOW)) == 4
    balanced(core)


def test_lease_expiry_reissues_and_late_submission_is_counted():
    core = ShardCore(cfg(), make_questions(20))
    [item] = core.lease("g", 1, now=NOW)
    assert item.deadline == NOW + 10.0
    assert core.expire(now=NOW + 10.5) == 1
    [again] = core.lease("g", 1, now=NOW + 11)
    assert again.question.id == item.question.id and again.lease_id != item.lease_id
    out = core.submit([group_for(item, 2)], now=NOW + 11)
    assert out["late"] == 1
    a = balanced(core)
    assert a["expired"] == 1 and a["issued"] == 2 and a["outstanding"] == 1 and a["late_submissions"] == 1


def test_a_dead_generators_leases_end_at_once_and_open_the_window_for_the_others():
    """A generator whose process died (its node lost, killed) holds leases that never come back: ended at once
    (counted as expired, their questions issued again first), the back-pressure window they held is free for the
    live generators, the other generator's leases stay, and a submission of the dead one is late."""
    core = ShardCore(cfg(batch_questions=2, max_lag=1), make_questions(20))  # a window of (1 + 1) * 2 = 4 items
    dead = core.lease("g-dead", 3, now=NOW)
    live = core.lease("g-live", 3, now=NOW)
    assert len(dead) == 3 and len(live) == 1 and core.lease("g-live", 1, now=NOW) == []  # the window is full
    assert core.end_leases_of("g-dead") == 3
    assert core.end_leases_of("g-dead") == 0
    again = core.lease("g-live", 4, now=NOW + 1)  # well before the dead leases' deadline (NOW + 10)
    assert [it.question.id for it in again] == [it.question.id for it in dead]
    assert core.submit([group_for(dead[0], 2)], now=NOW + 1)["late"] == 1
    assert core.submit([group_for(live[0], 2)], now=NOW + 1)["accepted"] == 1
    acc = balanced(core)
    assert acc["expired"] == 3 and acc["reissued"] == 3 and acc["outstanding"] == 3 and acc["late_submissions"] == 1
    assert core.metrics()["expired_holder_died"] == 3


def test_returned_and_rejected_leases_are_reissued():
    core = ShardCore(cfg(), make_questions(20))
    a, b = core.lease("g", 2, now=NOW)
    assert core.return_leases([a.lease_id, "nope"]) == 1
    bad = group_for(b, 2)
    bad.rollouts = bad.rollouts[:3]  # a fresh lease wants K = 4 rollouts
    assert core.submit([bad], now=NOW)["rejected"] == 1
    reissued = [it.question.id for it in core.lease("g", 2, now=NOW)]
    assert reissued == [a.question.id, b.question.id]
    acc = balanced(core)
    assert acc["lost"] == 2 and acc["returned"] == 1 and acc["rejected"] == 1


def test_zero_signal_groups_are_counted_and_still_update_the_store():
    core = ShardCore(cfg(collect_before_mixed=True, drop_zero_signal=True), make_questions(20))
    a, b, c = core.lease("g", 3, now=NOW)
    out = core.submit([group_for(a, 4), group_for(b, 0), group_for(c, 2)], now=NOW)
    assert out == {"accepted": 1, "zero_signal": 2, "rejected": 0, "late": 0}
    assert core.n.zero_signal_fresh == 2 and core.n.zero_signal_fresh_correct == 1  # for the run's switch
    assert a.question.id in core.store.retired  # all correct: retired although kept out of batches
    assert core.store.total == 2 and len(core.ready_fresh) == 1
    assert balanced(core)["zero_signal"] == 2
    keep = ShardCore(cfg(), make_questions(20))  # the default: trained on with advantage 0 (official)
    [x] = keep.lease("g", 1, now=NOW)
    keep.submit([group_for(x, 0)], now=NOW)
    assert len(keep.ready_fresh) == 1 and keep.n.zero_signal_seen == 1 and keep.n.zero_signal == 0


def test_retired_question_is_not_issued_fresh_again():
    core = ShardCore(cfg(batch_questions=100, max_lag=0), make_questions(3))
    items = core.lease("g", 3, now=NOW)
    core.submit([group_for(items[0], 4)], now=NOW)
    core.return_leases([it.lease_id for it in items[1:]])
    ids = [it.question.id for it in core.lease("g", 50, now=NOW)]
    assert items[0].question.id not in ids and len(ids) == 50


def test_switch_needs_a_full_window_and_stays_on():
    # window 4, threshold 0.35, one observe() per batch
    sw = MixedSwitch(4, 0.35)
    assert not sw.observe([1.0, 1.0])  # window not full: never, whatever the accuracy
    assert sw.observe([0.25, 0.0])  # (1 + 1 + 0.25 + 0) / 4 = 0.5625 > 0.35: on
    assert not sw.observe([0.0] * 8) and sw.on  # falls to 0: stays on, and only one call returns True
    low = MixedSwitch(4, 0.35)
    assert not low.observe([0.5, 0.25, 0.25, 0.375]) and not low.on  # mean 0.34375


def test_default_window_is_one_batch_and_smaller_windows_are_refused():
    assert cfg(batch_questions=16).switch_groups == 16
    assert cfg(batch_questions=16, switch_window=64).switch_groups == 64
    with pytest.raises(ValueError, match="switch_window: 8 fresh groups is less than one batch"):
        cfg(batch_questions=16, switch_window=8)


def test_shards_never_switch_themselves():
    core = ShardCore(cfg(batch_questions=50), make_questions(20))
    items = core.lease("g", 20, now=NOW)
    core.submit([group_for(it, 3) for it in items], now=NOW)  # accuracy 0.75 everywhere
    assert not core.mixed_mode and core.store.total == 0  # the run-wide switch decides, not a shard


def test_collection_starts_with_mixed_mode():
    core = ShardCore(cfg(batch_questions=50), make_questions(20))
    a, b = core.lease("g", 2, now=NOW)
    core.submit([group_for(a, 2)], now=NOW)  # before the switch: nothing stored
    assert core.store.total == 0
    assert all(r.key == "" for r in core.ready_fresh[0].group.rollouts)
    core.set_mixed_mode()
    core.submit([group_for(b, 3)], now=NOW)  # after: this group's 3 correct rollouts are stored
    assert core.store.total == 3
    keys = [r.key for r in core.ready_fresh[1].group.rollouts]
    assert all(keys[:3]) and keys[3] == ""


def _mixed_core(**kw) -> ShardCore:
    core = ShardCore(cfg(collect_before_mixed=True, **kw), make_questions(40))
    core.set_mixed_mode()
    return core


def test_replay_item_carries_every_candidate_to_the_learner():
    core = _mixed_core()
    [a] = core.lease("g", 1, now=NOW)
    core.submit([group_for(a, 2, entropies=[0.9, 0.3, 1.0, 1.0])], now=NOW)
    core.take(0, 1, 0)
    items = core.lease("g", 2, now=NOW)
    replay = [it for it in items if it.replay is not None]
    assert len(replay) == 1 and replay[0].num_samples == 3 and replay[0].question.id == a.question.id
    assert replay[0].replay.candidates == 2 and 0 < replay[0].replay.probability <= 1
    core.submit([group_for(replay[0], 1, version=1, seed=5)], now=NOW)
    g = core.ready_mixed[0].group
    assert g.mixed and len(g.rollouts) == 3 and not any(r.replayed for r in g.rollouts)
    # both stored trajectories travel (the learner picks o*), with keys and stored log-probs
    assert sorted(c.entropy for c in g.candidates) == pytest.approx([0.3, 0.9])
    assert all(c.replayed and c.key and c.version == 0 and c.reward == 1.0 for c in g.candidates)
    assert g.candidates[0].logprobs.tolist() == [-0.5] * 3
    assert core.store.entries[a.question.id].bucket == 2  # k = 1 fresh + o* = 2
    assert core.ready_mixed[0].version == 1  # staleness counts the fresh rollouts only
    assert core.metrics()["times_replayed_0"] == 3  # nothing counts as replayed before it is trained
    core.feedback(LearnerFeedback(3, [c.key for c in g.candidates], float32_array([0.7, 0.2]), [g.candidates[1].key]))
    m = core.metrics()
    assert m["times_replayed_1"] == 1 and m["chosen"] == 1
    assert m["entropy_chosen_mean"] == pytest.approx(0.2) and m["entropy_available_mean"] == pytest.approx(0.45)


def test_random_selector_ships_one_candidate():
    core = _mixed_core(trajectory_selector="random")
    [a] = core.lease("g", 1, now=NOW)
    core.submit([group_for(a, 3)], now=NOW)
    core.take(0, 1, 0)
    [r] = [it for it in core.lease("g", 2, now=NOW) if it.replay]
    core.submit([group_for(r, 1, seed=9)], now=NOW)
    assert len(core.ready_mixed[0].group.candidates) == 1


def test_lowest_stored_entropy_ships_the_lowest_measured_candidate_alone():
    # two stored (entropies 0.7 and 0.2 measured by the learner at version 3): lowest_stored_entropy ships the 0.2 alone,
    # so the learner has nothing to score
    core = _mixed_core(trajectory_selector="lowest_stored_entropy")
    [a] = core.lease("g", 1, now=NOW)
    core.submit([group_for(a, 3)], now=NOW)
    [g] = core.take(0, 1, 0)
    keys = [r.key for r in g.rollouts if r.correct]
    core.feedback(LearnerFeedback(3, [], float32_array([]), [], fresh_keys=keys,
                                  fresh_entropies=float32_array([0.7, 0.2, 0.9][:len(keys)])))
    [r] = [it for it in core.lease("g", 2, now=NOW) if it.replay]
    core.submit([group_for(r, 1, seed=9)], now=NOW)
    [shipped] = core.ready_mixed[0].group.candidates
    assert shipped.key == keys[1] and shipped.entropy == pytest.approx(0.2)


def test_k_without_o_star_counts_the_fresh_rollouts_of_a_mixed_group_only():
    """SU-01 counts on-policy samples: with buffer.k_fresh_only a mixed group's k leaves o* out. By hand, K = 4,
    retire_above = 2 (k >= 3 retires): q stores 2 of a fresh group (k = 2, bucket 2); its mixed group then has 2 of
    3 fresh correct + o*. ExGRPO's k = 2 + 1 = 3: retired, its experience deleted. k_fresh_only: k = 2: bucket 2,
    the 2 new correct stored beside the 2 (4). A mixed group with 1 of 3 correct: bucket 2 (1 + o*) or 1."""
    for fresh_only in (False, True):
        for n_ok, bucket, stored in ((2, None if not fresh_only else 2, 0 if not fresh_only else 4),
                                     (1, 2 if not fresh_only else 1, 3)):
            core = _mixed_core(k_fresh_only=fresh_only, retire_above=2)
            [a] = core.lease("g", 1, now=NOW)
            core.submit([group_for(a, 2)], now=NOW)
            core.take(0, 1, 0)
            [r] = [it for it in core.lease("g", 2, now=NOW) if it.replay]
            core.submit([group_for(r, n_ok, seed=7)], now=NOW)
            e = core.store.entries.get(a.question.id)
            assert (e.bucket if e else None) == bucket, (fresh_only, n_ok)
            assert (len(e.recs) if e else 0) == stored, (fresh_only, n_ok)
            assert (a.question.id in core.store.retired) == (bucket is None)
            balanced(core)


def _reversed(g):
    """The same group with its rollouts in the opposite order (group_for puts the correct ones first)."""
    from common.messages import ScoredGroup
    return ScoredGroup(g.lease_id, g.question_id, list(reversed(g.rollouts)), g.generator_id)


def test_retirement_from_the_pool_and_from_the_fresh_stream_are_two_things():
    """ExGRPO (retire_fresh=with_pool): a question retired from the experience pool leaves the fresh stream too.
    SU-01 (last_three_correct): retirement deletes its experience only; it is issued fresh until its last three
    tracked rollouts were all correct. By hand, K = 4, retire_above = 1 (k >= 2 retires), one question:
      group 1 correct 1, 1, 0, 0: k = 2 retires q0 from the pool (nothing stored); last three 1, 0, 0.
        with_pool: nothing to issue. last_three_correct: q0 issued again (epoch 2).
      group 2 correct 0, 1, 1, 1 (reversed 3 of 4): late for the pool (stores nothing); last three 1, 1, 1: q0 leaves
        the fresh stream: nothing to issue, `retired` (out of the fresh stream) 1, `retired_from_pool` 1.
    A group of 0, 0, 1, 1 then 1, 1, 1, 0 never has three correct last: q1 keeps coming back (no pool retirement)."""
    for mode in ("with_pool", "last_three_correct"):
        core = ShardCore(cfg(collect_before_mixed=True, batch_questions=100, max_lag=0, retire_above=1,
                             retire_fresh=mode), make_questions(1))
        [a] = core.lease("g", 1, now=NOW)
        core.submit([group_for(a, 2)], now=NOW)
        assert core.store.retired == {"q0"} and "q0" not in core.store.entries
        again = core.lease("g", 1, now=NOW)
        if mode == "with_pool":
            assert again == [] and core.metrics()["retired"] == 1
            continue
        assert [it.question.id for it in again] == ["q0"] and core.policy.tracked["q0"] == [True, False, False]
        core.submit([_reversed(group_for(again[0], 3, seed=1))], now=NOW)
        assert core.store.c.late_for_retired == 1 and not core.store.entries
        assert core.policy.tracked["q0"] == [True, True, True] and core.lease("g", 1, now=NOW) == []
        m = core.metrics()
        assert (m["retired"], m["retired_from_pool"]) == (1, 1)
        balanced(core)
    core = ShardCore(cfg(collect_before_mixed=True, batch_questions=100, max_lag=0,
                         retire_fresh="last_three_correct"), make_questions(1))
    [a] = core.lease("g", 1, now=NOW)
    core.submit([_reversed(group_for(a, 2))], now=NOW)  # 0, 0, 1, 1
    [b] = core.lease("g", 1, now=NOW)
    core.submit([group_for(b, 3, seed=1)], now=NOW)  # 1, 1, 1, 0: last three 1, 1, 0
    assert [it.question.id for it in core.lease("g", 1, now=NOW)] == ["q0"] and not core.policy.fresh_out
    assert core.store.entries["q0"].bucket == 3 and not core.store.retired


def test_without_retirement_a_solved_question_keeps_its_experience_and_comes_back_fresh():
    # K = 4. q stores 2 correct rollouts (k = 2, bucket 2), then a group of 4 correct: ExGRPO retires it (deletes the
    # two, never issues it fresh again); retire=false leaves it as a k = 0 group would: bucket 2, the two stored,
    # nothing of the solved group stored, and the next epoch issues it again.
    for retire in (True, False):
        core = ShardCore(cfg(collect_before_mixed=True, batch_questions=100, max_lag=0, retire=retire),
                         make_questions(1))
        [a] = core.lease("g", 1, now=NOW)
        core.submit([group_for(a, 2)], now=NOW)
        [b] = core.lease("g", 1, now=NOW)  # epoch 2
        core.submit([group_for(b, 4, seed=3)], now=NOW)
        e = core.store.entries.get("q0")
        if retire:
            assert e is None and core.store.retired == {"q0"} and core.lease("g", 1, now=NOW) == []
        else:
            assert e.bucket == 2 and len(e.recs) == 2 and not core.store.retired
            assert [it.question.id for it in core.lease("g", 1, now=NOW)] == ["q0"]
        assert core.n.zero_signal_seen == 1  # the solved group still counts as all-correct for the switch
        balanced(core)


def test_advantage_replay_never_draws_a_question_whose_latest_group_was_all_correct():
    """Issue 60: without retirement, a question solved in its latest group kept its old bucket, so advantage replay
    drew it with weight 1 - b_old/K although every trajectory of it has |A| = 0 there. By hand, K = 4: q0 in bucket 1
    (|A| = 0.75), q1 in bucket 3 (0.25): P(q0) = 0.75 / 1.0. q1 solved: its weight is 0, P(q0) = 1. q1 then 2 of 4
    correct: bucket 2 (0.5), P(q0) = 0.75 / 1.25 = 0.6. The Gaussian sampler still draws the solved q1 by its bucket."""
    import random as _random

    for sampler in ("advantage", "gaussian"):
        core = ShardCore(cfg(collect_before_mixed=True, batch_questions=100, max_lag=0, retire=False,
                             question_sampler=sampler, trajectory_selector="random", trajectory_eviction="oldest"),
                         make_questions(2))
        items = {it.question.id: it for it in core.lease("g", 2, now=NOW)}
        core.submit([group_for(items["q0"], 1), group_for(items["q1"], 3)], now=NOW)

        def p_q0() -> float:
            draws = [core.store.sample(1, _random.Random(i)) for i in range(200)]
            return {q: prob for d in draws for q, prob, _ in d}.get("q0", 0.0), {q for d in draws for q, _, _ in d}

        if sampler == "advantage":
            assert p_q0() == (pytest.approx(0.75), {"q0", "q1"})
        items = {it.question.id: it for it in core.lease("g", 2, now=NOW)}  # epoch 2
        core.submit([group_for(items["q0"], 1, seed=1), group_for(items["q1"], 4, seed=1)], now=NOW)
        assert core.store.entries["q1"].bucket == 3 and core.store.solved == {"q1"}
        prob, drawn = p_q0()
        if sampler == "advantage":
            assert (prob, drawn) == (pytest.approx(1.0), {"q0"})
        else:
            assert drawn == {"q0", "q1"}
        items = {it.question.id: it for it in core.lease("g", 2, now=NOW)}  # epoch 3
        core.submit([group_for(items["q0"], 1, seed=2), group_for(items["q1"], 2, seed=2)], now=NOW)
        assert not core.store.solved
        if sampler == "advantage":
            assert p_q0() == (pytest.approx(0.6), {"q0", "q1"})
        balanced(core)


def test_a_reissued_replay_of_a_solved_question_is_not_issued_under_advantage_replay():
    """A replay whose lease ends unfinished is issued again as replay; advantage replay never draws a question whose
    latest group was all correct (|A| = 0), and a re-issue is held to the same rule. q0 (1 of 4) and q1 (2 of 4)
    stored; the next lease call issues a replay of each and both again fresh (epoch 2). q0's fresh group comes back
    all correct (solved, kept: no retirement); its replay's lease is given back. The next call drops that re-issue
    (`replay_reissue_dropped`) instead of replaying a question whose every trajectory has |A| = 0."""
    core = ShardCore(cfg(collect_before_mixed=True, batch_questions=100, max_lag=0, retire=False,
                         question_sampler="advantage", trajectory_selector="random", trajectory_eviction="oldest"),
                     make_questions(2))
    core.set_mixed_mode()
    items = {it.question.id: it for it in core.lease("g", 2, now=NOW)}
    core.submit([group_for(items["q0"], 1), group_for(items["q1"], 2)], now=NOW)
    core.take(0, 2, 0)
    second = core.lease("g", 4, now=NOW)
    replay = {it.question.id: it for it in second if it.replay}
    fresh = {it.question.id: it for it in second if not it.replay}
    assert sorted(replay) == sorted(fresh) == ["q0", "q1"]
    core.submit([group_for(fresh["q0"], 4, seed=1)], now=NOW)
    assert core.store.solved == {"q0"}
    core.return_leases([replay["q0"].lease_id])
    assert list(core.reissue_replay) == ["q0"]
    again = core.lease("g", 4, now=NOW)
    assert [it.question.id for it in again if it.replay] == [] and core.n.replay_reissue_dropped == 1, again
    balanced(core)


def test_fifo_eviction_keeps_the_newest_trajectories():
    # max 3 per question. Group 1 stores t0 t1 (entropies 0.1, 0.2), group 2 stores t2 t3 (0.9, 1.0): FIFO drops
    # t0, the oldest, though its entropy is the lowest; ExGRPO's rule keeps all 4 (t2, t3 wait unmeasured) and,
    # once the learner measures them, drops the highest (t3).
    for evict, left in (("oldest", [0.2, 0.9, 1.0]), ("highest_entropy", [0.1, 0.2, 0.9])):
        core = ShardCore(cfg(collect_before_mixed=True, batch_questions=100, max_lag=0, max_traj_per_question=3,
                             trajectory_eviction=evict), make_questions(1))
        [a] = core.lease("g", 1, now=NOW)
        core.submit([group_for(a, 2, entropies=[0.1, 0.2, 5, 5])], now=NOW)
        [b] = core.lease("g", 1, now=NOW)
        core.submit([group_for(b, 2, seed=4, entropies=[0.9, 1.0, 5, 5])], now=NOW)
        keys = [r.key for q in (core.ready_fresh[0], core.ready_fresh[1]) for r in q.group.rollouts if r.key]
        core.feedback(LearnerFeedback(1, [], float32_array([]), [], keys, float32_array([0.1, 0.2, 0.9, 1.0])))
        assert sorted(core.store.entries["q0"].ents) == pytest.approx(left)
        assert core.store.c.evicted == 1
        balanced(core)


def test_replay_modes_refuse_settings_they_never_read():
    BufferConfig(question_sampler="uniform", trajectory_selector="random", retire=False, trajectory_eviction="oldest")
    BufferConfig(question_sampler="advantage")
    # a saved config writes every field out (the defaults of the bucket weight too) and loads again
    full = BufferConfig(question_sampler="uniform", retire=False).model_dump()
    assert BufferConfig(**full).model_dump() == full
    with pytest.raises(ValueError, match="buffer.bucket_std: the bucket weight of question_sampler=gaussian, unused "
                                         "by buffer.question_sampler=uniform"):
        BufferConfig(question_sampler="uniform", bucket_std=0.2)
    with pytest.raises(ValueError, match="buffer.retire=false: buffer.collect=false stores and retires nothing"):
        BufferConfig(collect=False, replay_ratio=0, retire=False)
    with pytest.raises(ValueError, match="buffer.question_sampler: buffer.replay_ratio=0 replays nothing"):
        BufferConfig(replay_ratio=0, question_sampler="advantage")


def test_a_question_is_never_replayed_twice_while_live():
    core = _mixed_core(batch_questions=8, max_lag=3, replay_ratio=0.75)
    seeds = core.lease("g", 2, now=NOW)
    core.submit([group_for(it, 2) for it in seeds], now=NOW)  # 2 stored questions
    core.take(0, 2, 0)
    replay = [it for it in core.lease("g", 24, now=NOW) if it.replay]
    assert sorted(it.question.id for it in replay) == sorted(it.question.id for it in seeds)
    core.submit([group_for(it, 1, seed=3) for it in replay], now=NOW)  # ready as mixed groups: still live
    assert not [it for it in core.lease("g", 24, now=NOW) if it.replay]
    core.take(0, 0, 2)
    core.return_leases(list(core.leases))  # make room (back-pressure) for the next lease call
    assert len([it for it in core.lease("g", 24, now=NOW) if it.replay]) == 2  # trained: may come again
    balanced(core)


def test_expired_and_stale_replays_are_issued_again_as_replay():
    core = _mixed_core(batch_questions=4, max_lag=1)
    seeds = core.lease("g", 2, now=NOW)
    core.submit([group_for(it, 2) for it in seeds], now=NOW)
    core.take(0, 2, 0)
    replay = [it for it in core.lease("g", 6, now=NOW) if it.replay]
    assert len(replay) == 2
    core.expire(now=replay[0].deadline + 1)  # every lease expires
    again = [it for it in core.lease("g", 6, now=replay[0].deadline + 2) if it.replay]
    assert sorted(it.question.id for it in again) == sorted(it.question.id for it in replay)
    assert all(it.replay.reissue for it in again) and core.n.reissued_replay == 2
    core.submit([group_for(it, 1, version=0, seed=4) for it in again], now=replay[0].deadline + 2)
    core.set_version(2)  # version 0 is stale at max_lag 1: the mixed groups are dropped ...
    assert core.ready_counts() == (0, 0)
    third = [it for it in core.lease("g", 6, now=replay[0].deadline + 3) if it.replay]
    assert len(third) == 2 and all(it.replay.reissue for it in third)  # ... and their replay comes back
    assert core.metrics()["times_replayed_0"] == core.store.total  # none of this counted as a replay
    balanced(core)


def test_batch_ratio_and_fresh_filling():
    # B = 4, rho = 0.5 -> 2 mixed + 2 fresh; with one mixed group ready -> 1 mixed + 3 fresh
    core = _mixed_core(batch_questions=4, max_lag=3)
    seeds = core.lease("g", 4, now=NOW)
    core.submit([group_for(it, 2) for it in seeds], now=NOW)
    core.take(0, 4, 0)
    items = core.lease("g", 8, now=NOW)
    mixed = [it for it in items if it.replay]
    fresh = [it for it in items if not it.replay]
    assert len(mixed) == 4 and len(fresh) == 4  # live mix kept at rho, replay quota floor(0.5*16) = 8
    core.submit([group_for(it, 1) for it in fresh + mixed[:1]], now=NOW)
    batch = core.batch(0)
    assert [g.mixed for g in batch] == [True, False, False, False]
    core.submit([group_for(it, 1) for it in mixed[1:]], now=NOW)
    batch = core.batch(0)
    assert batch == []  # 1 fresh ready but 2 fresh needed
    more = [it for it in core.lease("g", 4, now=NOW) if not it.replay]
    core.submit([group_for(it, 1) for it in more], now=NOW)
    assert sorted(g.mixed for g in core.batch(0)) == [False, False, True, True]
    balanced(core)


@pytest.mark.parametrize("fresh_draw", ["trained", "per_step"])
def test_official_fresh_draw_consumes_a_fresh_question_per_replay(fresh_draw):
    """buffer.fresh_draw=official (issue 44): the official loader draws B fresh questions a step and replaces rho B
    of them by replays, so each new replay consumes the next fresh question unused; a re-issued replay does not."""
    core = _mixed_core(batch_questions=4, max_lag=3, fresh_draw=fresh_draw)
    seeds = core.lease("g", 4, now=NOW)
    core.submit([group_for(it, 2) for it in seeds], now=NOW)
    core.take(0, 4, 0)
    cursor = core.cursor
    items = core.lease("g", 8, now=NOW)
    replays = [it for it in items if it.replay]
    fresh = [it for it in items if not it.replay]
    assert len(replays) == len(fresh) == 4
    skipped = 4 if fresh_draw == "per_step" else 0
    assert core.cursor - cursor == len(fresh) + skipped and core.n.fresh_discarded == skipped
    issued = {it.question.id for it in items} | {it.question.id for it in seeds}
    discarded = core._order[cursor:core.cursor]
    assert len(set(discarded) - issued) == skipped  # the skipped ones were never issued
    core.return_leases([it.lease_id for it in replays[:2]])  # issued again as replay: nothing more consumed
    again = core.lease("g", 2, now=NOW)
    assert [bool(it.replay and it.replay.reissue) for it in again] == [True, True]
    assert core.n.fresh_discarded == skipped
    balanced(core)


def test_stale_groups_are_dropped_and_reissued():
    core = ShardCore(cfg(max_lag=1, batch_questions=4, mixed_switch_accuracy=1.0), make_questions(20))
    a, b = core.lease("g", 2, now=NOW)
    core.submit([group_for(a, 2, version=0), group_for(b, 2, version=2)], now=NOW)
    core.set_version(2)  # version 0 is 2 > max_lag behind
    assert core.ready_counts() == (1, 0)
    [again] = core.lease("g", 1, now=NOW)
    assert again.question.id == a.question.id
    taken = core.take(2, 4, 0)
    assert [g.question_id for g in taken] == [b.question.id]
    acc = balanced(core)
    assert acc["stale_dropped"] == 1 and acc["trained"] == 1 and acc["reissued"] == 1
    assert core.n.stale_dropped_mixed == core.n.stale_dropped_spanning == 0  # a fresh group started on old weights


def test_a_partial_rollout_is_as_stale_as_its_oldest_token():
    """A rollout whose tokens span versions 0..2 (weights loaded mid-generation) is judged by version 0."""
    core = ShardCore(cfg(max_lag=1, batch_questions=4, mixed_switch_accuracy=1.0), make_questions(20))
    a, b = core.lease("g", 2, now=NOW)
    spanning = group_for(a, 2, version=0)
    spanning.rollouts[1].newest_version = 2
    core.submit([spanning, group_for(b, 2, version=1)], now=NOW)
    core.set_version(2)
    assert [g.question_id for g in core.take(2, 4, 0)] == [b.question.id]
    assert balanced(core)["stale_dropped"] == 1 and core.n.stale_dropped_spanning == 1
    assert core.metrics()["stale_dropped_spanning"] == 1.0


class SimRun:
    """What the client and the driver do, over S pure shards: route leases and groups, compose each
    batch with `plan_take`, feed the run-wide `MixedSwitch` once per batch, and play the learner:
    complete mixed groups (lowest entropy), split into mini-batches, send the chosen keys back."""

    def __init__(self, bcfg: BufferConfig, questions, mini_batches: int):
        parts = [[] for _ in range(bcfg.num_shards)]
        for q in questions:
            parts[shard_of(q.id, bcfg.num_shards)].append(q)
        shares = batch_shares([len(p) for p in parts], bcfg.batch_questions)
        self.cores = [ShardCore(bcfg, parts[i], shard=i, batch_share=shares[i], shares=shares)
                      for i in range(bcfg.num_shards)]
        self.cfg, self.mini_batches = bcfg, mini_batches
        self.switch = MixedSwitch(bcfg.switch_groups, bcfg.mixed_switch_accuracy)
        self.zero_seen = (0, 0)
        self.accuracies: list[float] = []  # every fresh group the batches consumed, in order (for the check)
        self.window_means: list[tuple[int, float]] = []
        self.switched_at: int | None = None
        self.rr = 0

    def lease(self, n: int, now: float):
        out = []
        for _ in range(n):
            self.rr = (self.rr + 1) % len(self.cores)
            out += self.cores[self.rr].lease("g", 1, now=now)
        return out

    def submit(self, groups, now: float) -> None:
        for i, core in enumerate(self.cores):
            core.submit([g for g in groups if g.lease_id.startswith(f"{i}-")], now=now)

    def batch(self, version: int, batch_index: int):
        counts = [c.ready_summary(version) for c in self.cores]
        plan = plan_take(counts, 0, 0, self.cfg.batch_questions, self.cfg.replay_ratio, self.switch.on,
                         version - self.cfg.max_lag, sum(c.last_chance_in_flight(version) for c in self.cores))
        if plan is None:
            return None
        groups = [g for c, (f, m) in zip(self.cores, plan) for g in c.take(version, f, m)]
        zs = (sum(c.n.zero_signal_fresh for c in self.cores), sum(c.n.zero_signal_fresh_correct for c in self.cores))
        n_zero, n_one = zs[0] - self.zero_seen[0], zs[1] - self.zero_seen[1]
        self.zero_seen = zs
        acc = [1.0] * n_one + [0.0] * (n_zero - n_one) + [sum(r.correct for r in g.rollouts) / self.cfg.group_size
                                                         for g in groups if not g.mixed]
        self.accuracies += acc
        w = self.cfg.switch_groups
        if len(self.accuracies) >= w:  # the windowed accuracy after this batch, computed independently
            self.window_means.append((batch_index, sum(self.accuracies[-w:]) / w))
        if self.switch.observe(acc):
            self.switched_at = batch_index
            for c in self.cores:
                c.set_mixed_mode()
        return groups

    def learn(self, groups, version: int):
        """The learner's side of a step: o* by lowest entropy, mini-batches, feedback to the shards."""
        batch = TrainingBatch(groups, version)
        scores = {(g, c): float(ro.entropy) for g, grp in enumerate(groups) for c, ro in enumerate(grp.candidates)}
        done, fb = complete_groups(batch, scores)
        rows = batch_rows(done, std_normalize=False, max_positions=10_000)
        for i, core in enumerate(self.cores):  # routed by question, as the client does
            mine = [j for j, k in enumerate(fb.keys) if shard_of(k.split("#")[0], len(self.cores)) == i]
            core.feedback(LearnerFeedback(version, [fb.keys[j] for j in mine],
                                          float32_array([fb.entropies[j] for j in mine]),
                                          [k for k in fb.chosen if shard_of(k.split("#")[0], len(self.cores)) == i]))
        return split_mini_batches(rows, self.mini_batches, seed=version), fb


REPLAY_MODES = {  # the bundled ablations' buffer modes (cluster/experiments/ablations.yaml)
    "exgrpo": {},
    "plain_replay": dict(question_sampler="uniform", trajectory_selector="random", retire=False,
                         trajectory_eviction="oldest"),
    "advantage_replay": dict(question_sampler="advantage", trajectory_selector="random", retire=False,
                             trajectory_eviction="oldest"),
    # SU-01's code at K = 4: stores from groups with one correct, retires from the pool once more than 2 of the
    # fresh rollouts are correct (o* not counted), keeps a question fresh unless its last three were correct
    "su01": dict(store_below=2, retire_above=2, k_fresh_only=True, retire_fresh="last_three_correct"),
}


@pytest.mark.parametrize("shards,max_lag,replay_ratio,mini_batches,fast,seed,mode", [
    (1, 0, 0.5, 1, False, 0, "exgrpo"), (1, 0, 0.25, 2, False, 1, "exgrpo"), (2, 1, 0.5, 2, False, 2, "exgrpo"),
    (3, 2, 0.75, 2, False, 3, "exgrpo"), (2, 1, 0.5, 2, True, 4, "exgrpo"), (4, 1, 0.5, 2, True, 5, "exgrpo"),
    (1, 0, 0.5, 2, False, 6, "plain_replay"), (2, 1, 0.5, 2, True, 7, "plain_replay"),
    (2, 1, 0.5, 2, False, 8, "advantage_replay"), (2, 1, 0.5, 2, False, 9, "su01"), (1, 0, 0.25, 2, True, 10, "su01")])
def test_simulated_run_at_the_papers_settings(shards, max_lag, replay_ratio, mini_batches, fast, seed, mode):
    """Generators with random delays, failures and zero-signal groups; a learner that steps the version
    by one per batch. Checked after every step: accounting balances; no question replayed twice in a
    batch; every trained rollout within max_lag steps; the switch fires exactly when the windowed
    batch accuracy first crosses; every mini-batch mixes fresh and mixed groups when both exist; every
    batch holds ceil(rho * B) mixed groups once the store has filled (most batches with lagging generators);
    no question holds more trajectories than its mode allows. The plain-replay modes: nothing is retired, a
    mixed group carries one candidate, a question keeps at most max_traj_per_question (FIFO). SU-01's: no question
    out of the fresh stream is issued fresh, one retired from the pool stores nothing, and the two exits differ."""
    rng = random.Random(seed)
    bcfg = cfg(num_shards=shards, max_lag=max_lag, replay_ratio=replay_ratio, batch_questions=8, group_size=4,
               lease_timeout_s=5.0, max_traj_per_question=3, **REPLAY_MODES[mode])
    per_question = bcfg.max_traj_per_question + (0 if bcfg.trajectory_eviction == "oldest" else bcfg.group_size)
    sim = SimRun(bcfg, make_questions(120), mini_batches)
    skill = {f"q{i}": rng.uniform(0.05, 0.7) for i in range(120)}
    version, now, in_flight, batches, mixed_trained, mixed_per_batch, solved = 0, NOW, [], 0, 0, [], set()
    pool_only = 0  # steps x questions retired from the experience pool while still in the fresh stream
    for _ in range(2500):
        now += 0.1
        new = sim.lease(rng.randint(0, 6), now)
        assert not [it for it in new if it.replay is None and it.question.id in sim.cores[it.shard].left_fresh()]
        in_flight += [(it, version) for it in new]
        rng.shuffle(in_flight)
        n_done = len(in_flight) if fast else rng.randint(0, 3)
        done, in_flight = in_flight[:n_done], in_flight[n_done:]
        groups = []
        for it, v in done:
            if not fast and rng.random() < 0.05:
                continue  # generator died: the lease will expire
            skill[it.question.id] = min(0.95, skill[it.question.id] + 0.002)  # the policy improves
            n_ok = sum(rng.random() < skill[it.question.id] for _ in range(it.num_samples))
            if n_ok == it.num_samples:
                solved.add(it.question.id)
            groups.append(group_for(it, n_ok, version=v, seed=rng.randint(0, 3),
                                    entropies=[rng.uniform(0.1, 2.0) for _ in range(it.num_samples)]))
        sim.submit(groups, now)
        batch = sim.batch(version, batches)
        if batch:
            assert len(batch) == 8
            if sim.switch.on:  # (mixed groups, whether every shard had experience for its whole replay quota)
                plenty = all(len(c.store.entries) >= 2 * (max_lag + 1) * c.mixed_share() for c in sim.cores)
                mixed_per_batch.append((sum(g.mixed for g in batch), plenty))
            replayed = [g.question_id for g in batch if g.mixed]
            assert len(replayed) == len(set(replayed)), replayed
            assert all(version - r.version <= max_lag for g in batch for r in g.rollouts)
            assert all(g.candidates for g in batch if g.mixed)
            if bcfg.trajectory_selector == "random":
                assert all(len(g.candidates) == 1 for g in batch if g.mixed)
            minis, fb = sim.learn(batch, version)
            mixed_trained += len(replayed)
            assert len(fb.chosen) == len(replayed)
            n_mixed, n_fresh = len(replayed), len(batch) - len(replayed)
            for mini in minis:
                kinds = {r.group for r in mini if r.replayed}, {r.group for r in mini if not r.replayed}
                assert (n_mixed < mini_batches or kinds[0]) and (n_fresh < mini_batches or kinds[1] - kinds[0])
            batches += 1
            version += 1  # one per learner step, whatever mini_batches is
            for c in sim.cores:
                c.set_version(version)
        for c in sim.cores:
            balanced(c)
            assert all(len(e.recs) <= per_question for e in c.store.entries.values())
            assert bcfg.retire or not c.store.retired
            assert not c.store.retired & set(c.store.entries)  # retired from the pool: no experience
            pool_only += len(c.store.retired - c.left_fresh())
    # the switch fired at the first batch whose window (>= one batch of fresh groups) crossed 0.35
    first_crossing = next(b for b, mean in sim.window_means if mean > 0.35)
    assert sim.switched_at == first_crossing
    store_chosen = sum(c.store.c.chosen + c.store.c.chosen_gone for c in sim.cores)
    assert store_chosen == mixed_trained == sum(c.n.trained_mixed for c in sim.cores) > 0
    trained = sum(c.n.trained for c in sim.cores)
    # the replay share at every batch once the store has filled (3 batches after the switch): ceil(rho * B) mixed
    # groups whenever the generators keep up; with generators dying and lagging, short only now and then
    target = mixed_target(8, replay_ratio)
    settled = [m for m, plenty in mixed_per_batch[3:] if plenty]
    assert len(settled) > 20, mixed_per_batch
    if fast or max_lag == 0:
        assert all(m == target for m in settled), mixed_per_batch
    else:
        assert sum(settled) >= 0.85 * target * len(settled), mixed_per_batch  # per-shard floors: 5 of 6 (0.83)
    assert batches > 40, [c.accounting() for c in sim.cores]
    if mode == "su01":  # both exits were taken, at different times: retired from the pool, still issued fresh
        assert pool_only > 0 and sum(len(c.policy.fresh_out) for c in sim.cores) > 0, pool_only
    if not bcfg.retire:  # questions were solved (k = K) after they were stored, and they stay stored
        assert any(q in c.store.entries for c in sim.cores for q in solved), len(solved)
    if fast and max_lag >= 1:  # generators keep up: (almost) nothing goes stale
        assert sum(c.n.stale_dropped for c in sim.cores) <= 0.02 * trained, (sum(c.n.stale_dropped for c in sim.cores), trained)


@pytest.mark.parametrize("shards", [1, 2, 3])
def test_a_pipeline_one_batch_ahead_drops_almost_nothing_as_stale_at_the_switch(shards):
    """Issue 35: a real run's generators keep the pipeline one batch ahead: at each version they lease all the
    window allows (8 at a time, round-robin over the shards) and generate it with that version, part before the
    batch is taken and part after. The batch trains the previous version's work (lag 1 at max_lag 1). When mixed
    mode starts, the work leased for the next batch is all fresh (nothing was stored yet): the first batch that
    could take ceil(rho*B) mixed groups dropped rho*B fresh ones as stale, and the shards then leased only replays
    to bring their live mix back to rho, more mixed groups than the next batches take (7-8 of 480 trained dropped
    at B = 16; in real runs up to 15). Now a batch takes the fresh groups it is the last to be able to train before
    mixed groups that can wait, and each version's new work is leased at the shard's ratio."""
    for seed in range(4):
        rng = random.Random(seed)
        bcfg = cfg(num_shards=shards, max_lag=1, replay_ratio=0.5, batch_questions=16, group_size=8,
                   lease_timeout_s=3600.0, max_traj_per_question=8)
        sim = SimRun(bcfg, make_questions(500), 2)
        version, now, batches = 0, NOW, 0
        while batches < 30:
            now += 1
            leased = []
            while items := sim.lease(8, now):
                leased += items
            rng.shuffle(leased)
            cut = rng.randint(0, len(leased))
            acc = 0.2 if batches < 5 else 0.5  # (trained a batch later: the switch fires at batch 6)
            scored = [group_for(it, sum(rng.random() < acc for _ in range(it.num_samples)), version=version,
                                seed=rng.randint(0, 99), entropies=[rng.random() for _ in range(it.num_samples)])
                      for it in leased]
            sim.submit(scored[:cut], now)  # generated before the batch is taken
            batch = sim.batch(version, batches)
            sim.submit(scored[cut:], now)  # ... and after
            if batch:
                assert len(batch) == 16
                sim.learn(batch, version)
                batches += 1
                version += 1
                for c in sim.cores:
                    c.set_version(version)
            for c in sim.cores:
                balanced(c)
        assert sim.switched_at == 6
        stale = sum(c.n.stale_dropped for c in sim.cores)
        assert stale <= 3, (shards, seed, stale)


def test_collect_off_is_plain_grpo_nothing_stored_nothing_retired():
    core = ShardCore(cfg(collect=False, replay_ratio=0.0, collect_before_mixed=True), make_questions(8))
    items = core.lease("g", 4, now=NOW)
    core.submit([group_for(it, 2) for it in items[:2]] + [group_for(it, 4) for it in items[2:]], now=NOW)
    m = core.metrics()
    assert m["stored_trajectories"] == 0 and m["retired"] == 0
    groups = core.take(0, 4, 0)
    assert all(not r.key for g in groups for r in g.rollouts)  # nothing to rank, no feedback keys
    balanced(core)


def test_take_gives_the_oldest_versions_first_not_the_first_arrived():
    """A long response started under version 0 arrives after short ones started under version 1: taken in
    arrival order it would wait a step more and age past max_lag; taken oldest-first it is trained."""
    core = ShardCore(cfg(max_lag=1, batch_questions=4, mixed_switch_accuracy=1.0), make_questions(20))
    old, new1, new2 = core.lease("g", 3, now=NOW)
    assert {it.version for it in (old, new1, new2)} == {0}  # leases carry the buffer's version
    core.submit([group_for(new1, 2, version=1), group_for(new2, 2, version=1)], now=NOW)
    core.submit([group_for(old, 2, version=0)], now=NOW)
    core.set_version(1)
    assert [g.question_id for g in core.take(1, 1, 0)] == [old.question.id]
    assert [g.question_id for g in core.take(1, 2, 0)] == [new1.question.id, new2.question.id]  # then arrival order
    core.set_version(2)
    assert core.lease("g", 1, now=NOW)[0].version == 2
    assert balanced(core)["stale_dropped"] == 0


def test_batch_shares_sum_to_the_batch_and_give_every_shard_with_questions_one():
    assert batch_shares([33, 31], 64) == [33, 31]
    assert batch_shares([10, 10, 10], 16) == [6, 5, 5]  # before: ceil gave 6+6+6 = 18, two groups a step too many
    assert batch_shares([1, 99], 4) == [1, 4] and batch_shares([0, 5], 4) == [0, 4]


def test_a_batch_over_shards_takes_the_oldest_groups_of_all_shards_first():
    """Shard 0 holds one version-3 group and many newer ones, shard 1 only version-3 groups: the batch takes
    every version-3 group (before: shard 0, whose oldest is as old, filled the batch with its newer ones and
    shard 1's aged past max_lag)."""
    counts = [(5, 0, ((3, 1), (4, 2), (5, 2)), ()), (3, 0, ((3, 3),), ())]
    assert plan_take(counts, 0, 0, 4, 0.0, False) == [(1, 0), (3, 0)]
    assert plan_take(counts, 0, 0, 6, 0.0, False) == [(3, 0), (3, 0)]
    assert plan_take(counts, 0, 0, 9, 0.0, False) is None
    assert plan_take([(2, 0), (2, 0)], 0, 0, 3, 0.0, False) == [(2, 0), (1, 0)]  # no versions: in order


def test_mixed_shares_sum_to_the_batch_target():
    assert sum(mixed_shares([6, 5, 5], 8)) == 8 and mixed_shares([1, 1, 1, 1], 2).count(1) == 2
    assert mixed_shares([16], 8) == [8] and mixed_shares([1, 0, 3], 4) == [1, 0, 3]
    assert all(m <= s for m, s in zip(mixed_shares([2, 7, 1], 9), [2, 7, 1]))
    # shares 3/3/2 at 6 mixed: the left-over group moves between shards, so no shard is replay-only for good
    per_version = [mixed_shares([3, 3, 2], 6, v) for v in range(6)]
    assert all(sum(m) == 6 for m in per_version) and per_version[0] != per_version[1]
    assert [sum(m[i] for m in per_version) for i in range(3)] == [14, 13, 9]  # exact: 13.5, 13.5, 9 over 6


@pytest.mark.parametrize("shares, rho, due", [([2, 3, 3], 0.25, [0.5, 0.75, 0.75]), ([1, 3, 4], 0.75, [0.75, 2.25, 3.0])])
def test_each_shards_long_run_replay_part_is_rho_times_its_share(shares, rho, due):
    """Issue 35 (5): the left-over mixed groups go to the shards with the largest accumulated shortfall, so a
    question's replay rate does not depend on its shard's hash. Rotating them equally gave [0.667, 0.667, 0.667]
    and [0.5, 2.5, 3.0] averaged over 60 versions (B = 8)."""
    target = mixed_target(8, rho)
    per_version = [mixed_shares(shares, target, v) for v in range(60)]
    assert all(sum(m) == target for m in per_version)
    assert [sum(m[i] for m in per_version) / 60 for i in range(3)] == pytest.approx(due)
    for v in range(1, 61):  # within one group of the exact part at every version
        assert all(abs(sum(m[i] for m in per_version[:v]) - v * due[i]) < 1 for i in range(3))


@pytest.mark.parametrize("per_shard, batch", [(30, 16), (5, 4)])  # shares 6/5/5, and shares of 1 (4 shards)
def test_the_shards_together_lease_a_whole_batch_of_replays(per_shard, batch):
    """The replay quota is global: the shards' quotas sum to ceil(rho * B), so a synchronous batch has ceil(rho * B)
    mixed groups when every shard has experience. Before, each shard leased at most floor(rho * share): 7 of 8 at
    shares 6/5/5, none at all at shares of 1."""
    shards = 3 if per_shard == 30 else 4
    bcfg = cfg(num_shards=shards, max_lag=0, replay_ratio=0.5, batch_questions=batch, group_size=4,
               collect_before_mixed=True)
    sim = SimRun(bcfg, make_questions(per_shard * shards * 3), mini_batches=1)
    assert sorted(c.batch_share for c in sim.cores) == ([5, 5, 6] if shards == 3 else [1, 1, 1, 1])
    for version in range(3):  # fresh batches: every shard stores experience (2 of 4 correct)
        items = [it for c in sim.cores for it in c.lease("g", 100, now=NOW)]
        sim.submit([group_for(it, 2, version=version) for it in items], NOW)
        assert len(sim.batch(version, version)) == batch
        for c in sim.cores:
            c.set_version(version + 1)
    for c in sim.cores:
        c.set_mixed_mode()
    sim.switch.on = True
    items = [it for c in sim.cores for it in c.lease("g", 100, now=NOW)]
    assert sum(1 for it in items if it.replay is not None) == mixed_target(batch, 0.5)
    sim.submit([group_for(it, 2, version=3) for it in items], NOW)
    got = sim.batch(3, 3)
    assert len(got) == batch and sum(g.mixed for g in got) == mixed_target(batch, 0.5)


def test_a_shard_restarted_from_an_older_snapshot_feeds_no_spurious_zeros_to_the_switch():
    from buffer.batch_plan import zero_signal_news

    n_zero, n_correct, seen = zero_signal_news(None, [(3, 1), (2, 2)])
    assert (n_zero, n_correct) == (5, 3)
    # shard 1 restarted from a snapshot taken before two of its zero-signal groups: its counters went back
    n_zero, n_correct, seen = zero_signal_news(seen, [(4, 1), (1, 1)])
    assert (n_zero, n_correct) == (1, 0)  # before: 0 - 1 = -1 all-correct and 1 - 2 = -1 groups (spurious zeros)
    n_zero, n_correct, _ = zero_signal_news(seen, [(4, 1), (3, 2)])
    assert (n_zero, n_correct) == (2, 1)  # counted from where it restarted
    assert zero_signal_news([], [(4, 1)])[:2] == (0, 0)  # an unmatched (older) state: nothing counted once


def test_zero_signal_counts_never_span_a_shard_restart():
    """Issue 35 (7): restored counters that passed the seen values before the next batch gave differences spanning
    the restart: ([[10, 2]], [(11, 5)]) counted 1 zero-signal group of which 3 all correct (three 1.0 accuracies
    fed to the switch, no 0.0). The shard's incarnation (new after a restart from a snapshot) tells them apart, and
    the all-correct count is capped at the zero-signal count."""
    from buffer.batch_plan import zero_signal_news

    assert zero_signal_news([[10, 2, 7]], [(11, 5, 8)])[:2] == (0, 0)  # restarted: nothing this time
    n_zero, n_correct, seen = zero_signal_news([[10, 2, 7]], [(11, 5, 7)])
    assert (n_zero, n_correct) == (1, 1) and seen == [[11, 5, 7]]  # capped
    assert zero_signal_news(seen, [(14, 6, 7)])[:2] == (3, 1)
    assert zero_signal_news(None, [(3, 1, 9)])[:2] == (3, 1)  # nothing seen yet: every count is new


def test_a_second_take_round_never_replays_a_question_already_in_the_batch():
    """A shard that restarted from an older snapshot may hold a re-leased replay of a question the batch already
    took in its first round: `take` with that question excluded leaves it ready (for a later batch)."""
    core = ShardCore(cfg(collect_before_mixed=True, max_lag=1, batch_questions=4), make_questions(30))
    items = core.lease("g", 4, now=NOW)
    core.submit([group_for(it, 2) for it in items], now=NOW)
    core.take(0, 4, 0)
    core.set_mixed_mode()
    core.set_version(1)
    replay = [it for it in core.lease("g", 8, now=NOW) if it.replay is not None]
    core.submit([group_for(it, 2, version=1) for it in replay], now=NOW)
    qids = [it.question.id for it in replay]
    assert len(qids) >= 2
    got = core.take(1, 0, 8, exclude={qids[0]})
    assert qids[0] not in [g.question_id for g in got] and all(g.mixed for g in got)
    assert [x.group.question_id for x in core.ready_mixed] == [qids[0]]  # still ready
    assert [g.question_id for g in core.take(1, 0, 8)] == [qids[0]]
    balanced(core)


def _timed_run(gen_speed: float, seed: int, hold: bool = True, steps: int = 40) -> dict[str, float]:
    """The paper's asynchronous settings (2 shards, max_lag 1, rho 0.5, B = 16, K = 8, 2 mini-batches) in ticks, at a
    set relative speed: a learner step takes 10 ticks, and 4 generators, each with 8 slots of continuous batching,
    start a group whenever a slot is free and the window leases them one, on the newest published weights (never
    older than the item's `min_weights`), and finish it after a length drawn anew for each group (0.5-1.5 x the
    mean), so groups finish out of order. `gen_speed`: the groups the generators finish per learner step, in
    batches (5: five times what the learner trains). Returns the accounting summed over shards, the generators'
    busy fraction (slots generating) and `hold` seconds (ticks) the batches were held for groups in flight."""
    rng = random.Random(seed)
    bcfg = cfg(num_shards=2, max_lag=1, replay_ratio=0.5, batch_questions=16, group_size=8, lease_timeout_s=86400.0,
               max_traj_per_question=8)
    sim = SimRun(bcfg, make_questions(400), 2)
    learn_ticks, gens, slots = 10, 4, 8
    mean_len = gens * slots * learn_ticks / (gen_speed * bcfg.batch_questions)  # ticks per group per slot
    busy = [[None] * slots for _ in range(gens)]  # (item, weights, done at) per slot
    version, published, tick, learning_until, batches = 0, 0, 0, None, 0
    busy_ticks = held = 0
    while batches < steps:
        tick += 1
        for g in range(gens):
            for s in range(slots):
                work = busy[g][s]
                if work is not None and work[2] <= tick:  # done: scored on the weights it started on
                    it, w, _ = work
                    acc = 0.2 if batches < 4 else 0.5
                    sim.submit([group_for(it, sum(rng.random() < acc for _ in range(it.num_samples)), version=w,
                                          seed=rng.randint(0, 99),
                                          entropies=[rng.random() for _ in range(it.num_samples)])], tick)
                    busy[g][s] = work = None
                if work is None:
                    items = sim.lease(1, tick)
                    if items and items[0].min_weights <= published:
                        busy[g][s] = (items[0], published, tick + max(1, round(mean_len * rng.uniform(0.5, 1.5))))
                    elif items:  # leased ahead of the newest weights: starts when they are published
                        busy[g][s] = (items[0], items[0].min_weights, tick + learn_ticks
                                      + max(1, round(mean_len * rng.uniform(0.5, 1.5))))
                busy_ticks += busy[g][s] is not None
        if learning_until is not None and tick >= learning_until:
            learning_until, version, published = None, version + 1, version + 1
            for c in sim.cores:
                c.set_version(version)
        if learning_until is None:
            counts = [c.ready_summary(version) for c in sim.cores]
            in_flight = sum(c.last_chance_in_flight(version) for c in sim.cores) if hold else 0
            if plan_take(counts, 0, 0, 16, 0.5, sim.switch.on, version - 1, in_flight) is None and \
                    plan_take(counts, 0, 0, 16, 0.5, sim.switch.on, version - 1) is not None:
                held += 1
            batch = sim.batch(version, batches) if hold else _batch_without_hold(sim, version, batches)
            if batch:
                assert len(batch) == 16 and all(version - r.version <= 1 for g in batch for r in g.rollouts)
                sim.learn(batch, version)
                batches += 1
                learning_until = tick + learn_ticks
        for c in sim.cores:
            balanced(c)
    out = {k: float(sum(c.accounting()[k] for c in sim.cores)) for k in ("trained", "stale_dropped", "issued")}
    out.update(busy=busy_ticks / (tick * gens * slots), held=float(held), ticks=float(tick),
               throttled=float(sum(c.n.lease_requests_throttled for c in sim.cores)))
    return out


def _batch_without_hold(sim: SimRun, version: int, batch_index: int):
    """SimRun.batch as it was before the hold: batches formed from what is ready, whatever is in flight."""
    last_chance = ShardCore.last_chance_in_flight
    try:
        ShardCore.last_chance_in_flight = lambda self, v: 0
        return sim.batch(version, batch_index)
    finally:
        ShardCore.last_chance_in_flight = last_chance


@pytest.mark.parametrize("gen_speed", [5.0, 1.0, 0.2])
def test_nothing_goes_stale_whether_generators_are_faster_or_slower_than_the_learner(gen_speed):
    """Issue 58: at the paper's settings, with the generators 5x faster than the learner, as fast, and 5x slower,
    at most 2% of trained groups go stale (over 3 seeds): every leased item has a place in a batch within max_lag
    (the back-pressure window), batches take the oldest groups first, and a batch whose last chance it is to train
    groups still in flight waits for them instead of filling their places with newer ones."""
    for seed in range(3):
        r = _timed_run(gen_speed, seed)
        assert r["trained"] >= 40 * 16
        assert r["stale_dropped"] <= 0.02 * r["trained"], (gen_speed, seed, r)


def test_without_the_hold_slow_generators_lose_groups_to_staleness():
    """The simulation above can fail: batches formed from what is ready while older groups are still generated
    (as before issue 58) leave those to go stale when the generators are slower than the learner."""
    dropped = [_timed_run(0.2, seed, hold=False) for seed in range(3)]
    assert sum(r["stale_dropped"] for r in dropped) > 0.02 * sum(r["trained"] for r in dropped), dropped


def test_a_batch_waits_for_its_last_chance_groups_at_most_last_chance_wait_s(monkeypatch, caplog):
    """The wait is bounded (a generator that stalls, or died unseen, holding such a lease): past
    buffer.last_chance_wait_s of one version's batch, it is formed without them, said once; the next version waits
    again; 0 never waits. Driven by a clock set by hand."""
    import logging

    import buffer.client as client_module
    from buffer.client import BufferClient

    clock = [100.0]
    monkeypatch.setattr(client_module.time, "monotonic", lambda: clock[0])
    c = BufferClient([object()], cfg=cfg(last_chance_wait_s=30.0), run="r", namespace=None)
    with caplog.at_level(logging.WARNING, logger="buffer.client"):
        assert c._may_hold(3)
        clock[0] += 45.0  # a batch that waited 45 s with nothing in flight (slow generators) was never held:
        assert c._may_hold(3)  # its hold has not begun, and nothing is said
        c._hold_begins(3, clock[0])  # now it is whole without groups in flight at their last chance
        clock[0] += 29.9
        assert c._may_hold(3)
        c._hold_begins(3, clock[0])  # a later get_batch call for it does not restart the clock
        clock[0] += 0.2
        assert not c._may_hold(3) and not c._may_hold(3)
        assert c._may_hold(4)  # the next version's batch
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "batch 3 waited 30 s" in said[0] and "buffer.last_chance_wait_s" in said[0], said
    never = BufferClient([object()], cfg=cfg(last_chance_wait_s=0.0), run="r", namespace=None)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="buffer.client"):
        assert not any(never._may_hold(v) for v in range(5))  # 0 never waits, and says nothing at every step
    assert caplog.records == []
