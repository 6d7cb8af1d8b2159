"""MLflow tracking that never stops training, and whose store's faults stay off the console.

Metrics are buffered in memory and flushed in batches by a background thread; a store that cannot write is one
warning when it starts failing and one when it takes writes again, and the points are retried each round.
Points that cannot wait are appended to the run folder's `metrics-unsent.jsonl`, which
`exgrpo track --replay RUN` (`replay_main`) sends later; an offline run (`Tracker.offline`) writes every point
there. The metric history is also kept locally for the end-of-run plots.

Details: docs/internals.md#clustertrackingpy
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable

from common.config.secrets import PASSWORD_ENV, USERNAME_ENV, redact, split_password
from common.text import one_line

log = logging.getLogger("exgrpo.tracking")

UNSENT_FILE = "metrics-unsent.jsonl"
"""In the run folder: one metric point a line (`{"key", "value", "timestamp", "step"}`) that the store did not
take; `exgrpo track --replay RUN` sends them."""


def default_tracking_uri(runs_root: str | Path) -> str:
    """A SQLite store beside the run folders, so `mlflow ui --backend-store-uri <uri>` shows every run."""
    return f"sqlite:///{Path(runs_root).expanduser().resolve() / 'mlflow.db'}"


def artifact_location(uri: str, experiment: str) -> str | None:
    """Where a new experiment's artifacts go: beside a SQLite store (`<store folder>/mlartifacts/<experiment>`).

    MLflow's own default for a database store is `./mlruns` of whatever folder the process runs in, which
    scatters plots over the user's working folders. None (the server's or file store's own choice) otherwise."""
    if not uri.startswith("sqlite:///"):
        return None
    db = Path(uri.removeprefix("sqlite:///"))
    return (db.parent / "mlartifacts" / experiment).as_uri()


