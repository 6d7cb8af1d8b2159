"""Reward functions and the pool that runs them safely.

A reward function is `fn(response_text: str, answer: str) -> float in [0, 1]`, named in the registry
(`common.reward_registry`): `countdown`, `arithmetic`, `exact`, `math`, `math_think`, or
`package.module:function` (any importable user function). `RewardPool(reward_cfg, task_name).score(requests)`
scores a batch and never raises for a bad reward function: a call that raises, hangs, crashes its worker or
returns anything but a real number in [0, 1] scores 0. `stats()` is live (any thread); `abandon()` makes the
current or next `score` raise `ScoringAbandoned` within ~0.2 s.

Each function, where it runs (in-process, or a worker with a deadline per call): docs/internals.md#commonrewardspy
"""

from __future__ import annotations

import logging
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import msgpack

from common.config import RewardConfig
from common.reward_registry import check_task_matches, resolve_reward
from common.reward_worker import check_value, score_one
from common.text import clip

log = logging.getLogger(__name__)

@dataclass(frozen=True, slots=True)
class ScoreRequest:
    """One response to score.  # generator -> reward pool"""

    question_id: str
    response_text: str
    answer: str


@dataclass(frozen=True, slots=True)
class ScoreResult:
    """Its reward in [0, 1]; `error` says why it was forced to 0 (None when the function answered)."""

    reward: float
    error: str | None = None


# -------------------------------------------------------------------------------------------- pool


CALL_WINDOW = 256  # recent calls whose durations give the p50/max of `RewardPool.stats()`
ABANDON_POLL_S = 0.2  # how often a waiting `score` looks at `abandon()`


class ScoringAbandoned(Exception):
    """`RewardPool.abandon()` was called while (or before) `score` ran: its batch has no results."""

    def __init__(self, scored: int, total: int):
        super().__init__(f"scoring abandoned with {scored} of {total} responses scored")
        self.scored, self.total = scored, total


