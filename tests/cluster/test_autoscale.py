"""The autoscale policy as a pure decision (the driver applies it through the control actor)."""

from __future__ import annotations

from cluster.autoscale import autoscale_target
from common.config import AutoscaleConfig

A = AutoscaleConfig(enabled=True, min_generators=1, max_generators=3, learner_wait_fraction_up=0.5,
                    generator_wait_fraction_down=0.5)


def test_adds_a_generator_while_the_learner_waits_and_cpus_are_free():
    assert autoscale_target(A, 1, learner_wait=0.8, generator_wait=0.0, free_cpus=1.0, cpus_per_generator=1.0) == 2


def test_does_not_add_without_free_cpus_or_beyond_max():
    assert autoscale_target(A, 1, 0.8, 0.0, free_cpus=0.5, cpus_per_generator=1.0) == 1
    assert autoscale_target(A, 3, 0.8, 0.0, free_cpus=8.0, cpus_per_generator=1.0) == 3


def test_removes_a_generator_while_generators_wait_for_work_but_not_below_min():
    assert autoscale_target(A, 3, learner_wait=0.1, generator_wait=0.7, free_cpus=0, cpus_per_generator=1) == 2
    assert autoscale_target(A, 1, 0.1, 0.9, 0, 1) == 1


def test_balanced_load_changes_nothing_and_bounds_are_restored():
    assert autoscale_target(A, 2, 0.3, 0.3, 4, 1) == 2
    assert autoscale_target(A, 0, 0.0, 0.0, 4, 1) == 1
    assert autoscale_target(A, 5, 0.0, 0.0, 4, 1) == 3