class Tracker:
    """One MLflow run: parameters, metrics (buffered), artifacts and plots."""

    def __init__(self, uri: str, experiment: str, *, enabled: bool = True, flush_every_s: float = 5.0,
                 max_buffered: int = 200_000, unsent_path: str | Path | None = None, retry_open_s: float = 60.0):
        self.uri = _credentials_to_env(uri)
        self.where = redact(uri)  # what messages show
        self.unsent_path = Path(unsent_path) if unsent_path is not None else None
        self.experiment = experiment
        self.enabled = enabled
        self.run_id: str | None = None
        self.flush_every_s = flush_every_s
        self.max_buffered = max_buffered
        self.history: dict[str, list[tuple[int, float]]] = defaultdict(list)
        self.unsent = 0  # points this process appended to unsent_path
        self.lost = 0  # points dropped: the store refused them and unsent_path could not take them either
        self.failures = 0  # refused store calls
        self.failing = False  # the store refuses writes now: warned when it starts, and when it recovers
        self.offline = False  # no MLflow run could be opened: every point goes to unsent_path
        self.retry_open_s = retry_open_s  # offline: the MLflow run is tried again this often (0: never)
        self.on_online: Callable[[Tracker], None] | None = None  # runs once an offline run's MLflow run opens
        self._opening: tuple[str, str | None, dict[str, str] | None] | None = None  # start's arguments
        self._next_open = 0.0
        self._spell = 0  # failures before the current failing spell
        self._pending: list[Any] = []
        self._unsent_lock = threading.Lock()
        self._client = None
        self._lock = threading.Lock()
        self._flush_lock = threading.Lock()  # two flushes at once would send a chunk twice and drop the next
        self._wake = threading.Event()
        self._closing = False
        self._thread: threading.Thread | None = None
        # Fail fast against a dead HTTP server instead of MLflow's minutes of retries (user env wins).
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
        os.environ.setdefault("MLFLOW_LOGGING_LEVEL", "WARNING")  # no INFO banners on the user's console
        os.environ.setdefault("MLFLOW_CONFIGURE_LOGGING", "false")  # no console handler of MLflow's own

    # -------------------------------------------------------------------------------------- start

    def start(self, run_name: str, run_id: str | None = None, tags: dict[str, str] | None = None) -> str | None:
        """Create (or, with run_id, reopen) the MLflow run. Returns its id, None when tracking is off/down. A run
        with a folder for its points goes offline when the store does not answer, and its MLflow run is tried again
        every `retry_open_s` (`_try_online`)."""
        if not self.enabled:
            return None
        self._opening = (run_name, run_id, tags)
        try:
            self._open()
        except Exception as e:  # the tracking store is optional for training: report once, continue
            log.debug("starting the MLflow run at %s failed", self.where, exc_info=e)
            self._client = None
            self.offline = self.unsent_path is not None
            self._next_open = time.monotonic() + self.retry_open_s
            if isinstance(e, ImportError):  # MLflow is not installed: no later try can open it
                self.retry_open_s = 0
            if self.offline:
                again = f"; it is tried again every {self.retry_open_s:g} s" if self.retry_open_s > 0 else ""
                log.warning("could not start the MLflow run at %s: %s; training goes on, its metric points kept in "
                            "%s%s: `exgrpo track --replay %s` sends them to a store later (details in "
                            "logs/driver.log)", self.where, _short(e), self.unsent_path, again,
                            self.unsent_path.parent)
            else:
                log.warning("could not start the MLflow run at %s: %s; training goes on without tracking (details "
                            "in logs/driver.log)", self.where, _short(e))
        if self._client is not None or self.offline:
            self._thread = threading.Thread(target=self._flush_loop, name="mlflow-flush", daemon=True)
            self._thread.start()
        return self.run_id

    def _open(self) -> None:
        """Open the MLflow run `start` was asked for (sets `_client` and `run_id`); raises what the store raised."""
        from mlflow.tracking import MlflowClient

        from cluster.console import quiet_store_loggers

        run_name, run_id, tags = self._opening
        quiet_store_loggers()  # imported before this process set MLFLOW_CONFIGURE_LOGGING: MLflow's handler is on
        client = MlflowClient(tracking_uri=self.uri)
        if run_id is not None:
            client.update_run(run_id, status="RUNNING")
        else:
            exp = client.get_experiment_by_name(self.experiment)
            exp_id = exp.experiment_id if exp else client.create_experiment(
                self.experiment, artifact_location=artifact_location(self.uri, self.experiment))
            run_id = client.create_run(exp_id, run_name=run_name, tags=tags or {}).info.run_id
        self._client, self.run_id = client, run_id

    def _try_online(self) -> None:
        """Offline: open the MLflow run now. Once open, the points kept in `unsent_path` are sent (what the store
        refuses stays there for `finish`), later points go to the store, and `on_online` runs (the driver logs
        the parameters and names the run in state.json)."""
        try:
            self._open()
        except Exception as e:
            log.debug("the MLflow run at %s is still not open", self.where, exc_info=e)
            self._next_open = time.monotonic() + self.retry_open_s
            return
        with self._flush_lock:
            self.offline = False
        sent = 0
        try:
            with self._unsent_lock:
                if self.unsent_path.exists():
                    sent = replay(self._client, self.run_id, self.unsent_path)
                self.unsent = 0
        except Exception as e:
            self._store_failed("the metrics kept in " + str(self.unsent_path), e)
        log.warning("MLflow store %s answers now: the run's MLflow run is open (run id %s); %d metric points kept in "
                    "%s were sent, the next ones follow", self.where, self.run_id, sent, self.unsent_path)
        if self.on_online is not None:
            try:
                self.on_online(self)
            except Exception as e:  # noqa: BLE001 (the driver's bookkeeping must not end the flush thread)
                log.warning("after the MLflow run opened: %s (details in logs/driver.log)", _short(e))
                log.debug("on_online failed", exc_info=e)

    def log_params(self, params: dict[str, Any]) -> None:
        if self._client is None or self.run_id is None:
            return
        from mlflow.entities import Param

        items = [Param(k, str(v)[:6000]) for k, v in params.items()]
        try:
            for i in range(0, len(items), 100):
                self._client.log_batch(self.run_id, params=items[i : i + 100])
        except Exception as e:
            self._store_failed("parameters", e)

    def log_text(self, text: str, artifact_file: str) -> None:
        if self._client is None or self.run_id is None:
            return
        try:
            self._client.log_text(self.run_id, text, artifact_file)
        except Exception as e:
            self._store_failed(artifact_file, e)

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        if self._client is None or self.run_id is None:
            return
        try:
            p = Path(path)
            if p.is_dir():
                self._client.log_artifacts(self.run_id, str(p), artifact_path)
            else:
                self._client.log_artifact(self.run_id, str(p), artifact_path)
        except Exception as e:
            self._store_failed(f"artifact {path}", e)

    # ------------------------------------------------------------------------------------ metrics

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        """Buffer metrics of one step (non-finite and non-numeric values are skipped)."""
        now_ms = int(time.time() * 1000)
        for k, v in metrics.items():
            try:
                fv = float(v)
            except (TypeError, ValueError):
                continue
            if fv != fv or fv in (float("inf"), float("-inf")):
                continue
            self.history[k].append((step, fv))
            if self._client is not None or self.offline:
                with self._lock:
                    self._pending.append((k, fv, now_ms, step))
        with self._lock:
            over = self._pending[: max(0, len(self._pending) - self.max_buffered)]
            del self._pending[: len(over)]
        if over:  # the oldest wait in the run folder instead
            self._keep_unsent(over)

    def _flush_loop(self) -> None:
        while not self._closing:
            self._wake.wait(self.flush_every_s)
            self._wake.clear()
            if self.offline and self.retry_open_s > 0 and time.monotonic() >= self._next_open and not self._closing:
                self._try_online()
            self.flush()

    def flush(self) -> bool:
        """Send everything pending; False (and the values kept) when the store does not accept them.
        Callable from any thread (the background thread, a checkpoint, `finish`): one flush at a time.
        Offline, everything pending goes to `unsent_path`."""
        if self.offline:
            with self._flush_lock, self._lock:
                points, self._pending = self._pending, []
            self._keep_unsent(points)
            return True
        if self._client is None or self.run_id is None:
            return True
        with self._flush_lock:
            return self._flush()

    def _flush(self) -> bool:
        from mlflow.entities import Metric

        while True:
            with self._lock:
                chunk = self._pending[:1000]
            if not chunk:
                return True
            try:
                self._client.log_batch(self.run_id, metrics=[Metric(k, v, t, s) for k, v, t, s in chunk])
            except Exception as e:  # store down/slow/full: keep the values, say so once, retry next round
                self._store_failed("metrics", e)
                return False
            with self._lock:
                del self._pending[: len(chunk)]
            self._store_ok()

    def flush_or_keep(self) -> None:
        """Send everything pending, or append it to `unsent_path` when the store does not take it: a checkpoint
        calls this before it exists, so that a run killed right after it (whose resume never logs those steps
        again) loses no point."""
        if self.offline:
            self.flush()
            return
        if self._client is None or self.run_id is None:
            return
        with self._flush_lock:
            if self._flush():
                return
            with self._lock:
                points, self._pending = self._pending, []
        self._keep_unsent(points)

    def _keep_unsent(self, points: list) -> None:
        """Append `points` to `unsent_path` (fsynced); those it cannot take are counted as lost."""
        if not points:
            return
        with self._unsent_lock:
            try:
                if self.unsent_path is None:
                    raise OSError("no run folder to keep them in")
                with open(self.unsent_path, "a") as f:
                    f.writelines(json.dumps({"key": k, "value": v, "timestamp": t, "step": s}) + "\n"
                                 for k, v, t, s in points)
                    f.flush()
                    os.fsync(f.fileno())
                self.unsent += len(points)
            except OSError as e:
                log.debug("appending %d metric points to %s failed", len(points), self.unsent_path, exc_info=e)
                if not self.lost:
                    log.warning("MLflow: %d metric points the store did not take could not be kept in %s either "
                                "(%s); they are lost, and counted (metrics_lost in state.json)", len(points),
                                self.unsent_path, _short(e))
                self.lost += len(points)

    @property
    def pending(self) -> int:
        return len(self._pending)

    def counts(self) -> dict[str, int]:
        """Metric points the store has not taken: in memory (retried), in `unsent_path` (to replay), lost."""
        return {"metrics_buffered": self.pending, "metrics_unsent": self.unsent, "metrics_lost": self.lost}

    def finish(self, status: str = "FINISHED", timeout_s: float = 30.0) -> None:
        """Stop the flush thread, send what is left (bounded by timeout_s), close the run, and say how many points
        never reached the store (kept in `unsent_path`, or lost). When the store takes writes, the points an
        earlier failure left in `unsent_path` are sent first."""
        self._closing = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
        if self.offline:
            self.flush()
            log.warning("MLflow: no run was opened; the %d metric points are kept in %s: `exgrpo track --replay %s` "
                        "sends them to a store", count_unsent(self.unsent_path), self.unsent_path,
                        self.unsent_path.parent)
            return
        if self._client is None or self.run_id is None:
            return
        self.flush_or_keep()
        path = self.unsent_path
        if not self.failing and path is not None and path.exists():
            try:
                with self._unsent_lock:
                    replay(self._client, self.run_id, path)
            except Exception as e:
                self._store_failed("the metrics kept in " + str(path), e)
        try:
            self._client.set_terminated(self.run_id, status=status)
        except Exception as e:
            self._store_failed("the run's end", e)
        left = count_unsent(path) if path is not None else 0
        if left:
            log.warning("MLflow: %d metric points never reached the store %s; they are kept in %s: `exgrpo track "
                        "--replay %s` sends them once it takes writes", left, self.where, path, path.parent)
        elif self.failures:
            log.info("MLflow: every metric point reached the store (it refused %d writes on the way)", self.failures)
        if self.lost:
            log.warning("MLflow: %d metric points are lost (the store refused them and %s could not take them)",
                        self.lost, path)

    def _store_failed(self, what: str, e: Exception) -> None:
        """The store refused `what`: the trace to the log file; one warning when it starts failing."""
        self.failures += 1
        log.debug("MLflow store %s refused %s", self.where, what, exc_info=e)
        if not self.failing:
            self.failing, self._spell = True, self.failures - 1
            log.warning("MLflow store %s stopped taking writes (%s refused: %s); metric points are kept and retried "
                        "every %gs (details in logs/driver.log)", self.where, what, _short(e), self.flush_every_s)

    def _store_ok(self) -> None:
        if self.failing:
            self.failing = False
            kept = f"; the {self.unsent} kept in {self.unsent_path} are sent at the end" if self.unsent else ""
            log.warning("MLflow store %s takes writes again (%d writes refused meanwhile); the buffered metric points "
                        "were sent%s", self.where, self.failures - self._spell, kept)

    # -------------------------------------------------------------------------------------- plots

    def log_plots(self, out_dir: str | Path) -> list[Path]:
        """Draw the run's curves from the local history, save PNGs to out_dir and log them."""
        from cluster.plots import draw_all

        paths = draw_all(self.history, Path(out_dir))
        for p in paths:
            self.log_artifact(p, "plots")
        return paths


