"""The run around the training loop: `exgrpo train` checks its inputs, creates or reopens the run folder
(`--resume` with the fields that may change), starts Ray and MLflow, trains with bounded self-restarts from
the last checkpoint, stops on signals, and reports.

    train_main(cfg | None, resume, overrides) -> exit code
        _prepare: config, run folder, DriverState, model, questions (resume: the run's own, changed fields)
        _train_with_restarts: Trainer(...).build(latest checkpoint); .run(); on a component failure,
            restart from the last checkpoint (cluster.max_restarts); on RunStopped, checkpoint and stop
        _stop_on_signals: SIGTERM / Ctrl-C finish the step (or stop at once during start and shutdown)

The loop itself, one attempt's components and its checkpoints are `cluster.driver.Trainer`.
"""

from __future__ import annotations

import json
import logging
import os
import random
import signal
import sys
import time
from pathlib import Path

import numpy as np

from cluster.driver import Trainer
from cluster.liveness import EXIT_CONFIG, EXIT_FAILED, RunStopped
from cluster.profile import Profile
from cluster.preflight import fit_lengths  # noqa: F401  (moved to the start checks; imported from here too)
from cluster.state import DriverState, PreparedRun, set_rng_state
from common.config import ConfigError, RunConfig, flatten, to_yaml

log = logging.getLogger("exgrpo")

PROMPT_FILE = "prompt_example.txt"


def train_main(cfg: RunConfig | None, resume: str | None = None, overrides: list[str] | None = None, *,
               show_profile: bool = False, command: str = "exgrpo train") -> int:
    """`exgrpo train` (or `--resume RUN` with `overrides`): check every input, create or reopen the run
    folder, train with bounded self-restarts, report. Returns the exit code (2: bad input, nothing created).
    The run's wall-time profile is saved as profile.json in the run folder (`show_profile`: printed too)."""
    from cluster.console import Progress, setup_logging
    from cluster.tracking import LateStart, default_tracking_uri

    launched = command_started()
    profile = Profile(launched)
    setup_logging(None)  # the console only, until the run folder exists
    prepared = _prepare_beside_ray(cfg, resume, overrides or [], profile)
    if isinstance(prepared, int):
        return prepared
    run, ray_start = prepared
    cfg, run_dir, state, model_path, questions = run
    setup_logging(run_dir.path / "logs")
    random.seed(cfg.seed)
    np.random.seed(cfg.seed)
    if state.rng:  # resuming: continue the checkpoint's random streams
        set_rng_state(state.rng)
    uri = cfg.tracking.uri or default_tracking_uri(cfg.checkpoint.runs_root)
    run_dir.update_state(status="RUNNING", cause=None)

    def opened(tracker) -> None:
        run_dir.update_state(mlflow_run_id=state.mlflow_run_id)
        log.info("run %s in %s (MLflow %s, run id %s)", run_dir.name, run_dir.path, tracker.where, state.mlflow_run_id)
        _show_prompt(run_dir, questions, model_path, tracker)

    open_tracker = LateStart(lambda: _start_tracking(cfg, run_dir, state, uri), opened)
    with profile.phase("start-up: the driver's component modules (torch; beside Ray's start)"):
        _import_components()
    with profile.phase("start-up: Ray (the rest of its start)"):
        try:
            ray_start.finish(run_dir.path)
        except Exception as e:  # noqa: BLE001 (Ray's own start errors have no common base): said in one line
            return _ray_did_not_start(e, run_dir, resume, state)
    progress = Progress(cfg.total_steps, start=state.step)
    status, stopped = "FAILED", None
    try:
        status = _train_with_restarts(run, open_tracker, progress, profile, launched)
    except RunStopped as e:  # said why already; the run folder and MLflow lines still follow
        stopped = e
    finally:
        progress.close()
        tracker = open_tracker()
        with profile.phase("shutdown: plots, MLflow, Ray"):
            _close_run(cfg, run_dir, state, tracker, status, stopped)
    if stopped is not None and stopped.code == EXIT_CONFIG and not resume and state.step == 0:
        _remove_unused(run_dir)  # refused before training: the name stays free
        return stopped.code
    if run_dir.path.exists():
        _unless_the_disk_refuses("profile.json", lambda: profile.save(run_dir.path / "profile.json"))
    if show_profile:
        print(profile.table(command))
    _say_where(run_dir, tracker, uri, state)
    if stopped is not None:
        return stopped.code
    return 0 if status in ("FINISHED", "KILLED") else 1


