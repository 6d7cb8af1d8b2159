"""The batch-level, run-wide decisions the client takes over the shards (and one shard takes alone): how many
mixed groups a batch holds and how they split over shards, which ready groups a batch takes from which shard,
when mixed mode starts, and the shards' counters merged. Pure functions and small objects, no Ray.

    need = plan_take([shard.ready_summary() for shard in shards], 0, 0, B, rho, switch.on, last_chance)
    quota = mixed_shares(batch_shares, mixed_target(B, rho), version)[shard]
    switch = MixedSwitch(window_groups, accuracy)  # built by the experience policy (mixed_switch)
    if switch.observe(fresh_group_accuracies_of_the_batch): every shard.set_mixed_mode()
    metrics, accounting = merge_metrics(per_shard), merge_accounting(per_shard)

`buffer.core` (one shard) and `buffer.client` (the run, over shards) both use them.
"""

from __future__ import annotations

import functools
import math
from collections import deque


def mixed_target(batch_questions: int, replay_ratio: float) -> int:
    """Mixed groups wanted per batch: ceil(rho * B). Rounding up keeps the back-pressure quotas
    deadlock-free (see ShardCore.capacity)."""
    return min(batch_questions, math.ceil(replay_ratio * batch_questions - 1e-9))


def mixed_shares(shares: list[int], target: int, version: int = 0) -> list[int]:
    """The batch's `target` mixed groups split over the shards in proportion to their batch shares, at `version`:
    each shard the floor of its exact part, and the groups left over to the shards with the largest accumulated
    shortfall (exact part times versions so far, less what they were given; ties to the lower index). They sum to
    `target`, so the shards' replay quotas add up to the whole batch's, where a per-shard floor(rho * share) loses
    groups (shares 6/5/5 at rho 0.5: 7 of 8; shares of 1: none); every shard's long-run share is its exact part,
    rho times its share, within one group at any version (rotating the left-over groups equally gave shares
    [2, 3, 3] at rho 0.25 the parts [0.667, 0.667, 0.667] for [0.5, 0.75, 0.75]), and no shard stays
    replay-only for good (its fresh questions would never be issued)."""
    return list(_shortfall_split(tuple(shares), target).at(version))


@functools.lru_cache(maxsize=64)
def _shortfall_split(shares: tuple[int, ...], target: int) -> _ShortfallSplit:
    """The one `_ShortfallSplit` of (shares, target), kept across calls: a shard asks at every lease."""
    return _ShortfallSplit(shares, target)


class _ShortfallSplit:
    """`mixed_shares` for one (shares, target), version by version from 0."""

    def __init__(self, shares: tuple[int, ...], target: int):
        total = sum(shares)
        self.target = min(target, total)
        self.exact = [self.target * s / total if total else 0.0 for s in shares]
        self.given = [0] * len(shares)
        self.parts: list[tuple[int, ...]] = []

    def at(self, version: int) -> tuple[int, ...]:
        while len(self.parts) <= version:
            v = len(self.parts) + 1  # versions split so far, this one included
            out = [math.floor(x + 1e-9) for x in self.exact]
            short = [v * x - g - o for x, g, o in zip(self.exact, self.given, out)]
            for i in sorted(range(len(out)), key=lambda i: (-short[i], i))[:self.target - sum(out)]:
                out[i] += 1
            self.given = [g + o for g, o in zip(self.given, out)]
            self.parts.append(tuple(out))
        return self.parts[max(version, 0)]


def zero_signal_news(seen: list[list[int]] | None, counts: list[tuple[int, ...]]) -> tuple[int, int, list[list[int]]]:
    """(zero-signal fresh groups, of which all correct) counted by the shards since `seen` (per shard, as
    returned last time; None: nothing seen yet, every count is new; of another length: a state that cannot be
    matched to the shards, nothing counted this time), and the new `seen`.

    `counts[i]` is shard i's (zero, all correct, incarnation): cumulative counters, and the id its state got when
    the shard last restarted from a snapshot. A shard of another incarnation than the one seen contributes nothing
    this time: what it counted since its snapshot cannot be told apart from what was already seen (its restored
    counters may even have passed the seen values already, and their differences would span the restart: a count
    of all-correct groups above the count of groups). Nor does a shard whose counters went back. The all-correct
    count is capped at the zero-signal count, so the switch is never fed more 1.0 accuracies than groups."""
    if seen is None:
        seen = [[0, 0, *c[2:]] for c in counts]
    elif len(seen) != len(counts):
        seen = [list(c) for c in counts]
    n_zero = n_correct = 0
    for was, now in zip(seen, counts):
        d_zero, d_correct = now[0] - was[0], now[1] - was[1]
        if list(was[2:3]) == list(now[2:3]) and d_zero >= 0 and d_correct >= 0:
            n_zero += d_zero
            n_correct += min(d_correct, d_zero)
    return n_zero, n_correct, [list(c) for c in counts]


