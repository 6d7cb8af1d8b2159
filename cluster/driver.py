"""The driver: builds every component from one config and runs the training loop.

    batch    = buffer.get_batch(version)        # fixed fresh/mixed ratio, staleness <= max_lag
    result   = learner.step(batch)              # mixed-policy loss, optimizer step(s), version + 1
    publish  = learner.publish()                # weights to the store; generators pick them up
    buffer.end_step(result.feedback, version)   # entropy ranking refresh, new version, metrics: one call
    log, checkpoint, scale

Generators never wait for the driver. Its parts: the run's health (cluster/health.py), checkpoints
(cluster/checkpointer.py), the generator pool's size (cluster/control.py). The run around one attempt
(preparation, resume, restarts, signals) is cluster/run.py; deaths and signals: docs/internals.md#clusterdriverpy.
"""

from __future__ import annotations

import logging
import shutil
import time
from collections import Counter
from pathlib import Path

from cluster.checkpointer import Checkpointer
from cluster.control import GeneratorControl, stop_without_drain
from cluster.health import RunHealth
from cluster.liveness import EXIT_CONFIG, RunStopped, check_placement
from cluster.profile import Profile
from cluster.state import PreparedRun
from cluster.step_metrics import batch_metrics, prefixed
from cluster.tracking import LateStart
from common.config import ObjectStoreSyncConfig, RunConfig
from common.messages import TrainingBatch

log = logging.getLogger("exgrpo")

BATCH_WAIT_S = 2.0
"""How long one get_batch call waits before the driver checks signals, generators and scaling."""


