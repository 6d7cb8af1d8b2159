"""Replay sampling strategies: which stored question to replay, and which of its trajectories.

Pure functions and small classes over plain containers (no Ray, no config). The store calls them
with its bucket index; they can be swapped and tested alone (Reverb's `sampler=` in spirit).

    probs = bucket_probabilities({1, 2, 4}, group_size=8)   # Gaussian weight per non-empty bucket
    picks = GaussianBuckets(8).sample(buckets, all_questions, n, rng)  # [(question_id, probability)]
    idx = LowestEntropy().select(entropies, rng)            # which stored trajectory
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable, Sequence
from typing import Protocol


def bucket_probabilities(
    nonempty_buckets: Iterable[int], group_size: int, mean: float = 0.5, std: float = 0.125
) -> dict[int, float]:
    """Weight of bucket b = N(b / group_size; mean, std), normalised over the non-empty buckets.

    This is the official N(k; 4, 1) for K = 8 written in accuracy units, so it holds for any K. For
    K = 8 and all seven buckets non-empty: 0.004, 0.054, 0.242, 0.399, 0.242, 0.054, 0.004.
    """
    if std <= 0:
        raise ValueError(f"bucket std must be > 0, got {std}")
    weights = {}
    for b in sorted(set(nonempty_buckets)):
        if not 1 <= b <= group_size - 1:
            raise ValueError(f"bucket {b} is outside 1..{group_size - 1} for group size {group_size}")
        z = (b / group_size - mean) / std
        weights[b] = math.exp(-0.5 * z * z)  # the 1/(sigma*sqrt(2 pi)) factor cancels in the normalisation
    total = sum(weights.values())
    if not weights:
        return {}
    if total == 0.0:  # every bucket far in the tails (underflow): fall back to uniform over buckets
        return {b: 1.0 / len(weights) for b in weights}
    return {b: w / total for b, w in weights.items()}


class IndexedSet:
    """A set with O(1) add, remove and uniform draw by position (list + position map)."""

    __slots__ = ("items", "pos")

    def __init__(self) -> None:
        self.items: list[str] = []
        self.pos: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self.items)

    def __contains__(self, x: str) -> bool:
        return x in self.pos

    def add(self, x: str) -> None:
        if x not in self.pos:
            self.pos[x] = len(self.items)
            self.items.append(x)

    def discard(self, x: str) -> None:
        i = self.pos.pop(x, None)
        if i is None:
            return
        last = self.items.pop()
        if i < len(self.items):
            self.items[i] = last
            self.pos[last] = i


def _draw_distinct(s: IndexedSet, taken: set[int], rng: random.Random) -> int:
    """A uniform position of `s` not in `taken` (caller guarantees one exists)."""
    n = len(s)
    if len(taken) * 2 < n:
        while True:
            i = rng.randrange(n)
            if i not in taken:
                return i
    free = [i for i in range(n) if i not in taken]
    return free[rng.randrange(len(free))]


class QuestionSampler(Protocol):
    """Draws `n` distinct stored questions: [(question_id, probability of that draw)]."""

    def sample(
        self, buckets: dict[int, IndexedSet], questions: IndexedSet, n: int, rng: random.Random
    ) -> list[tuple[str, float]]: ...


class GaussianBuckets:
    """Bucket first with `bucket_probabilities`, then uniform inside the bucket, without replacement.

    When a bucket runs out within one request, the remaining non-empty buckets are renormalised.
    """

    def __init__(self, group_size: int, mean: float = 0.5, std: float = 0.125):
        self.group_size, self.mean, self.std = group_size, mean, std
        self._cache: dict[tuple[int, ...], tuple[list[int], list[float], dict[int, float]]] = {}

    def _probs(self, nonempty: tuple[int, ...]):
        hit = self._cache.get(nonempty)
        if hit is None:
            p = bucket_probabilities(nonempty, self.group_size, self.mean, self.std)
            cum, acc = [], 0.0
            for b in nonempty:
                acc += p[b]
                cum.append(acc)
            hit = self._cache[nonempty] = (list(nonempty), cum, p)
        return hit

    def sample(self, buckets, questions, n, rng):
        taken: dict[int, set[int]] = {b: set() for b in buckets}
        out: list[tuple[str, float]] = []
        for _ in range(n):
            nonempty = tuple(b for b in sorted(buckets) if len(buckets[b]) > len(taken[b]))
            if not nonempty:
                break
            order, cum, p = self._probs(nonempty)
            u = rng.random() * cum[-1]
            b = order[-1]
            for bb, c in zip(order, cum):
                if u < c:
                    b = bb
                    break
            s = buckets[b]
            prob = p[b] / (len(s) - len(taken[b]))
            i = _draw_distinct(s, taken[b], rng)
            taken[b].add(i)
            out.append((s.items[i], prob))
        return out


class UniformQuestions:
    """Uniform over all stored questions regardless of bucket (the ablation)."""

    def sample(self, buckets, questions, n, rng):
        taken: set[int] = set()
        out = []
        for _ in range(min(n, len(questions))):
            i = _draw_distinct(questions, taken, rng)
            out.append((questions.items[i], 1.0 / (len(questions) - len(taken))))
            taken.add(i)
        return out


class TrajectorySelector(Protocol):
    """Chooses one of a question's stored trajectories given their current entropy estimates."""

    def select(self, entropies: Sequence[float], rng: random.Random) -> int: ...


class LowestEntropy:
    """The trajectory with the lowest current entropy estimate (ties: the earliest stored)."""

    def select(self, entropies, rng):
        return min(range(len(entropies)), key=entropies.__getitem__)


class RandomTrajectory:
    """A uniformly random stored trajectory (the ablation)."""

    def select(self, entropies, rng):
        return rng.randrange(len(entropies))


def make_question_sampler(kind: str, group_size: int, mean: float, std: float) -> QuestionSampler:
    if kind == "gaussian":
        return GaussianBuckets(group_size, mean, std)
    if kind == "uniform":
        return UniformQuestions()
    raise ValueError(f"question_sampler must be 'gaussian' or 'uniform', got {kind!r}")


def make_trajectory_selector(kind: str) -> TrajectorySelector:
    if kind == "lowest_entropy":
        return LowestEntropy()
    if kind == "random":
        return RandomTrajectory()
    raise ValueError(f"trajectory_selector must be 'lowest_entropy' or 'random', got {kind!r}")
