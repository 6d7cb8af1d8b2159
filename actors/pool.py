"""GeneratorPool: the run's generator actors, grown and shrunk while training goes on.

    pool = GeneratorPool(cfg.generator, cfg.reward, model_path, buffer_client, weight_source,
                         task_name="countdown", run=name, namespace=ns)
    pool.scale_to(3)      # new actors load the model, fetch the newest weights, then lease
    pool.poll()           # (non-blocking scaling) adopt started actors, give up on ones that never start
    pool.metrics()        # summed counters / rates over the live generators
    pool.scale_to(1)      # removed actors finish their batch in flight (drain), then are killed
    pool.shutdown()

Actors are named `actor_name(run, "generator", i)`; a new actor takes the lowest free index, removal
takes the highest. Ray restarts a crashed actor (`gen_cfg.max_restarts`); it restarts its own loop.
"""

from __future__ import annotations

import logging
import time

import ray

from actors.generator import Generator, actor_options
from common.config import GeneratorConfig, RewardConfig
from common.interfaces import WeightSource, WorkSource, actor_name

log = logging.getLogger(__name__)

_SUM = ("batches", "groups", "rollouts", "tokens", "tokens_per_s", "rollouts_per_s", "wall_tokens_per_s", "generate_s",
        "score_s", "wait_s", "weight_loads", "weight_load_s", "reward_errors", "source_errors", "groups_dropped",
        "leases_returned", "running")
_MEAN = ("wait_fraction", "version_lag_mean", "weight_load_s_last", "startup_s", "version")
_MAX = ("version_lag_max",)


