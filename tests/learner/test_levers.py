"""The GPU levers (learner.levers): each switch trains the same update on and off, on CPU.

The CUDA side (inductor kernels, flex_attention's backward, the fused AdamW kernel on the device, the host syncs
the profiler sees) is measured by bench/gpu_bench.py where a GPU is."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from common.config import LearnerConfig, LoRAConfig
from tests.learner import sectioned
from common.messages import Rollout, TrainGroup, TrainingBatch, float32_array, int32_array
from learner.batching import batch_rows, collate
from learner.forward import check_packing, forward_stats, prepare_model
from learner.levers import build_optimizer, resolve_levers
from learner.lora import apply_lora, init_adapters
from learner.replay_choice import complete_groups
from learner.shape import TrainShape
from learner.step import TrainStep
from bench.batches import make_batch, with_own_logprobs

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


@pytest.mark.parametrize("overrides, device, dtype, flash, want", [
    ({}, CPU, torch.float32, False, (False, False, False, None)),
    # CUDA's defaults are what ran on a GPU (issue 42): compile and fused AdamW, padded micro-batches
    ({}, CUDA, torch.bfloat16, False, (True, True, False, None)),
    ({}, CUDA, torch.bfloat16, True, (True, True, False, None)),
    # packing is opt-in: flash-attention where installed (not float32), else flex_attention
    ({"padding_free": True}, CUDA, torch.bfloat16, False, (True, True, True, "flex_attention")),
    ({"padding_free": True}, CUDA, torch.bfloat16, True, (True, True, True, "flash_attention_2")),
    ({"padding_free": True}, CUDA, torch.float32, True, (True, True, True, "flex_attention")),
    ({"attn_implementation": "sdpa"}, CUDA, torch.bfloat16, False, (True, True, False, "sdpa")),
    ({"attn_implementation": "flex_attention"}, CPU, torch.float32, False, (False, False, False, "flex_attention")),
    ({"attn_implementation": "flash_attention_2"}, CPU, torch.float32, False,
     (False, False, True, "flash_attention_2")),
    ({"compile": True, "fused_optimizer": True, "padding_free": True}, CPU, torch.float32, False,
     (True, True, True, None)),
    ({"compile": False, "fused_optimizer": False, "padding_free": False}, CUDA, torch.bfloat16, False,
     (False, False, False, None)),
])
def test_auto_follows_the_device_and_every_decision_is_explained(overrides, device, dtype, flash, want):
    cfg, notes = resolve_levers(LearnerConfig(**sectioned(overrides)), device, dtype, flash=flash, flex=True)
    assert (cfg.levers.compile, cfg.levers.fused_optimizer, cfg.levers.padding_free, cfg.levers.attn_implementation) == want
    assert cfg.levers.packs_padding_free is want[2]
    assert len(notes) == 3 and all("(" in n for n in notes)  # each says why
    assert ("set" in notes[0]) == ("compile" in overrides)


def test_packing_on_cuda_is_opt_in_and_says_why():
    cfg, notes = resolve_levers(LearnerConfig(), CUDA, torch.bfloat16, flash=False, flex=True)
    assert cfg.levers.padding_free is False and "opt-in (learner.levers.padding_free=true)" in notes[2]
    cfg, notes = resolve_levers(LearnerConfig(levers=dict(padding_free=True)), CUDA, torch.bfloat16, flash=False, flex=False)
    assert cfg.levers.padding_free is True and cfg.levers.attn_implementation is None and "dense mask" in notes[2]


def _step(model_dir, **overrides):
    from transformers import AutoModelForCausalLM

    cfg = LearnerConfig(**sectioned({"micro_batch_rows": 4, "mini_batches": 2, "lr": 1e-3, **overrides}))
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if cfg.lora is not None:  # as learner.setup does: adapters before the head and compile, only they train
        apply_lora(model, cfg.lora)
        init_adapters(model, cfg.seed, 0, 1)
    model = prepare_model(model, cfg)
    opt, _ = build_optimizer((p for p in model.parameters() if p.requires_grad), cfg)
    return model, TrainStep(model, opt, cfg, TrainShape(max_new_tokens=40, max_positions=512), rank=0,
                            device=CPU)


def _weights(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_fused_adamw_trains_the_same_update(tiny_model_dir):
    """torch's fused AdamW kernel (also on CPU) against the default implementation: the same weights after two
    steps of two updates each (up to float32 rounding)."""
    states = []
    for fused in (False, True):
        model, step = _step(tiny_model_dir, fused_optimizer=fused)
        assert step.optimizer.defaults["fused"] is (True if fused else None)
        for v in range(2):
            assert step.run(make_batch(4 + v, candidates=2, version=v)).updates == 2
        states.append(_weights(model))
    for k in states[0]:
        torch.testing.assert_close(states[1][k], states[0][k], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("overrides", [{}, {"padding_free": True, "activation_checkpointing": True},
                                       {"lora": LoRAConfig(rank=4, alpha=8.0), "kl_coef": 0.1}],
                         ids=["padded", "packed-checkpointed", "lora"])
def test_compiled_layers_train_the_same_update_and_do_not_recompile_for_new_lengths(tiny_model_dir, overrides):
    """Per-layer torch.compile (aot_eager: traced through AOT autograd like inductor, without generating kernels,
    so fast on CPU) trains what eager trains, step after step, while every step brings micro-batches of new
    lengths (and row counts): after the first step (train + eval graphs), no new graph is compiled. With LoRA
    adapters and a KL reference (the same layers run with the adapters disabled) too."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    eager, eager_step = _step(tiny_model_dir, **overrides)
    compiled, compiled_step = _step(tiny_model_dir, compile=True, compile_backend="aot_eager", **overrides)
    assert list(compiled.state_dict()) == list(eager.state_dict())  # names unchanged (checkpoints, publication)
    graphs = []
    for v in range(4):
        batch = make_batch(10 + v, candidates=2, response_len=(1, 6 + 9 * v), version=v)
        want, got = eager_step.run(batch), compiled_step.run(batch)
        assert got.updates == want.updates == 2
        assert got.sums["loss"] == pytest.approx(want.sums["loss"], rel=1e-5, abs=1e-7)
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[0] > 0, "nothing was compiled"
    assert graphs[-1] == graphs[0], f"recompiled for new lengths: graphs after each step {graphs}"
    want_sd, got_sd = _weights(eager), _weights(compiled)
    for k in want_sd:
        torch.testing.assert_close(got_sd[k], want_sd[k], rtol=1e-5, atol=1e-7)