class LateStart:
    """A Tracker whose start (MLflow's imports and store migrations: ~2 CPU-seconds of this process) runs in a thread
    begun late, after the first learner update (`begin`), so that it takes no CPU from the components' start.
    Until it is open, `log_metrics` keeps the points in order; calling it returns the open Tracker (beginning the
    start and waiting for it when needed) with those points logged. `opened(tracker)` runs once, when it opens."""

    def __init__(self, start, opened=None):
        self._start, self._opened = start, opened
        self._future = None
        self._tracker: Tracker | None = None
        self._early: list[tuple[dict[str, float], int]] = []

    @classmethod
    def of(cls, tracker: Tracker) -> LateStart:
        """One already open."""
        late = cls(lambda: tracker)
        late._tracker = tracker
        return late

    def begin(self) -> None:
        if self._future is None and self._tracker is None:
            from concurrent.futures import ThreadPoolExecutor

            pool = ThreadPoolExecutor(1, thread_name_prefix="mlflow-start")
            self._future = pool.submit(self._start)
            pool.shutdown(wait=False)

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        if self._tracker is not None or (self._future is not None and self._future.done()):
            self().log_metrics(metrics, step)
        else:
            self._early.append((metrics, step))

    def __call__(self) -> Tracker:
        if self._tracker is None:
            self.begin()
            self._tracker = self._future.result()
            if self._opened is not None:
                self._opened(self._tracker)
        while self._early:
            self._tracker.log_metrics(*self._early.pop(0))
        return self._tracker


