"""GPU bench: the product's learner step and publication on Qwen2.5-shaped models, on a bare GPU machine.

    python bench/gpu_bench.py --out gpu_bench.json                       # 0.5B 1.5B 3B 7B (where memory allows)
    python bench/gpu_bench.py --runs 1.5B:fixed 3B:mixed --out gpu_bench.json   # these cases, in this order
    python bench/gpu_bench.py --sizes 1.5B --compile --fused-optimizer    # one lever at a time: --no-X turns it off
    python bench/gpu_bench.py --sizes 1.5B --activation-checkpointing selective   # auto | full | selective | none
    python bench/gpu_bench.py --quick --out /tmp/gpu_bench.json          # tiny shapes on CPU (the suite runs it)
    python bench/gpu_bench.py --quick --compile --compile-backend aot_eager --runs tiny:fixed tiny:mixed:padded
                                                   # compile's graphs and recompiles on CPU, one build for both
    bash scripts/device_bench.sh                                         # a short GPU lease, planned (see there)

Needs torch, transformers, numpy, pydantic, pyyaml, safetensors: no Ray, vLLM or MLflow is imported
(docs/gpu.md, section 1, lists the wheels to bring where pydantic is missing).

What runs: one process, one rank. `torch.distributed` over NCCL on CUDA (gloo on CPU) with world size 1,
and the product's rank setup (`learner.setup.setup_rank`: meta-device build, `prepare_model`, FSDP2
`fully_shard` per decoder layer with bf16 compute and fp32 master weights, AdamW), then the product's
`TrainStep.run` on synthetic `TrainingBatch`es. The weights are random (speed does not depend on them),
the vocabulary 151,936, the shapes Qwen2.5's.

Cases, each with the levers given (unset: the product's default):
- fixed: 8 rows of 256 prompt + 8,192 response tokens.
- mixed: as many response tokens in rows of 1,024-8,192 (uniform, seeded), padded and packed without padding
  (unless --padding-free / --no-padding-free picks one; `--runs SIZE:mixed` alone runs the product's default).
- publish: the publication alone, for a size that no step case published (one too large to train on the device:
  the publication needs only the fp32 master weights).

One build per size and lever set: consecutive cases of the same size and levers (the defaults' 1.5B fixed and
mixed padded) run their batch shapes on one rank, so its compile is paid once; the first of them reports the
setup, and each case the seconds to its first finished step (from the setup's start where it built the rank) and
its recompiles (graphs torch.compile built after the rank's first step: a new shape's, a failed guard's).
The checkpointing column shows the mode and, where `auto` chose it, the numbers it used (the setup's note: tokens
of the micro-batch, bytes per token, GiB left of the free memory x the Ray GPU share). --profile-first profiles
the first case only; --compile-cache DIR loads a past lease's inductor artifacts and saves this one's.

A case that fails is a row of the table with its error (out of memory is a result; any other failure prints its
traceback and makes the bench exit 1 after the table and the JSON), and the next case runs. Each finished case
prints a line and rewrites --out, so a bench killed at a lease's time limit leaves every finished case;
--budget-s starts no case that the last case's time says would overrun it.

Per case: seconds per step (median of --steps, 5 by default, after --warmup, with the fastest and slowest),
response tokens/s, three FLOP rates, peak memory, and over one more profiled step (not among the timed ones; its
wall time is reported beside the median, as the profiler's cost) the GPU kernel time by category, the 10 kernels
that took most of it (on CPU: the ops' self time) and the host syncs. The FLOP counts (`step_flops`), per token
of every row (prompt and response), over step time x the device's peak (989 TFLOP/s bf16 dense for H100 SXM
and H200, 312 for A100; --peak-tflops overrides): MFU (issue 34's count), MFU (torchtitan's) and HFU (MFU's
FLOPs plus recompute), each defined in bench/gpu_report.py.

Publication, per size: `learner.gather.iter_full_state(model, 0, 1, dtype=bfloat16)` consumed bucket by
bucket (GB/s = bytes published / seconds), beside this machine's copy limit: the same bytes copied from one
device bucket into two reused pinned host buffers with non_blocking copies. Bytes published are compared
with the unique parameter bytes (a tied embedding counted once).

Output: a table headed by the command line, the top kernels of each profiled step, issue 49's "Done when"
targets judged on the runs of the product's defaults (on a GPU), and --out JSON with every number (read by
`bench/scale_model.py --gpu-json`). This module runs the cases; bench/gpu_report.py counts the FLOPs, judges the
targets and prints the tables.
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from bench.gpu_report import (  # noqa: E402
    FLOP_FORMULAS, ParamCounts, checkpointing_choice, judge, kernel_summary, packed_over_padded, print_report,
    progress, save, step_flops)

VOCAB = 151_936
PROMPT = 256
# Qwen2.5 shapes: hidden, intermediate, layers, heads, kv heads, tied embedding
SIZES = {
    "0.5B": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, tie_word_embeddings=True),
    "1.5B": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                 num_key_value_heads=2, tie_word_embeddings=True),
    "3B": dict(hidden_size=2048, intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16,
               num_key_value_heads=2, tie_word_embeddings=True),
    "7B": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
               num_key_value_heads=4, tie_word_embeddings=False),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, tie_word_embeddings=True),  # --quick
}
PEAK_TFLOPS = (("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("GH200", 989.0), ("H200", 989.0), ("H100", 989.0),
               ("H800", 989.0), ("A100", 312.0), ("A800", 312.0))  # bf16 dense; first match of the device name
# lever flag -> (LearnerConfig field, value when on, value when off); activation_checkpointing takes a mode instead
LEVERS = {
    "compile": ("compile", True, False),
    "padding_free": ("padding_free", True, False),
    "fused_optimizer": ("fused_optimizer", True, False),
    "activation_checkpointing": ("activation_checkpointing", "full", "none"),
    "chunked_head": ("logits_chunk_tokens", None, 0),
    "compile_head_math": ("compile_head_math", True, False),  # opt-in (issue 49): the head's fused float32 math
}
CHECKPOINTING = ("auto", "full", "selective", "none")  # learner.levers.activation_checkpointing (true/false: full/none)
SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")


# ------------------------------------------------------------------------------------------------- set-up

def peak_tflops(device: torch.device, override: float | None) -> tuple[float | None, str]:
    """The device's bf16 dense peak and where it came from."""
    if override:
        return override, "--peak-tflops"
    if device.type != "cuda":
        return None, "unknown for a CPU (give --peak-tflops)"
    name = torch.cuda.get_device_name(device)
    for key, tflops in PEAK_TFLOPS:
        if key in name:
            return tflops, f"looked up from the device name ({key})"
    return None, f"unknown for {name!r} (give --peak-tflops)"


