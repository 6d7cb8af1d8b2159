"""SIGTERM or Ctrl-C to `exgrpo experiment`: forwarded to the `exgrpo train` runs in flight, each of which stops as
`exgrpo train` does (after its step, with a checkpoint, exit 0); no new run starts, and the command marks its
MLflow run KILLED and says how to go on. Before, the runs in flight went on to the end as orphans."""

from __future__ import annotations

import signal
import subprocess
import threading


class Stopping:
    """The runs in flight and whether a stop was asked (`signal`: the signal's name, or None)."""

    def __init__(self):
        self.signal: str | None = None
        self._live: set[subprocess.Popen] = set()
        self._lock = threading.Lock()

    def install(self):
        """Take SIGTERM and SIGINT (main thread only); returns a function that puts the previous handlers back."""
        previous = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
        for s in previous:
            signal.signal(s, self._handler)
        return lambda: [signal.signal(s, h) for s, h in previous.items()]

    def _handler(self, signum, frame) -> None:
        with self._lock:
            self.signal = signal.Signals(signum).name
            live = list(self._live)
        for p in live:  # a second signal reaches them again: `exgrpo train` then stops at once
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)

    def run(self, cmd: list[str], *, timeout_s: float, **popen) -> int | None:
        """`cmd`'s exit code, in its own session (a terminal's Ctrl-C reaches it once, through this process); None when
        a stop was asked before it could start. subprocess.TimeoutExpired after `timeout_s` (the run is killed)."""
        with self._lock:
            if self.signal is not None:
                return None
            p = subprocess.Popen(cmd, start_new_session=True, **popen)
            self._live.add(p)
        try:
            return p.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
            raise
        finally:
            with self._lock:
                self._live.discard(p)
