"""The autoscale policy (`cluster.autoscale.*`): a pure function of the driver's measurements."""

from __future__ import annotations


def autoscale_target(a, n: int, learner_wait: float, generator_wait: float, free_cpus: float,
                     cpus_per_generator: float) -> int:
    """The autoscale policy: one generator more while the learner mostly waits for batches and a
    generator's CPUs are free; one fewer while generators mostly wait for work; else unchanged.
    Always within [min_generators, max_generators]."""
    if n < a.min_generators:
        return a.min_generators
    if n > a.max_generators:
        return a.max_generators
    if learner_wait > a.learner_wait_fraction_up and n < a.max_generators and free_cpus >= cpus_per_generator:
        return n + 1
    if generator_wait > a.generator_wait_fraction_down and n > a.min_generators:
        return n - 1
    return n
