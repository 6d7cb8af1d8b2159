"""A generator's calls to its buffer and weight store, retried the one way all its threads retry them.

    calls = RemoteCalls(generator_id, stats, backoff_s=cfg.retry_backoff_s, stop=stop_event)
    items = calls.call("lease", work_source.lease, generator_id, n, wait)   # None: it failed (logged, counted)
    calls.call("latest", source.latest, required=True)                      # at start: until it answers or a stop
    if calls.back_off(): ...                                                 # waited backoff_s, or stopped

The engine thread, the scorer thread and the weight watcher (`actors.weight_loading`) share one.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import ray

from actors.generator_stats import GeneratorStats

log = logging.getLogger("actors.generator")

RETRYABLE = (RuntimeError, TimeoutError, ConnectionError, ray.exceptions.RayError)
"""Errors of a remote buffer / weight-store call that mean "not now" (BufferUnavailableError is a RuntimeError)."""


class RemoteCalls:
    """Remote calls that may fail transiently (`RETRYABLE`: logged, counted in `stats.source_errors`, backed off
    `backoff_s`), and the generator's stop, which ends every backoff and every retry."""

    retryable = RETRYABLE

    def __init__(self, generator_id: str, stats: GeneratorStats, *, backoff_s: float, stop: threading.Event):
        self.generator_id, self.stats, self.backoff_s = generator_id, stats, backoff_s
        self._stop = stop  # the generator's: set by its stop, cleared by its start

    @property
    def stopped(self) -> bool:
        return self._stop.is_set()

    def back_off(self) -> bool:
        """Wait `backoff_s`, or until the generator stops; whether it stopped."""
        return self._stop.wait(self.backoff_s)

    def call(self, what: str, fn: Callable, *args: Any, required: bool = False) -> Any:
        """`fn(*args)`; None when it failed transiently. A `required` call (during start) is retried until it
        answers or the generator stops; the time backing off counts as the generator's wait."""
        while True:
            try:
                return fn(*args)
            except RETRYABLE as e:
                self.stats.source_errors += 1
                log.warning("generator %s: %s failed (%s: %s); retrying in %.1fs", self.generator_id, what,
                            type(e).__name__, e, self.backoff_s)
                t0 = time.monotonic()
                self.back_off()
                self.stats.wait_s += time.monotonic() - t0
                if not required or self.stopped:
                    return None
