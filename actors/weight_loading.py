"""Weight loading in a generator: keep one engine on the newest published weights.

    weights = WeightLoader(gen_cfg, weight_source, model_path, calls, on_version=wake)   # calls: RemoteCalls
    weights.sync(engine, required=True)    # at start: the newest version, if newer than the model folder's
    weights.start_watching()               # weight_wait_s > 0: one long-poll call at the store at a time;
                                           # on_version() when it sees a new one
    ...
    weights.sync(engine, poll=False)       # every engine-thread iteration: load what the watcher saw, or poll
                                           # at most every weight_poll_s
    weights.torn / weights.load_pending    # the engine must not step / leasing pauses

When a version loads, torn loads, what it owns apart from the generator: docs/internals.md#actorsweight_loadingpy
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from actors.remote_calls import RemoteCalls
from common.config import GeneratorConfig
from common.interfaces import Engine, WeightSource

log = logging.getLogger("actors.generator")


class WeightLoader:
    """What one generator knows of the published weights, and the loads into its engine."""

    def __init__(self, cfg: GeneratorConfig, source: WeightSource, model_path: str, calls: RemoteCalls, *,
                 on_version: Callable[[], None]):
        """`calls`: the generator's remote calls (its id, counters, backoff and stop); `on_version()`: called by the
        weight watcher when it sees a new version (it wakes the generator's engine thread)."""
        self.cfg, self.source, self.model_path, self.calls = cfg, source, model_path, calls
        self.generator_id, self.stats = calls.generator_id, calls.stats
        self._on_version = on_version
        self.known_version = 0  # newest version the weight store announced
        self.load_pending = False  # a newer version waits for the samples in flight (in_flight_updates=false)
        self.torn = False  # a load failed part-way: the engine holds parts of two versions and must not step
        self._next_poll = 0.0
        self._watcher: threading.Thread | None = None  # waits at the weight store for new versions (weight_wait_s)
        self._watch_token = 0  # a watcher of an earlier start ends when it sees a newer token
        self._announced = None  # the newest announcement the watcher saw
        self._merger = None  # actors.adapters.AdapterMerger: the base of adapter publications (LoRA), on first use

    def start_watching(self) -> None:
        """At every start: a new weight watcher (`weight_wait_s` > 0 and a store that long-polls); the one of an
        earlier start ends."""
        self._watch_token += 1
        self._announced = None
        self._watcher = None
        if self.cfg.weight_wait_s > 0:
            self._watcher = threading.Thread(target=self._watch, args=(self._watch_token,),
                                             name=f"{self.generator_id}-weights", daemon=True)
            self._watcher.start()

    def sync(self, engine: Engine, *, required: bool = False, poll: bool = True) -> None:
        """Load the newest published version if it is newer than the engine's.

        `poll=False` reads what the weight watcher learnt (`weight_wait_s`; no call), or asks the weight store at
        most every `weight_poll_s`. With samples in flight the load happens now (`in_flight_updates`) or once they
        are done (leasing pauses meanwhile)."""
        now = time.monotonic()
        watched = None if poll or self.load_pending or self.torn else self._watched(engine)
        if watched is False or (watched is None and not poll and not self.load_pending and not self.torn
                                and now < self._next_poll):
            return  # the watcher saw nothing newer than the engine's version, or the next poll is not due
        if not (self.torn or not self.load_pending or engine.in_flight() == 0):
            return
        self._next_poll = now + self.cfg.weight_poll_s
        ann = watched or self.calls.call("latest", self.source.latest, required=required)
        if ann is None:
            return
        self.known_version = max(self.known_version, ann.version)
        if ann.version <= engine.version and not self.torn:
            self.load_pending = False
            return
        in_flight = engine.in_flight()
        if in_flight and not self.cfg.in_flight_updates and not self.torn:
            self.load_pending = True  # leasing pauses; the samples in flight finish under the old version
            return
        t0 = time.monotonic()
        buckets = self.calls.call("fetch", self._fetch, ann, required=required)
        if buckets is None:
            return
        try:  # bucket by bucket, each fetched as it is loaded
            engine.load_weights(buckets, ann.version, partial=ann.adapters is not None)
        except self.calls.retryable as e:
            self.torn = True
            self.stats.loads_torn += 1
            self.stats.source_errors += 1
            log.error("generator %s: loading version %d failed part-way (%s: %s); the engine holds parts of "
                      "two versions and generates nothing until a whole version has loaded", self.generator_id,
                      ann.version, type(e).__name__, e)
            return
        self.torn = False
        dt = time.monotonic() - t0
        self.load_pending = False
        self.stats.weight_loads += 1
        self.stats.loads_in_flight += in_flight > 0
        self.stats.weight_load_s += dt
        self.stats.weight_load_s_last = dt
        self.calls.call("ack", self.source.ack, self.generator_id, ann.version, required=required)
        log.info("generator %s loaded weights version %d in %.2fs (%d samples in flight)", self.generator_id,
                 ann.version, dt, in_flight)

    def _fetch(self, ann):
        """The buckets of `ann`'s version for `engine.load_weights`, fetched as they are loaded; an adapter-only
        publication (LoRA) is received whole here and merged into the base as the engine loads it
        (`actors.adapters`: a partial state), so a failed transfer tears nothing. The merger is made at the first
        one (it logs once). None where the store already dropped that version (the next one is taken)."""
        try:
            buckets = self.source.fetch_buckets(ann)
            if ann.adapters is None:
                return buckets
            if self._merger is None:
                from actors.adapters import AdapterMerger

                self._merger = AdapterMerger(self.model_path, who=f"generator {self.generator_id}")
            return self._merger.merge(buckets, ann.adapters)
        except KeyError as e:
            log.warning("generator %s: weights no longer in the store (%s); taking the next version",
                        self.generator_id, e)
            self.stats.source_errors += 1
            return None

    def _watched(self, engine: Engine):
        """With the weight watcher running: its newest announcement if newer than the engine's version, else False;
        None without a watcher (the caller polls)."""
        if self._watcher is None or not self._watcher.is_alive():
            return None
        ann = self._announced
        return ann if ann is not None and ann.version > engine.version else False

    def _watch(self, token: int) -> None:
        """The weight watcher: one long-poll call at the weight store at a time (`weight_wait_s`); a new version
        is recorded for the engine loop, which is woken (`on_version`). Ends with the loop (the generator's stop) or
        when a newer watcher starts."""
        known = -1
        while not self.calls.stopped and token == self._watch_token:
            try:
                ann = self.source.wait_newer(known, self.cfg.weight_wait_s)
            except (LookupError, *self.calls.retryable) as e:  # the store restarts or is not there yet: ask again
                self.stats.source_errors += 1
                log.info("generator %s: waiting for weights failed (%s: %s); retrying", self.generator_id,
                         type(e).__name__, e)
                self.calls.back_off()
                continue
            if ann is not None and ann.version != known:
                known = ann.version
                self._announced = ann
                self._on_version()
