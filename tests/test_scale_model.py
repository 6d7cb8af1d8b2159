"""docs/scale.md shows what `bench/scale_model.py` prints: its tables are regenerated, not edited by hand."""

from __future__ import annotations

import json
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


def _fresh_model():
    """bench/scale_model.py as a new module object (its constant tables are module state)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("scale_model_under_test", ROOT / "bench" / "scale_model.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up while the class is made
    spec.loader.exec_module(mod)
    return mod


def test_the_gather_to_host_is_a_term_of_every_publication_and_of_the_learner_step():
    sm = _fresh_model()
    m, r = sm.Model(), sm.Run()
    p, lr, g = sm.publication(m, r), sm.learner(m, r), sm.generation(m, r)
    # 7.6e9 parameters x 2 bytes = 15.2 GB; at the H100's 47.48 GB/s (the lease of 2026-11-27): 15.2e9 / 47.48e9 =
    # 0.3201 s, at the pinned-copy limit 54.42 GB/s: 15.2e9 / 54.42e9 = 0.2793 s
    assert abs(p["gather_s"] - 0.32013) < 1e-4 and abs(p["copy_limit_s"] - 0.27931) < 1e-4
    # star = gather + 1.07 x 64 x 15.2e9 / 50e9 + 20 us = 0.320 + 20.818 = 21.14 s
    assert abs(p["star_s"] - 21.138) < 1e-2
    assert abs(p["relay_s"] - p["gather_s"] - 0.6885) < 1e-3  # the chain's own 688.5 ms
    # the learner waits for the gather: the step is max(generation 6.7 s, learner 11.7 s + 0.3 s)
    step = [row for row in sm.target_table(m, r) if row[1].startswith("async step")][0][2]
    assert step == sm._fmt(max(g["throughput_s"], lr["step_s"] + p["gather_s"]) + sm._c(sm.MEASURED, "handover_s"),
                           "s") == "12.2 s"


def test_gpu_constants_come_from_the_gpu_bench_json_and_say_where_from(tmp_path):
    def run(size, params, mfu, ckpt):
        return {"size": size, "case": "fixed", "params": params, "mfu": mfu, "rows": 8, "prompt_tokens": 256,
                "response_max": 8192, "settings": {"activation_checkpointing": ckpt}}

    bench = {"device": {"name": "NVIDIA H100 80GB HBM3"}, "versions": {"commit": "abc1234"},
             "command": "python bench/gpu_bench.py --sizes 1.5B 3B",
             "runs": [run("1.5B", 1.5e9, 0.30, True), run("1.5B", 1.5e9, 0.45, False), run("3B", 3.1e9, 0.36, True),
                      {**run("3B", 3.1e9, 0.50, True), "case": "mixed"}],
             "publication": {"1.5B": {"bytes_published": 3.1e9, "gb_per_s": 30.0, "copy_gb_per_s": 50.0},
                             "3B": {"bytes_published": 6.2e9, "gb_per_s": 40.0, "copy_gb_per_s": 52.0}}}
    path = tmp_path / "gpu.json"
    path.write_text(json.dumps(bench))
    sm = _fresh_model()
    sm.load_gpu_json(str(path), sm.Model().params)
    # the checkpointed fixed run of each size (not the faster run without checkpointing, nor the mixed case)
    assert {k: v[0] for k, v in sm.MFU_MEASURED.items()} == {"1.5B": 0.30, "3B": 0.36}
    # 7.6B target, nearest measured size 3B (3.1B, not within 25%): its MFU, marked assumed
    assert sm.GPU["mfu"][0] == 0.36 and sm.GPU["mfu"][3].startswith("assumed: the 3B's")
    # the largest publication: 6.2 GB at 40 GB/s; measured on the named device
    assert sm.GPU["gather_bytes_per_s"][0] == 40e9 and sm.GPU["pinned_copy_bytes_per_s"][0] == 52e9
    assert "measured: NVIDIA H100 80GB HBM3" in sm.GPU["gather_bytes_per_s"][3]
    # 15.2e9 B / 40e9 B/s = 0.38 s
    assert abs(sm.publication(sm.Model(), sm.Run())["gather_s"] - 0.38) < 1e-9
    out = subprocess.run([sys.executable, "bench/scale_model.py", "--gpu-json", str(path)], cwd=ROOT,
                         capture_output=True, text=True, timeout=120, check=True).stdout
    assert "at MFU 36.0% on 64 GPUs" in out and "- mfu_3B = 0.36 x" in out and "[assumed: the 3B's" in out
    bench["runs"].append(run("7B", 7.6e9, 0.40, True))  # a 7B measured: the target's MFU is measured, not assumed
    path.write_text(json.dumps(bench))
    sm = _fresh_model()
    sm.load_gpu_json(str(path), sm.Model().params)
    assert sm.GPU["mfu"][0] == 0.40 and sm.GPU["mfu"][3].startswith("measured: NVIDIA H100")


def test_a_bench_that_marks_its_defaults_gives_the_defaults_mfu(tmp_path):
    """Today's bench marks the runs at the product's defaults and names the checkpointing mode (a string; "none"
    is no checkpointing): the defaults' run counts, not a faster or a checkpointed one run by hand."""
    def run(mfu, mode, defaults):
        return {"size": "1.5B", "case": "fixed", "params": 1.5e9, "mfu": mfu, "rows": 8, "prompt_tokens": 256,
                "response_max": 8192, "settings": {"activation_checkpointing": mode}, "defaults": defaults}

    bench = {"device": {"name": "NVIDIA H100 80GB HBM3"}, "versions": {"commit": "abc1234"}, "command": "bench",
             "runs": [run(0.383, "none", True), run(0.30, "full", False), run(0.40, "selective", False)],
             "publication": {}}
    path = tmp_path / "gpu.json"
    path.write_text(json.dumps(bench))
    sm = _fresh_model()
    sm.load_gpu_json(str(path), sm.Model().params)
    mfu, _, step, _ = sm.MFU_MEASURED["1.5B"]
    assert mfu == 0.383 and step.endswith(", no checkpointing"), step
    for r in bench["runs"]:
        del r["defaults"]  # an older bench: checkpointed runs first, the mode in words
    path.write_text(json.dumps(bench))
    sm = _fresh_model()
    sm.load_gpu_json(str(path), sm.Model().params)
    mfu, _, step, _ = sm.MFU_MEASURED["1.5B"]
    assert mfu == 0.40 and step.endswith(", selective checkpointing"), step