class GeneratorPool:
    """Creates, scales and stops the generator actors of one run."""

    def __init__(self, gen_cfg: GeneratorConfig, reward_cfg: RewardConfig, model_path: str, work_source: WorkSource,
                 weight_source: WeightSource, *, task_name: str | None, run: str, namespace: str | None = None,
                 start_timeout_s: float = 900.0, call_timeout_s: float = 30.0):
        self.cfg, self.reward_cfg, self.model_path = gen_cfg, reward_cfg, model_path
        self.work_source, self.weight_source, self.task_name = work_source, weight_source, task_name
        self.run, self.namespace = run, namespace
        self.start_timeout_s, self.call_timeout_s = start_timeout_s, call_timeout_s
        self.actors: dict[int, ray.actor.ActorHandle] = {}
        # index -> (actor, start() ref, monotonic time requested): started without blocking the caller
        self.starting: dict[int, tuple[ray.actor.ActorHandle, ray.ObjectRef, float]] = {}
        self.removed_metrics: dict[str, float] = {}  # counters of generators already removed (nothing is forgotten)

    @property
    def size(self) -> int:
        """Generators running or starting (what scaling decisions count)."""
        return len(self.actors) + len(self.starting)

    @property
    def running(self) -> int:
        return len(self.actors)

    def generator_id(self, index: int) -> str:
        return actor_name(self.run, "generator", index)

    def scale_to(self, n: int, *, wait: bool = True) -> None:
        """Grow (started actors fetch the newest weights before leasing) or shrink (drain, then kill) to `n`.

        With `wait=False` new actors start in the background: `poll()` adopts them once started and
        gives up (kills, counts `start_failures`, logs why) on any that does not start within
        `start_timeout_s` — e.g. when the cluster has no free resources for it. The training loop
        uses this so that scaling up never stalls the learner.
        """
        if n < 0:
            raise ValueError(f"cannot scale the generator pool to {n}; use 0 or more")
        self.poll()
        if n > self.size:
            self._add(n - self.size, wait=wait)
        elif n < self.size:
            doomed = sorted(self.starting)[::-1][: self.size - n]  # cancel not-yet-started ones first
            for i in doomed:
                ray.kill(self.starting.pop(i)[0], no_restart=True)
            if n < self.size:
                self._remove(sorted(self.actors)[n:])

    def _add(self, k: int, *, wait: bool) -> None:
        taken = set(self.actors) | set(self.starting)
        free = [i for i in range(self.size + k) if i not in taken][:k]
        now = time.monotonic()
        for i in free:
            gid = self.generator_id(i)
            actor = Generator.options(name=gid, namespace=self.namespace, **actor_options(self.cfg)).remote(
                gid, self.cfg, self.reward_cfg, self.model_path, self.work_source, self.weight_source, self.task_name)
            self.starting[i] = (actor, actor.start.remote(), now)
        if wait:
            refs = [self.starting[i][1] for i in free]
            ray.wait(refs, num_returns=len(refs), timeout=self.start_timeout_s)
            self.poll(fail_pending=set(free))
        log.info("generator pool: requested %s (size %d)", [self.generator_id(i) for i in free], self.size)

    def poll(self, fail_pending: set[int] | None = None) -> None:
        """Adopt generators whose start() finished; kill and report those that failed or timed out.

        Raises RuntimeError for a generator in `fail_pending` that did not start (a blocking scale_to)."""
        now = time.monotonic()
        errors = []
        for i, (actor, ref, t0) in list(self.starting.items()):
            ready, _ = ray.wait([ref], timeout=0)
            if ready:
                try:
                    ray.get(ref)
                except ray.exceptions.RayError as e:
                    errors.append((i, f"{type(e).__name__}: {e}"))
                    continue
                self.actors[i] = actor
                del self.starting[i]
            elif now - t0 > self.start_timeout_s or (fail_pending and i in fail_pending):
                errors.append((i, f"not started within {self.start_timeout_s:.0f}s (no free resources for "
                                  f"num_cpus={self.cfg.num_cpus}, num_gpus={self.cfg.num_gpus}?)"))
        for i, why in errors:
            ray.kill(self.starting.pop(i)[0], no_restart=True)
            self.removed_metrics["start_failures"] = self.removed_metrics.get("start_failures", 0.0) + 1
            log.error("generator %s did not start: %s", self.generator_id(i), why)
        bad = [i for i, _ in errors if fail_pending and i in fail_pending]
        if bad:
            raise RuntimeError(f"generators {[self.generator_id(i) for i in bad]} did not start "
                               f"({dict(errors)[bad[0]]}); check the model folder and the engine settings "
                               "(generator.engine)")

    def _remove(self, indices: list[int]) -> None:
        actors = [self.actors.pop(i) for i in indices]
        refs = [a.stop.remote(drain=True) for a in actors]
        for i, a, ref in zip(indices, actors, refs):
            try:
                final = ray.get(ref, timeout=self.cfg.stop_timeout_s + 30)
                self._remember(final)
            except (ray.exceptions.RayError, TimeoutError) as e:  # its leases expire and are reissued
                log.error("generator %s did not stop cleanly (%s: %s); killing it, its leases will expire",
                          self.generator_id(i), type(e).__name__, e)
                self.removed_metrics["unclean_stops"] = self.removed_metrics.get("unclean_stops", 0.0) + 1
            ray.kill(a, no_restart=True)
        log.info("generator pool: removed %s (size %d)", [self.generator_id(i) for i in indices], self.size)

    def _remember(self, final: dict[str, float]) -> None:
        for k in ("batches", "groups", "rollouts", "tokens", "reward_errors", "groups_dropped", "leases_returned"):
            self.removed_metrics[f"removed_{k}"] = self.removed_metrics.get(f"removed_{k}", 0.0) + final.get(k, 0.0)

    def metrics(self) -> dict[str, float]:
        """Summed counters and rates, mean fractions, max lag over live generators; `unreachable` counts the silent."""
        self.poll()
        out: dict[str, float] = {"generators": float(self.running), "generators_starting": float(len(self.starting)),
                                 "unreachable": 0.0, **self.removed_metrics}
        per = []
        for i, a in sorted(self.actors.items()):
            ref = a.metrics.remote()
            per.append((i, ref))
        got = []
        for i, ref in per:
            try:
                got.append(ray.get(ref, timeout=self.call_timeout_s))
            except (ray.exceptions.RayError, TimeoutError) as e:  # restarting or dead: counted, not fatal
                log.warning("generator %s did not report metrics (%s)", self.generator_id(i), type(e).__name__)
                out["unreachable"] += 1
        for k in _SUM:
            out[k] = float(sum(m.get(k, 0.0) for m in got))
        for k in _MEAN:
            out[k] = float(sum(m.get(k, 0.0) for m in got) / len(got)) if got else 0.0
        for k in _MAX:
            out[k] = float(max((m.get(k, 0.0) for m in got), default=0.0))
        for m in got:
            for k, v in m.items():
                if k.startswith("submit_"):
                    out[k] = out.get(k, 0.0) + v
        return out

    def shutdown(self) -> None:
        """Stop every generator (draining its batch in flight) and kill the actors."""
        self.scale_to(0)
