"""The run's health between and after learner steps: stalls, reward errors and all-zero rewards, each judged in
one place. `RunHealth` says what it sees (console, stall/* metrics) and answers with the `RunStopped` to raise
when a policy says stop; the loop (cluster/driver.py) decides nothing about health itself.
The diagnoses and their wording: cluster/liveness.py; the exit codes: docs/faults.md.
"""

from __future__ import annotations

import logging
import time

from cluster.liveness import (
    EXIT_FAILED, EXIT_STALLED, NOTHING_LEFT, ErrorWindow, Readings, RunOutline, RunStopped, SignalWatch, StallWatch,
    diagnose, sample_text, zero_reward_hint,
)
from common.messages import TrainingBatch

log = logging.getLogger("exgrpo")

REWARD_ERROR_WINDOW = 10  # learner steps over which reward.max_error_fraction is measured


class RunHealth:
    """One attempt's health policies over its generator pool and buffer (`tracking`: the run's LateStart)."""

    def __init__(self, cfg, generators, buffer, num_questions: int, tracking):
        self.cfg, self.generators, self.buffer, self.tracking = cfg, generators, buffer, tracking
        self.num_questions = num_questions
        self.watch = StallWatch(cfg.cluster.stall_report_s, cfg.cluster.stall_timeout_s, time.monotonic())
        self._pool_reported: float | None = None  # None: not yet reported (at the first batch)
        self._zero_hinted = self._timeout_shown = False
        self._reward_errors = ErrorWindow(REWARD_ERROR_WINDOW)
        self._errors_warned_at = -REWARD_ERROR_WINDOW
        self._all_error_steps: int | None = 0  # steps of this attempt with every rollout a reward error (None: not all)
        self._signal = SignalWatch(cfg.generator.temperature)

    # ------------------------------------------------------------------------- between batches

    def watch_generators(self) -> None:
        """Adopt started generators and replace dead ones (GeneratorsFailed past the budget); a generator
        finishing its start counts as progress."""
        before = self.generators.running
        self.generators.poll()
        if self.generators.running > before:
            self.watch.progress(time.monotonic())

    def batch_arrived(self, batch: TrainingBatch) -> None:
        """Progress; generators still waiting for resources are reported (at the first batch, then every
        `stall_report_s`); the first batch whose rewards are all 0 is explained."""
        now = time.monotonic()
        self.watch.progress(now)
        st = self.generators.status()
        if (st["pending"] or st["restarting"] or st["respawn"]) and \
                (self._pool_reported is None or now - self._pool_reported >= self.cfg.cluster.stall_report_s):
            self._pool_reported = now
            log.warning("%s", self.generators.describe())
        rewards = [[r.reward for r in g.rollouts] for g in batch.groups]
        all_zero = not any(x > 0 for group in rewards for x in group)
        flat = self._signal.observe(rewards)
        if flat is not None and not all_zero:  # all 0: explained below instead
            log.warning("%s", flat)
        if not self._zero_hinted and all_zero:
            self._zero_hinted = True
            m = self.generators.metrics()
            hint = zero_reward_hint(self.cfg.reward.name, m.get("rollouts", 0.0), m.get("reward_errors", 0.0),
                                    m.get("reward_timeouts", 0.0))
            log.warning("every reward in this batch is 0; %s; %s", hint.removeprefix("every reward so far is 0, and ")
                        .removeprefix("every reward so far is 0 "), sample_text(self.generators.last_sample()))

    def no_batch(self, step: int) -> None:
        """No batch this time: stop at once when nothing is left to train on; say why every `stall_report_s`
        (console and stall/* metrics); past `stall_timeout_s` stop with exit code 3."""
        cfg, now = self.cfg, time.monotonic()
        buf = self.buffer.metrics()
        nothing_left = (cfg.buffer.collect and buf.get("retired", 0.0) >= self.num_questions
                        and buf.get("ready_fresh", 0.0) + buf.get("ready_mixed", 0.0) < cfg.buffer.batch_questions)
        due, expired = self.watch.report_due(now), self.watch.expired(now)
        if not (due or expired or nothing_left):
            return
        seen = Readings(self.generators.status(), self.generators.describe(), buf, self.generators.metrics())
        run = RunOutline(cfg.total_steps, self.num_questions, cfg.reward.name, cfg.reward.timeout_s,
                         cfg.buffer.batch_questions)
        d = diagnose(self.watch.seconds(now), step, seen, run)
        self.tracking.log_metrics(d.metrics, step)
        if d.scoring_holds and (not self._timeout_shown or expired):
            self._timeout_shown = True
            d.hints.append("the first reward call that timed out: " + sample_text(self.generators.last_sample("timeout")))
        elif d.all_rewards_zero and (not self._zero_hinted or expired):
            self._zero_hinted = True
            d.hints.append(sample_text(self.generators.last_sample()))
        if d.nothing_left:
            raise RunStopped(f"{NOTHING_LEFT} ({self.num_questions} questions); use more or harder data "
                             "(a retired question is never issued again)", EXIT_STALLED)
        text = d.line + "".join(f"\n  hint: {h}" for h in d.hints)
        if expired:
            raise RunStopped(f"stalled: {text}\n  stopping after cluster.stall_timeout_s="
                             f"{cfg.cluster.stall_timeout_s:g}s without progress", EXIT_STALLED)
        log.warning("%s", text)

    # ------------------------------------------------------------------------------ after a step

    def reward_errors(self, metrics: dict[str, float], step: int) -> RunStopped | None:
        """The stop to raise once the step is logged, when the last steps' reward errors pass a policy:
        `reward.max_error_fraction` of the window's rollouts, or every rollout of the attempt's first
        `reward.stop_after_error_steps` steps. Otherwise warn (once per window) when more than half were.
        Adds `train/reward_error_fraction` to `metrics`."""
        g = lambda k: metrics.get(f"generator/{k}", 0.0) + metrics.get(f"generator/removed_{k}", 0.0)  # noqa: E731
        errors, rollouts = self._reward_errors.observe(g("reward_errors"), g("rollouts"))
        rc, limit, first = self.cfg.reward, self.cfg.reward.max_error_fraction, self.cfg.reward.stop_after_error_steps
        metrics["train/reward_error_fraction"] = errors / rollouts if rollouts else 0.0
        if self._all_error_steps is not None and rollouts:  # the window holds this attempt's first steps
            self._all_error_steps = self._all_error_steps + 1 if errors >= rollouts else None
        if not rollouts or errors / rollouts <= (0.5 if limit is None else limit):
            return None
        what = (f"{errors:.0f} of the {rollouts:.0f} rollouts of the last {len(self._reward_errors.window)} steps "
                f"were reward errors scored 0 ({g('reward_timeouts'):.0f} timeouts so far) with reward.name={rc.name}")
        sample = sample_text(self.generators.last_sample())
        if limit is not None:
            return RunStopped(f"{what}: above reward.max_error_fraction={limit:g}; stopping instead of training on "
                              f"zeros: fix the reward function; {sample}", EXIT_FAILED)
        if first and self._all_error_steps is not None and self._all_error_steps >= first:
            return RunStopped(f"every rollout of the first {first} steps was a reward error scored 0 ({errors:.0f} of "
                              f"{rollouts:.0f}) with reward.name={rc.name}: the reward function fails on every call; "
                              f"stopping instead of training on zeros (reward.stop_after_error_steps={first}): fix "
                              f"the reward function; {sample}", EXIT_FAILED)
        if step - self._errors_warned_at >= REWARD_ERROR_WINDOW:
            self._errors_warned_at = step
            still = f", until {first} steps of nothing else (reward.stop_after_error_steps)" if first and \
                self._all_error_steps is not None else ""
            log.warning("%s: training goes on with those zeros%s (set reward.max_error_fraction to stop instead); %s",
                        what, still, sample)
        return None
