"""What one learner step's batch says, as metrics (the driver adds its own clocks and the components' counters).

    out, lags = batch_metrics(batch, max_new_tokens)   # train/*, staleness/*, response lengths of fresh rollouts
    out.update(prefixed("learner/", result.metrics))   # numeric entries under a prefix
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np

from common.messages import TrainingBatch


def batch_metrics(batch: TrainingBatch, max_new_tokens: int) -> tuple[dict[str, float], Counter[int]]:
    """The batch's rewards, mix and staleness from its fresh rollouts (replayed ones were sampled long ago), and
    {lag: rollouts} (learner steps between sampling and training)."""
    fresh = [r for g in batch.groups for r in g.rollouts if not r.replayed]
    lags = Counter(batch.version - r.version for r in fresh)
    mixed = sum(g.mixed for g in batch.groups)
    out: dict[str, float] = {
        "train/reward_mean": float(np.mean([r.reward for r in fresh])) if fresh else 0.0,
        "train/accuracy_fresh": float(np.mean([r.correct for r in fresh])) if fresh else 0.0,
        "train/mixed_groups": float(mixed),
        "train/groups": float(len(batch.groups)),
        "train/replay_fraction": mixed / max(1, len(batch.groups)),
        "staleness/mean": sum(k * n for k, n in lags.items()) / len(fresh) if fresh else 0.0,
        "staleness/spanning_fraction": (sum(r.newest_version != r.version for r in fresh) / len(fresh)
                                        if fresh else 0.0),  # partial rollouts: weights changed mid-sample
        "train/switch_accuracy": batch.stats.get("switch_accuracy", 0.0),
        "train/mixed_mode": batch.stats.get("mixed_mode", 0.0),
    }
    out.update({f"staleness/lag_{k}": float(v) for k, v in lags.items()})
    out.update(length_metrics(fresh, max_new_tokens))
    return out, lags


def length_metrics(rollouts, max_new_tokens: int) -> dict[str, float]:
    """Response lengths of a batch's fresh rollouts (tokens): mean, p90, max; the share truncated at
    `max_new_tokens` (finish reason `length`) and the mean reward of truncated and untruncated ones
    (NaN when there are none: not logged)."""
    if not rollouts:
        return {}
    lengths = np.array([len(r.response_ids) for r in rollouts], dtype=np.float64)  # [N]
    cut = np.array([r.finish_reason == "length" for r in rollouts])  # [N]
    rewards = np.array([r.reward for r in rollouts], dtype=np.float64)  # [N]
    nan = float("nan")
    return {
        "train/response_length_mean": float(lengths.mean()),
        "train/response_length_p90": float(np.percentile(lengths, 90)),
        "train/response_length_max": float(lengths.max()),
        "train/truncated_fraction": float(cut.mean()),
        "train/reward_truncated": float(rewards[cut].mean()) if cut.any() else nan,
        "train/reward_untruncated": float(rewards[~cut].mean()) if (~cut).any() else nan,
        "train/max_new_tokens": float(max_new_tokens),
    }


def prefixed(prefix: str, d: dict[str, Any]) -> dict[str, float]:
    """Numeric entries of d, keys under `prefix` (kept as they are when they already carry it)."""
    return {(k if k.startswith(prefix) else prefix + k): float(v) for k, v in d.items()
            if isinstance(v, (int, float, np.integer, np.floating))}
