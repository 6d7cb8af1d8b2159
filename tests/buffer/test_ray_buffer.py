"""The buffer on a real local Ray cluster: shard actors, the client, a kill and restore."""

import pickle
import random
import threading
import time

import numpy as np
import pytest

from buffer.client import BufferClient, BufferUnavailableError
from common.config import BufferConfig
from common.messages import LearnerFeedback, float32_array
from tests.buffer.helpers import group_for, make_questions


def small_cfg(**kw) -> BufferConfig:
    base = dict(num_shards=2, group_size=4, batch_questions=8, replay_ratio=0.5, max_lag=1,
                mixed_switch_accuracy=0.3, lease_timeout_s=20.0, call_timeout_s=10.0, snapshot_every_s=0.5)
    base.update(kw)
    return BufferConfig(**base)


def produce(client: BufferClient, gid: str, stop: threading.Event, version: list[int], seed: int, errors: list):
    """A generator loop: lease, score (fake but real messages), submit; return leases on stop."""
    rng = random.Random(seed)
    try:
        while not stop.is_set():
            items = client.lease(gid, 4)
            if not items:
                time.sleep(0.01)
                continue
            if stop.is_set():
                client.return_leases([it.lease_id for it in items])
                break
            groups = [group_for(it, sum(rng.random() < 0.5 for _ in range(it.num_samples)), version=version[0],
                                seed=rng.randint(0, 5), entropies=[rng.random() for _ in range(it.num_samples)])
                      for it in items]
            client.submit(groups)
    except Exception as e:  # surfaced by the test through `errors`
        errors.append(e)
        raise


def test_concurrent_producers_one_learner_and_exact_accounting(ray_cluster):
    client = BufferClient.create(small_cfg(), make_questions(200), run="conc", namespace=None, snapshot_dir=None)
    stop, version, errors = threading.Event(), [0], []
    workers = [threading.Thread(target=produce, args=(pickle.loads(pickle.dumps(client)), f"g{i}", stop, version, i,
                                                      errors)) for i in range(3)]
    for w in workers:
        w.start()
    mixed_groups, keys_seen = 0, 0
    try:
        for step in range(25):
            batch = client.get_batch(version[0], timeout_s=20)
            assert batch is not None and len(batch.groups) == 8, (step, client.accounting())
            for g in batch.groups:
                assert len(g.rollouts) == (3 if g.mixed else 4) and g.prompt_ids.dtype == np.int32
                assert not any(r.replayed for r in g.rollouts) and bool(g.candidates) == g.mixed
                assert min(r.version for r in g.rollouts) >= version[0] - 1
            replayed = [g.question_id for g in batch.groups if g.mixed]
            assert len(replayed) == len(set(replayed))  # never a question twice among a batch's replays
            mixed_groups += len(replayed)
            keys = [c.key for g in batch.groups for c in g.candidates]  # what the learner scores
            keys_seen += len(keys)
            chosen = [g.candidates[0].key for g in batch.groups if g.mixed]
            fb = LearnerFeedback(version[0], keys, float32_array(np.linspace(0, 1, len(keys))), chosen)
            version[0] += 1
            if step % 2:  # the driver's one call per shard, or the three calls it stands for
                assert client.end_step(fb, version[0])["trained"] == (step + 1) * 8
            else:
                client.feedback(fb)
                client.set_version(version[0])
    finally:
        stop.set()
        for w in workers:
            w.join(timeout=30)
    assert not errors
    acc = client.accounting()
    assert acc["balance"] == 0, acc
    assert acc["trained"] == 25 * 8
    assert acc["issued"] == acc["trained"] + acc["stale_dropped"] + acc["zero_signal"] + acc["lost"] + acc["outstanding"] + acc["ready"]
    m = client.metrics()
    assert m["mixed_mode"] == 1 and mixed_groups > 0 and keys_seen > 0
    assert m["feedback_applied"] > 0 and m["replay_fraction"] == pytest.approx(mixed_groups / 200)
    assert m["chosen"] + m["chosen_gone"] == mixed_groups  # each trained replay counted once, when trained
    per = client.shard_metrics()
    assert all(p["mixed_mode"] == 1 for p in per)  # the run-wide switch reached every shard
    assert sum(p["trained"] for p in per) == 200 and all(p["issued"] > 0 for p in per)
    client.shutdown()