def _credentials_to_env(uri: str) -> str:
    """`uri` for MLflow: an http(s) server's `user:password@` moved into MLFLOW_TRACKING_USERNAME / _PASSWORD of this
    process (which MLflow reads per request), so that no request URL, error or log line of MLflow's carries them; a
    database URI as it is (its driver needs them in the URI)."""
    bare, user, password = split_password(uri)
    if password is None or not uri.lower().startswith(("http://", "https://")):
        return uri
    os.environ[USERNAME_ENV], os.environ[PASSWORD_ENV] = user, password
    return bare


def _short(e: BaseException) -> str:
    """`Type: the first line that says something` of an exception (SQLAlchemy starts with a hint in brackets),
    credentials redacted."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip() and not ln.startswith("(raised as a result")]
    return redact(f"{type(e).__name__}: {one_line(lines[0], 200)}" if lines
                  else type(e).__name__)


def read_unsent(path: Path) -> list[tuple[str, float, int, int]]:
    """The points of an unsent file as (key, value, timestamp ms, step); a line cut short by a crash is skipped."""
    out = []
    for line in path.read_text().splitlines():
        try:
            p = json.loads(line)
            out.append((str(p["key"]), float(p["value"]), int(p["timestamp"]), int(p["step"])))
        except (ValueError, KeyError, TypeError):
            log.warning("%s: skipped a line that is not a metric point: %r", path, line[:200])
    return out


def count_unsent(path: Path) -> int:
    try:
        with open(path) as f:
            return sum(1 for line in f if line.strip())
    except FileNotFoundError:
        return 0


def replay(client, run_id: str, path: Path, chunk: int = 1000) -> int:
    """Send the points of the unsent file `path` to run `run_id`, in order, a chunk at a time; the file is
    removed once all were sent. When the store refuses a chunk, the file is rewritten with the points not sent
    (none twice) and the store's error raised. Returns how many were sent."""
    from mlflow.entities import Metric

    from common.disk import atomic_write_text

    points = read_unsent(path)
    for i in range(0, len(points), chunk):
        try:
            client.log_batch(run_id, metrics=[Metric(k, v, t, s) for k, v, t, s in points[i : i + chunk]])
        except Exception:
            atomic_write_text(path, "".join(json.dumps({"key": k, "value": v, "timestamp": t, "step": s}) + "\n"
                                            for k, v, t, s in points[i:]))
            raise
    path.unlink()
    return len(points)


