"""bench/gpu_bench.py runs on a bare GPU machine: `--quick` runs its whole pipeline on CPU (the product's rank
setup and TrainStep, the profiled step, the publication beside the copy limit) and writes every number, and
nothing it imports pulls in Ray, vLLM or MLflow."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUN_KEYS = {"size", "case", "rows", "response_tokens", "tokens", "settings", "params", "step_s", "step_s_all",
            "response_tokens_per_s", "tokens_per_s", "flops_per_step", "mfu", "peak_rss_gib", "kernel_split",
            "kernel_ms", "host_syncs", "scalar_reads", "updates", "padding_frac"}
PUB_KEYS = {"bytes_published", "unique_bytes", "buckets", "seconds", "gb_per_s", "copy_s", "copy_gb_per_s",
            "copy_pinned"}
CATEGORIES = {"matmul", "attention", "elementwise/copy", "reduction/softmax", "communication", "other"}


def test_quick_runs_the_whole_pipeline_and_writes_every_number(tmp_path):
    out = tmp_path / "gpu_bench.json"
    # a nominal peak (a CPU has none in the table), so that MFU is computed and reaches the scale model below
    proc = subprocess.run([sys.executable, "bench/gpu_bench.py", "--quick", "--peak-tflops", "0.001", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "$ python bench/gpu_bench.py --quick" in proc.stdout  # the table says which command made it
    r = json.loads(out.read_text())
    assert {"command", "versions", "device", "mfu_formula", "recompute_counted", "levers", "runs", "publication",
            "packed_over_padded", "skipped"} <= set(r)
    assert r["device"]["type"] == "cpu" and r["recompute_counted"] is False
    # fixed (levers as given), mixed padded and mixed packed
    assert [(x["case"], x["settings"]["packs_padding_free"]) for x in r["runs"]] == [
        ("fixed", False), ("mixed", False), ("mixed", True)]
    for run in r["runs"]:
        assert RUN_KEYS <= set(run), RUN_KEYS - set(run)
        assert run["updates"] == 1 and run["step_s"] > 0 and run["response_tokens_per_s"] > 0
        # MFU = FLOPs / step_s / peak, FLOPs = sum over rows of (prompt + response) x (6 P + 6 L H (prompt + response))
        mfu = run["flops_per_step"] / run["step_s"] / 1e9  # peak 0.001 TFLOP/s
        assert abs(run["mfu"] - mfu) <= 5e-5 + 1e-3 * mfu  # mfu rounded to 4 places, step_s to 6
        assert run["tokens"] == run["response_tokens"] + run["rows"] * run["prompt_tokens"]
        assert set(run["kernel_split"]) == CATEGORIES
        assert abs(sum(c["share"] for c in run["kernel_split"].values()) - 1) < 1e-3
        assert run["kernel_split"]["matmul"]["ms"] > 0
        assert run["scalar_reads"] > 0  # the step reads scalars back (a host sync each on a GPU)
    fixed, padded, packed = r["runs"]
    assert packed["padding_frac"] == 0 < padded["padding_frac"]
    assert r["packed_over_padded"]["tiny"] > 0
    pub = r["publication"]["tiny"]
    assert PUB_KEYS <= set(pub)
    # every parameter in bfloat16, the tied embedding once (at most once more while it is still published twice)
    assert pub["unique_bytes"] == 2 * fixed["params"]
    assert pub["unique_bytes"] <= pub["bytes_published"] <= pub["unique_bytes"] + 2 * 512 * 64
    assert pub["gb_per_s"] > 0 and pub["copy_gb_per_s"] > 0
    # the scale model reads it: the measured constants name this run, the 7B's MFU is assumed from the nearest size
    scale = subprocess.run([sys.executable, "bench/scale_model.py", "--gpu-json", str(out)], cwd=ROOT,
                           capture_output=True, text=True, timeout=120, check=True).stdout
    assert "- mfu_tiny = " in scale and "[assumed: the tiny's" in scale
    assert f"- gather_bytes_per_s = {pub['gb_per_s'] * 1e9:.4g} B/s" in scale and "[measured: CPU," in scale


def test_imports_neither_ray_nor_vllm_nor_mlflow():
    code = ("import sys; sys.path.insert(0, '.'); import bench.gpu_bench, learner.setup, learner.gather; "
            "print([m for m in ('ray', 'vllm', 'mlflow') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                         check=True).stdout
    assert out.strip() == "[]"