def test_shards_not_started_within_the_start_bound_are_named(ray_cluster):
    """The start waits for the shards' workers (and a snapshot's restore) up to buffer.start_timeout_s, not the
    per-call bound, and names the shards that were not ready (1 ms: no worker process starts that fast)."""
    with pytest.raises(BufferUnavailableError, match=r"buffer start: shard\(s\) \[0, 1\] of run 'slow' not ready "
                                                     r"within buffer.start_timeout_s=0.001s"):
        BufferClient.create(small_cfg(start_timeout_s=0.001), make_questions(20), run="slow", namespace=None,
                            snapshot_dir=None)


def test_shard_killed_restores_from_snapshot_and_client_errors_clearly(ray_cluster, tmp_path):
    import ray

    cfg = small_cfg(num_shards=1, call_timeout_s=5.0, snapshot_every_s=600, collect_before_mixed=True)
    client = BufferClient.create(cfg, make_questions(40), run="kill", namespace=None, snapshot_dir=str(tmp_path))
    items = client.lease("g0", 8)
    client.submit([group_for(it, 2) for it in items[:6]])
    at_snapshot = client.snapshot(str(tmp_path))  # the accounting of exactly the state written
    before_acc, before = client.accounting(), client.metrics()
    assert at_snapshot == before_acc
    assert before["stored_trajectories"] == 12 and before_acc["outstanding"] == 2
    client.lease("g0", 2)  # after the snapshot: lost in the crash, its questions come round again

    def incarnation() -> int:  # what the client's zero-signal counting sees (issue 35, item 7)
        return ray.get(client.shards[0].wait_ready.remote(0, 0, 0.0))[7]

    first = incarnation()
    ray.kill(client.shards[0], no_restart=False)
    deadline = time.monotonic() + 30
    unavailable = 0
    while True:  # ray.kill is asynchronous: wait until the restarted shard answers
        try:
            after = client.metrics()
            if after["restored"] == 1:
                break
        except BufferUnavailableError as e:
            assert "buffer metrics" in str(e)
            unavailable += 1
        assert time.monotonic() < deadline, "shard did not come back"
        time.sleep(0.1)
    assert client.accounting() == before_acc
    assert incarnation() != first  # restarted from a snapshot: its counters cannot be matched to what was seen
    assert client.restore(str(tmp_path)) == 0  # the switch state travels with the buffer snapshot
    assert client.accounting() == before_acc
    assert incarnation() == first  # restored with the client's state of the same checkpoint: they match again
    assert after["stored_trajectories"] == 12 and after["bucket_2"] == before["bucket_2"]
    # the two leases from before the snapshot are still known and can be completed
    out = client.submit([group_for(it, 1) for it in items[6:]])
    assert out["accepted"] + out["zero_signal"] == 2
    batch = client.get_batch(0, timeout_s=5)
    assert batch is not None and len(batch.groups) == 8
    assert client.accounting()["balance"] == 0

    # a shard that is gone for good: a clear error within the timeout, not a hang
    ray.kill(client.shards[0], no_restart=True)
    with pytest.raises(BufferUnavailableError, match="dead or restarting|did not answer"):
        client.get_batch(1, timeout_s=1)


def test_resume_ends_exactly_the_leases_the_snapshot_held(ray_cluster, tmp_path):
    """A checkpoint records the accounting of the states it wrote; resuming from it (`expire_leases`) ends
    exactly its outstanding leases as expired and reissues their questions. Leases issued after the snapshot
    are not in it: their generators' late submissions are counted and discarded."""
    client = BufferClient.create(small_cfg(), make_questions(60), run="resume", namespace=None, snapshot_dir=None)
    items = client.lease("g0", 8)
    client.submit([group_for(it, 2) for it in items[:5]])
    at_ckpt = client.snapshot(str(tmp_path))
    assert at_ckpt == client.accounting() and at_ckpt["outstanding"] == len(items) - 5 and at_ckpt["balance"] == 0
    later = client.lease("g1", 4)  # after the cut
    assert later and client.accounting()["outstanding"] == at_ckpt["outstanding"] + len(later)

    assert client.restore(str(tmp_path), expire_leases=True) == at_ckpt["outstanding"]
    acc = client.accounting()
    assert acc["outstanding"] == 0 and acc["balance"] == 0
    assert acc["expired"] == at_ckpt["expired"] + at_ckpt["outstanding"]
    assert acc["reissued"] == at_ckpt["reissued"] + at_ckpt["outstanding"]
    assert acc["issued"] == at_ckpt["issued"]
    out = client.submit([group_for(it, 1) for it in items[5:] + later])  # old generators answering late
    assert out["late"] == len(items) - 5 + len(later)
    client.shutdown()


