"""A generator's in-flight work: each leased item is in exactly one place until it is submitted or returned."""

from __future__ import annotations

import threading

from actors.in_flight import InFlight
from common.messages import Question, WorkItem, int32_array


def item(lease: str, samples: int = 2, min_weights: int = 0, deadline: float = 100.0) -> WorkItem:
    q = Question(id=f"q-{lease}", prompt="p", answer="1", prompt_ids=int32_array([1, 2]))
    return WorkItem(lease, q, samples, deadline, 0, None, 0, min_weights=min_weights)


def test_items_move_from_engine_or_hold_to_the_scorer_and_out():
    work = InFlight()
    start = work.add([item("a"), item("b", min_weights=3, deadline=100.0)], engine_version=2, now=0.0)
    assert [it.lease_id for it in start] == ["a"] and work.holding and work.in_engine() == 2
    assert work.due(engine_version=2, now=10.0) == []  # its weights are not there, its wait (until 50) not over
    assert [it.lease_id for it in work.due(engine_version=3, now=10.0)] == ["b"] and not work.holding
    work.finished("a", 0, "s0")
    assert work.unsubmitted == 0  # one sample of two: still in the engine
    work.finished("a", 1, "s1")
    work.finished("b", 1, "t1")
    work.finished("b", 0, "t0")
    assert work.unsubmitted == 2 and work.in_engine() == 0
    batch = work.next_batch()
    assert [g.item.lease_id for g in batch] == ["a", "b"] and batch[0].samples == ["s0", "s1"]
    work.scored(batch)
    assert work.unsubmitted == 0
    work.close()
    assert work.next_batch() is None


def test_a_held_item_starts_behind_its_weights_once_half_its_lease_has_passed():
    work = InFlight()
    work.add([item("a", min_weights=5, deadline=100.0)], engine_version=1, now=0.0)
    assert work.due(engine_version=1, now=49.0) == []
    assert [it.lease_id for it in work.due(engine_version=1, now=50.0)] == ["a"]


def test_unfinished_takes_every_item_from_every_place_once():
    work = InFlight()
    work.add([item("engine"), item("held", min_weights=9), item("queued", samples=1), item("scoring", samples=1)],
             engine_version=0, now=0.0)
    work.finished("scoring", 0, "x")
    batch = work.next_batch()
    assert [g.item.lease_id for g in batch] == ["scoring"]
    work.finished("queued", 0, "y")
    assert sorted(it.lease_id for it in work.unfinished()) == ["engine", "held", "queued", "scoring"]
    assert work.unfinished() == [] and work.in_engine() == 0 and not work.holding
    assert not work.abandon(batch)  # a stop took its leases: the scorer must not return them again


def test_the_end_comes_after_the_groups_queued_before_it():
    work = InFlight()
    work.add([item("a", samples=1)], engine_version=0, now=0.0)
    work.finished("a", 0, "x")
    work.close()
    got = []
    t = threading.Thread(target=lambda: got.extend(iter(work.next_batch, None)))
    t.start()
    t.join(10)
    assert [[g.item.lease_id for g in b] for b in got] == [["a"]]
