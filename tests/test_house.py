"""The layout keeps the architecture: no import circle, no arrow up a room or sideways between the middle rooms
(read from every import in the code, module level or inside a function, by scripts/import_graph.py)."""

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
