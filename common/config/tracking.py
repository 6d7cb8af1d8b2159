"""The `tracking` and `checkpoint` sections."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from common.config.base import Section


class TrackingConfig(Section):
    """MLflow tracking."""

    enabled: bool = True
    """Log to MLflow."""
    uri: str | None = None
    """Tracking URI; None = a SQLite store `mlflow.db` in the runs root. Its password (`https://user:pw@host/`,
    `postgresql://user:pw@host/db`) stays in the process: config.yaml, MLflow and the logs show `user:***@`; a resume
    reads it from MLFLOW_TRACKING_PASSWORD, or from the URI given again."""
    experiment: str = Field("exgrpo", min_length=1)
    """MLflow experiment name."""
    log_plots: bool = True
    """Log plots (buckets, reward, staleness, entropy) as artifacts at the end."""
    log_model: bool = False
    """Log the final model folder as an artifact."""
    parent_run_id: str | None = None
    """Nest this run under an MLflow parent run (set by `exgrpo experiment` for its variants)."""
    retry_open_s: float = Field(60.0, ge=0, le=86_400)
    """A run whose MLflow run could not be opened (its store down or slow to answer) trains offline, its metric
    points kept in the run folder's metrics-unsent.jsonl; its MLflow run is tried again this often (seconds), and once
    open the kept points, the parameters and the config are sent and the run logs as usual. 0: never (the points wait
    for `exgrpo track --replay RUN`)."""


class CheckpointConfig(Section):
    """Run folders and checkpoints."""

    runs_root: str = "runs"
    """Parent folder of run folders (and of the default MLflow store)."""
    every_steps: int = Field(25, ge=0)
    """Checkpoint every N learner steps (0: only at the end and on SIGTERM)."""
    keep_last: int = Field(2, ge=1, le=1000)
    """Checkpoints kept in the run folder."""
    on_full_disk: Literal["stop", "skip"] = "stop"
    """What a checkpoint that does not fit does. Before each checkpoint its size (that of the previous one;
    for the first, the model's and the buffer's bytes) is compared with the free space, and a write that
    fails anyway (no space, quota) counts the same. `stop`: a clean stop with exit code 4, state FAILED, the
    last complete checkpoint kept for `--resume`. `skip`: train on and try again at the next checkpoint (a
    warning each time, metric `checkpoint/skipped`). An I/O error or a read-only disk always stops."""
