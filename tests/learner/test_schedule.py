"""The learning-rate schedule, with the numbers worked out by hand, and its resolution in the config."""

from __future__ import annotations

import math

import pytest

from common.config import OptimConfig, RunConfig, load_config
from learner.schedule import learning_rate


def test_warmup_then_constant():
    cfg = OptimConfig(lr=1e-3, warmup_steps=4)
    # steps 0..3 climb by lr/4: 0.25e-3, 0.5e-3, 0.75e-3, 1e-3; then constant
    assert [learning_rate(cfg, s) for s in range(6)] == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3, 1e-3])


def test_linear_and_cosine_decay_to_min_lr_after_warmup():
    lin = OptimConfig(lr=1e-3, min_lr=1e-4, warmup_steps=2, lr_schedule="linear", lr_decay_steps=6)
    # after 2 warmup steps the decay spans steps 2..6: t = 0, 1/4, 1/2, 3/4, 1 -> 1e-4 + 9e-4 * (1 - t)
    assert [learning_rate(lin, s) for s in range(2, 9)] == pytest.approx(
        [1e-3, 7.75e-4, 5.5e-4, 3.25e-4, 1e-4, 1e-4, 1e-4])
    cos = lin.model_copy(update={"lr_schedule": "cosine"})
    # cosine: 1e-4 + 9e-4 * (1 + cos(pi t)) / 2 -> at t = 1/2 exactly halfway, 5.5e-4
    assert learning_rate(cos, 4) == pytest.approx(5.5e-4)
    assert learning_rate(cos, 3) == pytest.approx(1e-4 + 9e-4 * (1 + math.cos(math.pi / 4)) / 2)
    assert learning_rate(cos, 2) == pytest.approx(1e-3) and learning_rate(cos, 9) == pytest.approx(1e-4)


def test_the_config_resolves_the_horizon_and_the_warmup_ratio_once():
    c = load_config(None, ["total_steps=200", "learner.optim.lr_schedule=cosine", "learner.optim.warmup_ratio=0.05"])
    assert (c.learner.optim.lr_decay_steps, c.learner.optim.warmup_steps, c.learner.optim.warmup_ratio) == (200, 10, None)
    again = RunConfig.model_validate({**c.model_dump(), "total_steps": 400})  # a resume raising total_steps
    assert again.learner.optim.lr_decay_steps == 200  # the saved schedule is kept
    assert load_config(None, []).learner.optim.lr_decay_steps is None  # constant, no warmup ratio: nothing to resolve
    with pytest.raises(Exception, match="set one of them"):
        load_config(None, ["learner.optim.warmup_ratio=0.1", "learner.optim.warmup_steps=3"])
    with pytest.raises(Exception, match="learner.optim.min_lr: 0.1 is above learner.optim.lr"):
        load_config(None, ["learner.optim.min_lr=0.1", "learner.optim.lr=0.01"])
