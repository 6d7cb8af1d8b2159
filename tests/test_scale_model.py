"""docs/scale.md shows what `bench/scale_model.py` prints: its tables are regenerated, not edited by hand."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_scale_doc_holds_the_models_current_tables():
    out = subprocess.run([sys.executable, "bench/scale_model.py"], cwd=ROOT, capture_output=True, text=True,
                         timeout=120, check=True).stdout
    doc = (ROOT / "docs" / "scale.md").read_text()
    rows = [line for line in out.splitlines() if line.startswith("| ")]
    assert len(rows) > 20
    missing = [r for r in rows if r not in doc]
    assert not missing, ("docs/scale.md is out of date with bench/scale_model.py; paste its output again. "
                         f"Rows not in the doc: {missing[:3]}")
    # the doc's first bottleneck is what the model says: the star publication outgrows the step between N=32 and 64
    sweep = {int(r.split("|")[1]): float(r.split("|")[5]) for r in rows if r.split("|")[1].strip().isdigit()}
    assert sweep[32] < 1 < sweep[64]
