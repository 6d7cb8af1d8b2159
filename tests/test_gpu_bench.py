"""bench/gpu_bench.py runs on a bare GPU machine: `--quick` runs its whole pipeline on CPU (the product's rank
setup and TrainStep, the profiled step, the publication beside the copy limit) and writes every number, and
nothing it imports pulls in Ray, vLLM or MLflow."""

from __future__ import annotations

import json
import os
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


def test_the_lease_script_runs_the_whole_pipeline_and_writes_every_number(tmp_path):
    """scripts/device_bench.sh --quick: the GPU lease's plan on tiny shapes (checkpointing on, cases in --order
    case), through the bench's whole pipeline."""
    env = {**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable, "DEVICE_BUDGET_S": "3600"}
    # a nominal peak (a CPU has none in the table), so that MFU is computed and reaches the scale model below
    proc = subprocess.run(["bash", "scripts/device_bench.sh", "--quick", "--peak-tflops", "0.001"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # the table says which command made it; each case's line came as it finished
    assert "$ python bench/gpu_bench.py --quick --order case --activation-checkpointing --peak-tflops 0.001" in proc.stdout
    assert proc.stderr.count("[gpu_bench] tiny ") == 3 and "JSON and logs in" in proc.stderr
    out = tmp_path / "gpu-bench-defaults.json"
    assert (tmp_path / "gpu-bench-defaults.log").read_text().count("[gpu_bench] tiny ") == 3
    r = json.loads(out.read_text())
    assert {"command", "versions", "device", "mfu_formula", "recompute_counted", "levers", "runs", "publication",
            "packed_over_padded", "skipped"} <= set(r)
    assert r["device"]["type"] == "cpu" and r["recompute_counted"] is False
    # fixed (levers as given), mixed padded and mixed packed
    assert [(x["case"], x["settings"]["packs_padding_free"]) for x in r["runs"]] == [
        ("fixed", False), ("mixed", False), ("mixed", True)]
    for run in r["runs"]:
        assert RUN_KEYS <= set(run), RUN_KEYS - set(run)
        assert run["settings"]["activation_checkpointing"] is True
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
    # every parameter in bfloat16, the tied embedding once
    assert pub["bytes_published"] == pub["unique_bytes"] == 2 * fixed["params"]
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


def test_a_failing_case_is_a_row_with_its_error_the_next_case_runs_and_the_exit_is_1(tmp_path):
    """A lease is short: one case's failure (here flash-attention, absent on CPU) must not cost the others, and
    the JSON is written case by case; --budget-s 0 starts nothing and says why."""
    out = tmp_path / "gpu_bench.json"
    proc = subprocess.run([sys.executable, "bench/gpu_bench.py", "--quick", "--cases", "fixed", "publish",
                           "--attn", "flash_attention_2", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 1, proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert [(x["case"], x.get("failed")) for x in r["runs"]] == [("fixed", True), ("publish", True)]
    assert all(x["error"].startswith("ValueError: learner.attn_implementation=flash_attention_2") for x in r["runs"])
    assert "Traceback" in proc.stderr and "FAILED: tiny fixed, tiny publish" in proc.stderr
    assert "| tiny | fixed |" in proc.stdout and r["publication"] == {}

    proc = subprocess.run([sys.executable, "bench/gpu_bench.py", "--quick", "--budget-s", "0", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["runs"] == [] and set(r["skipped"]) == {"tiny fixed", "tiny mixed padded", "tiny mixed packed",
                                                     "tiny publish"}
    assert all(why.startswith("--budget-s 0:") for why in r["skipped"].values())


def test_publish_alone_measures_the_publication_without_a_step(tmp_path):
    """The case for a size too large to train on the device (7B on an 80 GiB card): the fp32 master weights,
    the bf16 publication beside the copy limit, no step."""
    out = tmp_path / "gpu_bench.json"
    subprocess.run([sys.executable, "bench/gpu_bench.py", "--quick", "--cases", "publish", "--out", str(out)],
                   cwd=ROOT, capture_output=True, text=True, timeout=600, check=True)
    r = json.loads(out.read_text())
    (run,) = r["runs"]
    assert run["case"] == "publish" and "step_s" not in run and "error" not in run
    pub = r["publication"]["tiny"]
    assert pub["bytes_published"] == pub["unique_bytes"] == 2 * run["params"] and pub["gb_per_s"] > 0
