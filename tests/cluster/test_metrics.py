"""Per-step metrics the driver derives from a batch, as pure functions (hand-worked numbers)."""

from __future__ import annotations

import math

import numpy as np

from cluster.step_metrics import batch_metrics, length_metrics, prefixed
from common.messages import Rollout, TrainGroup, TrainingBatch


def _ro(n: int, reward: float, finish: str, version: int = 0, **kw) -> Rollout:
    return Rollout(response_ids=np.zeros(n, np.int32), logprobs=np.zeros(n, np.float32), reward=reward,
                   correct=reward >= 1, entropy=0.0, version=version, finish_reason=finish, **kw)


def test_response_lengths_and_truncation():
    # lengths 10, 20, 30, 40; only the finish reason says which were cut
    batch = [_ro(10, 1.0, "stop"), _ro(20, 0.0, "stop"), _ro(30, 1.0, "stop"), _ro(40, 0.0, "length")]
    m = length_metrics(batch, 40)
    assert m["train/response_length_mean"] == 25 and m["train/response_length_max"] == 40
    assert m["train/response_length_p90"] == 37  # numpy's linear interpolation: 30 + 0.7 * (40 - 30)
    assert m["train/truncated_fraction"] == 0.25
    assert m["train/reward_truncated"] == 0.0 and math.isclose(m["train/reward_untruncated"], 2 / 3)
    none_cut = length_metrics(batch[:3], 40)
    assert math.isnan(none_cut["train/reward_truncated"]) and none_cut["train/truncated_fraction"] == 0
    assert length_metrics([], 40) == {}


def test_batch_metrics_count_fresh_rollouts_only():
    """A batch at version 5: a fresh group (lags 0 and 2, one rollout spanning two versions) and a mixed one whose
    stored trajectory (version 0, replayed) counts in no reward, lag or length."""
    fresh = TrainGroup("q1", np.zeros(2, np.int32), [_ro(10, 1.0, "stop", 5), _ro(20, 0.0, "length", 3,
                                                                                   newest_version=4)], mixed=False)
    mixed = TrainGroup("q2", np.zeros(2, np.int32), [_ro(30, 1.0, "stop", 4), _ro(8, 1.0, "stop", 0, replayed=True)],
                       mixed=True)
    m, lags = batch_metrics(TrainingBatch([fresh, mixed], version=5, stats={"mixed_mode": 1.0}), 20)
    assert lags == {0: 1, 2: 1, 1: 1}
    assert m["staleness/mean"] == 1.0 and m["staleness/lag_2"] == 1.0 and "staleness/lag_5" not in m
    assert math.isclose(m["staleness/spanning_fraction"], 1 / 3)
    assert math.isclose(m["train/reward_mean"], 2 / 3) and m["train/response_length_max"] == 30
    assert m["train/mixed_groups"] == 1.0 and m["train/replay_fraction"] == 0.5 and m["train/mixed_mode"] == 1.0
    assert prefixed("learner/", {"loss": np.float32(0.5), "learner/lr": 1e-6, "note": "x"}) == {
        "learner/loss": 0.5, "learner/lr": 1e-6}
