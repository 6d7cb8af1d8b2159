"""Where a run's wall time goes: start-up phases, the steps, shutdown, and the generators' time.

    profile = Profile()
    with profile.phase("start-up: Ray"):
        start_ray(...)
    profile.add("step: learner compute", seconds)      # per step, summed with a count
    profile.generators(pool_metrics)                   # engine busy / scoring / idle, summed over actors
    print(profile.table(command))                      # `exgrpo train --profile`; always saved as profile.json

Phases of the driver process are wall time of that process, so they add up to the whole command
(the rest is the `other` row). Generator rows are actor time summed over generators: they overlap
with the driver's phases (that overlap is the point of an asynchronous system).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

GENERATOR_ROWS = (
    ("generate_s", "engine busy (samples in flight)"),
    ("wait_s", "engine idle (no work, or waiting)"),
    ("score_s", "scoring (beside the engine)"),
    ("weight_load_s", "weight loads"),
)


class Profile:
    """Wall-time accounting of one `exgrpo train` process."""

    def __init__(self, launched: float | None = None) -> None:
        """`launched`: time.monotonic() at which the command's process started (its interpreter and imports are then
        the first row)."""
        self.started = time.monotonic()
        self.seconds: dict[str, float] = {}
        self.counts: dict[str, int] = {}
        self.generator: dict[str, float] = {}
        self.first_update_s: float | None = None  # seconds from the command's start to its first learner update
        self.first_update_traced_s: float | None = None  # of those, the seconds inside the rows (the rest: untraced)
        if launched is not None and launched < self.started:
            self.add("start-up: Python and imports", self.started - launched)
            self.started = launched

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        t0 = time.monotonic()
        try:
            yield
        finally:
            self.add(name, time.monotonic() - t0)

    def add(self, name: str, seconds: float) -> None:
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds
        self.counts[name] = self.counts.get(name, 0) + 1

    def first_update(self, seconds: float) -> None:
        """The command's first learner update, `seconds` after it started: what the rows hold by then is traced."""
        self.first_update_s = seconds
        self.first_update_traced_s = min(seconds, sum(self.seconds.values()))

    def generators(self, metrics: dict[str, float]) -> None:
        """The pool's summed generator metrics (call before the pool stops)."""
        self.generator = {k: float(metrics.get(k, 0.0)) for k, _ in GENERATOR_ROWS}
        self.generator["uptime_s"] = float(metrics.get("uptime_s", 0.0))
        self.generator["generators"] = float(metrics.get("generators", 0.0))

    def rows(self) -> list[tuple[str, float, int]]:
        """(phase, seconds, count) in the order they happened, then `other` and `whole command`."""
        wall = time.monotonic() - self.started
        rows = [(k, v, self.counts[k]) for k, v in self.seconds.items()]
        rows.append(("other (driver bookkeeping)", max(0.0, wall - sum(self.seconds.values())), 1))
        rows.append(("whole command", wall, 1))
        return rows

    def table(self, command: str) -> str:
        rows = self.rows()
        wall = rows[-1][1]
        lines = [f"$ {command}", ""]
        if self.first_update_s is not None:
            traced = self.first_update_traced_s if self.first_update_traced_s is not None else self.first_update_s
            lines += [f"first learner update {self.first_update_s:.1f} s after the command started: {traced:.1f} s in "
                      "the start-up rows below and the first step's (its wait for a batch and learner compute), "
                      f"{self.first_update_s - traced:.1f} s untraced driver bookkeeping", ""]
        lines += ["| phase | seconds | % of command | count | mean ms |", "|---|---:|---:|---:|---:|"]
        for name, s, n in rows:
            lines.append(f"| {name} | {s:.2f} | {100 * s / max(wall, 1e-9):.1f} | {n} | {1000 * s / max(n, 1):.1f} |")
        g = self.generator
        if g:
            up = g["uptime_s"] or 1e-9
            lines += ["", f"generators (actor time summed over {g['generators']:.0f} generator(s), "
                          f"{up:.1f} s of generator uptime):", "", "| generator time | seconds | % of uptime |",
                      "|---|---:|---:|"]
            lines += [f"| {label} | {g[k]:.2f} | {100 * g[k] / up:.1f} |" for k, label in GENERATOR_ROWS]
        return "\n".join(lines)

    def save(self, path: Path) -> None:
        path.write_text(json.dumps({"phases": [{"phase": n, "seconds": s, "count": c} for n, s, c in self.rows()],
                                    "generators": self.generator, "first_update_s": self.first_update_s,
                                    "first_update_traced_s": self.first_update_traced_s}, indent=1))