def test_flex_attention_packed_forward_equals_sdpa_on_cpu(tiny_model_dir):
    """flex_attention (what padding_free=true packs with on CUDA) has no backward on CPU: its forward over packed
    rows (the document BlockMask of learner.forward) gives sdpa's padded log-probs and entropies, and passes the
    start-up packing check. The whole step under flex_attention is measured by bench/gpu_bench.py on a GPU."""
    from transformers import AutoModelForCausalLM

    rows = batch_rows(complete_groups(make_batch(5, groups=3, candidates=1, vocab=60), {})[0], std_normalize=False,
                      max_positions=512)
    out = {}
    for impl, packed in (("sdpa", False), ("flex_attention", True)):
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32, attn_implementation=impl)
        model = prepare_model(model, LearnerConfig()).eval()
        with torch.no_grad():
            out[impl] = forward_stats(model, collate(rows, 0, CPU, packed=packed))[:2]  # [R, L-1] each
    assert model.config._attn_implementation == "flex_attention"
    torch.testing.assert_close(out["flex_attention"][0], out["sdpa"][0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out["flex_attention"][1], out["sdpa"][1], rtol=1e-5, atol=1e-5)
    assert check_packing(model, CPU) < 1e-5


def test_compiled_layers_leave_flex_attention_out_of_their_graphs_and_do_not_recompile_for_new_lengths(
        tiny_model_dir):
    """Per-layer compile with flex_attention (issue 42's crash: flex traced inside the layers' dynamic-shape graphs
    failed in inductor's lowering on an H100): no graph holds a flex_attention call (it is a graph break, run by
    transformers' own compiled flex), three packed micro-batches of new lengths compile one graph set, and the
    forward (no grad: flex has no CPU backward) equals eager's. On a CPU, inductor itself fails to build flex's
    kernel inside the `dynamic=True` layer graph (a C++ compile error)."""
    from transformers import AutoModelForCausalLM

    from learner.levers import apply_compile

    graphs: list[str] = []

    def recording(gm, example_inputs):  # a backend: keep each graph's code, run it as traced
        graphs.append(gm.code)
        return gm.forward

    torch._dynamo.reset()
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32,
                                                 attn_implementation="flex_attention")
    model = prepare_model(model, LearnerConfig()).eval()
    batches = [batch_rows(complete_groups(make_batch(20 + v, groups=2, candidates=1, vocab=60,
                                                     response_len=(2, 5 + 7 * v)), {})[0],
                          std_normalize=False, max_positions=512) for v in range(3)]
    assert len({collate(rows, 0, CPU, packed=True).packed.input_ids.shape[1] for rows in batches}) == 3
    with torch.no_grad():
        eager = [forward_stats(model, collate(rows, 0, CPU, packed=True))[0] for rows in batches]
        apply_compile(model, recording)
        first = None
        for rows, want in zip(batches, eager):
            have = forward_stats(model, collate(rows, 0, CPU, packed=True))[0]
            torch.testing.assert_close(have, want, rtol=1e-5, atol=1e-5)
            first = first or len(graphs)
    assert graphs, "nothing was compiled"
    assert len(graphs) == first, f"recompiled for new lengths: {len(graphs)} graphs after {first}"
    assert not any("flex_attention" in code for code in graphs)


