"""Named sets of overrides an experiment variant takes with `preset: NAME` (docs/reference.md, Comparing variants
fairly; docs/algorithm.md says where each departs from the project's defaults)."""

from __future__ import annotations

from typing import Any

_PAPER = {
    "buffer.max_lag": 0,  # synchronous: generate, then train
    "buffer.mixed_switch_accuracy": 0.35,  # the delayed start at the paper's threshold
    "learner.batching.mini_batches": 2,  # two optimizer updates per batch
    "learner.loss.recompute_old_logprobs": True,  # π_old recomputed (and stored with the learner's trajectories)
}
PRESETS: dict[str, dict[str, Any]] = {
    "exgrpo_paper": {**_PAPER, "learner.loss.clip_fresh": "auto"},  # fresh tokens unclipped once mixed mode is on
    "grpo_paper": {**_PAPER, "learner.loss.clip_fresh": True, "buffer.replay_ratio": 0, "buffer.collect": False},
}
"""Named settings a variant takes with `preset: NAME` (applied after the spec's base, before the variant's own
overrides). exgrpo_paper is the paper's ExGRPO at the project's scale (docs/algorithm.md, The paper's settings):
synchronous, the delayed start at batch accuracy 0.35, 2 mini-batches, π_old recomputed, fresh tokens clipped until
mixed mode starts and unclipped after. grpo_paper is on-policy GRPO under the same settings, its clip kept (GRPO's
buffer switches mixed mode on too, and `learner.loss.clip_fresh=auto` would unclip it: refused by the config)."""
