"""The layout keeps the architecture: no import circle, no arrow up a room or sideways between the middle rooms
(read from every import in the code, module level or inside a function, by scripts/import_graph.py), and the
buffer's processes start without torch."""

from __future__ import annotations

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "import_graph.py"


def _tool():
    spec = importlib.util.spec_from_file_location("import_graph", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_no_import_circle_and_every_arrow_points_down():
    tool = _tool()
    g = tool.graph()
    assert "common.config" in g and "cluster.driver" in g  # it read the code
    assert tool.circles(g) == []
    assert tool.forbidden(g) == []


def test_the_checker_sees_a_circle_and_an_arrow_up():
    tool = _tool()
    g = {"common.a": {"common.b"}, "common.b": {"common.a"}, "actors.x": {"cluster.y"}, "cluster.y": set(),
         "learner.z": {"buffer.w"}, "buffer.w": set()}
    assert tool.circles(g) == [["common.a", "common.b"]]
    assert tool.forbidden(g) == [("actors.x", "cluster.y"), ("learner.z", "buffer.w")]


def test_the_buffer_shard_starts_without_torch():
    """A buffer shard's process imports buffer.shard and what it needs, never torch (2 s of a 3 s import on this
    machine, paid by every shard at every run's start): the shards hold numpy arrays and msgpack bytes."""
    import subprocess
    import sys

    code = "import sys, buffer.shard, buffer.client; print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=SCRIPT.parents[1]).stdout
    assert out.strip() == "[]", out
