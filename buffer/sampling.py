"""Replay sampling strategies: which stored question to replay, and which of its trajectories.

Pure functions and small classes over plain containers (no Ray, no config). The store calls them
with its bucket index; they can be swapped and tested alone (Reverb's `sampler=` in spirit).

    probs = bucket_probabilities({1, 2, 4}, group_size=8)   # Gaussian weight per non-empty bucket
    picks = GaussianBuckets(8).sample(buckets, n, rng)      # [(question_id, probability)]
    idx = LowestEntropy().candidates(entropies, measured, rng)  # which stored trajectories go to the learner

Question samplers (`buffer.question_sampler`): `GaussianBuckets` (ExGRPO's), `UniformQuestions` (plain replay's
uniform draw: Arnal et al., arXiv 2604.08706), `AdvantagePrioritised` (|advantage|-prioritised replay: arXiv
2606.04560, prime-rl #2273). Trajectory selectors (`buffer.trajectory_selector`): `LowestEntropy`,
`LowestStoredEntropy`, `RandomTrajectory`.
"""

from __future__ import annotations

import bisect
import itertools
import math
import random
from collections.abc import Iterable, Sequence
from typing import Protocol


def bucket_probabilities(
    nonempty_buckets: Iterable[int], group_size: int, mean: float = 0.5, std: float = 0.125
) -> dict[int, float]:
    """Weight of bucket b = N(b / group_size; mean, std), normalised over the non-empty buckets.

    This is the authors' N(k; 4, 1) for K = 8 written in accuracy units, so it holds for any K. For
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


class QuestionSampler(Protocol):
    """Draws up to `n` distinct stored questions from the buckets: [(question_id, probability)], where
    probability is the chance of that question in a single draw."""

    skips_solved: bool  # questions whose latest group was all correct (kept, without retirement) are never drawn

    def sample(self, buckets: dict[int, IndexedSet], n: int, rng: random.Random) -> list[tuple[str, float]]: ...


class GaussianBuckets:
    """Bucket first with `bucket_probabilities`, then uniform inside the bucket, without replacement.

    The n bucket draws are made first; a draw that lands on a bucket already used up within this
    request is redrawn over the remaining non-empty buckets (renormalised). Then each bucket gives its
    count of distinct questions uniformly (`random.sample`). Cost: O(n log K), independent of the
    number of stored questions.
    """

    skips_solved = False

    def __init__(self, group_size: int, mean: float = 0.5, std: float = 0.125):
        self.group_size, self.mean, self.std = group_size, mean, std
        self._cache: dict[tuple[int, ...], tuple[list[int], list[float], dict[int, float]]] = {}

    def _probs(self, nonempty: tuple[int, ...]):
        hit = self._cache.get(nonempty)
        if hit is None:
            p = bucket_probabilities(nonempty, self.group_size, self.mean, self.std)
            hit = self._cache[nonempty] = (list(nonempty), list(itertools.accumulate(p[b] for b in nonempty)), p)
        return hit

    def sample(self, buckets, n, rng):
        size = {b: len(s.items) for b, s in buckets.items() if s.items}
        n = min(n, sum(size.values()))
        if n <= 0:
            return []
        p_first = self._probs(tuple(sorted(size)))[2]
        count = dict.fromkeys(size, 0)
        order, cum, _ = self._probs(tuple(sorted(size)))
        drawn = 0
        while drawn < n:
            b = order[min(bisect.bisect_right(cum, rng.random() * cum[-1]), len(order) - 1)]
            if count[b] < size[b]:
                count[b] += 1
                drawn += 1
                if count[b] == size[b]:  # used up: renormalise over the others for the next draws
                    left = tuple(x for x in order if count[x] < size[x])
                    if left:
                        order, cum, _ = self._probs(left)
        out = []
        for b, c in count.items():
            items, prob = buckets[b].items, p_first[b] / size[b]
            out.extend((items[i], prob) for i in rng.sample(range(size[b]), c))
        return out


class UniformQuestions:
    """Uniform over all stored questions regardless of bucket (the ablation)."""

    skips_solved = False

    def sample(self, buckets, n, rng):
        order = [b for b in sorted(buckets) if buckets[b].items]
        ends = list(itertools.accumulate(len(buckets[b].items) for b in order))
        total = ends[-1] if ends else 0
        out = []
        for g in rng.sample(range(total), min(n, total)):
            j = bisect.bisect_right(ends, g)
            start = ends[j - 1] if j else 0
            out.append((buckets[order[j]].items[g - start], 1.0 / total))
        return out


class AdvantagePrioritised:
    """Questions drawn with probability proportional to the |advantage| their stored trajectories had: a correct
    trajectory (reward 1) in a group of K with k correct has A = 1 - k/K, so q weighs 1 - b/K with b its bucket (its
    latest k), the same for all of q's trajectories (priority replay by |A|: arXiv 2606.04560, prime-rl #2273).
    Without replacement (successive draws over the questions left, each bucket's weight its questions left x
    1 - b/K), uniform inside a bucket. `probability` is q's chance in a single draw, (1 - b/K) / sum over the stored
    questions of 1 - b'/K. Cost O(n K). A question whose latest group was all correct has A = 0 for every trajectory
    and is never drawn (`skips_solved`: the store hides those it kept without retirement)."""

    skips_solved = True

    def __init__(self, group_size: int):
        self.group_size = group_size

    def sample(self, buckets, n, rng):
        size = {b: len(s.items) for b, s in buckets.items() if s.items}
        weight = {b: 1.0 - b / self.group_size for b in size}  # b in 1..K-1: every weight in (0, 1)
        total = sum(size[b] * weight[b] for b in size)
        count = dict.fromkeys(size, 0)
        for _ in range(min(n, sum(size.values()))):
            left = [(b, (size[b] - count[b]) * weight[b]) for b in size if count[b] < size[b]]
            x, b = rng.random() * sum(w for _, w in left), left[-1][0]
            for cand, w in left:
                if x < w:
                    b = cand
                    break
                x -= w
            count[b] += 1
        out = []
        for b, c in count.items():
            out.extend((buckets[b].items[i], weight[b] / total) for i in rng.sample(range(size[b]), c))
        return out


class TrajectorySelector(Protocol):
    """Chooses which of a question's stored trajectories travel with its mixed group (indices)."""

    def candidates(self, entropies: Sequence[float], measured: Sequence[bool], rng: random.Random) -> list[int]:
        """`entropies[i]` as last recorded; `measured[i]`: by the learner (else the generator's estimate)."""
        ...


