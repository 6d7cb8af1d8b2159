"""A leased question's way from the engine to the buffer: its samples as they finish (`Group`), and the scored
group the buffer takes (`scored_groups`): each sample's reward, whether it counts as correct, the task's reasoning
check of correct responses, and the versions it was generated under. The scorer thread's loop around it (one
reward call for everything queued, submit, return leases): actors/generator.py.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from actors.remote_calls import RETRYABLE, RemoteCalls
from common.interfaces import WorkSource
from common.messages import Rollout, ScoredGroup, WorkItem, float32_array, int32_array

log = logging.getLogger("actors.generator")

@dataclass(frozen=True)
class Correctness:
    """What counts as a correct sample: a reward of at least `threshold` (`reward.correct_threshold`), and where the
    task checks reasoning (`reasoning`, None: it does not), whether a correct response's reasoning is valid."""

    threshold: float
    reasoning: Callable[[str, str, str], bool | None] | None = None


@dataclass
class Group:
    """One leased question on its way through the engine and the scorer."""

    item: WorkItem
    samples: list
    left: int


def scored_groups(batch: list[Group], scores: list, generator_id: str, correctness: Correctness, known_version: int,
                  stats) -> list[ScoredGroup]:
    """The groups of `batch` with `scores` (one per sample, in order), judged by `correctness`; the versions' lag
    behind `known_version`; counts what it saw in `stats`."""
    results = iter(scores)
    groups = []
    for g in batch:
        rollouts, errors = [], 0
        for s in g.samples:
            res = next(results)
            errors += res.error is not None
            rollouts.append(_rollout(s, res, correctness, g.item, stats))
        if rollouts:
            lag = max(0, known_version - min(r.version for r in rollouts))
            stats.lag_sum += lag
            stats.lag_max = max(stats.lag_max, lag)
        stats.rollouts += len(rollouts)
        stats.reward_errors += errors
        groups.append(ScoredGroup(lease_id=g.item.lease_id, question_id=g.item.question.id, rollouts=rollouts,
                                  generator_id=generator_id, reward_errors=errors))
    return groups


def _rollout(s, res, correctness: Correctness, item: WorkItem, stats) -> Rollout:
    stats.rewarded += res.reward > 0
    oldest, newest = s.versions
    stats.rollouts_spanning += newest != oldest
    correct = bool(res.reward >= correctness.threshold)
    valid = None
    if correct and correctness.reasoning is not None:
        q = item.question
        valid, error = check_reasoning(correctness.reasoning, s.text, q.prompt, q.answer, q.id)
        stats.reasoning_errors += error is not None
    stats.reasoning_checked += valid is not None
    stats.reasoning_valid += bool(valid)
    stats.tokens += len(s.token_ids)
    return Rollout(response_ids=int32_array(s.token_ids), logprobs=float32_array(s.logprobs), reward=float(res.reward),
                   correct=correct, entropy=float(s.entropy), version=oldest, finish_reason=s.finish_reason,
                   newest_version=newest, valid=-1 if valid is None else int(valid))


def check_reasoning(reasoning: Callable[[str, str, str], bool | None], text: str, prompt: str, answer: str,
                    question_id: str) -> tuple[bool | None, str | None]:
    """(valid, None), or (None, error) when the task's reasoning check raised on this response: a model's output is
    data, so a check that fails on it (RecursionError, MemoryError, a bug) is logged and counted, never a crashed
    scorer, which would crash the generator again on the same question when its lease is reissued."""
    try:
        return reasoning(text, prompt, answer), None
    except Exception as e:  # noqa: BLE001 -- any failure of the check on one response is that response's problem
        error = f"{type(e).__name__}: {str(e)[:200]}"
        log.warning("reasoning check on question %s raised %s on a response of %d characters (counted in "
                    "reasoning_errors; its reasoning is not checked)", question_id, error, len(text))
        return None, error


def submit_groups(work_source: WorkSource, groups: list[ScoredGroup], items: list[WorkItem], calls: RemoteCalls,
                  giving_up: Callable[[], bool]) -> int:
    """Submit in one call; retry (`calls.backoff_s` apart) while the buffer is unavailable, until the leases'
    deadlines pass (or `giving_up`). How many groups were submitted."""
    stats, backoff_s, generator_id = calls.stats, calls.backoff_s, calls.generator_id
    deadline = min(it.deadline for it in items)
    while True:
        try:
            result = work_source.submit(groups)
            break
        except RETRYABLE as e:
            stats.source_errors += 1
            if time.time() + backoff_s > deadline or giving_up():
                log.error("generator %s: dropping %d groups after submit failed (%s: %s); the buffer reissues "
                          "their leases when they expire", generator_id, len(groups), type(e).__name__, e)
                stats.groups_dropped += len(groups)
                return 0
            log.warning("generator %s: submit failed (%s: %s); retrying in %.1fs", generator_id,
                        type(e).__name__, e, backoff_s)
            time.sleep(backoff_s)
    for k, v in (result or {}).items():
        stats.submit[k] = stats.submit.get(k, 0) + int(v)
    stats.batches += 1
    stats.groups += len(groups)
    return len(groups)


def return_leases(work_source: WorkSource, items: list[WorkItem], stats, generator_id: str) -> None:
    """Give the leases back (their questions are issued again at once); when the buffer does not answer they
    expire on their own, and that is said."""
    if not items:
        return
    ids = [it.lease_id for it in items]
    try:
        work_source.return_leases(ids)
        stats.leases_returned += len(ids)
    except RETRYABLE as e:
        stats.source_errors += 1
        log.warning("generator %s: could not return %d leases (%s: %s); they will expire and be reissued",
                    generator_id, len(ids), type(e).__name__, e)


def end_dead_leases(work_source: WorkSource, generator_id: str) -> int | None:
    """End the leases `generator_id` holds because its process died (`WorkSource.end_leases_of`): their questions
    are issued again now instead of holding the buffer's back-pressure window until lease_timeout_s. How many;
    None when the buffer did not answer (said here: they expire at their deadline, as before)."""
    try:
        return work_source.end_leases_of(generator_id)
    except RETRYABLE as e:
        log.warning("generator %s: the leases of its dead process could not be ended (%s); they expire at their "
                    "deadline", generator_id, e)
        return None
