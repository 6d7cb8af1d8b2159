"""ShardCore: issuing, leases, back-pressure, ready queues, batches, switch, accounting."""

import random

import pytest

from buffer.core import ShardCore
from common.config import BufferConfig
from tests.buffer.helpers import group_for, make_questions

NOW = 1000.0


def cfg(**kw) -> BufferConfig:
    base = dict(group_size=4, batch_questions=4, replay_ratio=0.5, max_lag=1, switch_window=2,
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
    core = ShardCore(cfg(collect_before_mixed=True), make_questions(20))
    a, b, c = core.lease("g", 3, now=NOW)
    out = core.submit([group_for(a, 4), group_for(b, 0), group_for(c, 2)], now=NOW)
    assert out == {"accepted": 1, "zero_signal": 2, "rejected": 0, "late": 0, "mixed_mode": 1}
    assert a.question.id in core.store.retired  # all correct: retired although kept out of batches
    assert core.store.total == 2 and len(core.ready_fresh) == 1
    assert balanced(core)["zero_signal"] == 2
    keep = ShardCore(cfg(drop_zero_signal=False), make_questions(20))
    [x] = keep.lease("g", 1, now=NOW)
    keep.submit([group_for(x, 0)], now=NOW)
    assert len(keep.ready_fresh) == 1 and keep.n["zero_signal_seen"] == 1 and keep.n["zero_signal"] == 0


def test_retired_question_is_not_issued_fresh_again():
    core = ShardCore(cfg(batch_questions=100, max_lag=0), make_questions(3))
    items = core.lease("g", 3, now=NOW)
    core.submit([group_for(items[0], 4)], now=NOW)
    core.return_leases([it.lease_id for it in items[1:]])
    ids = [it.question.id for it in core.lease("g", 50, now=NOW)]
    assert items[0].question.id not in ids and len(ids) == 50


def test_switch_needs_a_full_window_and_stays_on():
    # window 2, threshold 0.35: accuracies 0.5 (window not full) -> off; then 0.25 -> mean 0.375 -> on
    core = ShardCore(cfg(switch_window=2, batch_questions=50), make_questions(20))
    a, b, c, d = core.lease("g", 4, now=NOW)
    core.submit([group_for(a, 2)], now=NOW)
    assert not core.mixed_mode
    core.submit([group_for(b, 1)], now=NOW)
    assert core.mixed_mode
    core.submit([group_for(c, 0), group_for(d, 0)], now=NOW)  # moving accuracy falls to 0: stays on
    assert core.mixed_mode
    core2 = ShardCore(cfg(switch_window=2, batch_questions=50), make_questions(20))
    a, b = core2.lease("g", 2, now=NOW)
    core2.submit([group_for(a, 1), group_for(b, 1)], now=NOW)  # mean 0.25: off
    assert not core2.mixed_mode


def test_collection_starts_with_mixed_mode():
    core = ShardCore(cfg(switch_window=1, mixed_switch_accuracy=0.6, batch_questions=50), make_questions(20))
    a, b = core.lease("g", 2, now=NOW)
    core.submit([group_for(a, 2)], now=NOW)  # accuracy 0.5: off, nothing stored
    assert not core.mixed_mode and core.store.total == 0
    assert all(r.key == "" for r in core.ready_fresh[0].group.rollouts)
    core.submit([group_for(b, 3)], now=NOW)  # 0.75 > 0.6: on, this group's 3 correct rollouts are stored
    assert core.mixed_mode and core.store.total == 3
    keys = [r.key for r in core.ready_fresh[1].group.rollouts]
    assert all(keys[:3]) and keys[3] == ""


def _mixed_core(**kw) -> ShardCore:
    core = ShardCore(cfg(collect_before_mixed=True, **kw), make_questions(40))
    core.set_mixed_mode()
    return core


def test_replay_item_is_joined_into_a_mixed_group_of_k():
    core = _mixed_core()
    [a] = core.lease("g", 1, now=NOW)
    core.submit([group_for(a, 2, entropies=[0.9, 0.3, 1.0, 1.0])], now=NOW)
    core.take(0, 1, 0)
    items = core.lease("g", 2, now=NOW)
    replay = [it for it in items if it.replay is not None]
    assert len(replay) == 1 and replay[0].num_samples == 3 and replay[0].question.id == a.question.id
    stored = core.store.entries[a.question.id].recs
    assert replay[0].replay.entropy == pytest.approx(0.3)  # the lowest-entropy stored trajectory
    core.submit([group_for(replay[0], 1, version=1, seed=5)], now=NOW)
    g = core.ready_mixed[0].group
    assert g.mixed and len(g.rollouts) == 4
    old = g.rollouts[-1]
    assert old.replayed and old.key == replay[0].replay.key and old.version == 0 and old.reward == 1.0
    assert old.logprobs.tolist() == [-0.5] * 3 and len(stored) == 3  # k = 1 fresh + 1 replayed = 2 -> bucket 2
    assert core.store.entries[a.question.id].bucket == 2
    assert core.ready_mixed[0].version == 1  # staleness counts the fresh rollouts only


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


@pytest.mark.parametrize("max_lag,replay_ratio,seed", [(0, 0.5, 0), (0, 0.25, 1), (1, 0.5, 2), (2, 0.75, 3)])
def test_simulated_run_never_deadlocks_and_accounts_for_everything(max_lag, replay_ratio, seed):
    """Generators with random delays, failures and zero-signal groups; a learner that steps the version."""
    rng = random.Random(seed)
    core = ShardCore(cfg(max_lag=max_lag, replay_ratio=replay_ratio, batch_questions=6, switch_window=4,
                         lease_timeout_s=5.0, group_size=4), make_questions(60))
    skill = {f"q{i}": rng.uniform(0.1, 0.8) for i in range(60)}
    version, now, in_flight, batches = 0, NOW, [], 0
    for _ in range(3000):
        now += 0.1
        in_flight += [(it, version) for it in core.lease("g", rng.randint(0, 4), now=now)]
        rng.shuffle(in_flight)
        n_done = rng.randint(0, 3)
        done, in_flight = in_flight[:n_done], in_flight[n_done:]
        groups = []
        for it, v in done:
            if rng.random() < 0.05:
                continue  # generator died: the lease will expire
            n_ok = sum(rng.random() < skill[it.question.id] for _ in range(it.num_samples))
            groups.append(group_for(it, n_ok, version=v, seed=rng.randint(0, 3)))
        core.submit(groups, now=now)
        batch = core.batch(version)
        if batch:
            assert len(batch) == 6
            batches += 1
            version += 1
            core.set_version(version)
        balanced(core)
    assert batches > 50, core.accounting()
    assert core.mixed_mode and core.n["trained_mixed"] > 0


def test_collect_off_is_plain_grpo_nothing_stored_nothing_retired():
    core = ShardCore(cfg(collect=False, replay_ratio=0.0, collect_before_mixed=True), make_questions(8))
    items = core.lease("g", 4, now=NOW)
    core.submit([group_for(it, 2) for it in items[:2]] + [group_for(it, 4) for it in items[2:]], now=NOW)
    m = core.metrics()
    assert m["stored_trajectories"] == 0 and m["retired"] == 0
    groups = core.take(0, 4, 0)
    assert all(not r.key for g in groups for r in g.rollouts)  # nothing to rank, no feedback keys
    balanced(core)