def model_folder(size: str, vocab: int, tmp: Path) -> Path:
    """A folder holding only config.json: `learner.loading.build_empty` reads it; the weights are drawn."""
    from transformers import Qwen2Config

    cfg = Qwen2Config(vocab_size=vocab, max_position_embeddings=32_768, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
                      hidden_act="silu", pad_token_id=0, **SIZES[size])
    path = tmp / size
    cfg.save_pretrained(path)
    return path


def random_fill(seed: int):
    """`setup_rank`'s fill: N(0, 0.02) weights, unit norms, zero biases, on each rank's local shard."""
    @torch.no_grad()
    def fill(model: torch.nn.Module) -> None:
        for name, p in model.named_parameters():
            local = p.to_local() if hasattr(p, "to_local") else p
            g = torch.Generator(device=local.device).manual_seed(seed + zlib.crc32(name.encode()))
            if "norm" in name:
                local.fill_(1.0)
            elif name.endswith("bias"):
                local.zero_()
            else:
                local.normal_(0.0, 0.02, generator=g)
    return fill


def learner_sections() -> dict[str, str]:
    """Each learner field's section in this tree (`lr` -> `optim`); {} in a tree from before the sections."""
    try:
        from common.config.learner import LEARNER_SECTIONS
    except ImportError:
        return {}
    return LEARNER_SECTIONS


def learner_field(cfg, name: str):
    """`cfg`'s field or property `name`, found in its section where this tree has sections; None where this tree
    has no such field."""
    for owner in (cfg, *(getattr(cfg, s) for s in sorted(set(learner_sections().values())))):
        if hasattr(owner, name):
            return getattr(owner, name)
    return None


def nested(over: dict) -> dict:
    """The bench's flat learner settings grouped into this tree's sections."""
    sections, out = learner_sections(), {}
    for name, value in over.items():
        if name in sections:
            out.setdefault(sections[name], {})[name] = value
        else:
            out[name] = value
    return out


def learner_config(args, padding_free: bool | None, device: torch.device, dtype: torch.dtype):
    """LearnerConfig with the bench's budget and the levers asked for (others: the product's defaults).
    `padding_free` (the mixed case's padded/packed pair) overrides --padding-free. Packed without --attn uses the
    attention `padding_free=auto` packs with on this device; where auto pads (packing is opt-in), flash-attention
    where installed, else flex_attention, on CUDA (on CPU: transformers' default, sdpa with a dense mask)."""
    from common.config import LearnerConfig
    from learner.levers import flash_attention_installed, resolve_levers

    fields = set(LearnerConfig.model_fields) | set(learner_sections())
    # every step applies its update (random weights may give a gradient norm above the default skip threshold,
    # and a skipped update would leave AdamW out of the timing)
    over = {"micro_batch_tokens": args.micro_batch_tokens, "lr": 1e-6, "skip_grad_norm": 1e12}
    if args.pad_multiple is not None:  # the pad_multiple A/B: 1 against auto's 64 on CUDA
        over["pad_multiple"] = args.pad_multiple
    for flag, (field, on, off) in LEVERS.items():
        value = getattr(args, flag)
        if flag == "padding_free" and padding_free is not None:
            value = padding_free
        if value is None:
            continue
        if field not in fields:
            sys.exit(f"--{'' if value else 'no-'}{flag.replace('_', '-')}: this tree's LearnerConfig has no "
                     f"field {field!r}; leave the flag out")
        if flag == "activation_checkpointing":
            over[field] = checkpointing_value(value)
        else:
            over[field] = on if value else off
    if args.lora:  # adapters on the default targets; only they train (learner.lora)
        from common.config.learner import LoRAConfig

        over["lora"] = LoRAConfig(rank=args.lora)
    if args.compile_backend:
        over["compile_backend"] = args.compile_backend
    if args.attn:
        over["attn_implementation"] = args.attn
    elif over.get("padding_free") is True:
        auto, _ = resolve_levers(LearnerConfig(), device, dtype)
        if learner_field(auto, "packs_padding_free"):
            over["attn_implementation"] = learner_field(auto, "attn_implementation")
        elif device.type == "cuda":
            flash = flash_attention_installed() and dtype != torch.float32
            over["attn_implementation"] = "flash_attention_2" if flash else "flex_attention"
    return LearnerConfig(**nested(over))


def checkpointing_value(mode: str) -> str | bool:
    """learner.levers.activation_checkpointing for the bench's `mode`: the mode's name where this tree's LearnerConfig
    takes it, else full/none as true/false (a tree from before the modes); auto/selective there: exit saying so."""
    from pydantic import ValidationError

    from common.config import LearnerConfig

    try:
        LearnerConfig(**nested({"activation_checkpointing": mode}))
        return mode
    except ValidationError:
        if mode in ("full", "none"):
            return mode == "full"
        sys.exit(f"--activation-checkpointing {mode}: this tree's learner.levers.activation_checkpointing takes only "
                 "true/false; pass full or none")


