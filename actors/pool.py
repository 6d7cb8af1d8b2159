"""GeneratorPool: the run's generator actors, grown, shrunk and healed while training goes on.

    spec = GeneratorSpec(cfg.generator, cfg.reward, model_path, task_name="countdown")
    pool = GeneratorPool(spec, buffer_client, weight_source, run=name, namespace=ns)
    pool.scale_to(3, wait=False)  # new actors load the model, fetch the newest weights, then lease
    pool.poll()           # adopt started actors, replace dead ones (raises GeneratorsFailed past the budget)
    pool.status(); pool.metrics()   # who runs, restarts, starts or waits for a CPU/GPU; summed counters
    pool.scale_to(1)      # removed actors finish their batch in flight (drain), then are killed
    pool.shutdown()

Naming, restarts and healing (what counts as a death): docs/internals.md#actorspoolpy
"""

from __future__ import annotations

import logging
import time
from collections import deque

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from actors.generator import Generator, GeneratorSpec, actor_options
from actors.scoring import end_dead_leases
from common.interfaces import WeightSource, WorkSource, actor_name

log = logging.getLogger(__name__)
console = logging.getLogger("exgrpo")  # what the user sees on the console (cluster/console.py)

_SUM = ("batches", "groups", "rollouts", "tokens", "tokens_per_s", "rollouts_per_s", "wall_tokens_per_s", "generate_s",
        "score_s", "wait_s", "weight_loads", "weight_load_s", "reward_errors", "rewarded", "source_errors",
        "groups_dropped", "leases_returned", "running", "in_flight", "loads_in_flight", "rollouts_spanning",
        "uptime_s", "reward_in_flight", "reward_timeouts", "scoring_abandoned", "loads_torn", "reasoning_checked",
        "reasoning_valid", "reasoning_errors", "weights_delta_loads", "weights_full_loads", "weights_delta_mismatches",
        "weights_from_relay", "weights_from_root", "weights_relay_resumed", "leases_held", "started_behind_weights")
_MEAN = ("wait_fraction", "busy_fraction", "version_lag_mean", "weight_load_s_last", "startup_s", "version")
_MAX = ("version_lag_max", "reward_oldest_s", "reward_call_p50_s", "reward_call_max_s",  # p50: the slowest generator's
        "peak_memory_gib")
_PENDING_STATES = ("PENDING_CREATION", "DEPENDENCIES_UNREADY")
FAST_STOP_S = 10.0  # a stop without drain (a signal): leases not returned by then expire and are reissued
CALL_TIMEOUT_S = 30.0  # a call to a running generator (its metrics, its last sample)


class GeneratorsFailed(RuntimeError):
    """More generators died for good within `replace_window_s` than `replace_budget` allows."""


