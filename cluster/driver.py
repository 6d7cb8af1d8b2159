"""The driver: builds every component from one config and runs the training loop.

    batch    = buffer.get_batch(version)        # fixed fresh/mixed ratio, staleness <= max_lag
    result   = learner.step(batch)              # mixed-policy loss, optimizer step(s), version + 1
    publish  = learner.publish()                # weights to the store; generators pick them up
    buffer.end_step(result.feedback, version)   # entropy ranking refresh, new version, metrics: one call
    log, checkpoint, scale

Generators never wait for the driver. The run around one attempt (preparation, resume, restarts, signals) is
cluster/run.py; the state a checkpoint carries for the driver is cluster/state.py.
Deaths, liveness, signals: docs/internals.md#clusterdriverpy (exit codes: docs/faults.md)
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from collections import Counter
from pathlib import Path

from cluster.autoscale import autoscale_target
from cluster.liveness import (
    EXIT_CONFIG, EXIT_DISK, EXIT_FAILED, EXIT_STALLED, NOTHING_LEFT, ErrorWindow, RunStopped, StallWatch,
    check_placement, diagnose, sample_text, zero_reward_hint,
)
from cluster.profile import Profile
from cluster.state import DriverState, rng_state
from cluster.step_metrics import batch_metrics, prefixed
from cluster.tracking import LateStart
from common.config import ObjectStoreSyncConfig, RunConfig
from common.messages import TrainingBatch

log = logging.getLogger("exgrpo")

BATCH_WAIT_S = 2.0
"""How long one get_batch call waits before the driver checks signals, generators and scaling."""
REWARD_ERROR_WINDOW = 10  # learner steps over which reward.max_error_fraction is measured


class Trainer:
    """Owns the components of one attempt of a run (rebuilt from the checkpoint on restart)."""

    def __init__(self, cfg: RunConfig, run_dir, state: DriverState, model_path: Path, questions, tracker,
                 profile: Profile | None = None, launched: float | None = None):
        """`tracker`: the run's Tracker, or a `LateStart` of it, begun after the first learner update."""
        self.cfg, self.run_dir, self.state, self.model_path = cfg, run_dir, state, model_path
        self.tracking = tracker if isinstance(tracker, LateStart) else LateStart.of(tracker)
        self.profile = profile or Profile()
        # time.monotonic() when `exgrpo train` started: the first update of this attempt logs driver/first_update_s
        # (None: a restarted attempt, which does not)
        self.launched = launched
        self._first_batch = False
        self.questions = questions
        self.stop_flag = False
        self.autoscale_bounds: dict[str, int] = {}  # set while running: `exgrpo scale --min/--max-generators`
        self.phase = "start"  # start | train | close: what a signal interrupts (see cluster.run._stop_on_signals)
        self.interrupted = False  # stopped at once by a signal: no drain, no checkpoint
        self.staleness: Counter[int] = Counter()
        self.components_built = False
        self.evaluation = None
        self.control = None  # cluster.runtime.Control, created after the first update (`_start_control`)
        self._control_started = None  # its first answer, while its process starts
        self._pending = None
        self._publish_s = 0.0
        self._publish_bytes = (0.0, 0.0)  # the last publication: bytes whole, bytes of its delta (0: none)
        self._publish_blocking = (0.0, 0.0)  # the last publication on learner rank 0: (seconds busy, of which gather)
        self._ingest_mark: tuple[float, float] | None = None  # (time, groups accepted by the buffer)
        self._reward_errors = ErrorWindow(REWARD_ERROR_WINDOW)
        self._errors_warned_at = -REWARD_ERROR_WINDOW
        self._all_error_steps: int | None = 0  # steps of this attempt with every rollout a reward error (None: not all)
        self._params: int | None = None  # the model's parameters (the first checkpoint's size estimate)
        self._buffer_bytes = 0.0  # the buffer's stored trajectories at the last step

    # ------------------------------------------------------------------------------------- build

    @property
    def tracker(self):
        """The open Tracker (waits for its start)."""
        return self.tracking()

    def build(self, checkpoint: Path | None) -> None:
        from actors.engines import describe_engine
        from buffer.client import BufferClient
        from cluster.in_run_eval import InRunEval
        from learner.pool import LearnerPool
        from learner.trial import switch_off

        cfg, name, ns = self.cfg, self.run_dir.name, self.cfg.cluster.namespace
        self._check_placement()  # before any actor starts
        log.info("starting %d buffer shard(s), %d learner rank(s) and %d generator(s); %s", cfg.buffer.num_shards,
                 cfg.learner.num_ranks, self.state.generators, describe_engine(cfg.generator, self.model_path))
        live = self.run_dir.path / "buffer-live"  # shards' periodic snapshots (for a shard's own restart)
        if checkpoint is None and live.exists():  # a fresh start must not pick up a dead attempt's shards
            shutil.rmtree(live)
        phase = self.profile.phase
        # Whether generators may start before the learner has published: a fresh run's version 0 is the model
        # folder the engines load, so they load it while the learner ranks build (both take long). A resumed run,
        # or a collective channel that needs the learner's side, schedules them after the first publication.
        # Only when the learner and every generator fit at once (decided before the learner reserves its
        # CPUs/GPUs): generators placed first must never take what the learner ranks need.
        early = (checkpoint is None and isinstance(cfg.learner.weight_sync, ObjectStoreSyncConfig)
                 and self._everything_fits())
        learner_cfg = switch_off(cfg.learner, self.state.levers_off)  # what failed its trial stays off
        if self.state.levers_off:
            log.info("learner levers kept off from the run's first start: %s",
                     "; ".join(f"{k} ({v})" for k, v in self.state.levers_off.items()))
        # the rows one rank trains per optimizer step: the micro-batch checkpointing "auto" budgets for
        rows_per_update = max(1, cfg.buffer.batch_questions * cfg.buffer.group_size
                              // (cfg.learner.mini_batches * cfg.learner.num_ranks))
        with phase("start-up: ask for the learner ranks"):  # they load and shard the model while the rest builds
            self.learner = LearnerPool(learner_cfg, str(self.model_path), run=name, namespace=ns,
                                       max_new_tokens=cfg.generator.max_new_tokens, dtype=cfg.model.dtype,
                                       publish_dtype=cfg.generator.dtype, wait=False,
                                       prompt_tokens=cfg.data.max_prompt_tokens, rows_per_update=rows_per_update)
        with phase("start-up: ask for the buffer shards"):  # their worker processes start beside the rest too
            self.buffer = BufferClient.create(cfg.buffer, self.questions, run=name, namespace=ns,
                                              snapshot_dir=str(self.run_dir.path / "buffer-live"), wait=False)
        if early:  # the generators' leases queue at the shards until those run
            with phase("start-up: schedule generators"):
                self._schedule_generators()
            with phase("start-up: in-run evaluator"):  # its engine loads beside the generators' too
                self.evaluation = InRunEval.create(cfg, self.model_path, run=name, namespace=ns)
        with phase("start-up: buffer shards (the rest of their start)"):
            self.buffer.wait_ready()
        with phase("start-up: learner ranks (the rest of their start)"):
            self.learner.wait_ready()
        if self.learner.summary:  # LoRA: rank, targets, trainable parameters and their share
            log.info("%s", self.learner.summary)
        if self.learner.levers_off:  # the rank logged each one; the driver's log and state keep them
            self.state.levers_off.update(self.learner.levers_off)
            log.warning("learner levers off for this run (they failed their trial at setup; the run trains on): %s",
                        "; ".join(f"learner.{k}: {v}" for k, v in self.learner.levers_off.items()))
        self.learner.levers_off = dict(self.state.levers_off)  # metric learner/levers_off: those kept off too
        with phase("start-up: restore checkpoint"):
            if checkpoint is not None:
                self.learner.load_checkpoint(checkpoint / "learner")
                ended = self.buffer.restore(str(checkpoint / "buffer"), expire_leases=True)
                log.info("resumed the buffer of %s: the %d lease(s) it held outstanding were ended as expired "
                         "and their questions reissued", checkpoint.name, ended)
            self.buffer.set_version(self.learner.version)
        with phase("start-up: publish the first weights"):
            self.learner.publish()  # version 0 (or the checkpoint's) before any generator starts
        if not early:
            with phase("start-up: schedule generators"):
                self._schedule_generators()
        if not early:
            with phase("start-up: in-run evaluator"):
                self.evaluation = InRunEval.create(cfg, self.model_path, run=name, namespace=ns)
        self.components_built = True
        now = time.monotonic()
        self.watch = StallWatch(cfg.cluster.stall_report_s, cfg.cluster.stall_timeout_s, now)
        self._pool_reported, self._zero_hinted = None, False  # None: not yet reported (at the first batch)
        self._timeout_shown = False

    def _everything_fits(self) -> bool:
        """The learner ranks, all generators asked for and the evaluator fit in the cluster's free CPUs and GPUs."""
        import ray

        free, g, lc, ev = ray.available_resources(), self.cfg.generator, self.cfg.learner, self.cfg.eval
        n, e = self.state.generators, 1 if ev.every_steps else 0
        return all(free.get(r, 0.0) + 1e-9 >= lc.num_ranks * need_l + n * need_g + e * need_e
                   for r, need_l, need_g, need_e in (("CPU", lc.num_cpus, g.num_cpus, ev.num_cpus),
                                                     ("GPU", lc.num_gpus, g.num_gpus, ev.num_gpus)))

    def _schedule_generators(self) -> None:
        """Create the generator pool; the generators start in the background (training starts once one runs)."""
        from actors.pool import GeneratorPool
        from learner.weights import make_weight_source

        cfg, name, ns = self.cfg, self.run_dir.name, self.cfg.cluster.namespace
        weights = make_weight_source(cfg.learner.weight_sync, run=name, namespace=ns,
                                     timeout_s=cfg.learner.publish_timeout_s)
        self.generators = GeneratorPool(cfg.generator, cfg.reward, str(self.model_path), self.buffer, weights,
                                        task_name=cfg.data.task if cfg.data.train_path is None else None,
                                        run=name, namespace=ns)
        self.generators.scale_to(self.state.generators, wait=False)

    def _check_placement(self) -> None:
        """Refuse (exit 2) a config whose learner and first generator can never be placed; warn when
        fewer generators than asked fit (the others wait for resources, reported, and start when they can)."""
        import ray

        nodes = [n["Resources"] for n in ray.nodes() if n.get("Alive")]
        largest = {r: max((n.get(r, 0.0) for n in nodes), default=0.0) for r in ("CPU", "GPU")}
        p = check_placement(self.cfg.generator, self.cfg.learner, self.state.generators, ray.cluster_resources(),
                            largest, fixed=self.cfg.cluster.address is None)
        if p.refuse:
            raise RunStopped(p.refuse, EXIT_CONFIG, checkpoint=False)
        if p.warning:
            log.warning("%s", p.warning)

    # -------------------------------------------------------------------------------------- loop

    def run(self, progress) -> None:
        """The training loop (see the module docstring)."""
        cfg, phase = self.cfg, self.profile.phase
        while self.state.step < cfg.total_steps and not self.stop_flag and not self._budget_spent():
            with phase("step: wait for a batch" if self._first_batch else "start-up: until the first batch"):
                batch = self._next_batch()
                self._log_evals()
            if batch is None:
                continue
            self._first_batch = True
            t0 = time.monotonic()
            with phase("step: wait for the previous publication"):
                self._finish_publish()  # the previous version's gather overlapped with the batch fetch
            with phase("step: learner compute"):
                result = self.learner.step(batch)
            first_update_s = self._first_update_s()
            if self.control is None:  # MLflow and the control actor start once the first update is done
                self._start_control()
            self.tracking.begin()
            with phase("step: start publication"):
                self._pending = (self.learner.publish_async(), time.monotonic())
                if cfg.buffer.max_lag == 0:  # synchronous: no rollout of the next batch may see the old weights
                    self._finish_publish()
            with phase("step: buffer feedback + version"):
                buffer_metrics = self.buffer.end_step(result.feedback, result.version)
                self._buffer_bytes = buffer_metrics.get("stored_bytes", 0.0)
            self.state.train_s += time.monotonic() - t0
            self.state.step += 1
            self.state.rollouts += sum(len(g.rollouts) for g in batch.groups)  # fresh ones (o* joins in the learner)
            with phase("step: metrics, MLflow, progress"):
                metrics = self._metrics(batch, result, time.monotonic() - t0, buffer_metrics)
                if first_update_s is not None:
                    metrics["driver/first_update_s"] = first_update_s
                too_many_errors = self._check_reward_errors(metrics)
                self.tracking.log_metrics(metrics, self.state.step)
                progress.update(self.state.step, {**metrics, **(self.evaluation.last if self.evaluation else {})})
                if too_many_errors is not None:
                    raise too_many_errors
                if self.evaluation is not None:
                    self.evaluation.after_step(self.state.step)
            if cfg.checkpoint.every_steps and self.state.step % cfg.checkpoint.every_steps == 0:
                with phase("checkpoints"):
                    self.checkpoint()
            with phase("step: scaling"):
                self._scale(metrics)
        with phase("step: wait for the previous publication"):
            self._finish_publish()
        self.profile.generators(self.generators.metrics())
        if self.evaluation is not None and not self.stop_flag:
            with phase("final evaluation"):
                self._log_evals(self.evaluation.final(self.learner.version))
        if self.run_dir.latest_checkpoint() != self.run_dir.checkpoint_dir(self.state.step):
            with phase("checkpoints"):
                self.checkpoint()

    def _first_update_s(self) -> float | None:
        """At the first learner update of the command: seconds since `exgrpo train` started (logged and said once,
        `driver/first_update_s`); None at every other step."""
        if self.launched is None:
            return None
        seconds, self.launched = time.monotonic() - self.launched, None
        self.profile.first_update_s = seconds
        log.info("first learner update %.1f s after exgrpo train started", seconds)
        return seconds

    def _budget_spent(self) -> bool:
        return self.cfg.total_rollouts is not None and self.state.rollouts >= self.cfg.total_rollouts

    def _log_evals(self, reports=None) -> None:
        """Log finished in-run evaluations at the step whose policy they measured."""
        if self.evaluation is None:
            return
        for step, m in self.evaluation.poll() if reports is None else reports:
            self.tracking.log_metrics(m, step)
            per_set = sorted({k.split("/")[1] for k in m if k.count("/") == 2})
            parts = [(f"{name}: " if name else "") + f"greedy {m[p + 'greedy_accuracy']:.3f}  pass@1 "
                     f"{m[p + 'pass_at_1']:.3f}" for name, p in ([(n, f"eval/{n}/") for n in per_set] or [("", "eval/")])]
            log.info("eval of step %d: %s  (%d questions, %.0fs)", step, "; ".join(parts),
                     self.evaluation.num_questions, m["eval/seconds"])

    def _finish_publish(self) -> None:
        """Wait for the publication in flight (WeightSyncTimeout names the version) and time it: the whole, as the
        driver waits for it, and the part the learner waits for (rank 0's `PublishReport.blocking_s`)."""
        if self._pending is None:
            return
        pending, started = self._pending
        ann = pending.result()
        self._publish_s = time.monotonic() - started
        self._publish_bytes = (float(ann.num_bytes), float(ann.delta_bytes)) if ann is not None else (0.0, 0.0)
        report = pending.report
        self._publish_blocking = (report.blocking_s, report.gather_s) if report is not None else (0.0, 0.0)
        self._pending = None

    def _next_batch(self) -> TrainingBatch | None:
        """A batch, or None after at most BATCH_WAIT_S; meanwhile heal the generator pool and, while no
        batch comes, say why (and stop past `cluster.stall_timeout_s`)."""
        t0 = time.monotonic()
        try:
            batch = self.buffer.get_batch(self.learner.version, timeout_s=BATCH_WAIT_S)
        finally:
            self.state.wait_s += time.monotonic() - t0
        self._poll_control()
        self._watch_generators()
        if batch is not None and batch.groups:
            self.watch.progress(time.monotonic())
            self._report_waiting_generators()
            self._hint_if_all_zero(batch)
            return batch
        self._check_stall()
        return None

    # ---------------------------------------------------------------------------------- liveness

    def _watch_generators(self) -> None:
        """Adopt started generators and replace dead ones (GeneratorsFailed past the budget); a
        generator finishing its start counts as progress."""
        before = self.generators.running
        self.generators.poll()
        if self.generators.running > before:
            self.watch.progress(time.monotonic())

    def _report_waiting_generators(self) -> None:
        """While batches arrive, generators still waiting for resources or restarting are reported at
        the first batch and then every `stall_report_s` (while none arrive, the stall report says it)."""
        now = time.monotonic()
        st = self.generators.status()
        last = self._pool_reported
        if (st["pending"] or st["restarting"] or st["respawn"]) and \
                (last is None or now - last >= self.cfg.cluster.stall_report_s):
            self._pool_reported = now
            log.warning("%s", self.generators.describe())

    def _check_stall(self) -> None:
        """No batch this time: stop at once when nothing is left to train on; report why every
        `stall_report_s` (console and stall/* metrics); past `stall_timeout_s` stop with exit code 3."""
        now = time.monotonic()
        buf = self.buffer.metrics()
        nothing_left = (self.cfg.buffer.collect and buf.get("retired", 0.0) >= len(self.questions)
                        and buf.get("ready_fresh", 0.0) + buf.get("ready_mixed", 0.0) < self.cfg.buffer.batch_questions)
        due, expired = self.watch.report_due(now), self.watch.expired(now)
        if not (due or expired or nothing_left):
            return
        d = diagnose(self.watch.seconds(now), self.state.step, self.cfg.total_steps, self.generators.status(),
                     self.generators.describe(), buf, self.generators.metrics(), len(self.questions),
                     self.cfg.reward.name, self.cfg.reward.timeout_s, self.cfg.buffer.batch_questions)
        self.tracking.log_metrics(d.metrics, self.state.step)
        if d.scoring_holds and (not self._timeout_shown or expired):
            self._timeout_shown = True
            d.hints.append("the first reward call that timed out: " + sample_text(self.generators.last_sample("timeout")))
        elif d.all_rewards_zero and (not self._zero_hinted or expired):
            self._zero_hinted = True
            d.hints.append(sample_text(self.generators.last_sample()))
        if d.nothing_left:
            raise RunStopped(f"{NOTHING_LEFT} ({len(self.questions)} questions); use more or harder data "
                             "(a retired question is never issued again)", EXIT_STALLED)
        text = d.line + "".join(f"\n  hint: {h}" for h in d.hints)
        if expired:
            raise RunStopped(f"stalled: {text}\n  stopping after cluster.stall_timeout_s="
                             f"{self.cfg.cluster.stall_timeout_s:g}s without progress", EXIT_STALLED)
        log.warning("%s", text)

    def _hint_if_all_zero(self, batch: TrainingBatch) -> None:
        """The first batch whose rewards are all 0 names the reward function (leading with its errors when
        they explain the zeros) and shows one response."""
        if self._zero_hinted or any(r.reward > 0 for g in batch.groups for r in g.rollouts):
            return
        self._zero_hinted = True
        m = self.generators.metrics()
        hint = zero_reward_hint(self.cfg.reward.name, m.get("rollouts", 0.0), m.get("reward_errors", 0.0),
                                m.get("reward_timeouts", 0.0))
        log.warning("every reward in this batch is 0; %s; %s", hint.removeprefix("every reward so far is 0, and ")
                    .removeprefix("every reward so far is 0 "), sample_text(self.generators.last_sample()))

    def _check_reward_errors(self, metrics: dict[str, float]) -> RunStopped | None:
        """Past `reward.max_error_fraction` of the last steps' rollouts scored as reward errors, the stop to
        raise once the step is logged; without it, warn (at most once per window) when more than half were.
        Adds `train/reward_error_fraction` to `metrics`."""
        g = lambda k: metrics.get(f"generator/{k}", 0.0) + metrics.get(f"generator/removed_{k}", 0.0)  # noqa: E731
        errors, rollouts = self._reward_errors.observe(g("reward_errors"), g("rollouts"))
        limit = self.cfg.reward.max_error_fraction
        metrics["train/reward_error_fraction"] = errors / rollouts if rollouts else 0.0
        if self._all_error_steps is not None and rollouts:  # the window holds this attempt's first steps
            self._all_error_steps = self._all_error_steps + 1 if errors >= rollouts else None
        if not rollouts or errors / rollouts <= (0.5 if limit is None else limit):
            return None
        what = (f"{errors:.0f} of the {rollouts:.0f} rollouts of the last {len(self._reward_errors.window)} steps "
                f"were reward errors scored 0 ({g('reward_timeouts'):.0f} timeouts so far) with "
                f"reward.name={self.cfg.reward.name}")
        if limit is not None:
            return RunStopped(f"{what}: above reward.max_error_fraction={limit:g}; stopping instead of training on "
                              f"zeros: fix the reward function; {sample_text(self.generators.last_sample())}",
                              EXIT_FAILED)
        first = self.cfg.reward.stop_after_error_steps
        if first and self._all_error_steps is not None and self._all_error_steps >= first:
            return RunStopped(f"every rollout of the first {first} steps was a reward error scored 0 ({errors:.0f} of "
                              f"{rollouts:.0f}) with reward.name={self.cfg.reward.name}: the reward function fails on "
                              f"every call; stopping instead of training on zeros (reward.stop_after_error_steps="
                              f"{first}): fix the reward function; {sample_text(self.generators.last_sample())}",
                              EXIT_FAILED)
        if self.state.step - self._errors_warned_at >= REWARD_ERROR_WINDOW:
            self._errors_warned_at = self.state.step
            still = f", until {first} steps of nothing else (reward.stop_after_error_steps)" if first and \
                self._all_error_steps is not None else ""
            log.warning("%s: training goes on with those zeros%s (set reward.max_error_fraction to stop instead); %s",
                        what, still, sample_text(self.generators.last_sample()))
        return None

    def stop_with(self, e: RunStopped) -> None:
        """Say why the run stops (console, MLflow) and write a checkpoint when it can be written."""
        log.error("%s", e.message)
        self.tracker.log_text(e.message + "\n", "stopped.txt")
        if e.checkpoint and self.components_built and self.phase == "train":
            try:
                log.info("writing a checkpoint before stopping")
                self.checkpoint()
            except KeyboardInterrupt:
                log.warning("checkpoint interrupted; the last complete one is %s", self.run_dir.latest_checkpoint())
            except RunStopped as refused:  # the disk refused it: said; the run stops for its first reason
                log.error("%s", refused.message)

    # ------------------------------------------------------------------------------- checkpoints

    def checkpoint(self) -> Path | None:
        """A consistent cut: learner (model, optimizer, version), every shard, driver state. Returns its folder.

        First its size (`_checkpoint_bytes`) is compared with the free space. One that does not fit, or whose
        write fails for the disk (no space, quota, I/O error, read-only: `common.disk`), leaves no partial
        folder and the last complete checkpoint the one a resume takes; it is said in one line (the trace goes
        to logs/driver.log) and, per `checkpoint.on_full_disk`, stops the run (RunStopped, EXIT_DISK) or is
        skipped (returns None) while the disk may take it later."""
        from cluster import disk
        from common.disk import disk_error

        final = self.run_dir.checkpoint_dir(self.state.step)
        tmp = final.with_name(final.name + ".partial")
        vanished = self.run_dir.forget_vanished_checkpoints()
        if vanished:
            log.warning("%s", vanished)
        need, free = self._checkpoint_bytes(), disk.free_bytes(final.parent)
        blocked = disk.not_writable(final.parent)
        if blocked is not None:  # a read-only mount still reports free bytes: say read-only, not "disk full"
            return self._refused(disk.DiskFault(self.state.step, final.parent, free, self.run_dir.latest_checkpoint(),
                                                error=blocked, before=True))
        if free is not None and need > free:
            return self._refused(disk.DiskFault(self.state.step, final.parent, free, self.run_dir.latest_checkpoint(),
                                                need=need))
        try:
            return self._write_checkpoint(final, tmp)
        except BaseException as e:
            err, free = disk_error(e), disk.free_bytes(final.parent)
            shutil.rmtree(tmp, ignore_errors=True)
            if final.exists() and str(final) not in self.run_dir.read_state().get("checkpoints", []):
                shutil.rmtree(final, ignore_errors=True)  # complete, but state.json could not list it
            if err is None:
                raise
            log.debug("the checkpoint of step %d failed", self.state.step, exc_info=e)
            return self._refused(disk.DiskFault(self.state.step, final.parent, free, self.run_dir.latest_checkpoint(),
                                                error=err))

    def _write_checkpoint(self, final: Path, tmp: Path) -> Path:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
        self.learner.save_checkpoint(tmp / "learner")
        # the counts of exactly the states written: generators keep leasing and submitting meanwhile
        self.state.accounting = self.buffer.snapshot(str(tmp / "buffer"))
        self.state.rng = rng_state()
        self.tracker.log_metrics(prefixed("accounting/", self.state.accounting), self.state.step)
        # The metrics of the steps up to this one reach MLflow (or, when it refuses them, the run folder's
        # metrics-unsent.jsonl) before the checkpoint exists: a run killed right after it resumes from the next
        # step and would never log them again.
        self.tracker.flush_or_keep()
        self.state.__dict__.update(self.tracker.counts())
        (tmp / "driver.json").write_text(json.dumps(self.state.__dict__, default=str))
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
        ckpts = [c for c in self.run_dir.read_state().get("checkpoints", []) if Path(c) != final] + [str(final)]
        self.run_dir.update_state(checkpoints=ckpts[-self.cfg.checkpoint.keep_last :], **self.tracker.counts())
        for old in ckpts[: -self.cfg.checkpoint.keep_last]:  # after state.json stopped listing them
            shutil.rmtree(old, ignore_errors=True)
        log.info("checkpoint %s", final)
        return final

    def _checkpoint_bytes(self) -> int:
        """The next checkpoint's size: the last one's, or, before any, the model's and the buffer's bytes."""
        from cluster import disk

        last = self.run_dir.latest_checkpoint()
        if last is not None and last.is_dir():
            return disk.folder_bytes(last)
        if self._params is None:
            self._params = disk.model_params(self.model_path)
        return disk.first_checkpoint_bytes(self._params, 4 if self.cfg.model.dtype == "float32" else 2,
                                           int(self._buffer_bytes))

    def _refused(self, fault) -> None:
        """A checkpoint the disk refused: skipped (checkpoint.on_full_disk=skip, while space may come back) or
        the run stops with EXIT_DISK."""
        if self.cfg.checkpoint.on_full_disk == "skip" and fault.space:
            self.state.checkpoints_skipped += 1
            log.warning("%s; skipped (checkpoint.on_full_disk=skip, %d so far): training goes on and tries again at "
                        "the next checkpoint", fault.line(), self.state.checkpoints_skipped)
            self.tracker.log_metrics({"checkpoint/skipped": float(self.state.checkpoints_skipped)}, self.state.step)
            return None
        why = "checkpoint.on_full_disk=stop" if fault.space else "the disk refuses writes"
        raise RunStopped(f"{fault.line()}; stopping ({why}): free space, then `exgrpo train --resume "
                         f"{self.run_dir.path}` continues from the last complete checkpoint", EXIT_DISK,
                         checkpoint=False)

    # ------------------------------------------------------------------------------------ scaling

    def _start_control(self) -> None:
        """The control actor `exgrpo scale` talks to (created after the first update: its process start would take
        CPU from the components'); polled once it answers."""
        from cluster.runtime import create_control

        a = self.cfg.cluster.autoscale
        self.control = create_control(self.run_dir.name, self.cfg.cluster.namespace, self.state.generators,
                                      {"min_generators": a.min_generators, "max_generators": a.max_generators})
        self._control_started = self.control.get.remote()

    def _poll_control(self) -> None:
        import ray

        if self.control is None:
            return
        if self._control_started is not None:  # its process starts: no wait for it in the loop
            if not ray.wait([self._control_started], timeout=0)[0]:
                return
            self._control_started = None
        ctl = ray.get(self.control.get.remote(), timeout=10)
        if ctl["stop"]:
            self.stop_flag = True
        if ctl["bounds"] != self.autoscale_bounds:
            log.info("autoscale bounds set to %s", ctl["bounds"])
            self.autoscale_bounds = ctl["bounds"]
        if ctl["target"] != self.generators.size:
            log.info("scaling generators %d -> %d", self.generators.size, ctl["target"])
            self.generators.scale_to(ctl["target"], wait=False)  # never stalls the learner
            self.state.generators = ctl["target"]

    def _scale(self, metrics: dict[str, float]) -> None:
        a = self.cfg.cluster.autoscale
        if not a.enabled or self.state.step % a.cooldown_steps:
            return
        import ray

        a = a.model_copy(update=self.autoscale_bounds)  # `exgrpo scale --min/--max-generators`
        n = self.generators.size
        free = ray.available_resources().get("CPU", 0.0)
        if a.grow_cluster:  # a pending generator makes the Ray autoscaler add a node; one at a time
            free = 0.0 if self.generators.starting else float("inf")
        target = autoscale_target(a, n, metrics.get("driver/learner_wait_fraction", 0.0),
                                  metrics.get("generator/wait_fraction", 0.0), free, self.cfg.generator.num_cpus)
        if target != n:
            ray.get(self.control.set_target.remote(target))
            log.info("autoscale: generators %d -> %d (learner waits %.0f%%, generators wait %.0f%%)", n, target,
                     100 * metrics.get("driver/learner_wait_fraction", 0.0),
                     100 * metrics.get("generator/wait_fraction", 0.0))

    # ------------------------------------------------------------------------------------ metrics

    @staticmethod
    def _alive_nodes() -> int:
        """Ray nodes alive now (one GCS call; a cluster autoscaler adds and removes them)."""
        import ray

        return sum(1 for n in ray.nodes() if n.get("Alive"))

    def _metrics(self, batch: TrainingBatch, result, step_s: float, buffer_metrics: dict[str, float]
                 ) -> dict[str, float]:
        out, lags = batch_metrics(batch, self.cfg.generator.max_new_tokens)
        self.staleness.update(lags)
        out.update({
            "train/rollouts_total": float(self.state.rollouts),
            "driver/step_s": step_s,
            "driver/learner_wait_fraction": self.state.wait_s / max(1e-9, self.state.wait_s + self.state.train_s),
            "driver/generators": float(self.generators.running),
            "cluster/nodes": float(self._alive_nodes()),
            "policy/version": float(result.version),
            "driver/weight_publish_s": self._publish_s,
            # bytes of the last publication, whole and (learner.weight_sync.delta) as a delta from the one before
            "weights/bytes_full": self._publish_bytes[0],
            "weights/bytes_delta": self._publish_bytes[1],
            # seconds learner rank 0 was busy publishing (its next step queues behind that), of which waiting for the
            # gather; driver/weight_publish_s is the whole publication as the driver waits for its announcement
            "weights/publish_blocking_s": self._publish_blocking[0],
            "weights/publish_gather_s": self._publish_blocking[1],
        })
        out.update(prefixed("learner/", result.metrics))
        buf = prefixed("buffer/", buffer_metrics)
        now, accepted = time.monotonic(), buf.get("buffer/accepted", 0.0) + buf.get("buffer/zero_signal_seen", 0.0)
        if self._ingest_mark is not None and now > self._ingest_mark[0]:
            buf["buffer/groups_per_s"] = (accepted - self._ingest_mark[1]) / (now - self._ingest_mark[0])
        self._ingest_mark = (now, accepted)
        out.update(buf)
        out.update(prefixed("generator/", self.generators.metrics()))
        return out

    # ----------------------------------------------------------------------------------- teardown

    def _stop_generators(self) -> None:
        """Stop the generators without draining, and say what they gave up."""
        from actors.pool import FAST_STOP_S

        pool = self.generators
        before = {k: _removed(pool, k) for k in ("leases_returned", "scoring_abandoned")}
        unclean = pool.removed_metrics.get("unclean_stops", 0.0)
        pool.shutdown(drain=False)
        returned, abandoned = (_removed(pool, k) - v for k, v in before.items())
        killed = pool.removed_metrics.get("unclean_stops", 0.0) - unclean
        log.info("generators stopped: %.0f lease(s) returned (their questions are reissued on resume)%s%s", returned,
                 f"; abandoned the reward calls of {abandoned:.0f} group(s) in scoring" if abandoned else "",
                 f"; {killed:.0f} did not answer within {FAST_STOP_S:g} s and were killed" if killed else "")

    def close(self) -> None:
        """Stop every component; a further signal abandons the rest to ray.shutdown(). Generators return their
        leases at once instead of finishing their work (nothing trains on it: the last checkpoint is written) and
        abandon any reward call in progress, so the stop is bounded whatever the reward function does: at most
        ~10 s for the generators, then they are killed (docs/faults.md, "Stopping is bounded")."""
        import ray

        self.phase = "close"
        try:
            for part in ("evaluation", "generators", "learner", "buffer"):
                obj = getattr(self, part, None)
                if obj is None:
                    continue
                try:  # generators return their leases rather than finish work nothing will train on
                    if part == "generators":
                        self._stop_generators()
                    else:
                        obj.shutdown()
                except ray.exceptions.RayError as e:
                    log.warning("shutting down %s: %s", part, str(e).splitlines()[0] if str(e) else type(e).__name__)
            ctl = self.control
            if ctl is not None:
                ray.kill(ctl)
            _wait_names_released(self.run_dir.name, self.cfg.cluster.namespace, 10.0 if self.interrupted else 60.0)
        except KeyboardInterrupt:
            log.warning("shutdown interrupted: the remaining actors end with Ray")


def _removed(pool, key: str) -> float:
    return pool.removed_metrics.get(f"removed_{key}", 0.0)


def _wait_names_released(run: str, namespace: str, timeout_s: float = 60.0) -> None:
    """ray.kill is asynchronous; a restart re-creates actors under the same names, so wait until the
    run's named actors are gone (a name still taken would fail the new actor's creation)."""
    import ray

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        left = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                if a["namespace"] == namespace and a["name"].startswith(run + "/")]
        if not left:
            return
        time.sleep(0.2)
    log.warning("actors %s of run %s were still registered %ds after shutdown", left, run, timeout_s)
