"""bench/gpu_bench.py runs on a bare GPU machine: `--quick` runs its whole pipeline on CPU (the product's rank
setup and TrainStep, the profiled step, the publication beside the copy limit) and writes every number, and
nothing it imports pulls in Ray, vLLM or MLflow; its report (bench/gpu_report.py: FLOPs, targets, tables) imports
not even torch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUN_KEYS = {"size", "case", "rows", "response_tokens", "tokens", "settings", "params", "param_counts", "defaults",
            "step_s", "step_s_all", "step_s_min", "step_s_max", "step_spread", "response_tokens_per_s", "tokens_per_s",
            "flops_per_step", "flops_per_step_torchtitan", "flops_per_step_hardware", "mfu", "mfu_torchtitan", "hfu",
            "peak_rss_gib", "updates", "padding_frac", "levers_off", "first_step_s", "recompiles", "built_here",
            "checkpointing", "case_s"}
PROFILE_KEYS = {"kernel_split", "kernel_ms", "top_kernels", "profiled_step_s", "profile_overhead", "host_syncs",
                "scalar_reads", "profile_read_s"}
PUB_KEYS = {"bytes_published", "unique_bytes", "buckets", "seconds", "gb_per_s", "copy_s", "copy_gb_per_s",
            "copy_pinned"}
CATEGORIES = {"matmul", "attention", "elementwise/copy", "reduction/softmax", "communication", "other"}


def flops_by_hand(run: dict) -> tuple[float, float, float]:
    """(model, torchtitan, recompute) FLOPs of a fixed-case run: every row is prompt + response tokens long."""
    c, layers, hidden = run["param_counts"], run["layers"], run["hidden"]
    rows, n = run["rows"], run["response_tokens"] // run["rows"]
    t = run["prompt_tokens"] + n
    params = 6 * c["trained"] + 4 * c["frozen"]
    model = rows * t * (params + 6 * layers * hidden * t)
    torchtitan = rows * t * (params + 12 * layers * hidden * t)  # tied embedding: nothing left out
    full = rows * t * (2 * c["layer"] + 2 * layers * hidden * t)
    head = rows * n * 2 * c["head"]
    return model, torchtitan, (full if run["settings"]["activation_checkpointing"] == "full" else 0) + head


def test_the_lease_script_runs_the_whole_pipeline_and_writes_every_number(tmp_path):
    """scripts/device_bench.sh --quick: the GPU lease's plan on tiny shapes (the product's defaults: fixed, mixed
    padded, mixed packed; then full checkpointing; then LoRA), through the bench's whole pipeline: fixed and mixed
    padded on one build, only fixed profiled, the table's recompiles / first step / checkpointing columns, the
    part seconds written for the next lease's estimates."""
    env = {**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable, "DEVICE_BUDGET_S": "3600"}
    # a nominal peak (a CPU has none in the table), so that MFU is computed and reaches the scale model below
    proc = subprocess.run(["bash", "scripts/device_bench.sh", "--quick", "--peak-tflops", "0.001"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # $OUT holds what one device call brings back (8 files, 16 MiB each, 64 MiB): the tables, part 1's JSON, the rest
    # packed (scripts/device_out.py); unpacked here as after a lease, the cache folder merged into the next carry
    back = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*") if p.is_file())
    assert back == ["compile-cache.tar", "device_bench.md", "gpu-bench-defaults.json", "results.tar.gz"], back
    assert "## device_bench: every case" in (tmp_path / "device_bench.md").read_text()
    subprocess.run([sys.executable, "scripts/device_out.py", "unpack", str(tmp_path), str(tmp_path / "back"),
                    "--cache-to", str(tmp_path / "carry")], cwd=ROOT, check=True, capture_output=True)
    assert (tmp_path / "carry" / "part-seconds-quick.txt").is_file()
    tmp_path = tmp_path / "back"
    # the table says which command made it; each case's line came as it finished
    assert ("$ python bench/gpu_bench.py --quick --profile-first --runs tiny:fixed tiny:mixed:padded "
            "tiny:mixed:packed --peak-tflops 0.001") in proc.stdout
    assert proc.stderr.count("[gpu_bench] tiny ") == 5 and "the rest packed" in proc.stderr
    assert "device_out: back: results.tar.gz (" in proc.stderr
    assert "| Done when (issue 49) | target | measured | verdict |" in proc.stdout
    assert "## device_bench: every case" in proc.stdout and "| lora | tiny fixed | " in proc.stdout
    assert "| peak GiB | first step s | recompiles | checkpointing |" in proc.stdout
    assert "| first step s | recompiles | checkpointing |" in proc.stdout.split("## device_bench")[0]
    # the next call's part estimates: this one's seconds per part (--quick's in a file of their own)
    seconds = dict(line.split() for line in (tmp_path / "inductor-cache" / "part-seconds-quick.txt").read_text().splitlines())
    assert {"defaults", "ckpt", "lora", "eager", "plain"} <= set(seconds) and all(v.isdigit() for v in seconds.values())
    out = tmp_path / "gpu-bench-defaults.json"
    assert (tmp_path / "gpu-bench-defaults.log").read_text().count("[gpu_bench] tiny ") == 3
    r = json.loads(out.read_text())
    assert {"command", "versions", "device", "mfu_formula", "flop_formulas", "recompute_counted", "levers", "runs",
            "publication", "packed_over_padded", "skipped", "targets"} <= set(r)
    assert r["device"]["type"] == "cpu" and r["recompute_counted"] is False
    # fixed and mixed padded are the product's defaults on a CPU; packed is the opt-in lever
    assert [(x["case"], x["settings"]["packs_padding_free"], x["defaults"]) for x in r["runs"]] == [
        ("fixed", False, True), ("mixed", False, True), ("mixed", True, False)]
    assert r["compile_cache"]["loaded"] == []  # nothing carried in
    for run in r["runs"]:
        assert RUN_KEYS <= set(run), RUN_KEYS - set(run)
        # compile is off on a CPU: no graph, no recompile; auto's note says why it chose none
        assert run["recompiles"] == 0 and run["first_step_s"] > 0
        assert run["checkpointing"]["mode"] == "none" and run["checkpointing"]["note"] == "auto: not CUDA"
        assert run["settings"]["activation_checkpointing"] in {"auto", "full", "selective", "none"}
        assert run["updates"] == 1 and run["step_s"] > 0 and run["response_tokens_per_s"] > 0
        assert len(run["step_s_all"]) == 2 and run["step_s_min"] <= run["step_s"] <= run["step_s_max"]
        # MFU = FLOPs / step_s / peak, FLOPs = sum over rows of T x (6 P + 6 L H T), T = prompt + response
        mfu = run["flops_per_step"] / run["step_s"] / 1e9  # peak 0.001 TFLOP/s
        assert abs(run["mfu"] - mfu) <= 5e-5 + 1e-3 * mfu  # mfu rounded to 4 places, step_s to 6
        assert run["param_counts"]["frozen"] == 0 and run["param_counts"]["trained"] == run["params"]
        # torchtitan counts the whole attention square (12 L H T): more FLOPs than ours at the same step time
        assert run["flops_per_step_torchtitan"] > run["flops_per_step"] and run["mfu_torchtitan"] > run["mfu"]
        # HFU adds the chunked head's recompute (and full checkpointing's); None only while auto is unresolved
        assert run["hfu"] is None if run["settings"]["activation_checkpointing"] == "auto" else run["hfu"] > run["mfu"]
        assert run["tokens"] == run["response_tokens"] + run["rows"] * run["prompt_tokens"]
        # the profile: the first case only (--profile-first)
        if run is not r["runs"][0]:
            assert not PROFILE_KEYS & set(run)
            continue
        assert PROFILE_KEYS <= set(run)
        assert set(run["kernel_split"]) == CATEGORIES
        assert abs(sum(c["share"] for c in run["kernel_split"].values()) - 1) < 1e-3
        assert run["kernel_split"]["matmul"]["ms"] > 0
        # the top kernels of the profiled step: 10, the largest first, each a share of the split's total
        top = run["top_kernels"]
        assert len(top) == 10 and [k["ms"] for k in top] == sorted((k["ms"] for k in top), reverse=True)
        assert {"name", "category", "ms", "share", "calls"} <= set(top[0]) and sum(k["share"] for k in top) <= 1.001
        assert any(k["category"] == "matmul" for k in top) and all(k["calls"] > 0 for k in top)
        assert abs(top[0]["ms"] / run["kernel_ms"] - top[0]["share"]) < 1e-3
        # the profiled step is not among the timed ones; its cost on a step is reported
        assert abs(run["profile_overhead"] - (run["profiled_step_s"] / run["step_s"] - 1)) < 1e-3
        assert run["scalar_reads"] > 0  # the step reads scalars back (a host sync each on a GPU)
    fixed, padded, packed = r["runs"]
    # one build per size and lever set: mixed padded ran on fixed's rank; packed (another lever) built its own
    assert [x["built_here"] for x in r["runs"]] == [True, False, True]
    assert "setup_s" in fixed and "setup_s" not in padded and "setup_s" in packed
    assert fixed["first_step_s"] >= fixed["setup_s"]  # from the setup's start
    model, torchtitan, _ = flops_by_hand(fixed)
    assert fixed["flops_per_step"] == model and fixed["flops_per_step_torchtitan"] == torchtitan
    assert packed["padding_frac"] == 0 < padded["padding_frac"]
    assert r["packed_over_padded"]["tiny"] > 0
    # the targets name 1.5B and 3B: none measured here; the defaults ran every case
    targets = {t["key"]: t for t in r["targets"]}
    assert targets["defaults_run"]["verdict"] == "PASS" and targets["defaults_run"]["value"] == "2/2 ran"
    assert targets["mfu_1.5B_fixed"]["verdict"] == "not measured" and targets["mfu_1.5B_fixed"]["target"] == 0.36
    assert targets["recompiles"]["value"] == 0 and targets["recompiles"]["verdict"] == "not judged (CPU)"
    pub = r["publication"]["tiny"]
    assert PUB_KEYS <= set(pub)
    # every parameter in bfloat16, the tied embedding once
    assert pub["bytes_published"] == pub["unique_bytes"] == 2 * fixed["params"]
    assert pub["gb_per_s"] > 0 and pub["copy_gb_per_s"] > 0

    # full checkpointing: HFU counts one more forward of the layers, MFU does not
    (ckpt,) = json.loads((tmp_path / "gpu-bench-ckpt-full.json").read_text())["runs"]
    assert ckpt["settings"]["activation_checkpointing"] == "full" and "top_kernels" not in ckpt
    assert ckpt["checkpointing"] == {"mode": "full", "auto": False, "compiled": False,
                                     "note": "set", "tokens": None, "left_gib": None, "budget_gib": None,
                                     "free_gib": None, "gpu_share": None, "kb_per_token": {}, "halved_from": None}
    assert "| ckpt-full | tiny fixed | ckpt full | " in proc.stdout and " | full (set) |" in proc.stdout
    model, _, recompute = flops_by_hand(ckpt)
    assert ckpt["flops_per_step"] == model and ckpt["flops_per_step_hardware"] == model + recompute
    assert ckpt["hfu"] > ckpt["mfu"]
    # LoRA: the frozen base 4 x its parameters, the adapters 6 x
    lora = json.loads((tmp_path / "gpu-bench-lora.json").read_text())
    (run,) = lora["runs"]
    c = run["param_counts"]
    assert run["settings"]["lora_rank"] == 8 and 0 < c["trained"] < c["frozen"] and lora["publication"] == {}
    t = run["prompt_tokens"] + run["response_tokens"] // run["rows"]
    full_fine_tuning = run["rows"] * t * (6 * run["params"] + 6 * run["layers"] * run["hidden"] * t)
    assert run["flops_per_step"] == flops_by_hand(run)[0] < full_fine_tuning

    # the scale model reads it: the measured constants name this run, the 7B's MFU is assumed from the nearest size
    scale = subprocess.run([sys.executable, "bench/scale_model.py", "--gpu-json", str(out)], cwd=ROOT,
                           capture_output=True, text=True, timeout=120, check=True).stdout
    assert "- mfu_tiny = " in scale and "[assumed: the tiny's" in scale
    assert f"- gather_bytes_per_s = {pub['gb_per_s'] * 1e9:.4g} B/s" in scale and "[measured: CPU," in scale


def test_step_flops_worked_by_hand():
    """A model of 100 parameters, 2 layers, hidden 4, one row of 2 prompt + 6 response tokens (T = 8)."""
    sys.path.insert(0, str(ROOT))
    from bench.gpu_report import ParamCounts, step_flops

    full = ParamCounts(trained=100, frozen=0, layer=80, lookup=0, lookup_trained=True, head=10)
    f = step_flops(full, layers=2, hidden=4, lengths=[6], prompt=2, checkpointing="none", chunked_head=False)
    # per token: 6 x 100 + 6 x 2 x 4 x 8 = 600 + 384 = 984, x 8 tokens = 7872
    # torchtitan: 600 + 12 x 2 x 4 x 8 = 1368, x 8 = 10944; nothing recomputed: hardware = model
    assert f == {"model": 7872.0, "torchtitan": 10944.0, "hardware": 7872.0}
    # full checkpointing: + (2 x 80 + 2 x 2 x 4 x 8) x 8 = 288 x 8 = 2304; chunked head: + 2 x 10 x 6 = 120
    f = step_flops(full, layers=2, hidden=4, lengths=[6], prompt=2, checkpointing="full", chunked_head=True)
    assert f["model"] == 7872.0 and f["hardware"] == 7872.0 + 2304 + 120
    # selective: elementwise recompute only, counted as 0; auto unresolved: unknown
    assert step_flops(full, 2, 4, [6], 2, "selective", False)["hardware"] == 7872.0
    assert step_flops(full, 2, 4, [6], 2, "auto", False)["hardware"] is None
    # LoRA: 10 adapter parameters (6 x), a frozen base of 90 (4 x): 60 + 360 + 384 = 804 per token, x 8 = 6432
    lora = ParamCounts(trained=10, frozen=90, layer=80, lookup=0, lookup_trained=False, head=10)
    assert step_flops(lora, 2, 4, [6], 2, "none", False)["model"] == 6432.0
    # an untied input embedding of 20 (7B's shape): torchtitan leaves its lookup out, 6 x 80 + 768 = 1248, x 8
    untied = ParamCounts(trained=100, frozen=0, layer=60, lookup=20, lookup_trained=True, head=10)
    assert step_flops(untied, 2, 4, [6], 2, "none", False)["torchtitan"] == 9984.0
    # ... and under LoRA the frozen lookup comes out of the 4 x part: 60 + 4 x (90 - 20) + 768 = 1108, x 8
    frozen_lookup = ParamCounts(trained=10, frozen=90, layer=60, lookup=20, lookup_trained=False, head=10)
    assert step_flops(frozen_lookup, 2, 4, [6], 2, "none", False)["torchtitan"] == 8864.0


def test_checkpointing_flag_takes_the_modes_and_runs_name_their_cases():
    sys.path.insert(0, str(ROOT))
    from bench.gpu_bench import parse_args

    assert parse_args(["--quick", "--activation-checkpointing"]).activation_checkpointing == "full"
    assert parse_args(["--quick", "--activation-checkpointing", "selective"]).activation_checkpointing == "selective"
    assert parse_args(["--quick", "--no-activation-checkpointing"]).activation_checkpointing == "none"
    assert parse_args(["--quick"]).activation_checkpointing is None and parse_args(["--quick"]).steps == 2
    assert parse_args([]).steps == 5
    assert parse_args(["--runs", "1.5B:fixed", "3B:mixed", "1.5B:mixed:packed"]).runs == [
        ("1.5B", "fixed", None), ("3B", "mixed", None), ("1.5B", "mixed", True)]


def test_pad_multiple_flag_sets_the_learner_s():
    """--pad-multiple 1: the A/B against auto's rounding (64 on CUDA); left out, the product's auto."""
    import torch

    sys.path.insert(0, str(ROOT))
    from bench.gpu_bench import learner_config, parse_args

    cpu = torch.device("cpu")
    one = learner_config(parse_args(["--quick", "--pad-multiple", "1"]), None, cpu, torch.float32)
    assert one.levers.pad_multiple == 1
    assert learner_config(parse_args(["--quick"]), None, cpu, torch.float32).levers.pad_multiple == "auto"


def test_imports_neither_ray_nor_vllm_nor_mlflow():
    code = ("import sys; sys.path.insert(0, '.'); import bench.gpu_bench, learner.setup, learner.gather; "
            "print([m for m in ('ray', 'vllm', 'mlflow') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                         check=True).stdout
    assert out.strip() == "[]"
    # the report alone (scripts/device_bench.sh's summary reads its cells): not even torch
    code = ("import sys; sys.path.insert(0, '.'); import bench.gpu_report; "
            "print([m for m in ('ray', 'vllm', 'mlflow', 'torch') if m in sys.modules])")
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
    assert all(x["error"].startswith("ValueError: learner.levers.attn_implementation: flash_attention_2 needs the")
               for x in r["runs"])
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


def test_recompiles_are_graphs_built_after_the_first_step():
    """dynamo's graph counter, as the bench reads it (the learner's, learner.compile_cache): a new dtype is a new
    graph (a recompile)."""
    import torch

    sys.path.insert(0, str(ROOT))
    from bench.gpu_bench import compiled_graphs

    f = torch.compile(lambda x: x.sin() + 1, backend="eager")
    f(torch.ones(3))
    before = compiled_graphs()
    f(torch.ones(3))  # the same guards: nothing new
    assert compiled_graphs() == before
    f(torch.ones(3, dtype=torch.float64))  # a failed dtype guard: one more graph
    assert compiled_graphs() == before + 1


def test_the_table_shows_what_auto_chose_and_from_which_numbers():
    """The setup's note (learner.levers.activation_checkpointing's own, from numbers worked by hand in
    tests/learner/test_activation_checkpointing.py) read back into the JSON and the table's cell."""
    sys.path.insert(0, str(ROOT))
    from bench.gpu_report import checkpointing_cell, checkpointing_choice
    from learner.activation_checkpointing import (LayerCost, LayerShape, MemoryBudget, MicroBatchSize,
                                                  choose_checkpointing)

    gib = 2 ** 30
    shape = LayerShape(hidden=1024, kv_hidden=256, intermediate=4096, layers=10)
    budget = "learner.batching.micro_batch_tokens"
    choice = choose_checkpointing(MemoryBudget(free=75 * gib, total=80 * gib, share=0.5), 20 * gib,
                                  MicroBatchSize(16_384, counted=budget), LayerCost(shape, 2, compiled=True))
    line = (f"learner levers on cuda: per-layer compile; activation checkpointing {choice.mode} ({choice.note()}); "
            "fused AdamW")
    got = checkpointing_choice(["learner micro-batches: padded (attention sdpa)", line])
    # half of 80 GiB: 0.9 x 40 - 2 - 20 = 14 GiB left; compiled none 395,264 B/token x 16,384 = 6.0 GiB: none
    assert got["mode"] == "none" and got["auto"] and got["compiled"]
    assert (got["tokens"], got["left_gib"], got["budget_gib"], got["free_gib"], got["gpu_share"]) == (
        16_384, 14.0, 40.0, 75.0, 0.5)
    assert got["kb_per_token"] == {"none": 395.3, "selective": 292.9, "full": 74.8}
    assert checkpointing_cell({"activation_checkpointing": "none"}, got) == (
        "none (auto, compiled: 16,384 tok x 395.3 kB, 14.0 GiB left of free 75.0 x share 0.5)")
    assert checkpointing_choice(["activation checkpointing full (set)"])["auto"] is False
    # where only full fit the token budget, auto halved it for selective: the cell says so
    halved = choose_checkpointing(MemoryBudget(free=80 * gib, total=80 * gib, share=1.0), 66 * gib,
                                  MicroBatchSize(16_384, counted=budget, floor=8192), LayerCost(shape, 2))
    got = checkpointing_choice([f"activation checkpointing {halved.mode} ({halved.note()}); fused AdamW"])
    assert (got["mode"], got["tokens"], got["halved_from"]) == ("selective", 8192, 16_384)
    assert checkpointing_cell({"activation_checkpointing": "selective"}, got) == (
        "selective (auto: 8,192 tok (halved from 16,384) x 292.9 kB, 4.0 GiB left of free 80.0 x share 1)")


def test_under_compile_the_second_shape_reuses_the_build_without_recompiling(tmp_path):
    """--compile (aot_eager on a CPU: the graphs without inductor's kernels): fixed builds the rank, its setup and
    first step compile the layers' graphs; mixed padded (other lengths, more rows) runs on the same build and
    compiles nothing (issue 49: 0 recompiles after the first step)."""
    out = tmp_path / "gpu_bench.json"
    proc = subprocess.run([sys.executable, "bench/gpu_bench.py", "--quick", "--compile", "--compile-backend",
                           "aot_eager", "--runs", "tiny:fixed", "tiny:mixed:padded", "--steps", "1", "--no-profile",
                           "--no-publish", "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    fixed, mixed = json.loads(out.read_text())["runs"]
    assert fixed["settings"]["compile"] is True and fixed["built_here"] and not mixed["built_here"]
    assert fixed["graphs_first_step"] >= 1 and "graphs_first_step" not in mixed
    assert fixed["recompiles"] == 0 and mixed["recompiles"] == 0, (fixed["recompiles"], mixed["recompiles"])
    # the learner's own count agrees: every graph came from the setup's trial, none from a step (learner/recompiles)
    assert fixed["trial_graphs"] == fixed["graphs_first_step"] and "trial_graphs" not in mixed
    assert fixed["learner_recompiles"] == mixed["learner_recompiles"] == [0, 0]
    assert "| tiny | mixed | 7 x 14-92 | compile chunked |" in proc.stdout and " | 0 | none (auto: not CUDA) |" in proc.stdout