def _distinct_lengths_batch(groups: int = 4, size: int = 6) -> TrainingBatch:
    """Fresh groups whose rows all differ in length, so that every padded micro-batch of two or more rows is
    uneven (equal-length rows leave the mask to transformers, which reads the tensors once per forward)."""
    rng = np.random.default_rng(0)
    lengths = iter(rng.permutation(np.arange(2, 2 + groups * size)))
    out = []
    for g in range(groups):
        rollouts = []
        for i in range(size):
            t = int(next(lengths))
            rollouts.append(Rollout(response_ids=int32_array(rng.integers(4, 60, t)),
                                    logprobs=float32_array(np.full(t, -4.0)), reward=float(i % 2), correct=i % 2 == 1,
                                    entropy=4.0, version=0, finish_reason="stop", key=f"q{g}#{i}", replayed=False))
        out.append(TrainGroup(question_id=f"q{g}", prompt_ids=int32_array([5, 6, 7]), rollouts=rollouts, mixed=False))
    return TrainingBatch(groups=out, version=0)


HOST_READS = ("item", "tolist", "__float__", "__int__", "__bool__", "cpu", "numpy", "nonzero")


def _count_host_reads(fn) -> dict[str, int]:
    """Calls of the Tensor methods that wait for the device, made while `fn()` runs (ours and the libraries')."""
    counts = {name: 0 for name in HOST_READS}
    originals = {name: getattr(torch.Tensor, name) for name in HOST_READS}

    def counting(name):
        def method(self, *args, **kwargs):
            counts[name] += 1
            return originals[name](self, *args, **kwargs)
        return method

    try:
        for name in HOST_READS:
            setattr(torch.Tensor, name, counting(name))
        fn()
    finally:
        for name, method in originals.items():
            setattr(torch.Tensor, name, method)
    return counts


@pytest.fixture(scope="module")
def tiny_qwen2_dir(tmp_path_factory):
    from common.modeling import TinyQwen2, build_char_tokenizer, save_model_folder

    tok = build_char_tokenizer()
    model = TinyQwen2(vocab_size=len(tok), hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, seed=0,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id).build()
    return save_model_folder(model, tok, tmp_path_factory.mktemp("tiny-qwen2") / "model")


@pytest.mark.parametrize("overrides", [{}, {"tis_cap": 2.0}])
def test_host_reads_per_step_do_not_grow_with_micro_batches(tiny_qwen2_dir, overrides):
    """2 mini-batches of 12 rows, cut into 2 or 6 micro-batches each: the step reads the device as often either
    way (per step: the metrics' one transfer, TIS's old log-probs; per mini-batch: the grad-norm skip decision
    and CPU AdamW's step counters), never per micro-batch. Qwen2 (the architecture real runs train) takes its
    masks per layer type, so padded rows of any lengths go without a mask and without transformers' search for
    packed rows; a Llama pays that search, one read per forward (learner.forward.attention_inputs)."""
    counts = []
    for micro_rows in (6, 2):
        model, step = _step(tiny_qwen2_dir, micro_batch_rows=micro_rows, **overrides)
        batch = with_own_logprobs(_distinct_lengths_batch(), model)
        step.run(batch)  # warm-up: first calls may initialise lazily
        stats = []
        counts.append(_count_host_reads(lambda: stats.append(step.run(batch))))
        assert stats[0].updates == 2 and stats[0].sums["forward_tokens"] > 0
    assert counts[0] == counts[1], f"host reads with 2 vs 6 micro-batches per mini-batch: {counts}"
    assert counts[0]["nonzero"] == 0 and counts[0]["__bool__"] == 0