class GeneratorPool:
    """Creates, scales, heals and stops the generator actors of one run."""

    def __init__(self, spec: GeneratorSpec, work_source: WorkSource, weight_source: WeightSource, *, run: str,
                 namespace: str | None = None):
        """`spec`: what each generator is made of; they lease from `work_source` and load from `weight_source`."""
        self.spec, self.cfg = spec, spec.cfg
        self.work_source, self.weight_source = work_source, weight_source
        self.run, self.namespace = run, namespace
        self.start_timeout_s, self.call_timeout_s = spec.cfg.start_timeout_s, CALL_TIMEOUT_S
        self.actors: dict[int, ray.actor.ActorHandle] = {}  # started at least once
        # index -> (actor, start() ref, monotonic time requested): started without blocking the caller
        self.starting: dict[int, tuple[ray.actor.ActorHandle, ray.ObjectRef, float]] = {}
        self.placed_at: dict[int, float] = {}  # starting actors seen placed (the start timeout runs from here)
        self.respawn: set[int] = set()  # died; the replacement waits for the dead actor's name to be released
        self.state: dict[int, str] = {}  # index -> running | restarting | starting | pending | respawn
        self.placement_groups: dict[int, object] = {}  # index -> its placement group (tensor_parallel_size > 1)
        self.deaths: deque[tuple[float, str, str]] = deque()  # (monotonic time, generator id, why) in the window
        self.last_error: dict[str, str] = {}  # generator id -> why it last died
        self.removed_metrics: dict[str, float] = {}  # counters of generators already removed (nothing is forgotten)

    @property
    def size(self) -> int:
        """Generators running, starting or being replaced (what scaling decisions count)."""
        return len(self.actors) + len(self.starting) + len(self.respawn)

    @property
    def running(self) -> int:
        """Started generators that are alive (not being restarted by Ray)."""
        return sum(1 for i in self.actors if self.state.get(i) == "running")

    def generator_id(self, index: int) -> str:
        return actor_name(self.run, "generator", index)

    def scale_to(self, n: int, *, wait: bool = True) -> None:
        """Grow (started actors fetch the newest weights before leasing) or shrink (drain, then kill) to `n`.

        `wait=True` blocks until the new actors run, replacing deaths within the budget, and raises
        GeneratorsFailed when one is still not running after `start_timeout_s` (or waits for resources
        that long). With `wait=False` (the driver) new actors start in the background and `poll()`
        adopts them: scaling never stalls the learner.
        """
        if n < 0:
            raise ValueError(f"cannot scale the generator pool to {n}; use 0 or more")
        self.poll()
        if n > self.size:
            self._add(n - self.size)
            if wait:
                self._wait_started()
        elif n < self.size:
            for i in sorted(self.respawn)[::-1][: self.size - n]:
                self.respawn.discard(i)
                self.state.pop(i, None)
                self._release([i])
            doomed = sorted(self.starting)[::-1][: self.size - n]  # cancel not-yet-started ones first
            for i in doomed:
                ray.kill(self.starting.pop(i)[0], no_restart=True)
                self.placed_at.pop(i, None)
                self.state.pop(i, None)
            self._release(doomed)
            if n < self.size:
                self._remove(sorted(self.actors)[n:])

    def _add(self, k: int) -> None:
        taken = set(self.actors) | set(self.starting) | self.respawn
        free = [i for i in range(self.size + k) if i not in taken][:k]
        for i in free:
            if not self._spawn(i):
                self.respawn.add(i)
        log.info("generator pool: requested %s (size %d)", [self.generator_id(i) for i in free], self.size)

    def _spawn(self, i: int) -> bool:
        """Create the actor of index `i` and call its start(); False while its name is still taken."""
        gid = self.generator_id(i)
        options = actor_options(self.cfg)
        if self.cfg.tensor_parallel_size > 1:  # its engine's workers go into the generator's placement group
            options.pop("label_selector", None)  # its bundles carry the labels
            options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                self._placement_group(i), placement_group_bundle_index=0, placement_group_capture_child_tasks=True)
        try:
            actor = Generator.options(name=gid, namespace=self.namespace, **options).remote(
                gid, self.spec, self.work_source, self.weight_source)
        except ValueError as e:  # "name already taken": a killed actor's name is released asynchronously
            log.info("generator %s: name not released yet (%s); creating it at the next poll", gid, e)
            return False
        self.starting[i] = (actor, actor.start.remote(), time.monotonic())
        self.placed_at.pop(i, None)
        self.state[i] = "starting"
        return True

    def _placement_group(self, i: int):
        """Generator i's placement group: tensor_parallel_size bundles of one GPU on one node (the first also holds
        its CPUs). Kept across the generator's replacements; removed with the generator. Until the cluster can
        hold it, the generator is pending (reported with what it needs), never timed out."""
        if i not in self.placement_groups:
            tp = self.cfg.tensor_parallel_size
            bundles = [{"CPU": self.cfg.num_cpus, "GPU": 1.0}] + [{"GPU": 1.0} for _ in range(tp - 1)]
            labels = [dict(self.cfg.node_labels) for _ in bundles] if self.cfg.node_labels else None
            self.placement_groups[i] = placement_group([{k: v for k, v in b.items() if v} for b in bundles],
                                                       strategy="STRICT_PACK", name=f"{self.generator_id(i)}-tp",
                                                       bundle_label_selector=labels)
        return self.placement_groups[i]

    def _release(self, indices) -> None:
        for i in indices:
            pg = self.placement_groups.pop(i, None)
            if pg is not None:
                remove_placement_group(pg)

    def _wait_started(self) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        while self.starting or self.respawn:
            if time.monotonic() > deadline:
                raise GeneratorsFailed(f"generators {self._names(self.starting)} did not start within "
                                       f"{self.start_timeout_s:.0f}s ({self.describe()})")
            refs = [ref for _, ref, _ in self.starting.values()]
            if refs:
                ray.wait(refs, num_returns=1, timeout=1.0)
            else:
                time.sleep(0.2)
            self.poll()

    def poll(self) -> None:
        """Adopt generators whose start() finished; replace the dead (see the module docstring).

        Never blocks for long (one GCS lookup per actor); raises GeneratorsFailed past the budget."""
        for i in sorted(self.respawn):
            if self._spawn(i):
                self.respawn.discard(i)
        now = time.monotonic()
        for i, (actor, ref, t0) in list(self.starting.items()):
            ready, _ = ray.wait([ref], timeout=0)
            if ready:
                self._finish_start(i, actor, ref, t0)
                continue
            st, why = _gcs_state(actor)
            if st == "DEAD":
                self._died(i, f"died while starting: {why}")
            elif st in _PENDING_STATES:
                self.state[i] = "pending"
                self.placed_at.pop(i, None)
            else:
                self.state[i] = "starting"
                if now - self.placed_at.setdefault(i, now) > self.start_timeout_s:
                    self._died(i, f"placed but not started within {self.start_timeout_s:.0f}s "
                                  "(generator.start_timeout_s); check the model folder and generator.engine")
        for i, actor in list(self.actors.items()):
            st, why = _gcs_state(actor)
            if st == "DEAD":
                self._died(i, why)
            elif st == "ALIVE":
                if self.state.get(i) == "restarting":  # e.g. placed again after its node was lost
                    console.warning("generator %s is running again (Ray restarted it)", self.generator_id(i))
                self.state[i] = "running"
            else:
                if self.state.get(i) == "running" and st == "RESTARTING":  # its process died (killed, node lost)
                    self._end_leases(i, "its process died; Ray restarts it")
                self.state[i] = "restarting"

    def _finish_start(self, i: int, actor, ref, t0: float) -> None:
        try:
            ray.get(ref)
        except ray.exceptions.RayActorError as e:  # the process died during start()
            st, why = _gcs_state(actor)
            if st == "DEAD":
                self._died(i, f"died while starting: {why or _first_line(e)}")
            else:  # Ray restarts it and it starts itself; ask again (start() is idempotent)
                log.warning("generator %s crashed while starting; Ray restarts it", self.generator_id(i))
                self.starting[i] = (actor, actor.start.remote(), t0)
            return
        except ray.exceptions.RayError as e:  # start() raised: no model, engine error, ...
            self._died(i, f"start failed: {_first_line(e, skip_ray=True)}")
            return
        self.actors[i] = actor
        del self.starting[i]
        self.placed_at.pop(i, None)
        self.state[i] = "running"
        gid = self.generator_id(i)
        if gid in self.last_error:  # a replacement (e.g. placed again after its node was lost)
            console.warning("generator %s is running again, %.0fs after its replacement was requested", gid,
                        time.monotonic() - t0)

    def _died(self, i: int, why: str) -> None:
        """Forget actor `i` (killing what is left of it), count the death, replace it within the budget."""
        actor = self.actors.pop(i) if i in self.actors else self.starting.pop(i)[0]
        self.placed_at.pop(i, None)
        ray.kill(actor, no_restart=True)  # harmless on a dead actor; frees a live one that failed to start
        gid, now = self.generator_id(i), time.monotonic()
        if self.state.get(i) != "restarting":  # (a restarting one's leases were ended when it went down)
            self._end_leases(i, "it died")
        self.last_error[gid] = why
        self.deaths.append((now, gid, why))
        while self.deaths and now - self.deaths[0][0] > self.cfg.replace_window_s:
            self.deaths.popleft()
        self.removed_metrics["deaths"] = self.removed_metrics.get("deaths", 0.0) + 1
        if len(self.deaths) > self.cfg.replace_budget:
            self.state.pop(i, None)
            lines = "\n".join(f"  {g}: {w}" for g, w in self.last_error.items())
            raise GeneratorsFailed(
                f"{len(self.deaths)} generator deaths within {self.cfg.replace_window_s:.0f}s, more than "
                f"generator.replace_budget={self.cfg.replace_budget}; last errors:\n{lines}\n"
                "fix the cause above, or raise generator.replace_budget / generator.max_restarts")
        log.error("generator %s died for good (%s); replacing it (%d/%d deaths within %.0fs)", gid, why,
                  len(self.deaths), self.cfg.replace_budget, self.cfg.replace_window_s)
        self.removed_metrics["replacements"] = self.removed_metrics.get("replacements", 0.0) + 1
        if not self._spawn(i):
            self.respawn.add(i)
            self.state[i] = "respawn"

    def _end_leases(self, i: int, why: str) -> None:
        """Generator `i`'s process is gone: its leases end now (`end_dead_leases`), said on the console. Should the
        old process submit after all, the buffer counts a late submission."""
        gid = self.generator_id(i)
        if n := end_dead_leases(self.work_source, gid):
            console.warning("generator %s: %s; its %d lease(s) were ended and their questions issued again", gid,
                            why, n)

    def _names(self, indices) -> list[str]:
        return [self.generator_id(i) for i in sorted(indices)]

    def status(self) -> dict[str, list[str]]:
        """Generator ids by state: running, restarting (Ray restarts it), starting (placed, loading),
        pending (waiting for `needs()` to be free), respawn (replacement not created yet)."""
        out: dict[str, list[str]] = {k: [] for k in ("running", "restarting", "starting", "pending", "respawn")}
        for i, st in sorted(self.state.items()):
            if i in self.actors or i in self.starting or i in self.respawn:
                out[st].append(self.generator_id(i))
        return out

    def needs(self) -> dict[str, float]:
        """Resources one generator asks for (a tensor-parallel one: its GPUs all on one node)."""
        gpus = self.cfg.num_gpus * self.cfg.tensor_parallel_size
        return {k: v for k, v in (("CPU", self.cfg.num_cpus), ("GPU", gpus)) if v}

    def describe(self) -> str:
        """One line: e.g. `generators: 1 running, 1 pending (needs 1 CPU; the cluster has 0 CPU free)`."""
        st = self.status()
        parts = [f"{len(v)} {k}" for k, v in st.items() if v] or ["none"]
        line = "generators: " + ", ".join(parts)
        if st["pending"] or st["restarting"]:
            free = ray.available_resources()
            need = "; ".join(f"{v:g} {k}" for k, v in self.needs().items()) or "no resources"
            have = ", ".join(f"{free.get(k, 0.0):g} {k}" for k in self.needs()) or "-"
            where = (" on a node labelled " + ", ".join(f"{k}={v}" for k, v in self.cfg.node_labels.items())
                     if self.cfg.node_labels else "")
            line += f" (each needs {need}{where}; the cluster has {have} free)"
        if self.last_error:
            gid, why = list(self.last_error.items())[-1]
            line += f"; last death: {gid}: {why[:120]}"
        return line

    def last_sample(self, kind: str = "scored") -> dict | None:
        """The last scored sample of a running generator (question, response, reward), or None;
        `kind="timeout"`: its first reward call that timed out (the same fields)."""
        for i, actor in sorted(self.actors.items()):
            if self.state.get(i) != "running":
                continue
            try:
                s = ray.get(actor.last_sample.remote(kind), timeout=self.call_timeout_s)
            except (ray.exceptions.RayError, TimeoutError) as e:
                log.warning("generator %s did not return its last sample (%s)", self.generator_id(i), type(e).__name__)
                continue
            if s is not None:
                return s
        return None

    def _remove(self, indices: list[int], *, drain: bool = True) -> None:
        actors = [self.actors.pop(i) for i in indices]
        for i in indices:
            self.state.pop(i, None)
        refs = [a.stop.remote(drain=drain) for a in actors]
        deadline = time.monotonic() + (self.cfg.stop_timeout_s + 30 if drain else FAST_STOP_S)
        returned = abandoned = 0.0
        for i, a, ref in zip(indices, actors, refs):
            try:
                final = ray.get(ref, timeout=max(0.0, deadline - time.monotonic()))
                self._remember(final)
                returned += final.get("leases_returned", 0.0)
                abandoned += final.get("scoring_abandoned", 0.0)
            except (ray.exceptions.RayError, TimeoutError) as e:  # its leases expire and are reissued
                log.error("generator %s did not stop cleanly (%s: %s); killing it, its leases will expire",
                          self.generator_id(i), type(e).__name__, _first_line(e))
                self.removed_metrics["unclean_stops"] = self.removed_metrics.get("unclean_stops", 0.0) + 1
            ray.kill(a, no_restart=True)
        self._release(indices)
        log.info("generator pool: removed %s (size %d)%s", [self.generator_id(i) for i in indices], self.size,
                 f"; abandoned scoring {abandoned:.0f} group(s) in a reward call (leases returned: {returned:.0f})"
                 if abandoned else "")

    def _remember(self, final: dict[str, float]) -> None:
        for k in ("batches", "groups", "rollouts", "tokens", "reward_errors", "groups_dropped", "leases_returned",
                  "scoring_abandoned"):
            self.removed_metrics[f"removed_{k}"] = self.removed_metrics.get(f"removed_{k}", 0.0) + final.get(k, 0.0)

    def metrics(self) -> dict[str, float]:
        """Summed counters and rates, mean fractions, max lag over live generators; `unreachable` counts the silent."""
        self.poll()
        st = self.status()
        out: dict[str, float] = {"generators": float(self.running), "generators_starting": float(len(st["starting"])),
                                 "generators_pending": float(len(st["pending"])),
                                 "generators_restarting": float(len(st["restarting"]) + len(st["respawn"])),
                                 "unreachable": 0.0, **self.removed_metrics}
        per = []
        for i, a in sorted(self.actors.items()):
            if self.state.get(i) == "running":  # a restarting actor would hold the call until it is back
                per.append((i, a.metrics.remote()))
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
        # correct fresh rollouts with valid reasoning, of those checked (cumulative over the live generators)
        out["valid_given_correct"] = (out["reasoning_valid"] / out["reasoning_checked"] if out["reasoning_checked"]
                                      else float("nan"))
        return out

    def shutdown(self, *, drain: bool = True) -> None:
        """Stop every generator and kill the actors; nothing is replaced any more.

        `drain=True` finishes each batch in flight; `drain=False` (a signal) returns the leases at once."""
        self.respawn.clear()
        for actor, _, _ in self.starting.values():
            ray.kill(actor, no_restart=True)
        self._release(list(self.starting))
        self.starting.clear()
        self._remove(sorted(self.actors), drain=drain)
        self.state.clear()