def replay_main(run: str) -> int:
    """`exgrpo track --replay RUN`: send the metric points the run's store did not take (its metrics-unsent.jsonl)
    to the run's MLflow run. A run that trained offline (state.json names no MLflow run: MLflow was missing or its
    store down at the start) gets its MLflow run opened first, with the run folder's name, config and end state,
    and state.json then names it. Exit 0 when all were sent (or there were none), 1 when the store still refuses
    them (the file keeps the rest), 2 when RUN is not a run folder."""
    from cluster.console import quiet_store_loggers, setup_logging
    from cluster.runtime import RunDir, RunFolderError
    from common.config import ConfigError, restore_secrets

    setup_logging(None)
    run_dir = RunDir(run)
    try:
        run_id = run_dir.read_state().get("mlflow_run_id")
        cfg = run_dir.config()
    except (RunFolderError, ConfigError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    path = run_dir.path / UNSENT_FILE
    n = count_unsent(path)
    if n == 0:
        print(f"nothing to replay: {run_dir.path} holds no unsent metric points (every point reached the store)")
        return 0
    try:
        cfg = restore_secrets(cfg)
    except ConfigError as e:
        print(*(f"error: {line}" for line in e.lines), sep="\n", file=sys.stderr)
        return 2
    uri = _credentials_to_env(cfg.tracking.uri or default_tracking_uri(cfg.checkpoint.runs_root))
    where = redact(cfg.tracking.uri or uri)
    from mlflow.tracking import MlflowClient

    quiet_store_loggers()
    client = MlflowClient(tracking_uri=uri)
    try:
        if run_id is None:
            run_id = _open_offline_run(client, uri, run_dir, cfg)
        sent = replay(client, run_id, path)
    except Exception as e:
        log.debug("replaying %s into %s failed", path, where, exc_info=e)
        print(f"error: the MLflow store {where} refused them ({_short(e)}); {count_unsent(path)} of the {n} points "
              f"stay in {path}: try again once it takes writes", file=sys.stderr)
        return 1
    files = _send_files(client, run_id, run_dir)
    run_dir.update_state(metrics_unsent=0)
    print(f"sent {sent} metric points from {path}{f' and {files}' if files else ''} to {where} (run id {run_id})")
    return 0


def _send_files(client, run_id: str, run_dir) -> str:
    """The run folder's plots and prompt example as the run's artifacts, under the names `exgrpo train` gives them
    (a store that was down at the run's end never got them; sending them again replaces them). Says what was sent."""
    sent = []
    plots = sorted((run_dir.path / "plots").glob("*.png"))
    for p in plots:
        client.log_artifact(run_id, str(p), "plots")
    if plots:
        sent.append(f"{len(plots)} plot(s)")
    prompt = run_dir.path / "prompt_example.txt"
    if prompt.is_file():
        client.log_artifact(run_id, str(prompt))
        sent.append(prompt.name)
    return " and ".join(sent)


def _open_offline_run(client, uri: str, run_dir, cfg) -> str:
    """Open the MLflow run of a run that trained offline: its name, parameters and config as `exgrpo train` logs
    them, its end status from state.json; state.json then names it (so a second replay sends to the same run)."""
    from mlflow.entities import Param

    from common.config import flatten, to_yaml

    exp = client.get_experiment_by_name(cfg.tracking.experiment)
    exp_id = exp.experiment_id if exp else client.create_experiment(
        cfg.tracking.experiment, artifact_location=artifact_location(uri, cfg.tracking.experiment))
    tags = {"mlflow.parentRunId": cfg.tracking.parent_run_id} if cfg.tracking.parent_run_id else {}
    run_id = client.create_run(exp_id, run_name=run_dir.name, tags=tags).info.run_id
    params = [Param(k, str(v)[:6000]) for k, v in flatten(cfg).items()]
    for i in range(0, len(params), 100):
        client.log_batch(run_id, params=params[i : i + 100])
    client.log_text(run_id, to_yaml(cfg), "config.yaml")
    status = run_dir.read_state().get("status")
    if status in ("FINISHED", "FAILED", "KILLED"):
        client.set_terminated(run_id, status=status)
    run_dir.update_state(mlflow_run_id=run_id)
    return run_id
