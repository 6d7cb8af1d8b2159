"""The generator pool's size while a run goes on: `exgrpo scale` requests (cluster/scale.py) reach the run's named
control actor, which the driver polls between batches; `cluster.autoscale` sets its target from the wait fractions.
The actor is created after the first learner update (its process start would take CPU from the components').
"""

from __future__ import annotations

import logging

from cluster.autoscale import autoscale_target

log = logging.getLogger("exgrpo")


class GeneratorControl:
    """Scaling of one attempt's generator pool (`state.generators`: the size asked for, kept in checkpoints)."""

    def __init__(self, cfg, run: str, state, generators):
        self.cfg, self.run, self.state, self.generators = cfg, run, state, generators
        self.actor = None  # cluster.runtime.Control, created by `start`
        self.bounds: dict[str, int] = {}  # `exgrpo scale --min/--max-generators`
        self._started = None  # the actor's first answer, while its process starts

    def start(self) -> None:
        from cluster.runtime import create_control

        a = self.cfg.cluster.autoscale
        self.actor = create_control(self.run, self.cfg.cluster.namespace, self.state.generators,
                                    {"min_generators": a.min_generators, "max_generators": a.max_generators},
                                    autoscale=a.enabled)
        self._started = self.actor.get.remote()

    def poll(self) -> bool:
        """Apply what `exgrpo scale` asked for; True when it asked the run to stop."""
        import ray

        if self.actor is None:
            return False
        if self._started is not None:  # its process starts: no wait for it in the loop
            if not ray.wait([self._started], timeout=0)[0]:
                return False
            self._started = None
        ctl = ray.get(self.actor.get.remote(), timeout=10)
        if ctl["bounds"] != self.bounds:
            log.info("autoscale bounds set to %s", ctl["bounds"])
            self.bounds = ctl["bounds"]
        if ctl["target"] != self.generators.size:
            log.info("scaling generators %d -> %d", self.generators.size, ctl["target"])
            self.generators.scale_to(ctl["target"], wait=False)  # never stalls the learner
            self.state.generators = ctl["target"]
        return bool(ctl["stop"])

    def autoscale(self, metrics: dict[str, float]) -> None:
        """Every `cluster.autoscale.cooldown_steps`: a new target from the learner's and generators' waits."""
        a = self.cfg.cluster.autoscale
        if not a.enabled or self.state.step % a.cooldown_steps:
            return
        import ray

        a = a.model_copy(update=self.bounds)
        n = self.generators.size
        free = ray.available_resources().get("CPU", 0.0)
        if a.grow_cluster:  # a pending generator makes the Ray autoscaler add a node; one at a time
            free = 0.0 if self.generators.starting else float("inf")
        learner_wait = metrics.get("driver/learner_wait_fraction", 0.0)
        generator_wait = metrics.get("generator/wait_fraction", 0.0)
        target = autoscale_target(a, n, learner_wait, generator_wait, free, self.cfg.generator.num_cpus)
        if target != n:
            ray.get(self.actor.set_target.remote(target))
            log.info("autoscale: generators %d -> %d (learner waits %.0f%%, generators wait %.0f%%)", n, target,
                     100 * learner_wait, 100 * generator_wait)

    def close(self) -> None:
        import ray

        if self.actor is not None:
            ray.kill(self.actor)


def stop_without_drain(pool) -> None:
    """Stop the generators without draining (nothing trains on their work after the last checkpoint), and say what
    they gave up: leases returned, reward calls abandoned, generators killed past FAST_STOP_S."""
    from actors.pool import FAST_STOP_S

    removed = lambda k: pool.removed_metrics.get(f"removed_{k}", 0.0)  # noqa: E731
    before = {k: removed(k) for k in ("leases_returned", "scoring_abandoned")}
    unclean = pool.removed_metrics.get("unclean_stops", 0.0)
    pool.shutdown(drain=False)
    returned, abandoned = (removed(k) - v for k, v in before.items())
    killed = pool.removed_metrics.get("unclean_stops", 0.0) - unclean
    log.info("generators stopped: %.0f lease(s) returned (their questions are reissued on resume)%s%s", returned,
             f"; abandoned the reward calls of {abandoned:.0f} group(s) in scoring" if abandoned else "",
             f"; {killed:.0f} did not answer within {FAST_STOP_S:g} s and were killed" if killed else "")
