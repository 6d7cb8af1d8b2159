"""SU-01's thresholds as settings: buffer.store_below (store only from groups with few correct) and
buffer.retire_above (retire before all K are correct), on a real ShardCore."""

import pytest

from buffer.core import ShardCore
from common.config import BufferConfig
from tests.buffer.helpers import group_for, make_questions

NOW = 1000.0


def core_with(n: int, **kw) -> ShardCore:
    cfg = BufferConfig(group_size=8, batch_questions=100, replay_ratio=0.5, max_lag=0, collect_before_mixed=True,
                       lease_timeout_s=10.0, seed=0, **kw)
    return ShardCore(cfg, make_questions(n))


def submit(core: ShardCore, correct: dict[str, int], seed: int = 0) -> None:
    items = {it.question.id: it for it in core.lease("g", len(correct), now=NOW)}
    core.submit([group_for(items[q], k, seed=seed) for q, k in correct.items()], now=NOW)


def test_store_below_2_stores_only_groups_with_one_correct_and_still_moves_the_bucket():
    # K = 8, SU-01's experience_in_threshold = 2: q0 (1 of 8) stores its one correct rollout in bucket 1; q1 (2 of 8)
    # and q2 (7 of 8) store nothing and are not entered. Next epoch q0 has 3 of 8: nothing more stored, bucket 3.
    core = core_with(3, store_below=2)
    submit(core, {"q0": 1, "q1": 2, "q2": 7})
    assert set(core.store.entries) == {"q0"} and len(core.store.entries["q0"].recs) == 1
    assert core.store.entries["q0"].bucket == 1
    submit(core, {"q0": 3, "q1": 1, "q2": 1}, seed=5)
    assert len(core.store.entries["q0"].recs) == 1 and core.store.entries["q0"].bucket == 3
    assert {q: len(e.recs) for q, e in core.store.entries.items()} == {"q0": 1, "q1": 1, "q2": 1}
    default = core_with(1)  # ExGRPO's: every correct rollout of a group not all correct
    submit(default, {"q0": 7})
    assert len(default.store.entries["q0"].recs) == 7


def test_retire_above_4_retires_at_5_of_8():
    # SU-01's exgrpo_retire_threshold = 4: more than 4 of 8 correct retires (its trajectories deleted, never issued
    # fresh again); 4 of 8 does not. ExGRPO's default retires only at 8 of 8.
    core = core_with(3, retire_above=4)
    submit(core, {"q0": 4, "q1": 5, "q2": 8})
    assert core.store.retired == {"q1", "q2"} and set(core.store.entries) == {"q0"}
    assert {it.question.id for it in core.lease("g", 10, now=NOW)} == {"q0"}
    default = core_with(2)
    submit(default, {"q0": 5, "q1": 8})
    assert default.store.retired == {"q1"}


@pytest.mark.parametrize("kw, says", [
    (dict(retire_above=8), "buffer.retire_above=8: more than 8 of buffer.group_size=8 can never be correct; use 1..7"),
    (dict(store_below=9), "buffer.store_below=9: a group has 8 rollouts (buffer.group_size); use 2..8"),
    (dict(retire_above=4, retire=False), "buffer.retire_above=4: buffer.retire=false retires nothing"),
    (dict(store_below=2, collect=False, replay_ratio=0), "buffer.store_below=2: buffer.collect=false stores and "
                                                         "retires nothing"),
])
def test_thresholds_outside_a_group_or_beside_a_mode_that_ignores_them_are_refused(kw, says):
    with pytest.raises(ValueError, match=says.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        BufferConfig(group_size=8, **kw)