class RewardPool:
    """Scores batches of responses with a per-call timeout; see the module docstring.

        pool = RewardPool(cfg.reward, task_name="countdown")
        results = pool.score([ScoreRequest(q.id, text, q.answer) for ...])   # one call per batch
        pool.stats()   # live: calls, errors, timeouts, worker_restarts, in_flight, oldest_s, call_p50_s, ...
        pool.abandon() # from another thread: the running `score` raises ScoringAbandoned
        pool.close()

    One `score` call at a time (a generator scores its batches in turn); `stats` and `abandon` may be
    called from any thread. Workers start on the first call that needs them and live until `close()`
    (also called on garbage collection).
    """

    def __init__(self, reward_cfg: RewardConfig, task_name: str | None = None):
        self.cfg, self.task_name = reward_cfg, task_name  # the built-in task of the questions it scores (or None)
        self._workers: list[_Worker | None] = []  # set first: __del__ runs even when construction fails
        self._fn, self._in_process = resolve_reward(reward_cfg.name)
        check_task_matches(reward_cfg.name, task_name)
        self._workers = [None] * reward_cfg.num_workers
        self._stats = {"calls": 0, "errors": 0, "timeouts": 0, "worker_restarts": 0}
        self._lock = threading.Lock()  # guards _stats, _durations, _in_flight, _started (read by stats())
        self._durations: deque[float] = deque(maxlen=CALL_WINDOW)  # seconds per finished call
        self._in_flight = 0  # calls of the running batch without a result yet
        self._started: dict[int, float] = {}  # job worker -> when its current call started (monotonic)
        self._abandon = threading.Event()
        self._batch_ids: list[str] = []  # question ids of the running batch (for the first timeout's message)
        self.first_timeout: dict | None = None  # the first call that timed out: question_id, response, answer, ...

    def score(self, items: list[ScoreRequest]) -> list[ScoreResult]:
        """One result per request, in order. Never raises for a bad reward function; raises
        `ScoringAbandoned` after `abandon()`."""
        if self._abandon.is_set():
            raise ScoringAbandoned(0, len(items))
        limit = self.cfg.max_response_chars
        pairs = [(_tail(r.response_text, limit), r.answer) for r in items]
        self._batch_ids = [r.question_id for r in items]
        if self._in_process:
            raw = []
            for resp, ans in pairs:
                t0 = time.monotonic()
                raw.append(score_one(self._fn, resp, ans))
                with self._lock:
                    self._durations.append(time.monotonic() - t0)
        else:
            with self._lock:
                self._in_flight = len(pairs)
            try:
                raw = self._score_in_workers(pairs)
            finally:
                with self._lock:
                    self._in_flight, self._started = 0, {}
        with self._lock:
            self._stats["calls"] += len(items)
        return [self._result(req, reward, error) for req, (reward, error) in zip(items, raw)]

    def stats(self) -> dict[str, float]:
        """Live counters since construction: calls, errors (all forced zeros), timeouts, worker_restarts;
        the running batch's calls in flight and the age of the oldest running call (`oldest_s`); seconds
        per call over the last CALL_WINDOW calls (`call_p50_s`, `call_max_s`, 0 before any)."""
        with self._lock:
            out: dict[str, float] = dict(self._stats)
            durations = sorted(self._durations)
            out["in_flight"] = self._in_flight
            oldest = min(self._started.values(), default=None)
        out["oldest_s"] = time.monotonic() - oldest if oldest is not None else 0.0
        out["call_p50_s"] = durations[len(durations) // 2] if durations else 0.0
        out["call_max_s"] = durations[-1] if durations else 0.0
        return out

    def abandon(self) -> None:
        """Stop scoring for good (thread-safe): the running or next `score` raises `ScoringAbandoned`."""
        self._abandon.set()

    def close(self) -> None:
        """Stop the worker processes (idempotent)."""
        for i, w in enumerate(self._workers):
            if w is not None:
                w.stop()
                self._workers[i] = None

    def __enter__(self) -> RewardPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        self.close()

    # -- internals

    def _result(self, req: ScoreRequest, reward: float | None, error: str | None) -> ScoreResult:
        if error is None and reward is not None:
            return ScoreResult(reward)
        with self._lock:
            self._stats["errors"] += 1
        if not (error or "").startswith("timed out"):  # timeouts: the first is printed when it happens
            log.warning("reward %s on question %s: %s (scored 0)", self.cfg.name, req.question_id, error)
        return ScoreResult(0.0, error)

    def _call_started(self, job: _Job) -> None:
        """The job's worker begins its next item: a new per-call deadline and start time."""
        now = time.monotonic()
        job.deadline = now + self.cfg.timeout_s
        with self._lock:
            if job.done:
                self._started.pop(job.worker, None)
            else:
                self._started[job.worker] = now

    def _call_ended(self, job: _Job, results, result: tuple[float | None, str | None]) -> None:
        """Record the result of the job's current item (and its duration), move to the next."""
        results[job.indices[job.pos]] = result
        job.pos += 1
        with self._lock:
            self._in_flight -= 1
            start = self._started.get(job.worker)
            if start is not None:
                self._durations.append(time.monotonic() - start)

    def _score_in_workers(self, pairs: list[tuple[str, str]]) -> list[tuple[float | None, str | None]]:
        results: list[tuple[float | None, str | None]] = [(None, "not scored")] * len(pairs)
        n = len(self._workers)
        jobs = [_Job(w, list(range(w * len(pairs) // n, (w + 1) * len(pairs) // n))) for w in range(n)]
        jobs = [j for j in jobs if j.indices]
        self._start_missing([j.worker for j in jobs])
        for job in jobs:
            self._send(job, pairs, results)
        while any(not j.done for j in jobs):
            if self._abandon.is_set():
                for w in range(n):  # a worker may be inside a call that never ends: kill them all
                    if self._workers[w] is not None:
                        self._workers[w].stop()
                        self._workers[w] = None
                raise ScoringAbandoned(sum(j.pos for j in jobs), len(pairs))
            if not self._collect(jobs, pairs, results):
                self._expire_one(jobs, pairs, results)
        return results

    def _start_missing(self, indices: list[int]) -> None:
        started = []
        for i in indices:
            if self._workers[i] is None or not self._workers[i].alive():
                if self._workers[i] is not None:
                    self._workers[i].stop()
                self._workers[i] = _Worker(self.cfg)
                started.append(i)
        for i in started:
            self._workers[i].wait_ready(self.cfg.worker_start_timeout_s)

    def _send(self, job: _Job, pairs, results) -> None:
        """Send the job's remaining items to its worker; on a dead worker, fail them all."""
        w = self._workers[job.worker]
        if w.failure is not None:
            while not job.done:
                self._call_ended(job, results, (None, f"reward worker unavailable: {w.failure}"))
            self._call_started(job)
            return
        try:
            w.send([list(pairs[i]) for i in job.indices[job.pos:]])
        except OSError as e:
            w.failure = f"cannot send to the worker ({e})"
            return self._send(job, pairs, results)
        self._call_started(job)

    def _replace(self, job: _Job, pairs, results) -> None:
        """Kill the job's worker, start a new one and resend what is left."""
        self._workers[job.worker].stop()
        self._workers[job.worker] = None
        if job.done:
            with self._lock:
                self._started.pop(job.worker, None)
            return
        with self._lock:
            self._stats["worker_restarts"] += 1
        self._start_missing([job.worker])
        self._send(job, pairs, results)

    def _collect(self, jobs: list[_Job], pairs, results) -> bool:
        """Wait until a worker answers or the nearest deadline passes; False when nothing arrived.

        Only after a wait that found nothing may a job be expired, so time spent restarting a worker
        never turns another worker's already-written answers into timeouts.
        """
        active = {self._workers[j.worker].fd: j for j in jobs if not j.done}
        wait = max(0.0, min(j.deadline for j in active.values()) - time.monotonic())
        readable, _, _ = select.select(list(active), [], [], min(wait, ABANDON_POLL_S))
        if not readable and wait > ABANDON_POLL_S:
            return True  # no deadline passed yet: the caller looks at abandon() and waits again
        for fd in readable:
            job = active[fd]
            messages, eof = self._workers[job.worker].read()
            for reward, error in messages:
                if job.done:
                    break
                self._call_ended(job, results, (reward, error) if error else check_value(reward))
                self._call_started(job)
            if eof and not job.done:
                code = self._workers[job.worker].exit_code()
                self._call_ended(job, results, (None, f"reward worker died (exit code {code})"))
                self._replace(job, pairs, results)
        return bool(readable)

    def _expire_one(self, jobs: list[_Job], pairs, results) -> None:
        """Time out the current item of the first job past its deadline and replace its worker."""
        now = time.monotonic()
        for job in jobs:
            if not job.done and now >= job.deadline:
                i = job.indices[job.pos]
                self._call_ended(job, results, (None, f"timed out after {self.cfg.timeout_s:g} s"))
                with self._lock:
                    self._stats["timeouts"] += 1
                    first = self._stats["timeouts"] == 1
                if first:
                    response, answer = pairs[i]
                    self.first_timeout = {"question_id": self._batch_ids[i], "response": response, "answer": answer,
                                          "reward": 0.0, "error": f"timed out after {self.cfg.timeout_s:g} s"}
                    head = clip(response, 200)  # as it is: shown with repr, its newlines too
                    log.warning("reward %s timed out on question %s after reward.timeout_s=%g s (scored 0, its worker "
                                "replaced; later timeouts are counted, not printed): response %r, reference answer "
                                "%r", self.cfg.name, self._batch_ids[i], self.cfg.timeout_s, head, answer[:200])
                self._replace(job, pairs, results)
                return


def _tail(text: str, limit: int) -> str:
    if not isinstance(text, str):
        return ""
    return text if len(text) <= limit else text[-limit:]


@dataclass
class _Job:
    """A worker's contiguous share of one batch; `pos` is the item it is working on."""

    worker: int
    indices: list[int]
    pos: int = 0
    deadline: float = field(default=float("inf"))

    @property
    def done(self) -> bool:
        return self.pos >= len(self.indices)


class _Worker:
    """One `python -m common.reward_worker` process in its own process group."""

    def __init__(self, cfg: RewardConfig):
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p or os.getcwd() for p in sys.path)
        env["EXGRPO_REWARD_MEMORY_MB"] = str(cfg.worker_memory_mb)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "common.reward_worker", cfg.name],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, start_new_session=True,
        )
        self.fd = self.proc.stdout.fileno()
        os.set_blocking(self.fd, False)
        self.unpacker = msgpack.Unpacker(raw=False, max_buffer_size=64 << 20)
        self.failure: str | None = None

    def alive(self) -> bool:
        return self.failure is None and self.proc.poll() is None

    def wait_ready(self, timeout_s: float) -> None:
        """Block until the worker has imported the reward function; on failure set `failure`."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            readable, _, _ = select.select([self.fd], [], [], max(0.0, deadline - time.monotonic()))
            if not readable:
                break
            messages, eof = self.read()
            if messages:
                if messages[0][0] != "ready":
                    self.failure = f"reward function failed to load: {messages[0][-1]}"
                return
            if eof:
                self.failure = f"worker exited at start (exit code {self.exit_code()})"
                return
        self.failure = f"worker did not start within {timeout_s:g} s (reward.worker_start_timeout_s)"
        log.error("reward worker: %s", self.failure)

    def exit_code(self, wait_s: float = 5.0) -> int | None:
        """The exit code once the process has ended (waiting up to `wait_s`), else None."""
        try:
            return self.proc.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            return None

    def send(self, chunk: list) -> None:
        self.proc.stdin.write(msgpack.packb(chunk))
        self.proc.stdin.flush()

    def read(self) -> tuple[list, bool]:
        """Messages available now, and whether the worker closed its output."""
        try:
            data = os.read(self.fd, 1 << 16)
        except BlockingIOError:
            return [], False
        if not data:
            return [], True
        self.unpacker.feed(data)
        return list(self.unpacker), False

    def stop(self) -> None:
        """Kill the worker's process group and reap it."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                f.close()
            except OSError:  # the pipe is broken once the worker is gone; nothing left to flush
                pass
