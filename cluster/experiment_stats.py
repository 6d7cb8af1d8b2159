"""Paired comparisons of experiment variants: a 95% interval of a difference over seeds (Student t), its p-value,
and Holm's step-down adjustment over a family of such differences.

Two variants' runs with the same seed share the data order and the evaluation questions, so the per-seed
difference cancels what they share; the mean of the n differences gets a t interval with n - 1 degrees of
freedom. Student's t is scipy's (`scipy.stats.t`), imported where a quantile or a p-value is computed: it costs
about a second of import, which `exgrpo experiment`'s other commands need not pay.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, replace


def t_quantile(p: float, df: int) -> float:
    """The q with P(T <= q) = p for Student's t with `df` >= 1 degrees of freedom, 0.5 <= p < 1."""
    if not 0.5 <= p < 1 or df < 1:
        raise ValueError(f"t_quantile: need 0.5 <= p < 1 and df >= 1, got p={p}, df={df}")
    from scipy.stats import t

    return float(t.ppf(p, df))


@dataclass(frozen=True)
class Difference:
    """`a` - `b` over the seeds both ran: the mean difference, its t interval at `level` (nan with one seed), the
    sd of the per-seed differences and the two-sided p-value of "no difference" (paired t test; nan with one
    seed)."""

    a: str
    b: str
    seeds: int
    mean: float
    lo: float
    hi: float
    sd: float = float("nan")
    p: float = float("nan")
    level: float = 0.95

    def at_level(self, level: float) -> Difference:
        """The same difference with its interval at another confidence `level` (e.g. a Holm-adjusted one)."""
        if self.seeds < 2:
            return replace(self, level=level)
        half = t_quantile((1 + level) / 2, self.seeds - 1) * self.sd / math.sqrt(self.seeds)
        return replace(self, lo=self.mean - half, hi=self.mean + half, level=level)

    @property
    def beyond_noise(self) -> bool:
        """The interval excludes 0 (False when there is no interval)."""
        return self.lo > 0 or self.hi < 0

    def line(self, note: str = "") -> str:
        """`a − b = +0.031 [+0.004, +0.058] (3 seeds)`, with `: within noise` where the interval holds 0; `note` is
        added in the parentheses (`(3 seeds, Holm: 98.3% interval, adjusted p 0.26)`)."""
        head = f"{self.a} − {self.b} = {_signed(self.mean)}"
        if self.seeds < 2:
            return f"{head} ({self.seeds} seed: no interval)"
        verdict = "" if self.beyond_noise else ": within noise"
        return f"{head} [{_signed(self.lo)}, {_signed(self.hi)}] ({self.seeds} seeds{note}){verdict}"


def paired_difference(a: str, b: str, xa: dict[int, float], xb: dict[int, float],
                      level: float = 0.95) -> Difference | None:
    """`a` - `b` from per-seed values (seed -> value; nan values left out), paired on the seeds both have: mean
    of d_s = xa[s] - xb[s], interval mean ± t_{(1+level)/2, n-1} * sd(d) / sqrt(n). None when no seed is shared."""
    seeds = sorted(s for s in xa.keys() & xb.keys() if not (math.isnan(xa[s]) or math.isnan(xb[s])))
    d = [xa[s] - xb[s] for s in seeds]
    if not d:
        return None
    mean = statistics.fmean(d)
    if len(d) < 2:
        return Difference(a, b, len(d), mean, float("nan"), float("nan"), level=level)
    sd = statistics.stdev(d)
    half = t_quantile((1 + level) / 2, len(d) - 1) * sd / math.sqrt(len(d))
    return Difference(a, b, len(d), mean, mean - half, mean + half, sd, t_p_value(mean, sd, len(d)), level)


def t_p_value(mean: float, sd: float, n: int) -> float:
    """Two-sided p-value of the paired t statistic mean / (sd / sqrt(n)) with n - 1 degrees of freedom (sd 0: 0 for
    a non-zero mean, 1 for a zero one)."""
    if sd == 0:
        return 1.0 if mean == 0 else 0.0
    from scipy.stats import t

    return float(2 * t.sf(abs(mean) / (sd / math.sqrt(n)), n - 1))


def holm(ps: list[float], alpha: float = 0.05) -> tuple[list[float], list[float]]:
    """Holm's step-down over the family `ps` (nan: not in the family): each p-value adjusted, p_(i) ->
    max_{j <= i} min(1, (m - j + 1) p_(j)) over the ascending order, and the confidence level of each one's
    interval. That level is the one the step-down tests it at, 1 - alpha / (m - i + 1) for the i-th smallest, up
    to the first hypothesis not rejected; that one and every later one get its level, so an interval excludes 0
    exactly when its adjusted p-value is below alpha. Controls the family-wise error at alpha."""
    idx = sorted((i for i, p in enumerate(ps) if not math.isnan(p)), key=lambda i: ps[i])
    m = len(idx)
    adjusted, levels = [float("nan")] * len(ps), [float("nan")] * len(ps)
    running, stop = 0.0, None
    for rank, i in enumerate(idx):  # rank 0 is the smallest p
        running = max(running, min(1.0, (m - rank) * ps[i]))
        adjusted[i] = running
        if stop is None and ps[i] >= alpha / (m - rank):
            stop = rank
        levels[i] = 1 - alpha / (m - (rank if stop is None else stop))
    return adjusted, levels


def _signed(x: float) -> str:
    return f"{x:+.3f}".replace("-", "−")