def _gcs_state(actor) -> tuple[str, str]:
    """(state, why it died) of an actor as Ray's GCS sees it: ALIVE, PENDING_CREATION, RESTARTING, DEAD.

    Ray's public state API (`ray.util.state`) needs the dashboard, which the embedded Ray runs
    without; the GCS actor table answers directly in about a millisecond. Through Ray Client
    (`ray://`) there is no GCS table in this process: the actor is asked instead."""
    from ray._private import state
    from ray.util.client import ray as client

    if client.is_connected():
        return _probe(actor)
    info = state.actors(actor_id=actor._actor_id.hex())
    if not info:
        return "DEAD", "unknown to the cluster"
    cause = info.get("DeathCause")
    which = cause.WhichOneof("context") if cause is not None else None
    why = getattr(getattr(cause, which), "error_message", "") if which else ""
    why = why.split(" Some common causes")[0]  # Ray's generic advice after the facts
    return info["State"], " ".join(why.split())[:300]


def _probe(actor, timeout_s: float = 2.0) -> tuple[str, str]:
    """The state of an actor from a ping (Ray Client): a pending or loading one looks RESTARTING, one that does not
    answer in time UNRESPONSIVE (alive and busy, or down: a ping cannot tell)."""
    try:
        ray.get(actor.ping.remote(), timeout=timeout_s)
    except ray.exceptions.ActorDiedError as e:
        return "DEAD", _first_line(e)
    except ray.exceptions.ActorUnavailableError:
        return "RESTARTING", ""
    except ray.exceptions.GetTimeoutError:
        return "UNRESPONSIVE", ""
    except ray.exceptions.RayTaskError as e:  # ping() raises once the loop crashed; the process exits next
        return "RESTARTING", _first_line(e, skip_ray=True)
    return "ALIVE", ""


def _first_line(e: BaseException, skip_ray: bool = False) -> str:
    """A short description of a Ray error: the remote exception's last line (`skip_ray`) or the first."""
    text = str(e).strip()
    lines = [ln for ln in text.splitlines() if ln.strip()]
    if not lines:
        return type(e).__name__
    return (lines[-1] if skip_ray else lines[0])[:300]
