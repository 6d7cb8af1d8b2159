"""The Ray cluster that end-to-end runs of this package join (tests/cluster/shared_ray.py): one start for the
package instead of an embedded Ray per `exgrpo train`. A test takes `joined` and passes `*joined.overrides` and
`env=joined.env` to its run; after the test, what its runs left on the cluster is waited for, and an actor still
there after a minute is killed and named (the test errors: a run that does not clean up is a bug)."""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest

from tests.cluster.runs import ClusterHelper

SHARED_CPUS = 6  # the largest joined run: the paper's settings with 3 generators (2 ranks + 3) and an evaluator


class SharedRay(ClusterHelper):
    def __init__(self) -> None:
        self.temp = tempfile.mkdtemp(prefix="exgrpo-ray-", dir="/tmp")
        super().__init__("tests.cluster.shared_ray", str(SHARED_CPUS), self.temp)
        self.overrides = (f"cluster.address={self.address}",)
        # a process that joins sends the cluster's token only in token mode
        self.env = dict(os.environ, RAY_AUTH_MODE="token")

    def idle(self, timeout_s: float = 60) -> str:
        """'' when the runs' actors ended with their drivers, else what had to be killed or is still held."""
        answer = self._ask(f"idle {timeout_s}", "idle", timeout_s + 60)
        return "" if answer == "ok" else answer

    def close(self) -> None:
        super().close()
        shutil.rmtree(self.temp, ignore_errors=True)


@pytest.fixture(scope="session")  # (session: under `make test`'s two workers the package's files interleave with others)
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
