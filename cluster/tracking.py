"""MLflow tracking that never stops training.

Metrics are buffered in memory and flushed in batches (`MlflowClient.log_batch`) by a background
thread, so a slow tracking server never delays a training step. When the store is down or slow, the
problem is reported once, metrics stay buffered (bounded; the oldest are dropped and counted beyond
`max_buffered`) and flushing is retried on the next round. The metric
history is also kept locally for the end-of-run plots.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

log = logging.getLogger("exgrpo.tracking")


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
                 max_buffered: int = 200_000):
        self.uri = uri
        self.experiment = experiment
        self.enabled = enabled
        self.run_id: str | None = None
        self.flush_every_s = flush_every_s
        self.max_buffered = max_buffered
        self.history: dict[str, list[tuple[int, float]]] = defaultdict(list)
        self.dropped = 0
        self.failures = 0
        self._pending: list[Any] = []
        self._reported = False
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

    # -------------------------------------------------------------------------------------- start

    def start(self, run_name: str, run_id: str | None = None, tags: dict[str, str] | None = None) -> str | None:
        """Create (or, with run_id, reopen) the MLflow run. Returns its id, None when tracking is off/down."""
        if not self.enabled:
            return None
        try:
            from mlflow.tracking import MlflowClient

            self._client = MlflowClient(tracking_uri=self.uri)
            if run_id is not None:
                self._client.update_run(run_id, status="RUNNING")
                self.run_id = run_id
            else:
                exp = self._client.get_experiment_by_name(self.experiment)
                exp_id = exp.experiment_id if exp else self._client.create_experiment(
                    self.experiment, artifact_location=artifact_location(self.uri, self.experiment))
                run = self._client.create_run(exp_id, run_name=run_name, tags=tags or {})
                self.run_id = run.info.run_id
        except Exception as e:  # the tracking store is optional for training: report once, continue
            self._report(f"could not start the MLflow run at {self.uri}: {type(e).__name__}: {e}")
            self._client = None
        if self._client is not None:
            self._thread = threading.Thread(target=self._flush_loop, name="mlflow-flush", daemon=True)
            self._thread.start()
        return self.run_id

    def log_params(self, params: dict[str, Any]) -> None:
        if self._client is None or self.run_id is None:
            return
        from mlflow.entities import Param

        items = [Param(k, str(v)[:6000]) for k, v in params.items()]
        try:
            for i in range(0, len(items), 100):
                self._client.log_batch(self.run_id, params=items[i : i + 100])
        except Exception as e:
            self._report(f"could not log parameters: {type(e).__name__}: {e}")

    def log_text(self, text: str, artifact_file: str) -> None:
        if self._client is None or self.run_id is None:
            return
        try:
            self._client.log_text(self.run_id, text, artifact_file)
        except Exception as e:
            self._report(f"could not log {artifact_file}: {type(e).__name__}: {e}")

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
            self._report(f"could not log artifact {path}: {type(e).__name__}: {e}")

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
            if self._client is not None:
                with self._lock:
                    self._pending.append((k, fv, now_ms, step))
        with self._lock:
            if len(self._pending) > self.max_buffered:
                over = len(self._pending) - self.max_buffered
                del self._pending[:over]
                self.dropped += over

    def _flush_loop(self) -> None:
        while not self._closing:
            self._wake.wait(self.flush_every_s)
            self._wake.clear()
            self.flush()

    def flush(self) -> bool:
        """Send everything pending; False (and the values kept) when the store does not accept them.
        Callable from any thread (the background thread, a checkpoint, `finish`): one flush at a time."""
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
            except Exception as e:  # store down/slow: keep the values, report once, retry next round
                self.failures += 1
                self._report(f"MLflow store {self.uri} is not accepting metrics ({type(e).__name__}: {e}); "
                             f"buffering and retrying")
                return False
            with self._lock:
                del self._pending[: len(chunk)]

    @property
    def pending(self) -> int:
        return len(self._pending)

    def finish(self, status: str = "FINISHED", timeout_s: float = 30.0) -> None:
        """Stop the flush thread, send what is left (bounded by timeout_s) and close the run."""
        self._closing = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
        self.flush()
        if self._client is not None and self.run_id is not None:
            try:
                self._client.set_terminated(self.run_id, status=status)
            except Exception as e:
                self._report(f"could not close the MLflow run: {type(e).__name__}: {e}")

    def _report(self, msg: str) -> None:
        if not self._reported:
            log.warning("%s (reported once; training continues)", msg)
            self._reported = True
        else:
            log.debug(msg)

    # -------------------------------------------------------------------------------------- plots

    def log_plots(self, out_dir: str | Path) -> list[Path]:
        """Draw the run's curves from the local history, save PNGs to out_dir and log them."""
        from cluster.plots import draw_all

        paths = draw_all(self.history, Path(out_dir))
        for p in paths:
            self.log_artifact(p, "plots")
        return paths
