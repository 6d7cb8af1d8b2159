"""The Ray cluster that end-to-end runs of this package join (tests/cluster/shared_ray.py): one start for the
package instead of an embedded Ray per `exgrpo train`. A test takes `joined` and passes `*joined.overrides` and
`env=joined.env` to its run; after the test, what its runs left on the cluster is waited for, and an actor still
there after a minute is killed and named (the test errors: a run that does not clean up is a bug)."""

from __future__ import annotations

import os
import select
import shutil
import subprocess
import sys
import tempfile

import pytest

from tests.cluster.runs import ROOT

SHARED_CPUS = 6  # the largest joined run: the paper's settings with 3 generators (2 ranks + 3) and an evaluator


class SharedRay:
    def __init__(self) -> None:
        self.temp = tempfile.mkdtemp(prefix="exgrpo-ray-", dir="/tmp")
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.cluster.shared_ray", str(SHARED_CPUS), self.temp],
                                     cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.address = self._answer("address", 300)
        self.overrides = (f"cluster.address={self.address}",)
        # a process that joins sends the cluster's token only in token mode
        self.env = dict(os.environ, RAY_AUTH_MODE="token")

    def _answer(self, word: str, timeout_s: float) -> str:
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout_s)
        line = self.proc.stdout.readline() if ready else ""
        assert line.startswith(word + " "), f"shared Ray: expected {word!r}, got {line!r} (rc {self.proc.poll()})"
        return line.split(maxsplit=1)[1].strip()

    def idle(self, timeout_s: float = 60) -> str:
        """'' when the runs' actors ended with their drivers, else the ones that had to be killed."""
        self.proc.stdin.write(f"idle {timeout_s}\n")
        self.proc.stdin.flush()
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout_s + 60)
        line = self.proc.stdout.readline().strip() if ready else "no answer"
        return "" if line == "idle" else line

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.write("quit\n")
            self.proc.stdin.flush()
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        shutil.rmtree(self.temp, ignore_errors=True)


@pytest.fixture(scope="package")
def shared_ray():
    c = SharedRay()
    try:
        yield c
    finally:
        c.close()


@pytest.fixture
def joined(shared_ray):
    yield shared_ray
    left = shared_ray.idle()
    assert not left, f"the shared Ray cluster held actors of this test's runs after they ended: {left}"
