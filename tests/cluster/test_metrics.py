"""Per-step metrics the driver derives from a batch, as pure functions (hand-worked numbers)."""

from __future__ import annotations

import math

import numpy as np

from cluster.step_metrics import length_metrics
from common.messages import Rollout


def _ro(n: int, reward: float, finish: str) -> Rollout:
    return Rollout(response_ids=np.zeros(n, np.int32), logprobs=np.zeros(n, np.float32), reward=reward,
                   correct=reward >= 1, entropy=0.0, version=0, finish_reason=finish)


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
