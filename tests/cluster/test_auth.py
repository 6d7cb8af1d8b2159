"""Ray token authentication for a process that starts or joins a cluster (cluster.auth)."""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PROBE = """
import os, sys
{before}
from cluster.auth import loaded_ray_auth_mode, use_token_auth_when_connecting
use_token_auth_when_connecting(None)
print("RESULT", loaded_ray_auth_mode(), os.environ.get("RAY_AUTH_MODE"))
"""


def _probe(before: str, env: dict[str, str]) -> list[str]:
    out = subprocess.run([sys.executable, "-c", PROBE.format(before=before)], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return next(line for line in out.stdout.splitlines() if line.startswith("RESULT")).split()[1:]


def test_an_embedded_ray_starts_with_the_mode_this_process_imported_ray_with():
    """Ray reads RAY_AUTH_MODE once, when imported; an embedded Ray's GCS and raylet read it from the environment
    when they start. A process (a notebook, a test) that imported Ray before `exgrpo train` runs in it had set token
    mode for those only, and the driver could not talk to its own GCS (ray.init failed after 20 s). Now the mode
    Ray loaded is the one the environment gets. Before Ray is imported, token mode is chosen as before."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_AUTH_MODE"}
    assert _probe("import ray", env) == ["disabled", "disabled"]
    assert _probe("import ray", {**env, "RAY_AUTH_MODE": "token"}) == ["token", "token"]
    token = os.path.exists(os.path.expanduser("~/.ray/auth_token")) or "RAY_AUTH_TOKEN" in env
    assert _probe("", env) == ["None", "token" if token else "None"]


WARN = """
import os
{before}
from cluster.auth import unauthenticated_join_warning
print("RESULT", unauthenticated_join_warning("10.0.0.1:6379"))
"""


def test_joining_a_cluster_without_token_auth_is_one_warning_line():
    """`_init_ray` logs this line on the console after joining cluster.address; Ray's mode was matched to the
    cluster's before Ray was imported, so the mode it loaded is the cluster's."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_AUTH_MODE"}
    for mode, warned in (("disabled", True), ("token", False)):
        out = subprocess.run([sys.executable, "-c", WARN.format(before="import ray")], cwd=ROOT, capture_output=True,
                             env={**env, "RAY_AUTH_MODE": mode}, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        line = next(x for x in out.stdout.splitlines() if x.startswith("RESULT")).removeprefix("RESULT ")
        assert ("10.0.0.1:6379 runs without token authentication" in line and "\n" not in line) == warned, line
        assert (line == "None") != warned
