"""The `tracking` and `checkpoint` sections."""

from __future__ import annotations

from pydantic import Field

from common.config.base import Section


class TrackingConfig(Section):
    """MLflow tracking."""

    enabled: bool = True
    """Log to MLflow."""
    uri: str | None = None
    """Tracking URI; None = a SQLite store `mlflow.db` in the runs root."""
    experiment: str = Field("exgrpo", min_length=1)
    """MLflow experiment name."""
    log_plots: bool = True
    """Log plots (buckets, reward, staleness, entropy) as artifacts at the end."""
    log_model: bool = False
    """Log the final model folder as an artifact."""
    parent_run_id: str | None = None
    """Nest this run under an MLflow parent run (set by `exgrpo experiment` for its variants)."""


class CheckpointConfig(Section):
    """Run folders and checkpoints."""

    runs_root: str = "runs"
    """Parent folder of run folders (and of the default MLflow store)."""
    every_steps: int = Field(25, ge=0)
    """Checkpoint every N learner steps (0: only at the end and on SIGTERM)."""
    keep_last: int = Field(2, ge=1, le=1000)
    """Checkpoints kept in the run folder."""
