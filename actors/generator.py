"""The generator actor: lease work, stream it through the engine, score and submit each finished group; load
new weights as soon as they are published.

    spec = GeneratorSpec(gen_cfg, reward_cfg, model_path, task_name)   # the same for every generator of the run
    gen = Generator.options(name=actor_name(run, "generator", i)).remote(
        generator_id, spec, work_source, weight_source)
    ray.get(gen.start.remote())       # load the model folder, fetch the newest weights, then start leasing
    ...
    ray.get(gen.stop.remote(drain=True))   # finish the work in flight (drain=False: return its leases)

Two threads: the engine thread (weights, leasing, engine steps) and the scorer thread (score, submit:
actors/scoring.py).
The loop, partial rollouts, `min_weights`, failures: docs/internals.md#actorsgeneratorpy (overview: docs/design.md)
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
import traceback
from dataclasses import dataclass

import ray

from common.config import GeneratorConfig, RewardConfig, VllmEngineConfig
from common.interfaces import Engine, WeightSource, WorkSource
from actors.generator_stats import GeneratorStats, peak_memory_bytes
from actors.remote_calls import RETRYABLE, RemoteCalls
from actors.in_flight import InFlight
from actors.scoring import Correctness, Group, end_dead_leases, return_leases, scored_groups, submit_groups
from actors.weight_loading import WeightLoader
from common.messages import ScoredGroup, WorkItem

log = logging.getLogger(__name__)

_ABANDON_JOIN_S = 10.0  # after stop_timeout_s: how long the loop gets to notice that scoring was abandoned


@dataclass(frozen=True)
class GeneratorSpec:
    """What every generator of a run is made of: its section, the reward, the model folder it starts from, and the
    built-in task of its questions (the task's reasoning check; None: questions from a data file)."""

    cfg: GeneratorConfig
    reward: RewardConfig
    model_path: str
    task_name: str | None = None


class GeneratorWorker:
    """The body of the `Generator` Ray actor (a plain class: it also runs in-process)."""

    def __init__(self, generator_id: str, spec: GeneratorSpec, work_source: WorkSource, weight_source: WeightSource):
        self.generator_id = generator_id
        gen_cfg, reward_cfg, model_path, task_name = spec.cfg, spec.reward, spec.model_path, spec.task_name
        self.cfg, self.reward_cfg, self.model_path = gen_cfg, reward_cfg, model_path
        self.work_source, self.weight_source, self.task_name = work_source, weight_source, task_name
        from common.tasks import TASKS

        # reward >= correct_threshold, and the task's exact reasoning check of correct responses (Rollout.valid)
        self._correctness = Correctness(reward_cfg.correct_threshold,
                                        TASKS[task_name].reasoning if task_name in TASKS else None)
        self.engine: Engine | None = None
        self.rewards = None
        self.stats = GeneratorStats()
        self._stop = threading.Event()
        self._wake = threading.Event()  # ends the engine thread's idle wait early (stop, a finished submit)
        self._return_in_flight = False
        self._reward_calls = 0  # reward calls in progress (read by the engine thread: a plain int is enough)
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()
        self._work = InFlight()  # every leased item not submitted yet: in the engine, held, queued or being scored
        self._calls = RemoteCalls(generator_id, self.stats, backoff_s=gen_cfg.retry_backoff_s, stop=self._stop)
        # the published versions, the loads; a new version seen by its watcher wakes the engine thread
        self.weights = WeightLoader(gen_cfg, weight_source, model_path, self._calls, on_version=self._wake.set)
        self._next_lease = 0.0
        self._samples_per_item = 1  # samples per leased question (K or K-1), learned from the last lease
        self._requests = 0
        self._failure: str | None = None
        self._last_sample: dict | None = None  # the last scored response (for the driver's all-zero-reward hint)
        self._incarnation = 0
        self._seed_base = int.from_bytes(hashlib.blake2b(f"{gen_cfg.seed}/{generator_id}".encode(),
                                                         digest_size=4).digest(), "little")
        if _reconstructed():
            # Ray restarted this actor after a crash: come back on our own (clean start, newest weights).
            self._incarnation = int.from_bytes(os.urandom(2), "little") + 1
            log.warning("generator %s was restarted by Ray; starting again", generator_id)
            threading.Thread(target=self._restart, name=f"{generator_id}-restart", daemon=True).start()

    # ------------------------------------------------------------------------------------ control

    def start(self) -> dict[str, float]:
        """Clean start: load the model folder, fetch the newest weights, then start the loop. Idempotent."""
        with self._start_lock:
            if self._thread is not None and self._thread.is_alive():
                return {"version": float(self.engine.version), "startup_s": self.stats.startup_s}
            from actors.engines import make_engine
            from common.rewards import RewardPool

            t0 = time.monotonic()
            if self.engine is None:
                self.engine = make_engine(self.cfg, self.model_path, seed=self._seed_base)
            if self.rewards is None:
                self.rewards = RewardPool(self.reward_cfg, self.task_name)
            try:
                self.weight_source.register(self.generator_id)
            except LookupError as e:  # no learner yet: the first ack registers us
                log.info("generator %s: not registered with the weight store yet (%s)", self.generator_id, e)
            self.weights.sync(self.engine, required=True)
            if self._incarnation:
                self._end_dead_leases()
            self.stats.startup_s = time.monotonic() - t0
            if self.stats.batches == 0:
                self.stats.started_at = time.monotonic()  # rates count from the first lease, not model loading
            self._stop.clear()
            self._return_in_flight = False
            self._work.reopen()
            self._thread = threading.Thread(target=self._run, name=f"{self.generator_id}-loop", daemon=True)
            self._thread.start()
            self.weights.start_watching()
            log.info("generator %s started at version %d in %.1fs", self.generator_id, self.engine.version,
                     self.stats.startup_s)
            return {"version": float(self.engine.version), "startup_s": self.stats.startup_s}

    def _end_dead_leases(self) -> None:
        """Restarted by Ray: the leases of the process that died are ended now, before this process leases anything
        (none of its own work is ended; the pool does the same when it sees the restart first)."""
        n = end_dead_leases(self.work_source, self.generator_id)
        if n is None:
            self.stats.source_errors += 1
        elif n:
            log.warning("generator %s: %d lease(s) of its previous process ended, their questions issued again",
                        self.generator_id, n)

    def _restart(self) -> None:
        try:
            self.start()
        except Exception:  # nobody awaits this thread: crash the actor so Ray restarts it again (or gives up)
            self._failure = traceback.format_exc()
            log.error("generator %s could not restart:\n%s", self.generator_id, self._failure)
            os._exit(1)

    def stop(self, drain: bool = True) -> dict[str, float]:
        """Clean stop: no new leases; the work in flight is finished and submitted (drain) or its leases returned.

        Returns the final metrics. After `stop` the actor can be killed without losing work.
        """
        self._return_in_flight = not drain
        self._stop.set()
        self._wake.set()
        if not drain and self.rewards is not None:  # a reward call may never end: stop scoring now
            self.rewards.abandon()
        thread = self._thread
        if thread is not None:
            thread.join(timeout=self.cfg.stop_timeout_s)
            if thread.is_alive():
                if self.rewards is not None:
                    self.rewards.abandon()
                items = self._work.unfinished()
                log.error("generator %s: work in flight did not finish within stop_timeout_s=%.0fs; "
                          "returning its %d leases", self.generator_id, self.cfg.stop_timeout_s, len(items))
                self._return_leases(items)
                thread.join(timeout=_ABANDON_JOIN_S)
        try:
            self.weight_source.unregister(self.generator_id)
        except (LookupError, *RETRYABLE) as e:  # the learner may already be gone at shutdown; nothing waits on us
            log.warning("generator %s: could not unregister from the weight store: %s", self.generator_id, e)
            self.stats.source_errors += 1
        if self.rewards is not None:
            self.rewards.close()
            self.rewards = None
        return self.metrics()

    def ping(self) -> str:
        """Raises if the loop died; else the generator id."""
        if self._failure is not None:
            raise RuntimeError(f"generator {self.generator_id} loop failed: {self._failure}")
        return self.generator_id

    def last_sample(self, kind: str = "scored") -> dict | None:
        """The last response this generator scored: question id, response text, reference answer,
        reward and reward error (None before the first group). `kind="timeout"`: the first reward call
        that timed out, the same fields (seen while its batch is still being scored)."""
        if kind == "timeout":
            return self.rewards.first_timeout if self.rewards is not None else None
        return self._last_sample

    def metrics(self) -> dict[str, float]:
        """Counters and rates of this incarnation (all floats; see `GeneratorStats.as_metrics`)."""
        rewards, engine = self.rewards, self.engine  # read once: another thread may replace them
        out = self.stats.as_metrics(
            running=self._thread is not None and self._thread.is_alive(),
            version=engine.version if engine is not None else -1,
            in_flight=self._work.in_engine(),
            rewards=rewards.stats() if rewards is not None else None)
        # delta loads, relay transfers
        out.update({f"weights_{k}": float(v) for k, v in self.weight_source.transfer_stats().items()})
        out["peak_memory_gib"] = peak_memory_bytes() / 2**30
        return out

    # --------------------------------------------------------------------------------- engine thread

    def _run(self) -> None:
        scorer = threading.Thread(target=self._score_loop, name=f"{self.generator_id}-scorer", daemon=True)
        scorer.start()
        try:
            while not self._stop.is_set():
                self._iterate()
            self._return_leases(self._work.pop_held())  # not started: nothing to finish
            if self._return_in_flight or self.weights.torn:  # (never finish samples on half-loaded weights)
                groups = self._work.pop_in_engine()
                self.engine.abort([self._request_id(g.item, j) for g in groups for j in range(len(g.samples))])
                self._return_leases([g.item for g in groups])
            else:  # drain: finish what the engine holds; the scorer submits it
                while self.engine.in_flight():
                    self._step_engine()
                    self._check_scorer()
            self._work.close()
            scorer.join()
            self._check_scorer()
        except Exception:  # a bug, not a transient failure: let Ray restart the whole actor
            self._failure = self._failure or traceback.format_exc()
            items = self._work.unfinished()
            log.error("generator %s loop crashed; returning %d leases:\n%s", self.generator_id, len(items),
                      self._failure)
            self._return_leases(items)
            self._work.close()
            if _in_ray_actor():
                os._exit(1)
            raise

    def _iterate(self) -> None:
        """One engine-thread iteration: weights, leases, one engine step (or an idle wait)."""
        self._check_scorer()
        self.weights.sync(self.engine, poll=False)
        if self.weights.torn:  # nothing generates on half-loaded weights: retry the load after a backoff
            self._stop.wait(self.cfg.retry_backoff_s)
            return
        self._start_held()
        leased = self._top_up()
        if self.engine.in_flight():
            self._step_engine()
        elif not leased:  # idle: until the lease backoff ends, a submit completes (batch mode) or stop
            t0 = time.monotonic()
            self._wake.wait(min(self.cfg.idle_sleep_s, self._next_lease - t0) if self._next_lease > t0
                            else self.cfg.idle_sleep_s)
            self._wake.clear()
            self.stats.wait_s += time.monotonic() - t0

    def _top_up(self) -> bool:
        """Lease more questions when there is room (streaming) or when the last batch is submitted (batch mode)."""
        if self.weights.load_pending or self.weights.torn or self._work.holding or time.monotonic() < self._next_lease:
            return False  # (leases held for their weights: the next work is already here)
        if self._work.unsubmitted >= self.cfg.max_in_flight:  # the scorer is behind: do not pile up finished groups
            return False
        if self.cfg.streaming:
            # Keep every decode slot busy with about half a lease's samples waiting behind them, so that a slot
            # freed by a finished sample is refilled at the next step. Counted in samples, not questions: in a
            # long tail most questions in flight hold only their one or two slowest samples.
            room = self.cfg.max_in_flight - self._work.in_engine()
            waiting = self.engine.in_flight() - self.engine.slots
            if self._work.in_engine() and (room < 1 or waiting > self.cfg.questions_per_lease * self._samples_per_item // 2):
                return False
        else:
            if self._work.in_engine() or self._work.unsubmitted:
                return False
            room = self.cfg.questions_per_lease
        # nothing in flight: wait for work at the buffer (one long-poll call) rather than poll every idle_sleep_s
        wait = self.cfg.lease_wait_s if self.engine.in_flight() == 0 and not self._stop.is_set() else 0.0
        t0 = time.monotonic()
        items = self._calls.call("lease", self.work_source.lease, self.generator_id,
                                 min(room, self.cfg.questions_per_lease), wait)
        if wait:  # time waiting for work counts as idle (generator/wait_fraction, which the autoscaler reads)
            self.stats.wait_s += time.monotonic() - t0
        if not items:
            self._next_lease = time.monotonic() + self.cfg.idle_sleep_s
            return False
        # Work leased at version v is generated with weights `min_weights` (v + 1 - max(max_lag, 1)) or newer: its
        # group may be trained a batch later, at v + 1, so with max_lag 1 rollouts of v - 1 would go stale. The
        # buffer's version runs ahead of the published weights while a publication is in flight (the driver
        # overlaps it with fetching the next batch, and the long-poll lease answers the moment the version
        # advances), so an item whose weights have not arrived yet is held, out of the engine, until they have
        # (`_start_held`).
        if max(it.version for it in items) > self.engine.version:
            self.weights.sync(self.engine, poll=True)
        self._samples_per_item = max(it.num_samples for it in items) or 1
        start = self._work.add(items, self.engine.version, time.time())
        self.stats.leases_held += len(items) - len(start)
        for it in start:
            self._start(it)
        return True

    def _start(self, it: WorkItem) -> None:
        """Put one leased item's samples into the engine."""
        for j in range(it.num_samples):
            self._requests += 1
            seed = (self._seed_base + 7919 * self._requests + 104_729 * self._incarnation) % (2**31 - 1)
            self.engine.add(self._request_id(it, j), it.question.prompt_ids, seed)
        if it.num_samples == 0:
            self._work.complete(it.lease_id)

    def _start_held(self) -> None:
        """Start the held items whose version the engine has loaded; past half its lease's time left (the version's
        weights did not come: a publication failed or was skipped) an item starts on the weights there are, counted
        in `started_behind_weights`."""
        for it in self._work.due(self.engine.version, time.time()):
            self.stats.started_behind_weights += it.min_weights > self.engine.version
            self._start(it)

    def _step_engine(self) -> None:
        t0 = time.monotonic()
        self.stats.steps_while_scoring += self._reward_calls > 0
        finished = self.engine.step()
        self.stats.generate_s += time.monotonic() - t0
        for rid, sample in finished:
            lease_id, _, j = rid.rpartition("/")
            self._work.finished(lease_id, int(j), sample)

    @staticmethod
    def _request_id(item: WorkItem, j: int) -> str:
        return f"{item.lease_id}/{j}"

    def _check_scorer(self) -> None:
        if self._failure is not None:
            raise RuntimeError(f"the scorer thread failed:\n{self._failure}")

    # --------------------------------------------------------------------------------- scorer thread

    def _score_loop(self) -> None:
        from common.rewards import ScoringAbandoned

        try:
            while (batch := self._work.next_batch()) is not None:
                if self._return_in_flight:
                    self._return_leases([g.item for g in batch])
                else:
                    try:
                        scored = self._score(batch)
                    except ScoringAbandoned as e:  # a stop gave up on the reward: nothing of the batch is submitted
                        self.stats.scoring_abandoned += len(batch)
                        mine = self._work.abandon(batch)  # unless stop() already took them (`unfinished`)
                        log.warning("generator %s: stopping; abandoned scoring %d group(s) (%s); %s", self.generator_id,
                                    len(batch), e, "returning their leases" if mine else "their leases were returned")
                        if mine:
                            self._return_leases([g.item for g in batch])
                    else:
                        self._submit(scored, [g.item for g in batch])
                self._work.scored(batch)
                self._wake.set()
        except Exception:
            self._failure = traceback.format_exc()
            log.error("generator %s scorer crashed:\n%s", self.generator_id, self._failure)
            if _in_ray_actor():
                self._return_leases(self._work.unfinished())
                os._exit(1)

    def _score(self, batch: list[Group]) -> list[ScoredGroup]:
        from common.rewards import ScoreRequest

        t0 = time.monotonic()
        requests = [ScoreRequest(g.item.question.id, s.text, g.item.question.answer) for g in batch for s in g.samples]
        self._reward_calls += 1
        try:
            scores = self.rewards.score(requests)
        finally:
            self._reward_calls -= 1
        self.stats.score_s += time.monotonic() - t0
        if requests:
            last, res = requests[-1], scores[-1]
            self._last_sample = {"question_id": last.question_id, "response": last.response_text,
                                 "answer": last.answer, "reward": float(res.reward), "error": res.error}
        return scored_groups(batch, scores, self.generator_id, self._correctness, self.weights.known_version,
                             self.stats)

    def _submit(self, groups: list[ScoredGroup], items: list[WorkItem]) -> int:
        giving_up = lambda: self._stop.is_set() and self._return_in_flight  # noqa: E731
        return submit_groups(self.work_source, groups, items, self._calls, giving_up)

    def _return_leases(self, items: list[WorkItem]) -> None:
        return_leases(self.work_source, items, self.stats, self.generator_id)


def _in_ray_actor() -> bool:
    return ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None


def _reconstructed() -> bool:
    return _in_ray_actor() and ray.get_runtime_context().was_current_actor_reconstructed


def actor_options(gen_cfg: GeneratorConfig) -> dict:
    """Ray options of a generator actor: resources, restarts, and the environment vLLM needs in an actor."""
    from actors.engines import resolve_engine_config

    threads = str(max(1, int(gen_cfg.num_cpus)))
    env = {"OMP_NUM_THREADS": threads, "TOKENIZERS_PARALLELISM": "false"}
    if isinstance(resolve_engine_config(gen_cfg), VllmEngineConfig):  # without the model: vLLM whenever it may be
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core runs in the actor's process
    opts = dict(num_cpus=gen_cfg.num_cpus, num_gpus=gen_cfg.num_gpus, max_restarts=gen_cfg.max_restarts,
                max_task_retries=0, max_concurrency=4, runtime_env={"env_vars": env})
    if gen_cfg.node_labels:  # only nodes of this group (a tensor-parallel generator's bundles carry it instead)
        opts["label_selector"] = dict(gen_cfg.node_labels)
    return opts


Generator = ray.remote(max_concurrency=4, max_restarts=3, max_task_retries=0)(GeneratorWorker)
"""The Ray actor class. Use `Generator.options(name=..., **actor_options(gen_cfg)).remote(...)`."""
