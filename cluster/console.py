"""What the user sees: a progress bar on a terminal, concise lines otherwise, full logs in files."""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path

NOISY_LOGGERS = ("ray", "vllm", "transformers", "mlflow", "alembic", "urllib3", "filelock", "torch", "sqlalchemy",
                 "matplotlib", "PIL")
STORE_LOGGERS = ("mlflow", "sqlalchemy", "alembic", "huey")
"""The tracking store's libraries: their records (the tracebacks of a store that cannot write among them) go to
logs/driver.log only; `cluster.tracking` says what the user needs in one line."""


def setup_logging(log_dir: Path | None, level: int = logging.INFO) -> None:
    """Our INFO lines to the console; everything (ours and libraries') at DEBUG to logs/driver.log
    (console only while `log_dir` is None: before the run folder exists); credentials redacted in both."""
    root = logging.getLogger()
    root.setLevel(logging.DEBUG)
    for h in list(root.handlers):
        root.removeHandler(h)
    if log_dir is not None:
        log_dir.mkdir(parents=True, exist_ok=True)
        fh = LogFile(log_dir / "driver.log")
        fh.setLevel(logging.DEBUG)
        fh.setFormatter(Redacting("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        root.addHandler(fh)
    ch = logging.StreamHandler(sys.stderr)
    ch.setLevel(level)
    ch.setFormatter(Redacting("[exgrpo] %(message)s"))
    ch.addFilter(lambda r: (r.name.startswith("exgrpo") or r.levelno >= logging.ERROR)
                 and r.name.partition(".")[0] not in STORE_LOGGERS)
    root.addHandler(ch)
    for name in NOISY_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)


class Redacting(logging.Formatter):
    """A formatter that hides URI credentials (`scheme://user:***@`, `?token=***`) in the whole line, the traceback
    included: a library's message or error that quotes a store's URL never writes its password."""

    def format(self, record: logging.LogRecord) -> str:
        from common.config.secrets import redact

        return redact(super().format(record))


def quiet_store_loggers() -> None:
    """Take MLflow's own console handler off its loggers (it adds one when imported, unless MLFLOW_CONFIGURE_LOGGING
    is false), so that their records reach the root's handlers: the file, never the console."""
    for name in (*STORE_LOGGERS, "sqlalchemy.engine"):
        logger = logging.getLogger(name)
        logger.handlers = []
        logger.propagate = True


OUR_PACKAGES = ("actors", "buffer", "cluster", "common", "learner")


def setup_worker() -> None:
    """Ray's `worker_process_setup_hook` (`cluster.runtime.start_ray`), in every worker process of a run: our
    packages' INFO lines (a learner rank's levers and LoRA line, a generator's adapter merge, ...) go to the
    worker's stderr, which Ray keeps as `worker-*.err` (an embedded run copies them into the run's `logs/ray`);
    without it they were dropped, a worker's root logger passing WARNING and above only. And transformers imports
    no scikit-learn (`common.import_cost`: 2.6 s of each model-loading worker's start). Files the worker writes are
    private (umask 0o077, as `exgrpo train` sets for itself), on a joined cluster too."""
    import os

    from common.import_cost import skip_sklearn_in_transformers

    os.umask(0o077)

    skip_sklearn_in_transformers()
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    for name in OUR_PACKAGES:
        logger = logging.getLogger(name)
        if not any(getattr(h, "exgrpo_worker", False) for h in logger.handlers):
            handler.exgrpo_worker = True
            logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False  # Ray's own root handlers would print them twice


class LogFile(logging.FileHandler):
    """logs/driver.log. A line the disk refuses is not a traceback on the console (logging's default, once per
    line): the first one of a failing spell is said in one line, and lines are lost until the file takes writes."""

    failing = False
    _refused = False

    def handleError(self, record: logging.LogRecord) -> None:
        self._refused = True
        if not self.failing:
            self.failing = True
            sys.stderr.write(f"[exgrpo] {self.baseFilename} cannot be written ({sys.exc_info()[1]}); its lines are "
                             "lost while the disk refuses them\n")

    def emit(self, record: logging.LogRecord) -> None:
        self._refused = False
        super().emit(record)
        self.failing = self._refused


class Progress:
    """step | reward | accuracy | rollouts/s | buffer size | staleness — a bar on a TTY, lines elsewhere."""

    def __init__(self, total: int, start: int = 0, every_s: float = 10.0):
        self.total, self.every_s = total, every_s
        self._last = 0.0
        self._bar = None
        if sys.stderr.isatty():
            from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
            from rich.progress import Progress as RichProgress

            self._bar = RichProgress(
                TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                TextColumn("{task.fields[info]}"), transient=False,
            )
            self._bar.start()
            self._task = self._bar.add_task("train", total=total, completed=start, info="waiting for the first batch")

    @staticmethod
    def describe(m: dict[str, float]) -> str:
        return (f"reward {m.get('train/reward_mean', 0):.2f}  acc {m.get('train/accuracy_fresh', 0):.2f}  "
                f"{m.get('generator/rollouts_per_s', 0):.0f} rollouts/s  "
                f"buffer {int(m.get('buffer/stored_trajectories', 0))}  "
                f"lag {m.get('staleness/mean', 0):.1f}  replay {m.get('train/replay_fraction', 0):.2f}"
                + (f"  eval pass@1 {m['eval/pass_at_1']:.3f}" if "eval/pass_at_1" in m else ""))

    def update(self, step: int, metrics: dict[str, float]) -> None:
        info = self.describe(metrics)
        if self._bar is not None:
            self._bar.update(self._task, completed=step, info=info)
            return
        now = time.monotonic()
        if now - self._last >= self.every_s or step == self.total:
            self._last = now
            print(f"[exgrpo] step {step}/{self.total}  {info}", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
