"""The generator actor: lease work, generate, score, stream scored groups back; load new weights between batches.

    gen = Generator.options(name=actor_name(run, "generator", i)).remote(
        generator_id, gen_cfg, reward_cfg, model_path, work_source, weight_source, task_name)
    ray.get(gen.start.remote())       # load the model folder, fetch the newest weights, then start leasing
    ...
    ray.get(gen.stop.remote(drain=True))   # finish the batch in flight (drain=False: return its leases)

The loop (one iteration = one batch, in a background thread):

    items  = work_source.lease(generator_id, questions_per_lease)     # [] -> sleep idle_sleep_s, retry
    outs   = engine.generate([prompt ids], [item.num_samples], seed)  # ONE engine call for the whole lease
    scores = reward_pool.score([...every sample...])                  # one call
    work_source.submit([ScoredGroup per item])                        # one call
    ann = weight_source.latest()                                      # the safe point
    if ann.version > engine.version: engine.load_weights(weight_source.fetch(ann), ann.version); ack

Replay items arrive with `num_samples = K-1` (the buffer joins the stored trajectory), fresh ones
with K: the generator just generates what the item asks for. Every rollout carries the policy
version of the engine that generated it.

Failures: a buffer or weight-store call that fails with a Ray/availability error is logged, counted
(`source_errors`) and retried after `retry_backoff_s` (a shard may be restarting from its snapshot);
a batch whose submit keeps failing until its leases' deadlines is dropped and counted
(`groups_dropped`) — the buffer reissues those leases when they expire. Any other error in the
loop is a bug: it is logged with its traceback and the actor process exits, so Ray restarts it
(`max_restarts`); a restarted actor starts itself again (clean start) and its old leases expire.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
import traceback
from dataclasses import dataclass, field

import ray

from common.config import GeneratorConfig, RewardConfig, VllmEngineConfig
from common.interfaces import Engine, WeightSource, WorkSource
from common.messages import Rollout, ScoredGroup, WorkItem, float32_array, int32_array

log = logging.getLogger(__name__)

RETRYABLE = (RuntimeError, TimeoutError, ConnectionError, ray.exceptions.RayError)
"""Errors of a remote buffer / weight-store call that mean "not now" (BufferUnavailableError is a RuntimeError)."""


@dataclass
class GeneratorStats:
    """Counters of one generator incarnation (`metrics()` turns them into rates)."""

    started_at: float = field(default_factory=time.monotonic)
    batches: int = 0
    groups: int = 0
    rollouts: int = 0
    tokens: int = 0
    generate_s: float = 0.0
    score_s: float = 0.0
    wait_s: float = 0.0  # leases came back empty, or a source call failed and we backed off
    lag_sum: int = 0
    lag_max: int = 0
    weight_loads: int = 0
    weight_load_s: float = 0.0
    weight_load_s_last: float = 0.0
    startup_s: float = 0.0
    reward_errors: int = 0
    rewarded: int = 0  # rollouts with a reward above 0 (none at all: the reward function or data is wrong)
    source_errors: int = 0
    groups_dropped: int = 0
    leases_returned: int = 0
    submit: dict[str, int] = field(default_factory=dict)


class GeneratorWorker:
    """The body of the `Generator` Ray actor (a plain class: it also runs in-process)."""

    def __init__(self, generator_id: str, gen_cfg: GeneratorConfig, reward_cfg: RewardConfig, model_path: str,
                 work_source: WorkSource, weight_source: WeightSource, task_name: str | None):
        self.generator_id = generator_id
        self.cfg, self.reward_cfg, self.model_path = gen_cfg, reward_cfg, model_path
        self.work_source, self.weight_source, self.task_name = work_source, weight_source, task_name
        self.engine: Engine | None = None
        self.rewards = None
        self.stats = GeneratorStats()
        self._stop = threading.Event()
        self._return_in_flight = False
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()
        self._in_flight: list[WorkItem] = []
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
            register = getattr(self.weight_source, "register", None)  # optional beyond the WeightSource protocol
            if register is not None:
                try:
                    register(self.generator_id)
                except LookupError as e:  # no learner yet: the first ack registers us
                    log.info("generator %s: not registered with the weight store yet (%s)", self.generator_id, e)
            self._sync_weights(required=True)
            self.stats.startup_s = time.monotonic() - t0
            if self.stats.batches == 0:
                self.stats.started_at = time.monotonic()  # rates count from the first lease, not model loading
            self._stop.clear()
            self._return_in_flight = False
            self._thread = threading.Thread(target=self._run, name=f"{self.generator_id}-loop", daemon=True)
            self._thread.start()
            log.info("generator %s started at version %d in %.1fs", self.generator_id, self.engine.version,
                     self.stats.startup_s)
            return {"version": float(self.engine.version), "startup_s": self.stats.startup_s}

    def _restart(self) -> None:
        try:
            self.start()
        except Exception:  # nobody awaits this thread: crash the actor so Ray restarts it again (or gives up)
            self._failure = traceback.format_exc()
            log.error("generator %s could not restart:\n%s", self.generator_id, self._failure)
            os._exit(1)

    def stop(self, drain: bool = True) -> dict[str, float]:
        """Clean stop: no new leases; the batch in flight is submitted (drain) or its leases returned.

        Returns the final metrics. After `stop` the actor can be killed without losing work.
        """
        self._return_in_flight = not drain
        self._stop.set()
        thread = self._thread
        if thread is not None:
            thread.join(timeout=self.cfg.stop_timeout_s)
            if thread.is_alive():
                log.error("generator %s: batch in flight did not finish within stop_timeout_s=%.0fs; "
                          "returning its %d leases", self.generator_id, self.cfg.stop_timeout_s, len(self._in_flight))
                self._return_leases(list(self._in_flight))
        unregister = getattr(self.weight_source, "unregister", None)
        if unregister is not None:
            try:
                unregister(self.generator_id)
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

    def last_sample(self) -> dict | None:
        """The last response this generator scored: question id, response text, reference answer,
        reward and reward error (None before the first batch)."""
        return self._last_sample

    def metrics(self) -> dict[str, float]:
        """Counters and rates of this incarnation (all floats)."""
        s = self.stats
        wall = max(time.monotonic() - s.started_at, 1e-9)
        out = {
            "running": float(self._thread is not None and self._thread.is_alive()),
            "version": float(self.engine.version) if self.engine is not None else -1.0,
            "batches": float(s.batches),
            "groups": float(s.groups),
            "rollouts": float(s.rollouts),
            "tokens": float(s.tokens),
            "tokens_per_s": s.tokens / s.generate_s if s.generate_s else 0.0,
            "rollouts_per_s": s.rollouts / wall,
            "wall_tokens_per_s": s.tokens / wall,
            "generate_s": s.generate_s,
            "score_s": s.score_s,
            "wait_s": s.wait_s,
            "wait_fraction": s.wait_s / wall,
            "version_lag_mean": s.lag_sum / s.batches if s.batches else 0.0,
            "version_lag_max": float(s.lag_max),
            "weight_loads": float(s.weight_loads),
            "weight_load_s": s.weight_load_s,
            "weight_load_s_last": s.weight_load_s_last,
            "startup_s": s.startup_s,
            "reward_errors": float(s.reward_errors),
            "rewarded": float(s.rewarded),
            "source_errors": float(s.source_errors),
            "groups_dropped": float(s.groups_dropped),
            "leases_returned": float(s.leases_returned),
            "uptime_s": wall,
        }
        out.update({f"submit_{k}": float(v) for k, v in s.submit.items()})
        return out

    # --------------------------------------------------------------------------------------- loop

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self.run_once()
        except Exception:  # a bug, not a transient failure: let Ray restart the whole actor
            self._failure = traceback.format_exc()
            log.error("generator %s loop crashed; returning %d leases:\n%s", self.generator_id,
                      len(self._in_flight), self._failure)
            self._return_leases(list(self._in_flight))
            if _in_ray_actor():
                os._exit(1)
            raise

    def run_once(self) -> int:
        """One batch: lease, weight check, generate, score, submit, weight check. Returns groups submitted.

        The weight store is read right after a successful lease (one ~2 ms call) so that work leased
        just after a publication — always the case in synchronous mode, where the buffer leases nothing
        until the learner has published the next version — is generated with that version, not the old
        one (whose groups would only be dropped as stale). While idle it is read too, so a new version
        is usually loaded before the next lease arrives."""
        items = self._call("lease", self.work_source.lease, self.generator_id, self.cfg.questions_per_lease)
        if not items:
            t0 = time.monotonic()
            self._sync_weights()
            self._stop.wait(self.cfg.idle_sleep_s)
            self.stats.wait_s += time.monotonic() - t0
            return 0
        self._in_flight = items
        self._sync_weights()
        version = self.engine.version
        groups = self._generate_and_score(items, version)
        if self._return_in_flight:
            self._return_leases(items)
            return 0
        submitted = self._submit(groups, items)
        self._in_flight = []
        self._sync_weights(batch_version=version)
        return submitted

    def _generate_and_score(self, items: list[WorkItem], version: int) -> list[ScoredGroup]:
        from common.rewards import ScoreRequest

        t0 = time.monotonic()
        seed = (self._seed_base + 7919 * self.stats.batches + 104_729 * self._incarnation) % (2**31 - 1)
        outs = self.engine.generate([it.question.prompt_ids for it in items], [it.num_samples for it in items], seed)
        t1 = time.monotonic()
        requests = [ScoreRequest(it.question.id, s.text, it.question.answer) for it, o in zip(items, outs) for s in o]
        scores = self.rewards.score(requests)
        if requests:
            last, res = requests[-1], scores[-1]
            self._last_sample = {"question_id": last.question_id, "response": last.response_text,
                                 "answer": last.answer, "reward": float(res.reward), "error": res.error}
        results = iter(scores)
        self.stats.generate_s += t1 - t0
        self.stats.score_s += time.monotonic() - t1

        groups = []
        for it, samples in zip(items, outs):
            rollouts, errors = [], 0
            for s in samples:
                res = next(results)
                errors += res.error is not None
                self.stats.rewarded += res.reward > 0
                rollouts.append(Rollout(
                    response_ids=int32_array(s.token_ids), logprobs=float32_array(s.logprobs),
                    reward=float(res.reward), correct=bool(res.reward >= self.reward_cfg.correct_threshold),
                    entropy=float(s.entropy), version=version, finish_reason=s.finish_reason,
                ))
                self.stats.tokens += len(s.token_ids)
            self.stats.rollouts += len(rollouts)
            self.stats.reward_errors += errors
            groups.append(ScoredGroup(lease_id=it.lease_id, question_id=it.question.id, rollouts=rollouts,
                                      generator_id=self.generator_id, reward_errors=errors))
        return groups

    def _submit(self, groups: list[ScoredGroup], items: list[WorkItem]) -> int:
        """Submit the batch; retry while the buffer is unavailable, until the leases' deadlines pass."""
        deadline = min(it.deadline for it in items)
        while True:
            try:
                result = self.work_source.submit(groups)
                break
            except RETRYABLE as e:
                self.stats.source_errors += 1
                if time.time() + self.cfg.retry_backoff_s > deadline or self._stop.is_set() and self._return_in_flight:
                    log.error("generator %s: dropping %d groups after submit failed (%s: %s); the buffer reissues "
                              "their leases when they expire", self.generator_id, len(groups), type(e).__name__, e)
                    self.stats.groups_dropped += len(groups)
                    return 0
                log.warning("generator %s: submit failed (%s: %s); retrying in %.1fs", self.generator_id,
                            type(e).__name__, e, self.cfg.retry_backoff_s)
                time.sleep(self.cfg.retry_backoff_s)
        for k, v in (result or {}).items():
            self.stats.submit[k] = self.stats.submit.get(k, 0) + int(v)
        self.stats.batches += 1
        self.stats.groups += len(groups)
        return len(groups)

    def _return_leases(self, items: list[WorkItem]) -> None:
        if not items:
            return
        ids = [it.lease_id for it in items]
        try:
            self.work_source.return_leases(ids)
            self.stats.leases_returned += len(ids)
        except RETRYABLE as e:  # they expire on their own; say so
            self.stats.source_errors += 1
            log.warning("generator %s: could not return %d leases (%s: %s); they will expire and be reissued",
                        self.generator_id, len(ids), type(e).__name__, e)
        self._in_flight = []

    def _sync_weights(self, *, required: bool = False, batch_version: int | None = None) -> None:
        """The safe point: load the newest published version if it is newer than the engine's."""
        ann = self._call("latest", self.weight_source.latest, required=required)
        if ann is None:
            return
        if batch_version is not None:
            lag = max(0, ann.version - batch_version)
            self.stats.lag_sum += lag
            self.stats.lag_max = max(self.stats.lag_max, lag)
        if ann.version <= self.engine.version:
            return
        t0 = time.monotonic()
        state_dict = self._call("fetch", self.weight_source.fetch, ann, required=required)
        if state_dict is None:
            return
        self.engine.load_weights(state_dict, ann.version)
        dt = time.monotonic() - t0
        self.stats.weight_loads += 1
        self.stats.weight_load_s += dt
        self.stats.weight_load_s_last = dt
        self._call("ack", self.weight_source.ack, self.generator_id, ann.version, required=required)
        log.info("generator %s loaded weights version %d in %.2fs", self.generator_id, ann.version, dt)

    def _call(self, what: str, fn, *args, required: bool = False):
        """A remote call that may fail transiently: log, count, back off; None when it failed.

        `required` calls (during start) retry until they succeed or the actor is stopped.
        """
        while True:
            try:
                return fn(*args)
            except KeyError as e:  # fetch: the store already dropped that version
                if what != "fetch":
                    raise
                log.warning("generator %s: weights no longer in the store (%s); taking the next version",
                            self.generator_id, e)
                self.stats.source_errors += 1
                return None
            except RETRYABLE as e:
                self.stats.source_errors += 1
                log.warning("generator %s: %s failed (%s: %s); retrying in %.1fs", self.generator_id, what,
                            type(e).__name__, e, self.cfg.retry_backoff_s)
                t0 = time.monotonic()
                self._stop.wait(self.cfg.retry_backoff_s)
                self.stats.wait_s += time.monotonic() - t0
                if not required or self._stop.is_set():
                    return None


def _in_ray_actor() -> bool:
    return ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None


def _reconstructed() -> bool:
    return _in_ray_actor() and ray.get_runtime_context().was_current_actor_reconstructed


def actor_options(gen_cfg: GeneratorConfig) -> dict:
    """Ray options of a generator actor: resources, restarts, and the environment vLLM needs in an actor."""
    from actors.engines import resolve_engine_config

    threads = str(max(1, int(gen_cfg.num_cpus)))
    env = {"OMP_NUM_THREADS": threads, "TOKENIZERS_PARALLELISM": "false"}
    if isinstance(resolve_engine_config(gen_cfg.engine), VllmEngineConfig):
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core runs in the actor's process
    return dict(num_cpus=gen_cfg.num_cpus, num_gpus=gen_cfg.num_gpus, max_restarts=gen_cfg.max_restarts,
                max_task_retries=0, max_concurrency=4, runtime_env={"env_vars": env})


Generator = ray.remote(max_concurrency=4, max_restarts=3, max_task_retries=0)(GeneratorWorker)
"""The Ray actor class. Use `Generator.options(name=..., **actor_options(gen_cfg)).remote(...)`."""