def _import_components() -> None:
    """The modules the driver builds the components with (they import torch: seconds on a small machine), imported
    while Ray's processes finish starting, so that no second before the first update belongs to no profile row."""
    import actors.pool  # noqa: F401
    import buffer.client  # noqa: F401
    import cluster.in_run_eval  # noqa: F401
    import learner.pool  # noqa: F401
    import learner.weights  # noqa: F401


def _ray_did_not_start(e: Exception, run_dir, resume: str | None, state) -> int:
    """Ray's start failed (a timeout under load, a port taken): one line with why, the trace in logs/driver.log; a new
    run removes what it wrote (its name stays free), a resumed one keeps its folder with FAILED and the cause."""
    why = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
    log.debug("Ray's start failed", exc_info=e)
    _shutdown_ray()
    print(f"error: Ray did not start ({why[:300]}); nothing was trained: try again (on a loaded machine Ray's start "
          "can time out)", file=sys.stderr)
    if resume or state.step > 0:
        run_dir.update_state(status="FAILED", cause=f"Ray did not start ({why[:300]})")
    else:
        _remove_unused(run_dir)
    return EXIT_FAILED


def _remove_unused(run_dir) -> None:
    """A new run refused before its first step: remove what it wrote (only that) so that its name can be used again."""
    from cluster.console import setup_logging

    setup_logging(None)  # the console only: logs/driver.log is about to go
    left = run_dir.remove_own()
    if left:
        print(f"nothing was trained; removed the files the run wrote in {run_dir.path} (what else is there stays: "
              f"{', '.join(left[:3])}{' ...' if len(left) > 3 else ''})", file=sys.stderr)
        return
    what = run_dir.path if run_dir.made_folder else f"what the run wrote in {run_dir.path} (the folder was there before)"
    print(f"nothing was trained; removed {what} so that name={run_dir.path.name} can be used again", file=sys.stderr)


def _prepare_beside_ray(cfg: RunConfig | None, resume: str | None, overrides: list[str], profile: Profile):
    """(the prepared run, the Ray start) once every input is checked, Ray starting beside the model and data as soon
    as the quick checks pass; or 2 after a bad input is said (Ray stopped)."""
    from cluster.preflight import BadInput, user_modules
    from cluster.runtime import RayStart

    ray_start: list[RayStart] = []

    def begin_ray(checked: RunConfig) -> None:
        ray_start.append(RayStart(checked.cluster, user_modules(checked)))

    try:
        with profile.phase("start-up: model + data (Ray starts beside them)"):
            return _prepare(cfg, resume, overrides, begin_ray), ray_start[0]
    except BadInput as e:
        from common.config.secrets import redact

        print(redact(str(e)), file=sys.stderr)  # at once; then Ray, if starting, is stopped: nothing is left behind
        for r in ray_start:
            r.cancel()
        return 2
    except BaseException:
        for r in ray_start:
            r.cancel()
        raise


def _close_run(cfg: RunConfig, run_dir, state, tracker, status: str, stopped: RunStopped | None) -> None:
    """Plots, the MLflow run's end, state.json's last word, Ray's shutdown: each tried even when the disk refuses."""
    if cfg.tracking.log_plots:
        _unless_the_disk_refuses("the plots", lambda: tracker.log_plots(run_dir.path / "plots"))
    tracker.finish(status)
    end = dict(status=status, step=state.step, **tracker.counts())
    if stopped is not None:
        end["cause"] = stopped.message
    _unless_the_disk_refuses("state.json", lambda: run_dir.update_state(**end))
    _shutdown_ray()


