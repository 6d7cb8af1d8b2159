"""A generator's counters (one incarnation) and the metrics derived from them."""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class GeneratorStats:
    """Counters of one generator incarnation (`metrics()` turns them into rates)."""

    started_at: float = field(default_factory=time.monotonic)
    batches: int = 0  # submit calls that succeeded
    groups: int = 0
    rollouts: int = 0
    tokens: int = 0
    generate_s: float = 0.0  # engine busy: inside engine.step() (samples in flight)
    score_s: float = 0.0
    steps_while_scoring: int = 0  # engine steps taken while a scoring call was in progress (streaming overlap)
    wait_s: float = 0.0  # engine idle: nothing in flight (no work leased, waiting for a submit or a backoff)
    lag_sum: int = 0
    lag_max: int = 0
    weight_loads: int = 0
    weight_load_s: float = 0.0
    weight_load_s_last: float = 0.0
    loads_in_flight: int = 0  # weight loads with samples in flight (partial rollouts)
    loads_torn: int = 0  # loads that failed part-way (a bucket did not arrive): reloaded whole before generating
    rollouts_spanning: int = 0  # rollouts whose tokens come from more than one policy version
    leases_held: int = 0  # work items leased at a version whose weights had not arrived: held out of the engine
    started_behind_weights: int = 0  # ... of which started before those weights came (half the lease's time passed)
    startup_s: float = 0.0
    reward_errors: int = 0
    rewarded: int = 0  # rollouts with a reward above 0 (none at all: the reward function or data is wrong)
    reasoning_checked: int = 0  # correct rollouts whose reasoning the task checked (see common.tasks Task.reasoning)
    reasoning_valid: int = 0  # ... and found valid
    reasoning_errors: int = 0  # correct rollouts whose reasoning check raised (not checked: see actors.scoring)
    source_errors: int = 0
    groups_dropped: int = 0
    leases_returned: int = 0
    scoring_abandoned: int = 0  # groups whose scoring a stop abandoned (their leases returned)
    submit: dict[str, int] = field(default_factory=dict)

    def as_metrics(self, *, running: bool, version: int, in_flight: int, rewards: dict | None) -> dict[str, float]:
        """Counters and rates (all floats). `rewards`: the reward pool's live `stats()` (None before it exists)."""
        s = self
        wall = max(time.monotonic() - s.started_at, 1e-9)
        out = {
            "running": float(running),
            "version": float(version),
            "batches": float(s.batches),
            "groups": float(s.groups),
            "rollouts": float(s.rollouts),
            "tokens": float(s.tokens),
            "tokens_per_s": s.tokens / s.generate_s if s.generate_s else 0.0,
            "rollouts_per_s": s.rollouts / wall,
            "wall_tokens_per_s": s.tokens / wall,
            "generate_s": s.generate_s,
            "score_s": s.score_s,
            "steps_while_scoring": float(s.steps_while_scoring),
            "wait_s": s.wait_s,
            "wait_fraction": s.wait_s / wall,
            "busy_fraction": s.generate_s / wall,
            "in_flight": float(in_flight),
            "version_lag_mean": s.lag_sum / s.groups if s.groups else 0.0,
            "version_lag_max": float(s.lag_max),
            "weight_loads": float(s.weight_loads),
            "weight_load_s": s.weight_load_s,
            "weight_load_s_last": s.weight_load_s_last,
            "loads_in_flight": float(s.loads_in_flight),
            "loads_torn": float(s.loads_torn),
            "rollouts_spanning": float(s.rollouts_spanning),
            "leases_held": float(s.leases_held),
            "started_behind_weights": float(s.started_behind_weights),
            "startup_s": s.startup_s,
            "reward_errors": float(s.reward_errors),
            "rewarded": float(s.rewarded),
            "reasoning_checked": float(s.reasoning_checked),
            "reasoning_valid": float(s.reasoning_valid),
            "reasoning_errors": float(s.reasoning_errors),
            "source_errors": float(s.source_errors),
            "groups_dropped": float(s.groups_dropped),
            "leases_returned": float(s.leases_returned),
            "uptime_s": wall,
        }
        out.update({f"submit_{k}": float(v) for k, v in s.submit.items()})
        out["scoring_abandoned"] = float(s.scoring_abandoned)
        if rewards is not None:  # live, also while a batch is being scored
            r = rewards
            out.update(reward_in_flight=float(r["in_flight"]), reward_timeouts=float(r["timeouts"]),
                       reward_oldest_s=float(r["oldest_s"]), reward_call_p50_s=float(r["call_p50_s"]),
                       reward_call_max_s=float(r["call_max_s"]))
        return out


def peak_memory_bytes() -> int:
    """This process's peak memory so far: CUDA's max allocated bytes where it has used a GPU (the engine's weights,
    KV cache and decode tensors; the caching allocator's slack left out), else its peak resident set (VmHWM). The
    learner's `learner/peak_memory_gib` is measured the same way."""
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return int(torch.cuda.max_memory_allocated())
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
    except (OSError, StopIteration):
        return 0
