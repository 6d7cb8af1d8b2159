"""Liveness: the driver never waits without saying why (docs/faults.md).

    placement = check_placement(cfg.generator, cfg.learner, n, totals, largest_node, fixed=embedded)
    if placement.refuse: stop with exit code 2 before any actor starts
    watch = StallWatch(cfg.cluster.stall_report_s, cfg.cluster.stall_timeout_s, now)
    ... every loop iteration without a batch:
    if watch.report_due(now): d = diagnose(...); log d.line and d.hints; log d.metrics (stall/*)
    if watch.expired(now): checkpoint, exit 3 with the diagnosis
    watch.progress(now)   # on a learner step, or a generator finishing its start

Pure functions over plain numbers (no Ray). Exit codes of `exgrpo train`: docs/internals.md#clusterlivenesspy
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from common.text import clip

EXIT_FAILED = 1
EXIT_CONFIG = 2
EXIT_STALLED = 3
EXIT_DISK = 4

RESOURCES = ("CPU", "GPU")


class RunStopped(SystemExit):
    """The run stops with exit code `code` (EXIT_*), after the driver's cleanup ran; `message` says why
    and what to change. A SystemExit so that no `except Exception` on the way swallows it."""

    def __init__(self, message: str, code: int, *, checkpoint: bool = True):
        super().__init__(code)
        self.message, self.checkpoint = message, checkpoint


# ------------------------------------------------------------------------------------- placement


@dataclass(frozen=True)
class Placement:
    """What the cluster can place: `refuse` (never runs here), `warning` (fewer generators than asked)."""

    fit: int
    refuse: str | None = None
    warning: str | None = None


def check_placement(gen, learner, num_generators: int, total: dict[str, float], largest_node: dict[str, float],
                    *, fixed: bool) -> Placement:
    """Can the learner and at least one generator ever be placed? How many generators fit now?

    `gen`/`learner`: GeneratorConfig / LearnerConfig (num_cpus, num_gpus, num_ranks). `total`: the
    cluster's resources; `largest_node`: the most of each resource on one node. `fixed`: the cluster
    cannot grow (an embedded Ray); a joined cluster may get nodes from an autoscaler, so what does not
    fit is a warning there, not a refusal."""
    problems, fit = [], num_generators
    for r in RESOURCES:
        key = r.lower()
        g, per_rank = getattr(gen, f"num_{key}s"), getattr(learner, f"num_{key}s")
        tp = getattr(gen, "tensor_parallel_size", 1) if r == "GPU" else 1
        g *= tp  # a tensor-parallel generator takes tensor_parallel_size GPUs, all on one node
        lrn, have, node = learner.num_ranks * per_rank, total.get(r, 0.0), largest_node.get(r, 0.0)
        if g + lrn > have + 1e-9:
            problems.append(_too_big(r, g, per_rank, learner.num_ranks, have))
        elif g > node + 1e-9 or per_rank > node + 1e-9:
            what = f"generator.num_{key}s" + (f" x generator.tensor_parallel_size={tp}" if tp > 1 else "")
            problems.append(f"a generator needs {g:g} {r} ({what}) and a learner rank {per_rank:g} "
                            f"(learner.num_{key}s) on one node; the largest node has {node:g} {r}")
        elif g > 0:
            fit = min(fit, int((have - lrn + 1e-9) // g))
    if problems:
        text = "; ".join(problems)
        if fixed:
            return Placement(fit=0, refuse=f"this configuration can never be placed on the cluster: {text}")
        return Placement(fit=0, warning=f"the cluster cannot place the learner and one generator yet ({text}); "
                                         "waiting for nodes to join")
    if fit >= num_generators:
        return Placement(fit=num_generators)
    return Placement(fit=fit, warning=_fewer_fit(gen, learner, num_generators, fit, total))


def _too_big(r: str, g: float, per_rank: float, ranks: int, have: float) -> str:
    key = r.lower()
    more = " (cluster.num_cpus)" if r == "CPU" else ""
    need = f"one generator (generator.num_{key}s={g:g}) and the learner (learner.num_ranks={ranks} x " \
           f"learner.num_{key}s={per_rank:g}) need {g + ranks * per_rank:g} {r}; the cluster has {have:g} {r}"
    if have <= 0:
        return f"{need}: set generator.num_{key}s=0 and learner.num_{key}s=0, or run on a cluster with {r}s"
    if have > ranks * per_rank:
        return f"{need}: set generator.num_{key}s={_nice(have - ranks * per_rank)}, or give Ray more {r}s{more}"
    share = _nice(have / (ranks + 1))
    return f"{need}: set learner.num_{key}s={share} and generator.num_{key}s={share}, or give Ray more {r}s{more}"


def _fewer_fit(gen, learner, n: int, fit: int, total: dict[str, float]) -> str:
    parts = []
    for r in RESOURCES:
        key = r.lower()
        g, lrn = getattr(gen, f"num_{key}s"), learner.num_ranks * getattr(learner, f"num_{key}s")
        if g > 0 and n * g + lrn > total.get(r, 0.0) + 1e-9:
            per = _nice((total.get(r, 0.0) - lrn) / n)
            parts.append(f"generator.num_generators={n} needs {n * g:g} {r} + the learner {lrn:g} {r} = "
                         f"{n * g + lrn:g} {r}, the cluster has {total.get(r, 0.0):g} {r} "
                         f"(set generator.num_{key}s={per} to run all {n})")
    return (f"{'; '.join(parts)}: starting with the {fit} generator{'s' if fit != 1 else ''} that fit; the other "
            f"{n - fit} wait{'s' if n - fit == 1 else ''} for resources (reported while they wait; lower "
            f"generator.num_generators to {fit} to silence this)")


def _nice(x: float) -> str:
    """A resource amount rounded down to a tenth, at least 0.1 (what to suggest to the user)."""
    return f"{max(0.1, math.floor(x * 10 + 1e-9) / 10):g}"


# ----------------------------------------------------------------------------------------- stalls


class StallWatch:
    """Times the wait for progress: when to report, when to give up (`timeout_s` 0: never)."""

    def __init__(self, report_every_s: float, timeout_s: float, now: float):
        self.report_every_s, self.timeout_s = report_every_s, timeout_s
        self.since = self.last_report = now

    def progress(self, now: float) -> None:
        self.since = self.last_report = now

    def seconds(self, now: float) -> float:
        return now - self.since

    def report_due(self, now: float) -> bool:
        if now - self.last_report < self.report_every_s:
            return False
        self.last_report = now
        return True

    def expired(self, now: float) -> bool:
        return self.timeout_s > 0 and now - self.since >= self.timeout_s


@dataclass
class Diagnosis:
    """Why no batch arrives: one line for the console, hints (what to change), stall/* metrics."""

    line: str
    hints: list[str] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)
    nothing_left: bool = False  # every training question is retired: waiting cannot help
    all_rewards_zero: bool = False
    scoring_holds: bool = False  # reward calls hang or time out: the reward function holds the run


NOTHING_LEFT = "every training question is retired (solved in all K samples): nothing left to train on"


def scoring_holds(gen: dict[str, float], reward_timeout_s: float) -> bool:
    """Reward calls are in flight and hang or time out: the generators' scoring is what holds the run."""
    return gen.get("reward_in_flight", 0.0) > 0 and (
        gen.get("reward_timeouts", 0.0) > 0 or gen.get("reward_oldest_s", 0.0) >= reward_timeout_s)


def reward_calls_text(gen: dict[str, float]) -> str:
    """The reward calls of `gen` (GeneratorPool.metrics()) for a console line."""
    return (f"reward calls in flight {gen.get('reward_in_flight', 0.0):.0f} (oldest "
            f"{gen.get('reward_oldest_s', 0.0):.0f}s), timed out {gen.get('reward_timeouts', 0.0):.0f}, per call p50 "
            f"{gen.get('reward_call_p50_s', 0.0):.2f}s max {gen.get('reward_call_max_s', 0.0):.2f}s")


def zero_reward_hint(reward_name: str, rollouts: float, errors: float, timeouts: float) -> str:
    """Why every reward is 0: the reward errors first when they explain the zeros (at least half of the
    rollouts), else the data/format mismatch."""
    if errors + timeouts > 0 and errors >= rollouts / 2:
        return (f"every reward so far is 0, and {errors:.0f} of {rollouts:.0f} rollouts were reward errors "
                f"({timeouts:.0f} timeouts) scored 0: reward.name={reward_name} fails or hangs; fix it (its first "
                "error is in the console above and the generator logs) before looking at the data")
    return (f"every reward so far is 0 ({rollouts:.0f} rollouts): check that reward.name={reward_name} "
            "matches the data's answer field and the responses' format")


@dataclass(frozen=True)
class Readings:
    """What the run's parts report during a wait: the generator pool's `status()` (state -> generator ids) and
    `describe()` line, the buffer's `metrics()`, and the generators' `metrics()` (counters summed over generators;
    the reward_* ones live, read while a batch is being scored)."""

    pool: dict[str, list[str]]
    pool_line: str
    buf: dict[str, float]
    gen: dict[str, float]


@dataclass(frozen=True)
class RunOutline:
    """What a wait is judged against: the run's `total_steps`, its training `questions`, its reward function
    (`reward.name`, `reward.timeout_s`) and a batch's questions (`buffer.batch_questions`)."""

    total_steps: int
    questions: int
    reward_name: str
    reward_timeout_s: float = 5.0
    batch_questions: int = 1


def diagnose(seconds: float, step: int, seen: Readings, run: RunOutline) -> Diagnosis:
    """Explain a wait of `seconds` at `step` from what the run's parts report (`seen`). Nothing is left to train on
    when every question is retired and the ready groups cannot make a batch of `run.batch_questions` any more."""
    pool, pool_line, buf, gen = seen.pool, seen.pool_line, seen.buf, seen.gen
    total_steps, n_questions, reward_name = run.total_steps, run.questions, run.reward_name
    reward_timeout_s, batch_questions = run.reward_timeout_s, run.batch_questions

    def b(key: str) -> float:
        return float(buf.get(key, 0.0))

    ready = b("ready_fresh") + b("ready_mixed")
    dropped = {"zero-signal": b("zero_signal"), "stale": b("stale_dropped"), "rejected": b("rejected"),
               "expired leases": b("expired")}
    reward_errors, rollouts, rewarded = gen.get("reward_errors", 0.0), gen.get("rollouts", 0.0), gen.get("rewarded")
    timeouts = gen.get("reward_timeouts", 0.0)
    line = (f"no learner step for {seconds:.0f}s (step {step}/{total_steps}): {pool_line}; "
            f"leases outstanding {b('leases_outstanding'):.0f}, ready groups {ready:.0f}, "
            f"groups accepted {b('accepted'):.0f}; dropped so far: "
            + ", ".join(f"{k} {v:.0f}" for k, v in dropped.items())
            + f"; reward errors {reward_errors:.0f}; {reward_calls_text(gen)}; retired {b('retired'):.0f}/{n_questions}")
    d = Diagnosis(line=line, metrics=stall_metrics(seconds, ready, pool, buf, gen))
    if scoring_holds(gen, reward_timeout_s):
        d.scoring_holds = True
        d.line = f"scoring holds the run: {d.line}"
        d.hints.append(f"the reward function holds the run: reward.name={reward_name} has "
                       f"{gen.get('reward_in_flight', 0.0):.0f} call(s) in flight, the oldest for "
                       f"{gen.get('reward_oldest_s', 0.0):.0f}s, and {timeouts:.0f} timed out after reward.timeout_s="
                       f"{reward_timeout_s:g}s (each scores 0 and replaces its worker); a batch of hanging calls takes "
                       f"calls x timeout per worker: fix the function, lower reward.timeout_s or raise reward.num_workers")
    # the last groups may have come in after the batch wait ended: while they make a batch, the next one takes it
    if n_questions and b("retired") >= n_questions and ready < batch_questions:
        d.nothing_left = True
        d.hints.append(NOTHING_LEFT)
    if not any(pool.values()):
        d.hints.append("no generator is running or starting (scaled to 0? `exgrpo scale --generators N`)")
    elif pool.get("pending") and not any(pool.get(k) for k in ("running", "starting", "restarting")):
        d.hints.append("no generator could be placed yet: free the resources above or lower generator.num_cpus / "
                       "generator.num_gpus")
    if rollouts > 0 and rewarded == 0:
        d.all_rewards_zero = True
        d.hints.append(zero_reward_hint(reward_name, rollouts, reward_errors, timeouts))
    elif b("zero_signal") > 0 and b("accepted") == 0:
        d.hints.append(f"every group so far got equal rewards in all K samples (zero signal, {b('zero_signal'):.0f} "
                       "dropped): the questions are all too hard or all too easy for this model")
    if b("in_flight_last_chance") > 0 and ready >= batch_questions:
        d.hints.append(f"a whole batch is ready and waits for {b('in_flight_last_chance'):.0f} group(s) still being "
                       "generated that it is the last to be able to train within buffer.max_lag (taking newer ones "
                       "instead would drop them as stale); a generator that stalls holding them has its leases ended "
                       "after buffer.lease_timeout_s, or at once when its process dies")
    if b("stale_dropped") > 0 and b("stale_dropped") >= b("accepted"):
        d.hints.append("most groups arrive older than buffer.max_lag: raise buffer.max_lag or add generators")
    if reward_errors > 0 and not d.all_rewards_zero:
        d.hints.append(f"the reward function failed {reward_errors:.0f} times (errors score 0; see the generator logs)")
    return d


def stall_metrics(seconds: float, ready: float, pool: dict[str, list[str]], buf: dict[str, float],
                  gen: dict[str, float]) -> dict[str, float]:
    """The stall/* metrics of a wait of `seconds` with `ready` groups (the arguments as `diagnose` takes them)."""
    def b(key: str) -> float:
        return float(buf.get(key, 0.0))

    metrics = {"stall/seconds": seconds, "stall/ready_groups": ready,
               "stall/reward_errors": gen.get("reward_errors", 0.0),
               "stall/leases_outstanding": b("leases_outstanding"), "stall/zero_signal": b("zero_signal"),
               "stall/stale_dropped": b("stale_dropped"), "stall/rejected": b("rejected"),
               "stall/expired": b("expired"), "stall/retired": b("retired"),
               "stall/reward_in_flight": gen.get("reward_in_flight", 0.0),
               "stall/reward_timeouts": gen.get("reward_timeouts", 0.0),
               "stall/reward_oldest_s": gen.get("reward_oldest_s", 0.0),
               "stall/reward_call_max_s": gen.get("reward_call_max_s", 0.0),
               "stall/in_flight_last_chance": b("in_flight_last_chance")}
    for state, ids in pool.items():
        metrics[f"stall/generators_{state}"] = float(len(ids))
    return metrics


class ErrorWindow:
    """The share of rollouts scored as reward errors over the last `steps` learner steps, from the
    generators' running totals (a total that goes down, a generator restarting, starts a new count)."""

    def __init__(self, steps: int = 10):
        self.steps = steps
        self.last = (0.0, 0.0)
        self.window: list[tuple[float, float]] = []  # (errors, rollouts) per step

    def observe(self, errors_total: float, rollouts_total: float) -> tuple[float, float]:
        """Add one step's totals; returns (errors, rollouts) over the window."""
        if errors_total >= self.last[0] and rollouts_total >= self.last[1]:
            self.window.append((errors_total - self.last[0], rollouts_total - self.last[1]))
            self.window = self.window[-self.steps:]
        self.last = (errors_total, rollouts_total)
        return sum(e for e, _ in self.window), sum(r for _, r in self.window)


class SignalWatch:
    """Batches in a row in which no group has unequal rewards: every advantage is 0, so the step trains on nothing.
    `observe` returns the line to warn with at the `steps`-th such batch in a row, then every `every` more."""

    def __init__(self, temperature: float, steps: int = 3, every: int = 50):
        self.temperature, self.steps, self.every = temperature, steps, every
        self.flat = 0  # batches in a row without signal

    def observe(self, group_rewards: list[list[float]]) -> str | None:
        if any(len(set(rewards)) > 1 for rewards in group_rewards):
            self.flat = 0
            return None
        self.flat += 1
        if self.flat < self.steps or (self.flat - self.steps) % self.every:
            return None
        low = (f"generator.temperature={self.temperature:g} is too low for the K samples of a question to differ; "
               if self.temperature < 0.3 else "")
        return (f"the last {self.flat} batches held no group whose rollouts got different rewards: every advantage is "
                f"0 and each step trains on nothing (learner/pg_loss 0); {low}raise generator.temperature, use harder "
                "or easier questions, or check that the reward tells responses apart")


def sample_text(sample: dict | None, limit: int = 300) -> str:
    """One scored sample (GeneratorPool.last_sample()) as a short hint line."""
    if not sample:
        return "no sample response available yet"
    resp = clip(sample["response"], limit)
    err = f" (reward error: {sample['error']})" if sample.get("error") else ""
    return (f"a sample: question {sample['question_id']}, reference answer {sample['answer'][:limit]!r}, "
            f"response {resp!r} scored {sample['reward']:g}{err}")