def test_setup_builds_the_levers_it_logs(tiny_model_dir, caplog):
    """setup_rank resolves the levers for its device, builds what it resolved (fused AdamW, compiled layers) and
    says so in the start log."""
    from learner.setup import setup_rank

    cfg = LearnerConfig(levers=dict(fused_optimizer=True, compile=True, compile_backend="eager"))
    with caplog.at_level(logging.INFO, logger="learner.setup"):
        built = setup_rank(cfg, str(tiny_model_dir), TrainShape(max_new_tokens=12), rank=0, device=CPU)
    assert built.optimizer.defaults["fused"] is True and built.trainer.cfg.levers.compile is True
    assert all(hasattr(layer.forward, "_torchdynamo_orig_callable") for layer in built.model.model.layers)
    log = " ".join(r.getMessage() for r in caplog.records)
    assert "compile on (set)" in log and "AdamW fused" in log and "padded micro-batches (auto: not CUDA" in log


# ------------------------------------------------------------------------------------------------- compile once

def test_resolve_rounds_padded_lengths_on_cuda_only():
    """learner.levers.pad_multiple auto: 64 on CUDA (said in the padded note), 1 elsewhere; a set value stays."""
    cfg, notes = resolve_levers(LearnerConfig(), CUDA, torch.bfloat16, flash=False, flex=True)
    assert cfg.levers.pad_multiple == 64 and "multiple of 64 (learner.levers.pad_multiple)" in notes[2]
    cfg, notes = resolve_levers(LearnerConfig(), CPU, torch.float32, flash=False, flex=True)
    assert cfg.levers.pad_multiple == 1 and "pad_multiple" not in notes[2]
    assert resolve_levers(LearnerConfig(levers=dict(pad_multiple=128)), CPU, torch.float32)[0].levers.pad_multiple == 128
    with pytest.raises(ValueError, match="give a token count from 1 .* not 0"):
        LearnerConfig(levers=dict(pad_multiple=0))


