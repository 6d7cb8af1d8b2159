"""The wall-time profile of `exgrpo train --profile`: phases add up to the whole command."""

from __future__ import annotations

import json
import re
import time

from cluster.profile import Profile


def test_phases_add_up_to_the_whole_command_and_generator_time_is_shown(tmp_path):
    p = Profile()
    with p.phase("start-up: Ray"):
        time.sleep(0.02)
    for _ in range(3):
        with p.phase("step: learner compute"):
            time.sleep(0.005)
    p.generators({"generate_s": 9.0, "wait_s": 0.5, "score_s": 2.0, "weight_load_s": 0.5, "uptime_s": 10.0,
                  "generators": 2.0})
    rows = {name: (s, n) for name, s, n in p.rows()}
    assert rows["step: learner compute"][1] == 3 and rows["step: learner compute"][0] >= 0.015
    assert rows["start-up: Ray"][0] >= 0.02
    parts = sum(s for name, (s, _) in rows.items() if name != "whole command")
    assert abs(parts - rows["whole command"][0]) < 1e-3  # `other` is what no phase measured
    table = p.table("exgrpo train --profile")
    assert table.startswith("$ exgrpo train --profile") and re.search(r"\| step: learner compute \| \d+\.\d+", table)
    assert "| engine busy (samples in flight) | 9.00 | 90.0 |" in table and "over 2 generator(s)" in table
    p.save(tmp_path / "profile.json")
    saved = json.loads((tmp_path / "profile.json").read_text())
    assert saved["phases"][-1]["phase"] == "whole command" and saved["generators"]["score_s"] == 2.0


def test_the_interpreter_s_start_is_the_first_row_and_the_first_update_is_said(tmp_path):
    launched = time.monotonic() - 1.5  # the process started 1.5 s before the profile (its imports)
    p = Profile(launched)
    with p.phase("start-up: Ray"):
        time.sleep(0.01)
    p.first_update(2.25)
    rows = p.rows()
    assert rows[0][0] == "start-up: Python and imports" and 1.5 <= rows[0][1] < 1.6
    assert rows[-1][0] == "whole command" and rows[-1][1] >= 1.51  # counted from the process's start
    table = p.table("exgrpo train --profile")
    # what the rows held by then (the interpreter's 1.5 s and Ray's 0.01 s) is traced, the rest named untraced
    traced = sum(s for name, s, _ in rows[:2])
    assert p.first_update_traced_s == traced
    assert (f"first learner update 2.2 s after the command started: {traced:.1f} s in the start-up rows below and "
            f"the first step's (its wait for a batch and learner compute), {2.25 - traced:.1f} s untraced") in table
    p.save(tmp_path / "profile.json")
    saved = json.loads((tmp_path / "profile.json").read_text())
    assert saved["first_update_s"] == 2.25 and saved["first_update_traced_s"] == traced