def _say_where(run_dir, tracker, uri: str, state) -> None:
    """The run folder and the MLflow store (its credentials redacted: this is printed)."""
    from common.config.secrets import redact

    if tracker.offline:  # no MLflow run was opened: the points wait in the run folder
        print(f"run folder: {run_dir.path}\nMLflow: offline; `exgrpo track --replay {run_dir.path}` sends the run's "
              f"metric points to {redact(uri)}")
    elif uri.split(":", 1)[0].lower() in ("http", "https", "databricks"):  # a server: it has its own UI
        from urllib.parse import urlsplit, urlunsplit

        parts = urlsplit(redact(uri))
        page = urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2]))  # no user in a browser's address
        print(f"run folder: {run_dir.path}\nMLflow: open {page} in a browser (run id {state.mlflow_run_id})")
    else:
        print(f"run folder: {run_dir.path}\nMLflow: mlflow ui --backend-store-uri {redact(uri)}  (run id "
              f"{state.mlflow_run_id})")


def command_started() -> float:
    """time.monotonic() at which this process started (Linux: its start time in /proc/self/stat, so the interpreter's
    start and the imports count), else now."""
    now = time.monotonic()
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])  # field 22: starttime
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        age = uptime - ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return now
    return now - age if 0 <= age < 3600 else now


def _start_tracking(cfg: RunConfig, run_dir, state: DriverState, uri: str):
    """Open the run's MLflow run (the resumed run's, or a new one) and, for a new one, log its config: a new run's,
    and a resumed one's that trained offline so far. Offline at the start, the same follows once its store answers
    (`Tracker.on_online`)."""
    from cluster.tracking import UNSENT_FILE, Tracker

    tracker = Tracker(uri, cfg.tracking.experiment, enabled=cfg.tracking.enabled,
                      unsent_path=run_dir.path / UNSENT_FILE, retry_open_s=cfg.tracking.retry_open_s)
    parent = {"mlflow.parentRunId": cfg.tracking.parent_run_id} if cfg.tracking.parent_run_id else None
    new_run = state.mlflow_run_id is None

    def log_config(tr) -> None:
        tr.log_params(flatten(cfg))
        tr.log_text(to_yaml(cfg), "config.yaml")

    def online(tr) -> None:  # an offline start whose MLflow run opened later (the tracker's flush thread)
        state.mlflow_run_id = tr.run_id
        run_dir.update_state(mlflow_run_id=tr.run_id)
        if new_run:
            log_config(tr)
        if (run_dir.path / PROMPT_FILE).is_file():
            tr.log_artifact(run_dir.path / PROMPT_FILE)

    tracker.on_online = online
    # offline, a resumed run keeps its MLflow run's id: the points it keeps belong there (replay sends them there)
    state.mlflow_run_id = tracker.start(run_dir.name, run_id=state.mlflow_run_id, tags=parent) or state.mlflow_run_id
    if new_run:
        log_config(tracker)
    return tracker


def _train_with_restarts(run: PreparedRun, tracker, progress, profile, launched: float | None = None) -> str:
    """Build and train `run`, restarting from the last checkpoint after a component failure (bounded).

    Returns FINISHED or KILLED (a signal); raises RunStopped (exit code 1 or 3, after a checkpoint
    when one can be written) when the run cannot go on."""
    import ray

    from actors.pool import GeneratorsFailed
    from buffer.client import BufferUnavailableError
    from learner.weights import WeightSyncTimeout

    component_failures = (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError, BufferUnavailableError,
                          WeightSyncTimeout)

    cfg, run_dir, state = run.cfg, run.run_dir, run.state
    attempts = 0
    while True:
        trainer = Trainer(run, tracker, profile, launched)
        launched = None  # driver/first_update_s: the command's first update only, not a restarted attempt's
        restore_signals = _stop_on_signals(trainer)
        try:
            trainer.build(run_dir.latest_checkpoint())
            trainer.phase = "train"
            trainer.run(progress)
            return "KILLED" if trainer.stop_flag else "FINISHED"
        except KeyboardInterrupt:
            ckpt = run_dir.latest_checkpoint()
            log.warning("stopped during %s; %s", trainer.phase, f"the last checkpoint is {ckpt}" if ckpt else
                        "no checkpoint was written yet")
            return "KILLED"
        except RunStopped as e:
            trainer.stop_with(e)
            raise
        except GeneratorsFailed as e:
            stop = RunStopped(f"generators keep dying: {e}", EXIT_FAILED)
            trainer.stop_with(stop)
            raise stop from None
        except component_failures as e:
            attempts += 1
            if attempts > cfg.cluster.max_restarts:
                log.error("component failure (%s); restarts exhausted (%d)", e, cfg.cluster.max_restarts)
                raise
            log.error("component failure (%s: %s); restarting from the last checkpoint (%d/%d)",
                      type(e).__name__, str(e).splitlines()[0][:200] if str(e) else "", attempts,
                      cfg.cluster.max_restarts)
            state.__dict__.update(_load_driver_state(run_dir).__dict__)
        finally:
            with profile.phase("shutdown: components (stop generators and actors)"):
                trainer.close()
            restore_signals()


