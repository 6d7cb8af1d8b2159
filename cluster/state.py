"""The driver's own state in a checkpoint (`driver.json`): read by the driver, which writes it, and by the
start-up checks, which validate a checkpoint before resuming from it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


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