@pytest.mark.parametrize("multiple", [8, 64])
def test_rounded_lengths_give_the_same_values_and_gradients(tiny_model_dir, multiple):
    """A padded micro-batch rounded up to a multiple (21 tokens -> 24 or 64; the padding after every row's last
    token): the log-probs, entropies and every gradient of the unrounded one, within float32 rounding: not bit for
    bit on a CPU (its matmuls block differently for a longer sequence), which is why the CPU default is 1 and the
    CPU path is unchanged."""
    from transformers import AutoModelForCausalLM

    rows = batch_rows(complete_groups(make_batch(2, groups=2, candidates=1), {})[0], std_normalize=False,
                      max_positions=512)
    out = {}
    for m in (1, multiple):
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
        model = prepare_model(model, LearnerConfig(levers=dict(pad_multiple=m))).train()
        mb = collate(rows, 0, CPU)
        logp, ent, _ = forward_stats(model, mb)  # [R, L-1] each
        assert logp.shape == mb.response_mask.shape
        on = mb.response_mask > 0
        weight = torch.linspace(-1, 1, int(on.sum()))  # [N]
        ((logp[on] * weight).sum() + 0.1 * (ent[on] * weight).sum()).backward()
        out[m] = (logp.detach(), ent.detach(), {n: p.grad.clone() for n, p in model.named_parameters()})
    assert mb.input_ids.shape[1] % multiple != 0  # the rounding did pad
    torch.testing.assert_close(out[multiple][0], out[1][0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out[multiple][1], out[1][1], rtol=1e-5, atol=1e-6)
    for name, g in out[1][2].items():
        torch.testing.assert_close(out[multiple][2][name], g, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


def test_the_recompile_limit_is_a_warning_of_ours(caplog):
    """Past dynamo's recompile limit a function runs eager for the rest of the process: our log says so in one
    WARNING line (torch's own warning may not reach a run's log)."""
    from learner.compile_cache import RecompileWatch

    torch._dynamo.reset()
    f = torch.compile(lambda x: x * 2 + 1, backend="eager", dynamic=False)
    with torch._dynamo.config.patch(recompile_limit=1), caplog.at_level(logging.WARNING,
                                                                         logger="learner.compile_cache"):
        watch = RecompileWatch()
        for dtype in (torch.float32, torch.float64, torch.float16):  # a new dtype each: a recompile each
            f(torch.ones(3, dtype=dtype))
        assert watch.done("the test") == 1  # the graphs past the limit were never built
    lines = [r.getMessage() for r in caplog.records if "recompile limit" in r.getMessage()]
    assert lines and all("EAGER" in line and "\n" not in line for line in lines), lines


CACHE_PROCESS = """
import json, sys, torch
from torch._dynamo.utils import counters
from learner.compile_cache import enable_cache, load_compile_cache_folder, save_compile_cache
mode, path = sys.argv[1], sys.argv[2]
note = enable_cache(path if mode == "dir" else None)  # dir: learner.levers.compile_cache_dir, over the env var
loaded = load_compile_cache_folder(path) if mode == "load" else None  # the names of the files loaded
torch.compile(lambda x: torch.cos(x) * 3 + 1)(torch.randn(8))
saved = save_compile_cache(path) if mode == "save" else None
print("RESULT", json.dumps({"loaded": loaded, "saved": saved, "hits": counters["inductor"]["fxgraph_cache_hit"],
                           "note": note}))
"""


def test_inductors_cache_persists_on_the_machine_and_travels_in_a_file(tmp_path, caplog):
    """Four processes compiling one function with inductor (CPU kernels): the first compiles and saves its
    artifacts to a file; the file goes the way a lease's does (packed into $OUT by scripts/device_out.py, unpacked
    here into the next call's carry, gzip'd); a second process on a fresh cache folder loads it and compiles nothing
    (an FX graph cache hit); a third on the first's folder, without the file, hits the on-disk cache, and so does a
    fourth whose TORCHINDUCTOR_CACHE_DIR is a fresh folder but whose `learner.levers.compile_cache_dir` is the first's
    (a rank on a new node, the folder shared). A missing or corrupt file is one line and False."""
    import importlib.util
    import json
    import shutil
    import subprocess
    import sys

    from learner.compile_cache import load_compile_cache

    def run(mode: str, folder: str, path) -> dict:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / folder), "PYTHONPATH": os.getcwd()}
        proc = subprocess.run([sys.executable, "-c", CACHE_PROCESS, mode, str(path)], env=env,
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr
        return json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("RESULT"))[7:])

    first = run("save", "a", tmp_path / "cache.bin")
    assert first["saved"] > 0 and first["hits"] == 0
    spec = importlib.util.spec_from_file_location("device_out", Path("scripts/device_out.py").resolve())
    device_out = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(device_out)
    out = tmp_path / "out"
    (out / "inductor-cache").mkdir(parents=True)
    shutil.copyfile(tmp_path / "cache.bin", out / "inductor-cache" / "gpu-bench-defaults.bin")
    device_out.pack(out, [], out / "inductor-cache", ["gpu-bench-defaults"])
    device_out.unpack(out, tmp_path / "back", tmp_path / "carry")
    loaded = run("load", "b", tmp_path / "carry")  # the next call's carry folder, as the bench and tests/gpu load it
    assert {k: loaded[k] for k in ("loaded", "saved", "hits")} == {"loaded": ["gpu-bench-defaults.bin.gz"],
                                                                   "saved": None, "hits": 1}
    assert run("none", "a", tmp_path / "cache.bin")["hits"] == 1
    shared = run("dir", "fresh", tmp_path / "a")
    assert shared["hits"] == 1 and f"cache in {tmp_path / 'a'} (learner.levers.compile_cache_dir)" in shared["note"], shared
    (tmp_path / "corrupt.bin").write_bytes(b"not a cache")
    (tmp_path / "corrupt.bin.gz").write_bytes(b"not gzip")
    with caplog.at_level(logging.INFO, logger="learner.compile_cache"):
        assert not load_compile_cache(tmp_path / "missing.bin") and not load_compile_cache(tmp_path / "corrupt.bin")
        assert not load_compile_cache(tmp_path / "corrupt.bin.gz")
    said = [r.getMessage() for r in caplog.records if r.name == "learner.compile_cache"]
    assert len(said) == 3 and "not loaded: no file" in said[0] and "corrupt.bin not loaded" in said[1], said
    assert "corrupt.bin.gz not loaded (compiling from scratch): BadGzipFile" in said[2], said


def test_compile_auto_stays_off_below_the_minimum_width_on_cuda():
    """A toy width's step is launch-bound: compile "auto" is off there (the first update is not spent compiling),
    on at a real width, and learner.levers.compile=true compiles any width."""
    from learner.levers import COMPILE_MIN_WIDTH
    toy, _ = resolve_levers(LearnerConfig(), CUDA, torch.bfloat16, flash=False, flex=True, width=96)
    real, _ = resolve_levers(LearnerConfig(), CUDA, torch.bfloat16, flash=False, flex=True, width=COMPILE_MIN_WIDTH)
    forced, _ = resolve_levers(LearnerConfig(levers=dict(compile=True)), CUDA, torch.bfloat16, flash=False, flex=True, width=96)
    unknown, _ = resolve_levers(LearnerConfig(), CUDA, torch.bfloat16, flash=False, flex=True)
    assert (toy.levers.compile, real.levers.compile, forced.levers.compile, unknown.levers.compile) == (False, True, True, True)
    _, notes = resolve_levers(LearnerConfig(), CUDA, torch.bfloat16, flash=False, flex=True, width=96)
    assert "hidden size of 96 is below 512" in notes[0]