def _stop_on_signals(trainer: Trainer):
    """SIGTERM / Ctrl-C: while training, finish the step, checkpoint and stop; during start or shutdown,
    or a second time, stop at once (KeyboardInterrupt out of whatever waits). Returns a function that
    puts the previous handlers back."""
    previous = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}

    def handler(signum, frame):
        name = signal.Signals(signum).name
        if trainer.phase == "train" and not trainer.stop_flag:
            trainer.stop_flag = True
            log.warning("%s: stopping after the current step, with a checkpoint (again: stop at once)", name)
            return
        trainer.interrupted = True
        # the flag too: a KeyboardInterrupt raised inside a callback Python ignores (seen in CI: an import lock's
        # weakref callback during start) is lost, and the loop must still stop at its next check
        trainer.stop_flag = True
        log.warning("%s during %s: stopping now", name, trainer.phase)
        raise KeyboardInterrupt

    for s in previous:
        signal.signal(s, handler)
    return lambda: [signal.signal(s, h) for s, h in previous.items()]


def _load_driver_state(run_dir) -> DriverState:
    base = run_dir.read_state()
    ckpt = run_dir.latest_checkpoint()
    if ckpt is None:
        cfg = run_dir.config()
        return DriverState(mlflow_run_id=base.get("mlflow_run_id"), generators=cfg.generator.num_generators)
    d = json.loads((ckpt / "driver.json").read_text())
    if "mlflow_run_id" in base:  # state.json's is the newest (a copy's is its own, or none yet)
        d["mlflow_run_id"] = base["mlflow_run_id"]
    return DriverState(**d)


def _prepare(cfg: RunConfig | None, resume: str | None, overrides: list[str], on_checked=None):
    """Check the run's inputs (`cluster.preflight.check_start`, the checks `exgrpo config` makes), then create
    the run folder (or, resuming, apply the overrides and pick the newest usable checkpoint): a bad input leaves
    nothing behind and the same `name=` free. `on_checked(cfg)`: called once the quick checks pass. Returns the
    `PreparedRun`; BadInput says what to change."""
    from cluster.preflight import BadInput, check_start, gpus_missing
    from cluster.runtime import RunDir, RunFolderError

    try:
        if resume:  # what the run folder says first: it refuses before Ray starts (beside the checks below)
            run_dir, cfg, changes = _reopen(resume, overrides)
            if run_dir.usable_checkpoint(cfg.buffer.num_shards) is None:
                log.warning("resume: %s has no checkpoint (it stopped before its first): it starts from step 0",
                            run_dir.path)
            state = _load_driver_state(run_dir)
            _refuse_finished(run_dir, cfg, state)
        else:
            assert cfg is not None
            changes = {}
        gpus = gpus_missing(cfg)  # `exgrpo config` warns of it (a GPU run's config is checked on CPU machines too)
        if gpus:
            raise BadInput("invalid configuration:", gpus)
        start = check_start(cfg, new_run=not resume, on_checked=on_checked)
        cfg, model_path, questions = start.cfg, start.model_path, start.questions
        if not resume:
            run_dir = RunDir.planned(cfg)
            return PreparedRun(cfg, run_dir.make(cfg), DriverState(generators=cfg.generator.num_generators),
                               model_path, questions)
    except RunFolderError as e:
        raise BadInput(f"error: {e}") from None
    _settle_where(run_dir, state)
    if "generator.num_generators" in changes:
        state.generators = cfg.generator.num_generators
    if run_dir.renamed:
        log.info("resume: config.yaml was saved under older names, read as %s", ", ".join(run_dir.renamed))
    if changes or run_dir.renamed:
        run_dir.save_config(cfg)
    if changes:
        log.info("resume: %s", ", ".join(f"{k} {old} -> {new}" for k, (old, new) in changes.items()))
    return PreparedRun(cfg, run_dir, state, model_path, questions)