class Trainer:
    """Owns the components of one attempt of a run (rebuilt from the checkpoint on restart)."""

    def __init__(self, run: PreparedRun, tracker, profile: Profile | None = None, launched: float | None = None):
        """`run`: its config, folder, state, model and questions. `tracker`: the run's Tracker, or a `LateStart` of
        it, begun after the first learner update. `launched`: time.monotonic() when `exgrpo train` started (None: a
        restarted attempt, which does not log driver/first_update_s)."""
        self.prepared = run  # (`run` is the training loop)
        self.cfg, self.run_dir, self.state, self.model_path, self.questions = run
        self.tracking = tracker if isinstance(tracker, LateStart) else LateStart.of(tracker)
        self.profile = profile or Profile()
        self.launched = launched
        self.stop_flag = False
        self.phase = "start"  # start | train | close: what a signal interrupts (see cluster.run._stop_on_signals)
        self.interrupted = False  # stopped at once by a signal: no drain, no checkpoint
        self.staleness: Counter[int] = Counter()
        self.components_built = False
        self.evaluation = self.health = self.checkpointer = self.control = None
        self.publication = Publication()
        self._first_batch = False
        self._ingest_mark: tuple[float, float] | None = None  # (time, groups accepted by the buffer)

    # ------------------------------------------------------------------------------------- build

    @property
    def tracker(self):
        """The open Tracker (waits for its start)."""
        return self.tracking()

    def build(self, checkpoint: Path | None) -> None:
        """Start every component: the learner ranks and buffer shards beside each other, then (from the first
        publication, or beside them when they all fit at once) the generators and the in-run evaluator."""
        phase = self.profile.phase
        _check_placement(self.cfg, self.state.generators)  # before any actor starts
        live = self.run_dir.path / "buffer-live"  # shards' periodic snapshots (for a shard's own restart)
        if checkpoint is None and live.exists():  # a fresh start must not pick up a dead attempt's shards
            shutil.rmtree(live)
        # Generators may start before the learner has published when a fresh run's version 0 is the model folder
        # they load (they load it while the learner ranks build), and only when the learner and every generator fit
        # at once (decided before the learner reserves its CPUs/GPUs).
        early = (checkpoint is None and isinstance(self.cfg.learner.weight_sync, ObjectStoreSyncConfig)
                 and _everything_fits(self.cfg, self.state.generators))
        self._ask_for_learner_and_buffer()
        if early:  # the generators' leases queue at the shards until those run
            self._start_generators()
        with phase("start-up: buffer shards (the rest of their start)"):
            self.buffer.wait_ready()
        with phase("start-up: learner ranks (the rest of their start)"):
            self.learner.wait_ready()
        self._keep_levers_off()
        with phase("start-up: restore checkpoint"):
            self._restore(checkpoint)
        with phase("start-up: publish the first weights"):
            self.learner.publish()  # version 0 (or the checkpoint's) before any generator starts
        if not early:
            self._start_generators()
        self.health = RunHealth(self.cfg, self.generators, self.buffer, len(self.questions), self.tracking)
        self.checkpointer = Checkpointer(self.prepared, self.learner, self.buffer, self.tracking)
        self.control = GeneratorControl(self.cfg, self.run_dir.name, self.state, self.generators)
        self.components_built = True

    def _ask_for_learner_and_buffer(self) -> None:
        """Ask for the learner ranks and the buffer shards; they load and shard the model, and start their worker
        processes, while the rest builds."""
        from actors.engines import describe_engine
        from buffer.client import BufferClient
        from learner.pool import LearnerPool
        from learner.shape import TrainShape
        from learner.trial import switch_off

        cfg, name, ns, phase = self.cfg, self.run_dir.name, self.cfg.cluster.namespace, self.profile.phase
        with phase("start-up: ask for the learner ranks"):
            log.info("starting %d buffer shard(s), %d learner rank(s) and %d generator(s); %s", cfg.buffer.num_shards,
                     cfg.learner.num_ranks, self.state.generators, describe_engine(cfg.generator, self.model_path))
            learner_cfg = switch_off(cfg.learner, self.state.levers_off)  # what failed its trial stays off
            if self.state.levers_off:
                log.info("learner levers kept off from the run's first start: %s",
                         "; ".join(f"{k} ({v})" for k, v in self.state.levers_off.items()))
            shape = TrainShape(max_new_tokens=cfg.generator.max_new_tokens, prompt_tokens=cfg.data.max_prompt_tokens,
                               batch_rows=cfg.buffer.batch_questions * cfg.buffer.group_size, dtype=cfg.model.dtype,
                               publish_dtype=cfg.generator.dtype)
            self.learner = LearnerPool(learner_cfg, str(self.model_path), shape, run=name, namespace=ns, wait=False)
        with phase("start-up: ask for the buffer shards"):
            self.buffer = BufferClient.create(cfg.buffer, self.questions, run=name, namespace=ns,
                                              snapshot_dir=str(self.run_dir.path / "buffer-live"), wait=False)

    def _keep_levers_off(self) -> None:
        """Levers that failed their trial at a rank's setup stay off for the run (logged, kept in its state)."""
        if self.learner.summary:  # LoRA: rank, targets, trainable parameters and their share
            log.info("%s", self.learner.summary)
        if self.learner.levers_off:  # the rank logged each one; the driver's log and state keep them
            self.state.levers_off.update(self.learner.levers_off)
            log.warning("learner levers off for this run (they failed their trial at setup; the run trains on): %s",
                        "; ".join(f"learner.{k}: {v}" for k, v in self.learner.levers_off.items()))
        self.learner.levers_off = dict(self.state.levers_off)  # metric learner/levers_off: those kept off too

    def _restore(self, checkpoint: Path | None) -> None:
        if checkpoint is not None:
            self.learner.load_checkpoint(checkpoint / "learner")
            ended = self.buffer.restore(str(checkpoint / "buffer"), expire_leases=True)
            log.info("resumed the buffer of %s: the %d lease(s) it held outstanding were ended as expired "
                     "and their questions reissued", checkpoint.name, ended)
        self.buffer.set_version(self.learner.version)

    def _start_generators(self) -> None:
        """Create the generator pool (its generators start in the background: training starts once one runs) and
        the in-run evaluator."""
        from actors.generator import GeneratorSpec
        from actors.pool import GeneratorPool
        from cluster.in_run_eval import InRunEval
        from learner.weights import make_weight_source

        cfg, name, ns, phase = self.cfg, self.run_dir.name, self.cfg.cluster.namespace, self.profile.phase
        with phase("start-up: schedule generators"):
            weights = make_weight_source(cfg.learner.weight_sync, run=name, namespace=ns,
                                         timeout_s=cfg.learner.publish_timeout_s)
            spec = GeneratorSpec(cfg.generator, cfg.reward, str(self.model_path),
                                 task_name=cfg.data.task if cfg.data.train_path is None else None)
            self.generators = GeneratorPool(spec, self.buffer, weights, run=name, namespace=ns)
            self.generators.scale_to(self.state.generators, wait=False)
        with phase("start-up: in-run evaluator"):  # its engine loads beside the generators' too
            self.evaluation = InRunEval.create(cfg, self.model_path, run=name, namespace=ns)

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
                self.publication.finish()  # the previous version's gather overlapped with the batch fetch
            with phase("step: learner compute"):
                result = self.learner.step(batch)
            first_update_s = self._first_update_s()
            if self.control.actor is None:  # MLflow and the control actor start once the first update is done
                self.control.start()
            self.tracking.begin()
            with phase("step: start publication"):
                self.publication.start(self.learner.publish_async())
                if cfg.buffer.max_lag == 0:  # synchronous: no rollout of the next batch may see the old weights
                    self.publication.finish()
            with phase("step: buffer feedback + version"):
                buffer_metrics = self.buffer.end_step(result.feedback, result.version)
                self.checkpointer.buffer_bytes = buffer_metrics.get("stored_bytes", 0.0)
            self.state.train_s += time.monotonic() - t0
            self.state.step += 1
            self.state.rollouts += sum(len(g.rollouts) for g in batch.groups)  # fresh ones (o* joins in the learner)
            with phase("step: metrics, MLflow, progress"):
                metrics = self._metrics(batch, result, time.monotonic() - t0, buffer_metrics)
                if first_update_s is not None:
                    metrics["driver/first_update_s"] = first_update_s
                too_many_errors = self.health.reward_errors(metrics, self.state.step)
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
                self.control.autoscale(metrics)
        with phase("step: wait for the previous publication"):
            self.publication.finish()
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
        self.profile.first_update(seconds)
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

    def _next_batch(self) -> TrainingBatch | None:
        """A batch, or None after at most BATCH_WAIT_S; meanwhile apply scaling requests, heal the generator pool
        and, while no batch comes, say why (and stop past `cluster.stall_timeout_s`)."""
        t0 = time.monotonic()
        try:
            batch = self.buffer.get_batch(self.learner.version, timeout_s=BATCH_WAIT_S)
        finally:
            self.state.wait_s += time.monotonic() - t0
        if self.control.poll():
            self.stop_flag = True
        self.health.watch_generators()
        if batch is not None and batch.groups:
            self.health.batch_arrived(batch)
            return batch
        self.health.no_batch(self.state.step)
        return None

    def checkpoint(self) -> Path | None:
        """A consistent cut of the run now (cluster/checkpointer.py); None when the disk refused it (skipped)."""
        return self.checkpointer.save()

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

    # ------------------------------------------------------------------------------------ metrics

    def _metrics(self, batch: TrainingBatch, result, step_s: float, buffer_metrics: dict[str, float]
                 ) -> dict[str, float]:
        import ray

        out, lags = batch_metrics(batch, self.cfg.generator.max_new_tokens)
        self.staleness.update(lags)
        out.update({
            "train/rollouts_total": float(self.state.rollouts),
            "driver/step_s": step_s,
            "driver/learner_wait_fraction": self.state.wait_s / max(1e-9, self.state.wait_s + self.state.train_s),
            "driver/generators": float(self.generators.running),
            "cluster/nodes": float(sum(1 for n in ray.nodes() if n.get("Alive"))),  # a cluster autoscaler varies it
            "policy/version": float(result.version),
            **self.publication.metrics,
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

    def close(self) -> None:
        """Stop every component; a further signal abandons the rest to ray.shutdown(). Generators return their
        leases at once and abandon any reward call in progress, so the stop is bounded whatever the reward
        function does (docs/faults.md, "Stopping is bounded")."""
        import ray

        self.phase = "close"
        try:
            for part in ("evaluation", "generators", "learner", "buffer"):
                obj = getattr(self, part, None)
                if obj is None:
                    continue
                try:  # generators return their leases rather than finish work nothing will train on
                    stop_without_drain(obj) if part == "generators" else obj.shutdown()
                except ray.exceptions.RayError as e:
                    log.warning("shutting down %s: %s", part, str(e).splitlines()[0] if str(e) else type(e).__name__)
            if self.control is not None:
                self.control.close()
            _wait_names_released(self.run_dir.name, self.cfg.cluster.namespace, 10.0 if self.interrupted else 60.0)
        except KeyboardInterrupt:
            log.warning("shutdown interrupted: the remaining actors end with Ray")


class Publication:
    """The weight publication in flight (it overlaps with fetching the next batch) and the last one's numbers."""

    def __init__(self):
        self._pending = None
        self.metrics = {
            "driver/weight_publish_s": 0.0,  # the whole publication, as the driver waits for its announcement
            "weights/bytes_full": 0.0,  # bytes of the last publication, whole and (weight_sync.delta) as a delta
            "weights/bytes_delta": 0.0,
            "weights/publish_blocking_s": 0.0,  # learner rank 0 busy publishing (its next step queues behind it),
            "weights/publish_gather_s": 0.0,  # of which waiting for the gather
        }

    def start(self, pending) -> None:
        self._pending = (pending, time.monotonic())

    def finish(self) -> None:
        """Wait for the publication in flight (WeightSyncTimeout names the version) and keep its numbers."""
        if self._pending is None:
            return
        pending, started = self._pending
        ann = pending.result()
        report = pending.report
        self.metrics.update({
            "driver/weight_publish_s": time.monotonic() - started,
            "weights/bytes_full": float(ann.num_bytes) if ann is not None else 0.0,
            "weights/bytes_delta": float(ann.delta_bytes) if ann is not None else 0.0,
            "weights/publish_blocking_s": report.blocking_s if report is not None else 0.0,
            "weights/publish_gather_s": report.gather_s if report is not None else 0.0,
        })
        self._pending = None


def _everything_fits(cfg: RunConfig, generators: int) -> bool:
    """The learner ranks, all generators asked for and the evaluator fit in the cluster's free CPUs and GPUs."""
    import ray

    free, g, lc, ev = ray.available_resources(), cfg.generator, cfg.learner, cfg.eval
    n, e = generators, 1 if ev.every_steps else 0
    return all(free.get(r, 0.0) + 1e-9 >= lc.num_ranks * need_l + n * need_g + e * need_e
               for r, need_l, need_g, need_e in (("CPU", lc.num_cpus, g.num_cpus, ev.num_cpus),
                                                 ("GPU", lc.num_gpus, g.num_gpus, ev.num_gpus)))


def _check_placement(cfg: RunConfig, generators: int) -> None:
    """Refuse (exit 2) a config whose learner and first generator can never be placed; warn when
    fewer generators than asked fit (the others wait for resources, reported, and start when they can)."""
    import ray

    nodes = [n["Resources"] for n in ray.nodes() if n.get("Alive")]
    largest = {r: max((n.get(r, 0.0) for n in nodes), default=0.0) for r in ("CPU", "GPU")}
    p = check_placement(cfg.generator, cfg.learner, generators, ray.cluster_resources(), largest,
                        fixed=cfg.cluster.address is None)
    if p.refuse:
        raise RunStopped(p.refuse, EXIT_CONFIG, checkpoint=False)
    if p.warning:
        log.warning("%s", p.warning)


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