class LowestEntropy:
    """Ship every stored trajectory: the learner scores them under the policy it is training and picks the lowest
    score (`buffer.trajectory_score`): the lowest mean token entropy by default, the paper's rule (the authors'
    code computes another score, `learner.batching.chunk_window_spans`). The buffer's own estimates are not
    used."""

    def candidates(self, entropies, measured, rng):
        return list(range(len(entropies)))


class LowestStoredEntropy:
    """Ship one: the lowest entropy as stored, no scoring forward under the current weights (not SU-01's rule,
    which re-scores its candidates). Learner-measured values first (each from the policy that last measured it): an
    unmeasured one (a vLLM estimate is a lower bound) only if none is."""

    def candidates(self, entropies, measured, rng):
        pool = [i for i, m in enumerate(measured) if m] or list(range(len(entropies)))
        return [min(pool, key=lambda i: entropies[i])]


class RandomTrajectory:
    """Ship one uniformly random stored trajectory (the ablation): nothing left for the learner to choose."""

    def candidates(self, entropies, measured, rng):
        return [rng.randrange(len(entropies))]


def make_question_sampler(kind: str, group_size: int, mean: float, std: float) -> QuestionSampler:
    if kind == "gaussian":
        return GaussianBuckets(group_size, mean, std)
    if kind == "uniform":
        return UniformQuestions()
    if kind == "advantage":
        return AdvantagePrioritised(group_size)
    raise ValueError(f"question_sampler must be 'gaussian', 'uniform' or 'advantage', got {kind!r}")


def make_trajectory_selector(kind: str) -> TrajectorySelector:
    if kind == "lowest_entropy":
        return LowestEntropy()
    if kind == "lowest_stored_entropy":
        return LowestStoredEntropy()
    if kind == "random":
        return RandomTrajectory()
    raise ValueError(f"trajectory_selector must be 'lowest_entropy', 'lowest_stored_entropy' or 'random', got {kind!r}")