def checkpointing_mode(value) -> str:
    """A LearnerConfig's activation_checkpointing as a mode name: true/false (the old field) are full/none."""
    return {True: "full", False: "none"}.get(value, value) if isinstance(value, bool) else str(value)


def lever_settings(cfg, model) -> dict:
    """What the step ran with: `cfg` is the TrainStep's, with `auto` resolved for the device."""
    fields = set(type(cfg).model_fields) | set(learner_sections())
    out = {field: learner_field(cfg, field) for _, (field, _, _) in LEVERS.items() if field in fields}
    if "activation_checkpointing" in out:
        out["activation_checkpointing"] = checkpointing_mode(out["activation_checkpointing"])
    out["packs_padding_free"] = learner_field(cfg, "packs_padding_free")
    out["attention"] = model.config._attn_implementation if model is not None else learner_field(cfg, "attn_implementation")
    out["micro_batch_tokens"] = learner_field(cfg, "micro_batch_tokens")
    out["pad_multiple"] = learner_field(cfg, "pad_multiple")
    lora = getattr(cfg, "lora", None)
    out["lora_rank"] = lora.rank if lora is not None else None
    return out


# ------------------------------------------------------------------------------------------------- batches

def row_lengths(case: str, rows: int, response: int, seed: int) -> list[int]:
    """fixed (and publish): `rows` x `response`; mixed: as many response tokens in rows uniform in
    [response/8, response]."""
    if case != "mixed":
        return [response] * rows
    rng = np.random.default_rng(seed)
    out: list[int] = []
    while sum(out) < rows * response:
        out.append(int(rng.integers(max(1, response // 8), response + 1)))
    return out


def make_batch(lengths: list[int], prompt: int, vocab: int, version: int, seed: int):
    """Groups of 4 with 0/1 rewards, random tokens, behaviour log-probs -log(vocab); nothing to replay."""
    from common.messages import Rollout, TrainGroup, TrainingBatch, float32_array, int32_array

    rng = np.random.default_rng(seed)
    groups = []
    for g in range(0, len(lengths), 4):
        ros = [Rollout(response_ids=int32_array(rng.integers(3, vocab, n)),  # [T]
                       logprobs=float32_array(np.full(n, -np.log(vocab))),  # [T]
                       reward=float(i % 2), correct=bool(i % 2), entropy=1.0, version=version, finish_reason="stop",
                       key=f"q{g}#{i:016x}")
               for i, n in enumerate(lengths[g:g + 4])]
        groups.append(TrainGroup(question_id=f"q{g}", prompt_ids=int32_array(rng.integers(3, vocab, prompt)),
                                 rollouts=ros, mixed=False))
    return TrainingBatch(groups=groups, version=version)


# ------------------------------------------------------------------------------------------------- measuring

def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_rss_gib() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:")) / 2**30


def profile_step(trainer, batch, device: torch.device) -> dict:
    """One more step under torch.profiler (not among the timed steps): kernel time by category and the
    kernels that took most of it (`kernel_summary`: CUDA kernels by name; CPU ops' self time on CPU), the host syncs
    (CUDA runtime sync calls, device-to-host memcpys, scalar reads `aten::_local_scalar_dense`), and what the
    profiler cost: the profiled step's wall time and the seconds spent reading its trace afterwards."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        sync(device)
        t0 = time.perf_counter()
        trainer.run(batch)
        sync(device)
        step_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    kernels: dict[str, list] = {}  # name -> [ms, calls]
    syncs = {name: 0 for name in SYNC_CALLS}
    sync_cpu_us, dtoh, scalar_reads = 0.0, 0, 0
    for name, on_device, us, annotation in trace_events(prof):
        if device.type == "cuda" and on_device:  # a kernel, memcpy or memset on the GPU
            if annotation:  # a record_function span drawn on the GPU: not a kernel
                continue
            k = kernels.setdefault(name, [0.0, 0])
            k[0] += us / 1e3
            k[1] += 1
            dtoh += name.startswith("Memcpy DtoH")
            continue
        call = re.sub(r"(_v\d+|_ptsz|_ptds)+$", "", name)  # runtime API variants: cudaMemcpy_v2, ..._ptsz
        if call in syncs:
            syncs[call] += 1
            sync_cpu_us += us
        scalar_reads += name == "aten::_local_scalar_dense"
    if device.type != "cuda":
        for a in prof.key_averages():  # self time: nested ops are not counted twice
            kernels[a.key] = [a.self_cpu_time_total / 1e3, a.count]
    return {**kernel_summary(kernels, device.type == "cuda"),
            "host_syncs": {**syncs, "memcpy_dtoh": dtoh, "total": sum(syncs.values()),
                           "cpu_s": round(sync_cpu_us / 1e6, 4)},
            "scalar_reads": scalar_reads,
            "profiled_step_s": round(step_s, 6), "profile_read_s": round(time.perf_counter() - t0, 3)}


def trace_events(prof):
    """(name, on the device, microseconds, a user annotation) of every event of a finished profile, read from
    kineto's raw events: the profiler's own `events()` builds a FunctionEvent tree first (parents, children, a
    Python object per op), which took most of the time of reading a 1.5B step's trace; these are read as they
    are: 84,580 CPU events in 0.69 s against 9.07 s through `events()` (2 shared CPU cores, torch 2.13). Falls
    back to `events()` on a torch without `kineto_results`."""
    from torch.autograd import DeviceType

    raw = getattr(prof.profiler, "kineto_results", None)
    if raw is None:
        for e in prof.events():
            yield (e.name, e.device_type == DeviceType.CUDA, e.time_range.elapsed_us(),
                   bool(getattr(e, "is_user_annotation", False)))
        return
    for e in raw.events():
        us = e.duration_ns() / 1e3 if hasattr(e, "duration_ns") else e.duration_us()  # older torch: microseconds
        annotation = e.is_user_annotation() if hasattr(e, "is_user_annotation") else False
        yield e.name(), e.device_type() == DeviceType.CUDA, us, annotation


def compiled_graphs() -> int:
    """Graphs torch.compile has built in this process so far: a rise after a rank's first step is a recompile
    (`learner.compile_cache.compiled_graphs`, issue 49 item 2; 0 on a tree without it)."""
    if "torch._dynamo" not in sys.modules:  # nothing compiled yet (and importing dynamo costs seconds)
        return 0
    try:
        from learner.compile_cache import compiled_graphs as graphs
    except ImportError:
        return 0
    return graphs()


def recompiles_from_stats(stats) -> int | None:
    """Graphs the learner itself counted as compiled during a step (`RankStats.recompiles`, the metric
    `learner/recompiles`), where this tree's TrainStep reports it, else None."""
    value = getattr(stats, "recompiles", None)
    return None if value is None else int(value)


class _SetupLog(logging.Handler):
    """The lines `learner.setup` logs while a rank is built (its levers' notes: what auto chose and why)."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def build_rank(args, size: str, padding_free: bool | None, folder: Path, device: torch.device,
               dtype: torch.dtype) -> dict:
    """The product's rank setup for `size` and the levers asked for, built once and reused by the consecutive
    cases (batch shapes) of that size and lever set: {"cfg", "built", "setup_s", "started", "graphs", "checkpointing",
    "first_step_done"}, or with "error" (and "failed", "traceback" for anything but running out of memory)."""
    from learner.setup import setup_rank
    from learner.shape import TrainShape

    cfg = learner_config(args, padding_free, device, dtype)
    rank = {"cfg": cfg, "built": None, "started": time.perf_counter(), "first_step_done": False}
    log = logging.getLogger("learner.setup")
    notes, level = _SetupLog(), log.level
    log.addHandler(notes)
    log.setLevel(logging.INFO)
    try:
        shape = TrainShape(max_new_tokens=args.response, dtype=str(dtype).removeprefix("torch."))
        rank["built"] = setup_rank(cfg, str(folder), shape, rank=0, device=device, fill=random_fill(args.seed))
        rank["setup_s"] = round(time.perf_counter() - rank["started"], 2)
    except torch.OutOfMemoryError as e:  # a result of the case: the next case starts from a free device
        rank["error"] = f"out of memory: {str(e).splitlines()[0]}"
        print(f"[gpu_bench] {size}: {rank['error']}", file=sys.stderr)
    except Exception as e:  # noqa: BLE001 - one case's failure must not cost the others' numbers (a lease is short)
        # recorded with its traceback, and the bench exits 1 after the table and the JSON (main)
        rank["error"] = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:300]}"
        rank["failed"] = True
        print(f"[gpu_bench] {size} setup FAILED:\n{traceback.format_exc()}", file=sys.stderr)
    finally:
        log.removeHandler(notes)
        log.setLevel(level)
    rank["checkpointing"] = checkpointing_choice(notes.lines)
    rank["graphs"] = compiled_graphs()
    return rank


def run_case(args, size: str, case: str, rank: dict, device: torch.device, dtype: torch.dtype,
             want_publication: bool, profile: bool) -> dict:
    """One batch shape on a built rank (`build_rank`): warm up, time --steps steps, profile one more (`profile`),
    maybe publish. The rank's first case also reports its setup and the time from setup to its first step."""
    lengths = row_lengths(case, args.rows, args.response, seed=1)
    out = {"size": size, "case": case, "rows": len(lengths), "prompt_tokens": args.prompt,
           "response_min": min(lengths), "response_max": max(lengths), "response_tokens": sum(lengths),
           "tokens": sum(lengths) + len(lengths) * args.prompt}
    first = not rank["first_step_done"]  # this case runs the rank's first step: setup + compile are its cost
    t_case = rank["started"] if first else time.perf_counter()
    model = trainer = None
    try:
        if "error" in rank:
            out["error"] = rank["error"]
            if rank.get("failed"):
                out["failed"] = True
            return out
        model, trainer = rank["built"].model, rank["built"].trainer
        counts = describe_rank(out, rank, first, device)
        if case == "publish":  # the publication alone: no step, so no AdamW state or activations
            out["publication"] = publication(model, device, int(args.bucket_mb * 2**20), args.pub_repeats)
            return out
        steps = timed_steps(args, trainer, lengths, model.config.vocab_size, out, rank, t_case, device)
        out.update(step_numbers(args, out["settings"], counts, model.config, lengths, out["tokens"], steps, device))
        if device.type == "cuda":
            out["peak_mem_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
        else:
            out["peak_rss_gib"] = round(peak_rss_gib(), 3)
        if profile:
            out.update(profile_step(trainer, make_batch(lengths, args.prompt, model.config.vocab_size, version=99,
                                                        seed=99), device))
            out["profile_overhead"] = round(out["profiled_step_s"] / steps.median - 1, 4)  # the profiler's cost
        # graphs built after the rank's first step (this case's new shapes included): recompiles
        out["recompiles"] = compiled_graphs() - steps.graphs
        rank["graphs"] = compiled_graphs()
        if any(n is not None for n in steps.learner_recompiles):
            out["learner_recompiles"] = steps.learner_recompiles
        if want_publication:
            out["publication"] = publication(model, device, int(args.bucket_mb * 2**20), args.pub_repeats)
    except torch.OutOfMemoryError as e:  # a result of the case: the next case starts from a free device
        out["error"] = f"out of memory: {str(e).splitlines()[0]}"
        print(f"[gpu_bench] {size} {case}: {out['error']}", file=sys.stderr)
    except Exception as e:  # noqa: BLE001 - one case's failure must not cost the others' numbers (a lease is short)
        # recorded with its traceback, and the bench exits 1 after the table and the JSON (main)
        out["error"] = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:300]}"
        out["failed"] = True
        print(f"[gpu_bench] {size} {case} FAILED:\n{traceback.format_exc()}", file=sys.stderr)
    finally:
        if "settings" not in out:  # failed before the step was built: the levers as `auto` resolves them here
            from learner.levers import resolve_levers

            out["settings"] = lever_settings(resolve_levers(rank["cfg"], device, dtype)[0], None)
        # set-up and warm-up (compile) where this case built the rank, steps, profile, publication
        out["case_s"] = round(time.perf_counter() - t_case, 2)
        del model, trainer
        if device.type == "cuda":
            torch.cuda.empty_cache()  # what this case's activations left cached, before the next shape
    return out


def describe_rank(out: dict, rank: dict, first: bool, device: torch.device) -> ParamCounts:
    """Record into `out` what the case runs on: the rank's setup where this case is its first, the levers as
    resolved, the parameter counts and shape; reset the device's peak memory for the steps. The counts returned
    are the FLOP formulas'."""
    built = rank["built"]
    if first:
        out["setup_s"] = rank["setup_s"]
        for key in ("trial_graphs", "trial_s"):  # the setup's lever trial: the run's compile warm-up
            if hasattr(built, key):
                out[key] = round(getattr(built, key), 2)
    out["built_here"] = first  # False: the rank (and its compiled graphs) of the case before, reused
    if rank["checkpointing"] is not None:
        out["checkpointing"] = rank["checkpointing"]
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)  # the steps' peak (the model, AdamW state, activations)
    model, shape = built.model, built.model.config
    counts = ParamCounts.of(model)
    out.update(settings=lever_settings(built.trainer.cfg, model),
               params=sum(p.numel() for p in model.parameters()),  # unique: a tied embedding once
               param_counts=asdict(counts), layers=shape.num_hidden_layers, hidden=shape.hidden_size,
               levers_off={k: str(v) for k, v in (getattr(built, "levers_off", None) or {}).items()})
    return counts


@dataclass
class Steps:
    """What `timed_steps` measured: seconds of the untimed (warm-up) and timed steps, the last step's RankStats,
    the learner's own recompile count per step (None where this tree's TrainStep does not report it), and the
    compiled-graph count that any later graph is a recompile against (taken after the rank's first step)."""
    warmup: list[float]
    times: list[float]
    stats: object
    learner_recompiles: list[int | None]
    graphs: int

    @property
    def median(self) -> float:
        """Seconds of the median timed step."""
        return statistics.median(self.times)


def timed_steps(args, trainer, lengths: list[int], vocab: int, out: dict, rank: dict, t_case: float,
                device: torch.device) -> Steps:
    """--warmup then --steps steps on fresh batches of `lengths`, each timed between device syncs. The first step
    records into `out` the seconds to it (from `t_case`) and, where it is the rank's first, the graphs compiled."""
    first = not rank["first_step_done"]
    times, warm, learner_recompiles = [], [], []
    graphs, stats = rank["graphs"], None
    for i in range(args.warmup + args.steps):
        batch = make_batch(lengths, args.prompt, vocab, version=i, seed=100 + i)
        sync(device)
        t0 = time.perf_counter()
        stats = trainer.run(batch)
        sync(device)
        (warm if i < args.warmup else times).append(time.perf_counter() - t0)
        learner_recompiles.append(recompiles_from_stats(stats))
        if i == 0:
            out["first_step_s"] = round(time.perf_counter() - t_case, 2)  # setup (if built here) + first step
            if first:  # the graphs of the setup's trial and the first step; any later one is a recompile
                graphs = compiled_graphs()
                out["graphs_first_step"] = graphs
                rank["first_step_done"] = True
    return Steps(warm, times, stats, learner_recompiles, graphs)


def step_numbers(args, ran: dict, counts: ParamCounts, shape, lengths: list[int], tokens: int, steps: Steps,
                 device: torch.device) -> dict:
    """The timed steps' numbers: seconds per step (median, all, fastest, slowest, spread), updates, padding,
    tokens/s, the FLOPs per step three ways (`step_flops`, for the levers `ran` with) and their rates against the
    device's peak (None where the peak is unknown)."""
    times, stats = steps.times, steps.stats
    step_s = steps.median
    flops = step_flops(counts, shape.num_hidden_layers, shape.hidden_size, lengths, args.prompt,
                       ran.get("activation_checkpointing", "none"), ran.get("logits_chunk_tokens") != 0)
    tflops, _ = peak_tflops(device, args.peak_tflops)

    def rate(f: float | None) -> float | None:
        return round(f / step_s / (tflops * 1e12), 4) if tflops and f is not None else None

    return dict(step_s=round(step_s, 6), step_s_all=[round(t, 6) for t in times],
                step_s_min=round(min(times), 6), step_s_max=round(max(times), 6),
                step_spread=round((max(times) - min(times)) / step_s, 4),
                warmup_s=[round(t, 3) for t in steps.warmup], updates=stats.updates,
                padding_frac=round(1 - float(stats.sums["row_tokens"]) / max(1.0, float(stats.sums["forward_tokens"])),
                                   4),
                response_tokens_per_s=round(sum(lengths) / step_s, 1), tokens_per_s=round(tokens / step_s, 1),
                flops_per_step=flops["model"], flops_per_step_torchtitan=flops["torchtitan"],
                flops_per_step_hardware=flops["hardware"], mfu=rate(flops["model"]),
                mfu_torchtitan=rate(flops["torchtitan"]), hfu=rate(flops["hardware"]))


def release(rank: dict | None, device: torch.device) -> None:
    """Drop a built rank (its model, AdamW state, compiled layers) before the next size or lever set."""
    if rank is not None:
        rank.clear()
    free(device)


def free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    if "torch._dynamo" in sys.modules:  # compiled layers of the previous model: recompile for the next
        torch._dynamo.reset()


def unique_bytes(model: torch.nn.Module, dtype: torch.dtype) -> int:
    """Bytes of the published entries (`learner.gather.published_specs`: LoRA targets merged, adapters left out) in
    `dtype` where floating, each storage once (a tied embedding once)."""
    from learner.gather import published_specs

    seen, total = set(), 0
    for v in published_specs(model).values():
        local = v.to_local() if hasattr(v, "to_local") else v
        key = (local.untyped_storage().data_ptr(), local.storage_offset())
        if key in seen:
            continue
        seen.add(key)
        size = dtype.itemsize if v.is_floating_point() else v.element_size()
        total += v.numel() * size
    return total


def publication(model: torch.nn.Module, device: torch.device, bucket_bytes: int, repeats: int) -> dict:
    """iter_full_state in bf16, consumed bucket by bucket (one warm-up pass), beside the pinned-copy limit."""
    from learner.gather import iter_full_state

    def one() -> tuple[float, int, int]:
        sync(device)
        t0 = time.perf_counter()
        nbytes, buckets = 0, 0
        for chunk in iter_full_state(model, 0, 1, bucket_bytes=bucket_bytes, dtype=torch.bfloat16):
            nbytes += sum(t.numel() * t.element_size() for t in chunk.values())
            buckets += 1
        sync(device)
        return time.perf_counter() - t0, nbytes, buckets

    one()
    runs = [one() for _ in range(repeats)]
    seconds = statistics.median(r[0] for r in runs)
    nbytes, buckets = runs[0][1], runs[0][2]
    copy_s, pinned = copy_limit(nbytes, device, bucket_bytes)
    return {"bytes_published": nbytes, "unique_bytes": unique_bytes(model, torch.bfloat16), "buckets": buckets,
            "bucket_bytes": bucket_bytes, "seconds": round(seconds, 4), "gb_per_s": round(nbytes / seconds / 1e9, 3),
            "copy_s": round(copy_s, 4), "copy_gb_per_s": round(nbytes / copy_s / 1e9, 3), "copy_pinned": pinned}


def copy_limit(nbytes: int, device: torch.device, bucket_bytes: int) -> tuple[float, bool]:
    """Seconds to move `nbytes` from one device bucket into two reused host buffers (pinned, non_blocking on
    CUDA; plain copies on a CPU), after one warm-up pass."""
    elems = max(1, min(nbytes, bucket_bytes) // 2)
    src = torch.randn(elems, device=device).to(torch.bfloat16)  # [elems] one bucket on the device
    pinned = device.type == "cuda"
    host = [torch.empty(elems, dtype=torch.bfloat16, pin_memory=pinned) for _ in range(2)]  # [elems] x 2, reused

    def one() -> float:
        sync(device)
        t0 = time.perf_counter()
        left, i = nbytes, 0
        while left > 0:
            n = min(elems, -(-left // 2))
            host[i % 2][:n].copy_(src[:n], non_blocking=pinned)
            left -= 2 * n
            i += 1
        sync(device)
        return time.perf_counter() - t0

    one()
    return one(), pinned


# ------------------------------------------------------------------------------------------------- plan

def fits(size: str, device: torch.device, vocab: int, case: str = "fixed") -> str | None:
    """Why `case` of `size` is skipped on this device (None: it should fit). A step: 16 B per parameter (fp32
    master, grad, AdamW moments) + 8 GiB for activations, the bf16 gathered layers and the head; the publication
    alone: the fp32 master weights, 4 B per parameter, + 4 GiB (its bf16 buckets)."""
    if device.type != "cuda":
        return None
    s = SIZES[size]
    h, i, n = s["hidden_size"], s["intermediate_size"], s["num_hidden_layers"]
    kv = s["num_key_value_heads"] * h // s["num_attention_heads"]
    params = n * (2 * h * h + 2 * h * kv + 3 * h * i) + vocab * h * (1 if s["tie_word_embeddings"] else 2)
    per, extra = (4, 4) if case == "publish" else (16, 8)
    need = per * params + extra * 2**30
    have = torch.cuda.get_device_properties(device).total_memory
    if need > have:
        return (f"needs ~{need / 2**30:.0f} GiB ({per} B/parameter + {extra} GiB), the device has "
                f"{have / 2**30:.0f} GiB")
    return None


def versions() -> dict:
    import transformers

    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                                timeout=10).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        commit = "unknown"
    return {"torch": torch.__version__, "cuda": torch.version.cuda, "transformers": transformers.__version__,
            "commit": commit}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny shapes on CPU, the whole pipeline in seconds")
    ap.add_argument("--sizes", nargs="+", choices=list(SIZES), help="default 0.5B 1.5B 3B 7B (tiny with --quick)")
    ap.add_argument("--cases", nargs="+", choices=["fixed", "mixed", "publish"], default=["fixed", "mixed", "publish"],
                    help="publish: the publication alone (no step), run only for a size no step case published "
                         "(one too large to train here, say)")
    ap.add_argument("--order", choices=["size", "case"], default="size",
                    help="size: every case of a size, then the next size; case: a case on every size, then the next")
    ap.add_argument("--runs", nargs="+", type=run_spec, metavar="SIZE:CASE[:padded|packed]",
                    help="these cases in this order, instead of --sizes x --cases (a mixed case without a mode runs "
                         "once, with --padding-free or the product's default), e.g. 1.5B:fixed 3B:mixed "
                         "1.5B:mixed:packed")
    ap.add_argument("--budget-s", type=float, help="start no case once this many seconds are spent, or when the "
                                                   "last case's time would overrun them (a device lease's limit)")
    ap.add_argument("--rows", type=int, help="rows of the fixed case (default 8)")
    ap.add_argument("--prompt", type=int, help=f"prompt tokens per row (default {PROMPT})")
    ap.add_argument("--response", type=int, help="response tokens of a fixed row, the longest mixed one (8192)")
    ap.add_argument("--micro-batch-tokens", type=int, help="learner.batching.micro_batch_tokens (default 18432)")
    ap.add_argument("--pad-multiple", type=int, help="learner.levers.pad_multiple (default auto: 64 on CUDA, 1 elsewhere); "
                                                     "1 is the A/B against rounding padded lengths up")
    ap.add_argument("--steps", type=int, help="timed steps: the median, fastest and slowest reported (default 5; "
                                              "2 with --quick)")
    ap.add_argument("--warmup", type=int, help="untimed steps first (default 1)")
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16", help="compute dtype")
    ap.add_argument("--device", choices=["cuda", "cpu"], help="default cuda where available (cpu with --quick)")
    ap.add_argument("--peak-tflops", type=float, help="the device's dense peak for MFU (default: by device name)")
    ap.add_argument("--compile-backend", help="learner.levers.compile_backend (inductor; aot_eager traces without "
                                              "generating kernels: --quick --compile on a CPU)")
    ap.add_argument("--attn", help="learner.levers.attn_implementation (sdpa, flex_attention, flash_attention_2, ...)")
    ap.add_argument("--lora", type=int, metavar="RANK",
                    help="train rank-RANK adapters (learner.lora.rank): peak memory without the base's gradients and "
                         "AdamW state; the FLOPs count the frozen base 4 x (no weight gradient), the adapters 6 x")
    ap.add_argument("--bucket-mb", type=float, default=256.0, help="publication bucket (weight_sync.bucket_mb)")
    ap.add_argument("--pub-repeats", type=int, default=3, help="timed publications per size (median)")
    ap.add_argument("--no-profile", dest="profile", action="store_false", help="skip the profiled step")
    ap.add_argument("--profile-first", action="store_true",
                    help="profile the first case that runs a step only (the defaults' 1.5B fixed in a lease)")
    ap.add_argument("--compile-cache", type=Path, metavar="DIR",
                    help="inductor's compiled artifacts: load every DIR/*.bin at the start (a past lease's), save "
                         "this process's as DIR/<--out's name>.bin at the end")
    ap.add_argument("--no-publish", dest="publish", action="store_false",
                    help="no publication after the step cases (an A/B run beside one that published)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, help="write every number here as JSON")
    for flag, (field, _, _) in LEVERS.items():
        if flag == "activation_checkpointing":
            continue
        ap.add_argument(f"--{flag.replace('_', '-')}", action=argparse.BooleanOptionalAction, default=None,
                        help=f"learner.{field} on/off (default: the product's)")
    ckpt = ap.add_mutually_exclusive_group()
    ckpt.add_argument("--activation-checkpointing", nargs="?", const="full", choices=CHECKPOINTING, default=None,
                      help="learner.levers.activation_checkpointing (alone: full; default: the product's); a tree whose "
                           "field is still true/false takes full and none")
    ckpt.add_argument("--no-activation-checkpointing", dest="activation_checkpointing", action="store_const",
                      const="none", help="the same as --activation-checkpointing none")
    args = ap.parse_args(argv)
    quick = args.quick
    defaults = dict(sizes=["tiny"] if quick else ["0.5B", "1.5B", "3B", "7B"], rows=4 if quick else 8,
                    prompt=16 if quick else PROMPT, response=96 if quick else 8192,
                    micro_batch_tokens=256 if quick else 18_432, steps=2 if quick else 5, warmup=1,
                    device="cpu" if quick or not torch.cuda.is_available() else "cuda")
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if quick:
        args.pub_repeats = 1
    return args


def run_spec(text: str) -> tuple[str, str, bool | None]:
    """--runs' SIZE:CASE[:padded|packed] as (size, case, padding_free)."""
    size, case, *mode = text.split(":")
    if size not in SIZES or case not in ("fixed", "mixed", "publish") or mode not in ([], ["padded"], ["packed"]):
        raise argparse.ArgumentTypeError(f"{text!r}: SIZE:CASE[:padded|packed] with SIZE one of {', '.join(SIZES)}, "
                                         "CASE fixed, mixed or publish")
    return size, case, {"padded": False, "packed": True}[mode[0]] if mode else None


def main(argv: list[str] | None = None) -> dict:
    """Run the bench: the planned cases on one process group, then the report, the JSON, and exit 1 where a case
    failed for anything but memory (`argv` given: return the result instead of exiting)."""
    args = parse_args(argv)
    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(args.seed)
    backend = "nccl" if device.type == "cuda" else "gloo"
    torch.distributed.init_process_group(backend, store=torch.distributed.HashStore(), rank=0, world_size=1)  # no port
    vocab = 512 if args.quick else VOCAB
    result = new_result(args, argv, device, vocab)
    default_packs = product_packs(device, dtype)
    started = time.perf_counter()
    result["compile_cache"] = {"loaded": load_lease_cache(args.compile_cache)}
    try:
        run_plan(args, result, device, dtype, vocab, default_packs, started)
        result["packed_over_padded"] = packed_over_padded(result["runs"])
    finally:
        torch.distributed.destroy_process_group()
        result["compile_cache"]["saved"] = save_lease_cache(args.compile_cache, args.out)
    result["wall_s"] = round(time.perf_counter() - started, 1)
    result["targets"] = judge(result)
    print_report(result)
    if args.out:
        save(result, args.out)
        print(f"\nwrote {args.out}")
    failed = [f"{r['size']} {r['case']}" for r in result["runs"] if r.get("failed")]
    if failed:
        print(f"\n[gpu_bench] FAILED: {', '.join(failed)} (tracebacks above, errors in the table)", file=sys.stderr)
        if argv is None:
            sys.exit(1)
    return result


def new_result(args, argv: list[str] | None, device: torch.device, vocab: int) -> dict:
    """The JSON's head, before any case: the command line, versions, device and its peak, the FLOP formulas, the
    levers asked for; empty runs, publication, packed / padded and skipped for the cases to fill."""
    tflops, source = peak_tflops(device, args.peak_tflops)
    command = "python " + " ".join(shlex.quote(a) for a in [os.path.relpath(__file__, Path.cwd())]
                                   + (sys.argv[1:] if argv is None else argv))
    return {"command": command, "versions": versions(), "dtype": args.dtype,
            "device": {"type": device.type, "peak_tflops": tflops, "peak_source": source,
                       "name": torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU",
                       "memory_gib": round(torch.cuda.get_device_properties(device).total_memory / 2**30, 1)
                       if device.type == "cuda" else None},
            "mfu_formula": "(6 x params + 6 x layers x hidden x row length) x tokens / step_s / peak",
            "flop_formulas": FLOP_FORMULAS, "recompute_counted": False, "vocab": vocab,
            "levers": {flag: getattr(args, flag) for flag in LEVERS} | {"attn": args.attn, "lora": args.lora},
            "runs": [], "publication": {}, "packed_over_padded": {}, "skipped": {}}


def run_plan(args, result: dict, device: torch.device, dtype: torch.dtype, vocab: int, default_packs: bool,
             started: float) -> None:
    """Run the cases of `plan` in order into `result` (runs, publication, skipped), one build per size and lever
    set, each finished case printed and saved (`progress`); a case that does not fit or would overrun --budget-s
    is skipped with the reason."""
    levers_given = any(getattr(args, flag) is not None for flag in LEVERS) or bool(args.lora or args.attn)
    rank, rank_key, profiled = None, None, False
    with tempfile.TemporaryDirectory(prefix="gpu-bench-") as tmp:
        for size, case, pf in plan(args):
            if case == "publish" and size in result["publication"]:  # a step case of this size published
                continue
            why = fits(size, device, vocab, case) or over_budget(args, started, result["runs"])
            if why:
                mode = {True: " packed", False: " padded"}.get(pf, "") if case == "mixed" else ""
                result["skipped"][f"{size} {case}{mode}"] = why
                continue
            # one build per size and lever set: consecutive cases of both run their batch shapes on it
            key = (size, pf if pf is not None else args.padding_free if args.padding_free is not None
                   else default_packs)
            if rank is None or key != rank_key:
                release(rank, device)
                rank = build_rank(args, size, pf, model_folder(size, vocab, Path(tmp)), device, dtype)
                rank_key = key
            run = run_case(args, size, case, rank, device, dtype,
                           want_publication=size not in result["publication"] and (args.publish or
                                                                                    case == "publish"),
                           profile=args.profile and not (args.profile_first and profiled))
            profiled = profiled or "top_kernels" in run
            run["defaults"] = not levers_given and pf in (None, default_packs)
            if "publication" in run:
                result["publication"][size] = run.pop("publication")
            result["runs"].append(run)
            progress(run, result, args.out)
        release(rank, device)


def load_lease_cache(folder: Path | None) -> list[str]:
    """Load every inductor artifact file a past lease saved into `folder` (`save_lease_cache`), before anything
    compiles: the names loaded. The loading is the learner's (`learner.compile_cache.load_compile_cache`, issue 49
    item 1); on a tree without it, nothing is loaded and the bench says so."""
    if folder is None or not folder.is_dir():
        return []
    try:
        from learner.compile_cache import load_compile_cache_folder
    except ImportError:
        print("[gpu_bench] --compile-cache: this tree has no learner.compile_cache (issue 49 item 1): nothing "
              "loaded", file=sys.stderr)
        return []
    return load_compile_cache_folder(folder)


def save_lease_cache(folder: Path | None, out: Path | None) -> dict | None:
    """Save this process's inductor artifacts into `folder` as <--out's name>.bin (a lease brings them back
    under $OUT; carry the folder to the next one): {"file", "bytes"}, or None where nothing was saved."""
    if folder is None:
        return None
    try:
        from learner.compile_cache import save_compile_cache
    except ImportError:  # issue 49 item 1 not in this tree: nothing to save with
        return None
    path = folder / f"{out.stem if out else 'gpu-bench'}.bin"
    size = save_compile_cache(path)
    return None if size is None else {"file": path.name, "bytes": size}


def plan(args) -> list[tuple[str, str, bool | None]]:
    """(size, case, padding_free) in the order they run: --order size runs every case of a size before the next
    size; --order case runs a case on every size before the next case (with --budget-s: the first case everywhere
    before any second one). A mixed case is a padded/packed pair unless --padding-free picks one; publish goes
    last within a size (it runs only where no step case published). --runs gives the list itself."""
    if args.runs:
        return [(size, case, pf if pf is not None or case != "mixed" else args.padding_free)
                for size, case, pf in args.runs]
    cases = sorted(args.cases, key=lambda c: c == "publish")
    modes = {c: [args.padding_free] if c != "mixed" or args.padding_free is not None else [False, True]
             for c in cases}
    if args.order == "case":
        return [(size, c, pf) for c in cases for size in args.sizes for pf in modes[c]]
    return [(size, c, pf) for size in args.sizes for c in cases for pf in modes[c]]


def product_packs(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the product's defaults pack micro-batches without padding on this device."""
    from common.config import LearnerConfig
    from learner.levers import resolve_levers

    return learner_field(resolve_levers(LearnerConfig(), device, dtype)[0], "packs_padding_free")


def over_budget(args, started: float, runs: list[dict]) -> str | None:
    """Why no further case starts: --budget-s spent, or the last case's time would overrun it."""
    if args.budget_s is None:
        return None
    spent = time.perf_counter() - started
    last = runs[-1]["case_s"] if runs else 0.0
    if spent + last > args.budget_s:
        return f"--budget-s {args.budget_s:g}: {spent:.0f} s spent, the last case took {last:.0f} s"
    return None


if __name__ == "__main__":
    main()