class MixedSwitch:
    """The delayed start: one decision for the whole run, made once per batch.

    `observe` takes the accuracies (k/K) of the fresh groups a batch consumed (trained, or kept out as
    zero-signal); mixed mode switches on, once and for good, when the moving mean over the last
    `window` of them exceeds `threshold` with the window full. With the window at one batch (the
    default) it fires when the batch accuracy crosses, as the authors' code does."""

    def __init__(self, window: int, threshold: float):
        self.window: deque[float] = deque(maxlen=window)
        self.threshold = threshold
        self.on = False

    def observe(self, accuracies) -> bool:
        """Add one batch's fresh-group accuracies; True exactly when this call switches mixed mode on."""
        self.window.extend(float(a) for a in accuracies)
        if self.on or len(self.window) < self.window.maxlen:
            return False
        self.on = self.mean() > self.threshold
        return self.on

    def mean(self) -> float:
        return sum(self.window) / len(self.window) if self.window else 0.0

    def state(self) -> dict:
        return {"window": list(self.window), "on": self.on}

    def load_state(self, s: dict) -> None:
        self.window.clear()
        self.window.extend(float(x) for x in s["window"])
        self.on = bool(s["on"])


def plan_take(counts: list[tuple], have_fresh: int, have_mixed: int, batch_questions: int,
              replay_ratio: float, mixed_on: bool, last_chance: int | None = None, in_flight_last: int = 0
              ) -> list[tuple[int, int]] | None:
    """Per-shard (n_fresh, n_mixed) to take so that a batch holding `have_*` groups is completed with
    ceil(rho*B) mixed groups when available (once mixed mode is on) and fresh ones for the rest; None
    while the shards' ready `counts` cannot complete it yet.

    `counts[i]` is shard i's `ready_summary`: (fresh, mixed[, fresh versions, mixed versions]), the
    versions as ((version, groups), ...). The oldest groups of all shards go first (a shard takes its own
    oldest first too), so that none ages into staleness while newer ones are trained; without versions,
    shards give in order.

    `last_chance` (the batch's version - max_lag): ready fresh groups of this version or older go stale after this
    batch, so they take the places of mixed groups that can wait for the next one (never of mixed groups that
    cannot). That happens when mixed mode starts: the work leased for the next batch was all fresh (nothing was
    stored yet), so the first batch with ceil(rho*B) mixed groups would drop rho*B fresh ones as stale; instead it
    holds fewer mixed groups, and those wait a batch.

    `in_flight_last`: groups still being generated that this batch is the last to be able to train (the shards'
    `last_chance_in_flight`). While they and the ready groups of the last chance fit in the places left, the batch
    waits for them (None) instead of filling those places with newer groups and leaving them to go stale: the
    back-pressure window leased them a place within max_lag, and batches formed oldest-first keep it."""
    b, have = batch_questions, have_fresh + have_mixed
    if in_flight_last and last_chance is not None and len(counts[0]) > 2:
        ready_last = sum(n for c in counts for kind in (2, 3) for v, n in c[kind] if v <= last_chance)
        if ready_last + in_flight_last <= b - have:
            return None
    avail_m = sum(c[1] for c in counts)
    target_m = mixed_target(b, replay_ratio) if mixed_on else 0
    need_m = max(0, min(target_m - have_mixed, avail_m, b - have))
    if last_chance is not None and need_m and len(counts[0]) > 2:
        last_f = sum(n for c in counts for v, n in c[2] if v <= last_chance)
        last_m = sum(n for c in counts for v, n in c[3] if v <= last_chance)
        need_m = max(min(need_m, last_m), min(need_m, b - have - last_f))
    need_f = b - have - need_m
    if sum(c[0] for c in counts) < need_f:
        return None
    plan = [[0, 0] for _ in counts]
    for kind, need in ((0, need_f), (1, need_m)):
        if len(counts[0]) > 2:
            lots = sorted((v, i, n) for i, c in enumerate(counts) for v, n in c[2 + kind])
        else:
            lots = [(0, i, c[kind]) for i, c in enumerate(counts)]
        for _, i, n in lots:
            take = min(n, need)
            plan[i][kind] += take
            need -= take
    return [(f, m) for f, m in plan]


def balance(a: dict[str, int]) -> int:
    return a["issued"] - (a["trained"] + a["stale_dropped"] + a["zero_signal"] + a["lost"] + a["outstanding"] + a["ready"])


def finish_metrics(m: dict[str, float]) -> dict[str, float]:
    """Derive ratios from summed counters (works for one shard and for sums over shards)."""
    m["replay_fraction"] = m["trained_mixed"] / m["trained"] if m.get("trained") else 0.0
    c = m.get("chosen_measured", 0.0)
    m["entropy_chosen_mean"] = m["entropy_chosen_sum"] / c if c else 0.0
    m["entropy_available_mean"] = m["entropy_available_sum"] / c if c else 0.0
    return m


_MAX_KEYS = ("mixed_mode", "version", "epoch", "stored_bytes_max", "snapshot_last_s")  # the fullest/slowest shard
_DERIVED = ("replay_fraction", "entropy_chosen_mean", "entropy_available_mean")


def merge_metrics(per_shard: list[dict[str, float]]) -> dict[str, float]:
    """Shard metrics -> one dict: counters summed, flags/versions maxed, ratios recomputed."""
    out: dict[str, float] = {}
    for m in per_shard:
        for k, v in m.items():
            if k in _DERIVED:
                continue
            out[k] = max(out.get(k, v), v) if k in _MAX_KEYS else out.get(k, 0.0) + v
    return finish_metrics(out) if out else out


def merge_accounting(per_shard: list[dict[str, int]]) -> dict[str, int]:
    out: dict[str, int] = {}
    for a in per_shard:
        for k, v in a.items():
            out[k] = out.get(k, 0) + v
    if out:
        out["balance"] = balance(out)
    return out
