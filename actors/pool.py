"""GeneratorPool: the run's generator actors, grown and shrunk while training goes on.

    pool = GeneratorPool(cfg.generator, cfg.reward, model_path, buffer_client, weight_source,
                         task_name="countdown", run=name, namespace=ns)
    pool.scale_to(3)      # new actors load the model, fetch the newest weights, then lease
    pool.metrics()        # summed counters / rates over the live generators
    pool.scale_to(1)      # removed actors finish their batch in flight (drain), then are killed
    pool.shutdown()

Actors are named `actor_name(run, "generator", i)`; a new actor takes the lowest free index, removal
takes the highest. Ray restarts a crashed actor (`gen_cfg.max_restarts`); it restarts its own loop.
"""

from __future__ import annotations

import logging

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
        self.removed_metrics: dict[str, float] = {}  # counters of generators already removed (nothing is forgotten)

    @property
    def size(self) -> int:
        return len(self.actors)

    def generator_id(self, index: int) -> str:
        return actor_name(self.run, "generator", index)

    def scale_to(self, n: int) -> None:
        """Grow (started actors fetch the newest weights before leasing) or shrink (drain, then kill) to `n`."""
        if n < 0:
            raise ValueError(f"cannot scale the generator pool to {n}; use 0 or more")
        if n > self.size:
            self._add(n - self.size)
        elif n < self.size:
            self._remove(sorted(self.actors)[n:])

    def _add(self, k: int) -> None:
        free = [i for i in range(self.size + k) if i not in self.actors][:k]
        new = {}
        for i in free:
            gid = self.generator_id(i)
            new[i] = Generator.options(name=gid, namespace=self.namespace, **actor_options(self.cfg)).remote(
                gid, self.cfg, self.reward_cfg, self.model_path, self.work_source, self.weight_source, self.task_name)
        refs = [a.start.remote() for a in new.values()]
        try:
            ray.get(refs, timeout=self.start_timeout_s)
        except (ray.exceptions.RayError, TimeoutError) as e:
            for a in new.values():
                ray.kill(a, no_restart=True)
            raise RuntimeError(f"generators {[self.generator_id(i) for i in new]} did not start within "
                               f"{self.start_timeout_s:.0f}s ({type(e).__name__}: {e}); check the model folder and "
                               "the engine settings (generator.engine)") from e
        self.actors.update(new)
        log.info("generator pool: added %s (size %d)", [self.generator_id(i) for i in new], self.size)

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
        out: dict[str, float] = {"generators": float(self.size), "unreachable": 0.0, **self.removed_metrics}
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