def test_client_in_a_remote_task_and_connect_by_name(ray_cluster):
    import ray

    cfg = small_cfg(num_shards=2)
    client = BufferClient.create(cfg, make_questions(30), run="named", namespace=None, snapshot_dir=None)

    @ray.remote(num_cpus=0)
    def generator(c: BufferClient) -> dict:
        items = c.lease("remote-gen", 6)
        return c.submit([group_for(it, 1) for it in items])

    out = ray.get(generator.remote(client), timeout=60)
    assert out["accepted"] == 6
    again = BufferClient.connect("named", None, 2, cfg=cfg)
    assert again.accounting()["ready"] == 6
    with pytest.raises(BufferUnavailableError, match="not found"):
        BufferClient.connect("nope", None, 1)
    client.shutdown()


def test_an_idle_generator_long_polls_one_shard_and_gets_work_as_soon_as_it_comes_back(ray_cluster):
    """With no work anywhere, `lease(wait_s)` makes one waiting call to one shard (not a poll of every shard each
    idle_sleep_s) and returns the work that comes back meanwhile; with none, it returns [] after its bound."""
    client = BufferClient.create(small_cfg(num_shards=1, batch_questions=4, max_lag=0), make_questions(4), run="longpoll",
                                 namespace=None, snapshot_dir=None)
    taken = client.lease("g0", 8)
    assert len(taken) == 4 and client.lease("g1", 4) == []  # the window (one batch at max_lag 0) is all leased
    assert client.lease("g1", 4, wait_s=0.3) == []  # nothing came back within the bound
    before = client.shard_metrics()[0]
    got: list = []
    waiter = threading.Thread(target=lambda: got.extend(client.lease("g1", 4, wait_s=120)))
    waiter.start()
    # driven by progress: the waiting call has reached the shard, then g0 gives its leases back
    deadline = time.monotonic() + 120
    while client.shard_metrics()[0].get("calls_lease_wait", 0) <= before.get("calls_lease_wait", 0):
        assert time.monotonic() < deadline, "the long-poll lease never reached the shard"
        time.sleep(0.05)
    client.return_leases([it.lease_id for it in taken[:2]])
    waiter.join(120)
    assert not waiter.is_alive()
    assert sorted(it.question.id for it in got) == sorted(it.question.id for it in taken[:2])
    after = client.shard_metrics()[0]
    # one non-waiting ask and one waiting call for the whole wait, whatever its length
    assert after["calls_lease_wait"] - before["calls_lease_wait"] == 1
    assert after["calls_lease"] - before["calls_lease"] == 1


def test_the_clip_switch_acts_from_the_batch_after_the_one_that_fired_it(ray_cluster):
    """Issue 35 (3): the batch whose accuracy fires the mixed-mode switch was composed before it (all fresh) and is
    still trained clipped under `learner.loss.clip_fresh=auto` (`batch.mixed_mode`, which the learner reads, is False);
    the next batch is composed in mixed mode and unclipped. Batch accuracies 0.25, 0.5, 0.5, 0.5 at the threshold
    0.3 (window: one batch): the switch fires at batch 1, so the modes are 0, 0, 1, 1 (the official trainer clips
    step 1 and stops from step 2)."""
    client = BufferClient.create(small_cfg(num_shards=1, batch_questions=4), make_questions(40), run="clipswitch",
                                 namespace=None, snapshot_dir=None)
    modes = []
    for version, n_correct in enumerate([1, 2, 2, 2]):
        batch = None
        while batch is None:  # lease and submit until the batch can be composed (ceil(rho B) mixed once it is on)
            items = client.lease("g0", 4)
            client.submit([group_for(it, n_correct, version=version) for it in items])
            batch = client.get_batch(version, timeout_s=0.2)
        assert len(batch.groups) == 4
        assert batch.stats["mixed_mode"] == float(batch.mixed_mode)  # still logged as a metric
        modes.append(batch.mixed_mode)
        client.set_version(version + 1)
    assert modes == [False, False, True, True]
    assert client.switch.on and client.metrics()["mixed_mode"] == 1
    client.shutdown()