def _settle_where(run_dir, state: DriverState) -> None:
    """A folder resumed somewhere else than it was last used: moved, it continues its MLflow run; copied (the original
    still there), it resumes from its own checkpoints into a new MLflow run, so the two never write to one."""
    where = run_dir.moved_from()
    if where is None:
        return
    before, still_there = where
    if still_there:
        log.warning("resume: %s is a copy of %s (still there): it resumes from its own checkpoints and logs to a new "
                    "MLflow run; the original is not touched", run_dir.path, before)
        state.mlflow_run_id = None
    else:
        log.info("resume: %s was moved from %s; it continues there", run_dir.path, before)
    run_dir.update_state(folder=str(run_dir.path.resolve()), mlflow_run_id=state.mlflow_run_id)


def _refuse_finished(run_dir, cfg: RunConfig, state: DriverState) -> None:
    from cluster.preflight import BadInput

    if state.step >= cfg.total_steps:
        raise BadInput(f"error: run {run_dir.name} already reached total_steps={cfg.total_steps}; to train further "
                       f"raise it: exgrpo train --resume {run_dir.path} total_steps={cfg.total_steps * 2}")
    if cfg.total_rollouts is not None and state.rollouts >= cfg.total_rollouts:
        raise BadInput(f"error: run {run_dir.name} already spent total_rollouts={cfg.total_rollouts} ({state.rollouts} "
                       f"trained); to train further raise it: exgrpo train --resume {run_dir.path} "
                       f"total_rollouts={cfg.total_rollouts * 2}")


def _reopen(resume: str, overrides: list[str]):
    """A run folder to resume, its saved config with `overrides` applied, and {field: (old, new)}."""
    from cluster.preflight import BadInput
    from cluster.runtime import RunDir
    from common.config import resume_config

    run_dir = RunDir(resume)
    run_dir.read_state()  # RunFolderError: not a run folder, or a damaged state.json
    try:
        saved = run_dir.config()
    except ConfigError as e:
        raise BadInput(f"error: {run_dir.path} holds an unusable config.yaml:", *e.lines) from None
    try:
        cfg, changes = resume_config(saved, overrides)
    except ConfigError as e:
        raise BadInput("invalid configuration:", *e.lines) from None
    return run_dir, cfg, changes


def prompt_example(questions, tokenizer) -> str:
    """What the model sees for the first training question: its prompt ids decoded (special tokens kept)."""
    q = questions[0]
    return (f"question {q.id} ({len(q.prompt_ids)} prompt tokens; the model sees exactly this text, special tokens "
            f"included):\n{tokenizer.decode(list(q.prompt_ids), skip_special_tokens=False)}")


def _show_prompt(run_dir, questions, model_path: Path, tracker) -> None:
    """Print the prompt of the first question once, and save it in the run folder and MLflow."""
    from cluster.preflight import load_tokenizer

    text = prompt_example(questions, load_tokenizer(model_path))
    log.info("the model's prompt, %s", text)
    _unless_the_disk_refuses(PROMPT_FILE, lambda: (run_dir.path / PROMPT_FILE).write_text(text + "\n"))
    tracker.log_text(text + "\n", PROMPT_FILE)


def _unless_the_disk_refuses(what: str, write) -> None:
    """Call `write`; a disk that refuses it (full, quota, I/O error, read-only) is one line, the trace goes to
    logs/driver.log, and the run goes on (these files are not what a resume needs)."""
    from common.disk import disk_error

    try:
        write()
    except OSError as e:
        err = disk_error(e)
        if err is None:
            raise
        log.debug("writing %s failed", what, exc_info=e)
        log.error("could not write %s: %s (%s)", what, err.strerror, err.filename or "the run folder")


def _shutdown_ray() -> None:
    from cluster.runtime import shutdown_ray

    shutdown_ray()
