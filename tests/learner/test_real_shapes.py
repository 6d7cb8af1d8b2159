"""A learner step at a real vocabulary (151,936 rows) and a real response length (2,048 tokens) stays within
a memory bound: the chunked LM head and the token budget never build [rows, length, vocabulary] logits.

The bound is on memory (peak RSS of the process that runs the step), never on time. For scale: one
row's full float32 logits at this shape are 2,112 x 151,936 x 4 bytes = 1.2 GiB, and the old path kept
6-7 copies of them per row of a micro-batch."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_case(**case) -> dict:
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "shapes_bench.py"), "--case", json.dumps(case)],
                         capture_output=True, text=True, cwd=ROOT, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_step_at_vocabulary_151936_and_2048_token_responses_stays_under_3_gib():
    res = run_case(vocab=151_936, length=2048, tokens=4096, path="new", budget=8192)
    assert res["rows"] == 2 and res["tokens_trained"] == 4096 and res["updates"] == 1
    assert res["peak_rss_gib"] < 3.0, res
    # the step's own memory is below ONE row's full logits (1.2 GiB): no [R, L, V] tensor ever existed
    assert res["peak_rss_gib"] - res["base_rss_gib"] < 1.2, res
