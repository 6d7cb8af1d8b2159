"""The learning-rate schedule: a pure function of the learner step, so a resumed run (whose version is
restored from its checkpoint) continues it exactly.

    lr = learning_rate(cfg.optim, step)    # step: the learner step being trained (its batch's version, 0-based)

Linear warmup over `warmup_steps` (step s gets lr * (s + 1) / warmup_steps), then `lr_schedule`:
constant `lr`, or a linear / cosine decay from `lr` at the end of the warmup to `min_lr` at
`lr_decay_steps`, held there afterwards.
"""

from __future__ import annotations

import math

from common.config import OptimConfig


def learning_rate(opt: OptimConfig, step: int) -> float:
    warmup = opt.warmup_steps
    if step < warmup:
        return opt.lr * (step + 1) / warmup
    if opt.lr_schedule == "constant":
        return opt.lr
    span = max(1, (opt.lr_decay_steps or step + 1) - warmup)
    t = min(1.0, (step - warmup) / span)  # 0 at the end of the warmup, 1 at lr_decay_steps
    frac = 1.0 - t if opt.lr_schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * t))
    return opt.min_lr + (opt.lr - opt.min_lr) * frac
