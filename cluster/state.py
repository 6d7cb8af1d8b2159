"""The driver's own state in a checkpoint (`driver.json`): read by the driver, which writes it, by the run
(`cluster.run`), which restores it, and by the start-up checks, which validate a checkpoint before resuming."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

if TYPE_CHECKING:
    from common.config import RunConfig


@dataclass
class DriverState:
    """What the driver itself must carry across a checkpoint."""

    step: int = 0
    mlflow_run_id: str | None = None
    generators: int = 1
    rng: dict[str, Any] = field(default_factory=dict)
    wait_s: float = 0.0
    train_s: float = 0.0
    accounting: dict[str, int] = field(default_factory=dict)  # the buffer's counts at the checkpoint's snapshot
    rollouts: int = 0  # generated (fresh) rollouts trained so far: the budget `total_rollouts` counts
    checkpoints_skipped: int = 0  # checkpoints that did not fit (checkpoint.on_full_disk=skip)
    # metric points the tracking store had not taken when this checkpoint was written (cluster.tracking.Tracker):
    metrics_buffered: int = 0  # in memory, retried
    metrics_unsent: int = 0  # in the run's metrics-unsent.jsonl: `exgrpo track --replay RUN` sends them
    metrics_lost: int = 0  # dropped: written nowhere (the run folder could not take them either)
    # learner levers that failed their trial at the run's first start -> the error (learner.trial): a resume or a
    # restart starts with them off
    levers_off: dict[str, str] = field(default_factory=dict)


class PreparedRun(NamedTuple):
    """A run ready to train (`cluster.run`): its checked config, its folder, the driver's state (new, or the
    checkpoint's it resumes from; it advances with the run), the model folder and the training questions."""

    cfg: RunConfig
    run_dir: Any  # cluster.runtime.RunDir (which reads this module: not imported here)
    state: DriverState
    model_path: Path
    questions: list


def rng_state() -> dict[str, list]:
    """The driver process's Python and NumPy RNG states as JSON-ready lists."""
    v, internal, gauss = random.getstate()
    n = np.random.get_state()
    return {"python": [v, list(internal), gauss], "numpy": [n[0], n[1].tolist(), n[2], n[3], n[4]]}


def set_rng_state(rng: dict[str, list]) -> None:
    v, internal, gauss = rng["python"]
    random.setstate((v, tuple(internal), gauss))
    n = rng["numpy"]
    np.random.set_state((n[0], np.asarray(n[1], dtype=np.uint32), n[2], n[3], n[4]))
