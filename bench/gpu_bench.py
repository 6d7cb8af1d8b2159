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
(docs/cluster.md, "GPU bench", lists the wheels to bring where pydantic is missing).

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
and H200, 312 for A100; --peak-tflops overrides):
- MFU, as issue 34 counted it (issue 42's target metric): 6 x parameters + 6 x layers x hidden x row length
  (causal attention: half of the full square). With LoRA the frozen base counts 4 x (forward 2, the backward's
  input gradient 2, no weight gradient) and the adapters 6 x.
- MFU (torchtitan): torchtitan's `get_dense_model_nparams_and_flops`: 6 x parameters without the input
  embedding's lookup (a tied embedding is the head's matmul, so it stays) + 12 x layers x hidden x row length
  (the full square, the convention of not counting causal sparsity).
- HFU: MFU's FLOPs plus what the step recomputes: full activation checkpointing re-runs each decoder layer's
  forward (2 x layer parameters + 2 x layers x hidden x row length per token); selective re-runs only elementwise
  ops, counted as 0 matmul FLOPs (an approximation); the chunked LM head re-runs its forward in the backward
  (2 x vocabulary x hidden per response token). Like MFU it counts the head on prompt tokens, which the product
  skips.

Publication, per size: `learner.gather.iter_full_state(model, 0, 1, dtype=bfloat16)` consumed bucket by
bucket (GB/s = bytes published / seconds), beside this machine's copy limit: the same bytes copied from one
device bucket into two reused pinned host buffers with non_blocking copies. Bytes published are compared
with the unique parameter bytes (a tied embedding counted once).

Output: a table headed by the command line, the top kernels of each profiled step, issue 49's "Done when"
targets judged on the runs of the product's defaults (on a GPU), and --out JSON with every number (read by
`bench/scale_model.py --gpu-json`).
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import re
import shlex
import socket
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
FIRST_STEP_S = {"warm": 60.0, "cold": 120.0}  # 1.5B: setup to the first finished step, with/without a loaded cache
CHECKPOINTING = ("auto", "full", "selective", "none")  # learner.activation_checkpointing (true/false: full/none)
TOP_KERNELS = 10
# issue 49's "Done when", judged on a GPU on the runs of the product's defaults: (key, what, size, case, target);
# with the recompiles and the time to the first step (`judge`)
TARGETS = (("mfu_1.5B_fixed", "1.5B fixed: MFU (recompute not counted)", "1.5B", "fixed", 0.36),
           ("mfu_3B_mixed", "3B mixed: MFU (recompute not counted)", "3B", "mixed", 0.36),
           ("packed_over_padded_1.5B", "1.5B mixed: packed / padded response tokens/s", "1.5B", "mixed", 1.2),
           ("publication_1.5B", "1.5B publication, bf16, GB/s", "1.5B", "publish", 40.0))
CATEGORIES = (  # first match wins; names lower-cased (CUDA kernels, or aten ops on CPU)
    ("communication", r"nccl|c10d|gloo|all_gather|allgather|reduce_scatter|all_reduce|allreduce|broadcast"),
    ("attention", r"flash|fmha|attention|sdpa|flex|triton_tem"),
    ("matmul", r"gemm|gemv|matmul|cublas|cutlass|nvjet|xmma|wgmma|aten::(mm|addmm|bmm|baddbmm|linear)$"),
    ("reduction/softmax", r"reduce|softmax|norm|logsumexp|cross_entropy|triton_red|triton_per|"
                          r"aten::(sum|mean|max|min|amax|argmax|var|std)$"),
    ("elementwise/copy", r"elementwise|vectorized|unrolled|copy|memcpy|memset|fill|cat|index|gather|scatter|"
                         r"triton_poi|multi_tensor|foreach|aten::(add|add_|mul|mul_|sub|div|neg|exp|log|pow|rsqrt|"
                         r"sqrt|silu|sigmoid|where|clamp|to|_to_copy|copy_|zero_|zeros|ones|empty|contiguous|"
                         r"lerp_|addcmul_|addcdiv_|masked_fill)"),
)
FLOP_FORMULAS = {  # per token of every row (prompt and response), T its row length; see step_flops
    "MFU": "(6 x trained + 4 x frozen params + 6 x layers x hidden x T) x tokens / step_s / peak; issue 34's count "
           "and issue 42's target (recompute not counted); LoRA: the frozen base 4x, the adapters 6x",
    "MFU (torchtitan)": "(6 x trained + 4 x frozen params, without an untied input embedding's lookup, + 12 x layers "
                        "x hidden x T) x tokens / step_s / peak (torchtitan's get_dense_model_nparams_and_flops)",
    "HFU": "MFU's FLOPs + recompute: full checkpointing 2 x layer params + 2 x layers x hidden x T per token, "
           "selective ~0 (elementwise ops only, not counted), chunked head 2 x vocab x hidden per response token",
}
SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")


# ------------------------------------------------------------------------------------------------- set-up

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


def learner_config(args, padding_free: bool | None, device: torch.device, dtype: torch.dtype):
    """LearnerConfig with the bench's budget and the levers asked for (others: the product's defaults).
    `padding_free` (the mixed case's padded/packed pair) overrides --padding-free. Packed without --attn uses the
    attention `padding_free=auto` packs with on this device; where auto pads (packing is opt-in), flash-attention
    where installed, else flex_attention, on CUDA (on CPU: transformers' default, sdpa with a dense mask)."""
    from common.config import LearnerConfig
    from learner.levers import flash_attention_installed, resolve_levers

    fields = LearnerConfig.model_fields
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
        if auto.packs_padding_free:
            over["attn_implementation"] = auto.attn_implementation
        elif device.type == "cuda":
            flash = flash_attention_installed() and dtype != torch.float32
            over["attn_implementation"] = "flash_attention_2" if flash else "flex_attention"
    return LearnerConfig(**over)


def checkpointing_value(mode: str) -> str | bool:
    """learner.activation_checkpointing for the bench's `mode`: the mode's name where this tree's LearnerConfig
    takes it, else full/none as true/false (a tree from before the modes); auto/selective there: exit saying so."""
    from pydantic import ValidationError

    from common.config import LearnerConfig

    try:
        LearnerConfig(activation_checkpointing=mode)
        return mode
    except ValidationError:
        if mode in ("full", "none"):
            return mode == "full"
        sys.exit(f"--activation-checkpointing {mode}: this tree's learner.activation_checkpointing takes only "
                 "true/false; pass full or none")


def checkpointing_mode(value) -> str:
    """A LearnerConfig's activation_checkpointing as a mode name: true/false (the old field) are full/none."""
    return {True: "full", False: "none"}.get(value, value) if isinstance(value, bool) else str(value)


def lever_settings(cfg, model) -> dict:
    """What the step ran with: `cfg` is the TrainStep's, with `auto` resolved for the device."""
    out = {field: getattr(cfg, field) for _, (field, _, _) in LEVERS.items() if field in type(cfg).model_fields}
    if "activation_checkpointing" in out:
        out["activation_checkpointing"] = checkpointing_mode(out["activation_checkpointing"])
    out["packs_padding_free"] = cfg.packs_padding_free
    out["attention"] = model.config._attn_implementation if model is not None else cfg.attn_implementation
    out["micro_batch_tokens"] = cfg.micro_batch_tokens
    out["pad_multiple"] = getattr(cfg, "pad_multiple", None)
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


@dataclass(frozen=True)
class ParamCounts:
    """The parameter counts the FLOP formulas read (unique parameters: a tied embedding once)."""
    trained: int  # parameters with a weight gradient: all of them, or with LoRA the adapters
    frozen: int  # LoRA's frozen base: forward and input gradient, no weight gradient (0 without LoRA)
    layer: int  # the decoder layers' (adapters included): what full activation checkpointing re-runs
    lookup: int  # an input embedding not tied to the head: a lookup, not a matmul (0 where tied)
    lookup_trained: bool  # whether that embedding is among `trained` (else among `frozen`)
    head: int  # vocabulary x hidden: the LM head, re-run in the backward by the chunked head

    @classmethod
    def of(cls, model: torch.nn.Module) -> ParamCounts:
        params = list(model.parameters())  # unique (a tied embedding once); numel of a DTensor is its global size
        trained = sum(p.numel() for p in params if p.requires_grad)
        emb, cfg = model.get_input_embeddings().weight, model.config
        return cls(trained=trained, frozen=sum(p.numel() for p in params) - trained,
                   layer=sum(p.numel() for p in model.model.layers.parameters()),
                   lookup=0 if cfg.tie_word_embeddings else emb.numel(), lookup_trained=emb.requires_grad,
                   head=cfg.vocab_size * cfg.hidden_size)


def step_flops(c: ParamCounts, layers: int, hidden: int, lengths: list[int], prompt: int, checkpointing: str,
               chunked_head: bool) -> dict[str, float | None]:
    """One step's FLOPs three ways, summed over rows of `prompt` + n tokens for n in `lengths` (T = row length):
    - model (MFU, issue 34's count): per token 6 x trained + 4 x frozen + 6 x layers x hidden x T.
    - torchtitan: per token 6 x trained + 4 x frozen without the lookup + 12 x layers x hidden x T (torchtitan's
      torchtitan/models/utils.py, get_dense_model_nparams_and_flops: `6 * (nparams - nparams_embedding) +
      12 * l * h * q * t`, h x q = hidden; a tied embedding is the head's weight, so it stays counted).
    - hardware (HFU): model + recompute. checkpointing full: one more forward of the layers, per token
      2 x layer + 2 x layers x hidden x T; selective: elementwise ops only, counted as 0; none: 0; "auto" left
      unresolved: None (unknown). The chunked head's backward re-runs its forward: 2 x head per response token."""
    model = tt = recompute = 0.0
    params = 6 * c.trained + 4 * c.frozen
    lookup = (6 if c.lookup_trained else 4) * c.lookup
    for n in lengths:
        t = prompt + n  # tokens of the row, each attending to up to t
        model += t * (params + 6 * layers * hidden * t)
        tt += t * (params - lookup + 12 * layers * hidden * t)
        if checkpointing == "full":
            recompute += t * (2 * c.layer + 2 * layers * hidden * t)
        if chunked_head:
            recompute += n * 2 * c.head
    known = checkpointing in ("full", "selective", "none")
    return {"model": model, "torchtitan": tt, "hardware": model + recompute if known else None}


# ------------------------------------------------------------------------------------------------- measuring

def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_rss_gib() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:")) / 2**30


def category(name: str) -> str:
    low = name.lower()
    return next((cat for cat, pattern in CATEGORIES if re.search(pattern, low)), "other")


def profile_step(trainer, batch, device: torch.device) -> dict:
    """One more step under torch.profiler (not among the timed steps): kernel time by category and the
    `TOP_KERNELS` kernels that took most of it (CUDA kernels by name; CPU ops' self time on CPU), the host syncs
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
    split = {cat: {"ms": 0.0, "launches": 0} for cat, _ in CATEGORIES}
    split["other"] = {"ms": 0.0, "launches": 0}
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
    for name, (ms, calls) in kernels.items():
        cat = split[category(name)]
        cat["ms"] += ms
        cat["launches"] += calls
    total = sum(c["ms"] for c in split.values()) or 1.0
    for c in split.values():
        c["share"] = round(c["ms"] / total, 4)
        c["ms"] = round(c["ms"], 3)
    top = sorted(kernels.items(), key=lambda kv: -kv[1][0])[:TOP_KERNELS]
    return {"kernel_split": split, "kernel_ms": round(total, 3),
            "kernel_clock": "CUDA kernel time" if device.type == "cuda" else "CPU op self time",
            "top_kernels": [{"name": name[:400], "category": category(name), "ms": round(ms, 3),
                             "share": round(ms / total, 4), "calls": calls} for name, (ms, calls) in top],
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


def checkpointing_choice(lines: list[str]) -> dict | None:
    """The activation checkpointing note of the setup's log (`learner.checkpointing.resolve_checkpointing`): the
    mode, whether auto chose it, and the numbers auto used (None where this tree's note does not give them)."""
    m = next((m for line in lines for m in [re.search(r"activation checkpointing (\w+) \(([^;]*)\)", line)] if m),
             None)
    if m is None:
        return None
    mode, note = m.group(1), m.group(2)

    def num(pattern: str) -> float | None:
        hit = re.search(pattern, note)
        return float(hit.group(1)) if hit else None

    kb = re.search(r"kB/token (.*?) =", note)
    return {"mode": mode, "auto": note.startswith("auto"), "compiled": note.startswith("auto, compiled"),
            "note": note, "tokens": None if num(r"activations of (\d+) tokens") is None
            else int(num(r"activations of (\d+) tokens")), "left_gib": num(r"([-\d.]+) GiB left"),
            "budget_gib": num(r"x ([\d.]+) GiB budget"), "free_gib": num(r"\(free ([\d.]+),"),
            "gpu_share": num(r"GPU share ([\d.]+)"),
            "halved_from": None if num(r"micro_batch_tokens halved from (\d+)") is None
            else int(num(r"micro_batch_tokens halved from (\d+)")),
            "kb_per_token": {k: float(v) for k, v in re.findall(r"(none|selective|full) ([\d.]+)", kb.group(1))}
            if kb else {}}


def checkpointing_cell(s: dict, choice: dict | None) -> str:
    """The table's checkpointing cell: the mode, and where auto chose it, the numbers it used."""
    mode = s.get("activation_checkpointing", "-")
    if not choice:
        return str(mode)
    if not choice["auto"]:
        return f"{mode} (set)"
    if choice.get("tokens") is None:  # off CUDA, or a tree whose note gives no numbers
        return f"{mode} ({choice['note']})"
    kb = choice["kb_per_token"].get(mode)
    halved = f" (halved from {choice['halved_from']:,})" if choice.get("halved_from") else ""
    return (f"{mode} (auto{', compiled' if choice['compiled'] else ''}: {choice['tokens']:,} tok{halved} x "
            f"{kb if kb is not None else '?'} kB, {choice['left_gib']} GiB left of free {choice['free_gib']} "
            f"x share {choice['gpu_share']:g})")


def build_rank(args, size: str, padding_free: bool | None, folder: Path, device: torch.device,
               dtype: torch.dtype) -> dict:
    """The product's rank setup for `size` and the levers asked for, built once and reused by the consecutive
    cases (batch shapes) of that size and lever set: {"cfg", "built", "setup_s", "started", "graphs", "checkpointing",
    "first_step_done"}, or with "error" (and "failed", "traceback" for anything but running out of memory)."""
    from learner.setup import setup_rank

    cfg = learner_config(args, padding_free, device, dtype)
    rank = {"cfg": cfg, "built": None, "started": time.perf_counter(), "first_step_done": False}
    log = logging.getLogger("learner.setup")
    notes, level = _SetupLog(), log.level
    log.addHandler(notes)
    log.setLevel(logging.INFO)
    try:
        rank["built"] = setup_rank(cfg, str(folder), rank=0, world=1, device=device, dtype=dtype,
                                   max_new_tokens=args.response, fill=random_fill(args.seed))
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
    cfg, built = rank["cfg"], rank["built"]
    first = not rank["first_step_done"]  # this case runs the rank's first step: setup + compile are its cost
    t_case = rank["started"] if first else time.perf_counter()
    model = trainer = None
    try:
        if "error" in rank:
            out["error"] = rank["error"]
            if rank.get("failed"):
                out["failed"] = True
            return out
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
        model, trainer = built.model, built.trainer
        shape = model.config
        params = sum(p.numel() for p in model.parameters())  # unique: a tied embedding once
        counts = ParamCounts.of(model)
        out.update(settings=lever_settings(trainer.cfg, model), params=params, param_counts=asdict(counts),
                   layers=shape.num_hidden_layers, hidden=shape.hidden_size,
                   levers_off={k: str(v) for k, v in (getattr(built, "levers_off", None) or {}).items()})
        if case == "publish":  # the publication alone: no step, so no AdamW state or activations
            out["publication"] = publication(model, device, int(args.bucket_mb * 2**20), args.pub_repeats)
            return out
        times, warm, learner_recompiles = [], [], []
        graphs = rank["graphs"]
        for i in range(args.warmup + args.steps):
            batch = make_batch(lengths, args.prompt, shape.vocab_size, version=i, seed=100 + i)
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
        step_s = statistics.median(times)
        ran = out["settings"]
        flops = step_flops(counts, shape.num_hidden_layers, shape.hidden_size, lengths, args.prompt,
                           ran.get("activation_checkpointing", "none"), ran.get("logits_chunk_tokens") != 0)
        tflops, _ = peak_tflops(device, args.peak_tflops)

        def rate(f: float | None) -> float | None:
            return round(f / step_s / (tflops * 1e12), 4) if tflops and f is not None else None

        out.update(step_s=round(step_s, 6), step_s_all=[round(t, 6) for t in times],
                   step_s_min=round(min(times), 6), step_s_max=round(max(times), 6),
                   step_spread=round((max(times) - min(times)) / step_s, 4),
                   warmup_s=[round(t, 3) for t in warm], updates=stats.updates,
                   padding_frac=round(1 - float(stats.sums["row_tokens"]) / max(1.0, float(stats.sums["forward_tokens"])),
                                      4),
                   response_tokens_per_s=round(sum(lengths) / step_s, 1), tokens_per_s=round(out["tokens"] / step_s, 1),
                   flops_per_step=flops["model"], flops_per_step_torchtitan=flops["torchtitan"],
                   flops_per_step_hardware=flops["hardware"], mfu=rate(flops["model"]),
                   mfu_torchtitan=rate(flops["torchtitan"]), hfu=rate(flops["hardware"]))
        if device.type == "cuda":
            out["peak_mem_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
        else:
            out["peak_rss_gib"] = round(peak_rss_gib(), 3)
        if profile:
            out.update(profile_step(trainer, make_batch(lengths, args.prompt, shape.vocab_size, version=99, seed=99),
                                    device))
            out["profile_overhead"] = round(out["profiled_step_s"] / step_s - 1, 4)  # the profiler's cost on a step
        # graphs built after the rank's first step (this case's new shapes included): recompiles
        out["recompiles"] = compiled_graphs() - graphs
        rank["graphs"] = compiled_graphs()
        if any(n is not None for n in learner_recompiles):
            out["learner_recompiles"] = learner_recompiles
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

            out["settings"] = lever_settings(resolve_levers(cfg, device, dtype)[0], None)
        # set-up and warm-up (compile) where this case built the rank, steps, profile, publication
        out["case_s"] = round(time.perf_counter() - t_case, 2)
        del model, trainer
        if device.type == "cuda":
            torch.cuda.empty_cache()  # what this case's activations left cached, before the next shape
    return out


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


# ------------------------------------------------------------------------------------------------- report

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


def levers_on(s: dict) -> str:
    ckpt = s.get("activation_checkpointing")
    on = [name for name, yes in (("packed", s["packs_padding_free"]), ("compile", s.get("compile")),
                                 ("fused", s.get("fused_optimizer")), (f"ckpt {ckpt}", ckpt not in (None, "none")),
                                 ("chunked", s.get("logits_chunk_tokens") != 0),
                                 ("head math compiled", s.get("compile_head_math")),
                                 (f"lora r{s.get('lora_rank')}", s.get("lora_rank"))) if yes]
    return " ".join(on) or "none"


def judge(result: dict) -> list[dict]:
    """Issue 49's "Done when", each with its measured value and PASS/FAIL (judged on a GPU only), from the runs of
    the product's defaults (`run["defaults"]`), the 1.5B mixed pair and the 1.5B publication: every case runs, the
    MFU targets, no recompile after a rank's first step, the 1.5B time from setup to the first step (warm: the
    run loaded a compile cache), packed / padded, the publication. Each target has `target_text` and `value_text`
    for the tables."""
    gpu = result["device"]["type"] == "cuda"

    def verdict(value, target, at_most: bool = False) -> str:
        if value is None:
            return "not measured"
        return ("PASS" if (value <= target if at_most else value >= target) else "FAIL") if gpu \
            else "not judged (CPU)"

    def fmt(value, mfu: bool) -> str:
        return "-" if value is None else pct(value) if mfu else f"{value:.2f}" if isinstance(value, float) else str(value)

    out = []
    defaults = [r for r in result["runs"] if r.get("defaults") and r["case"] != "publish"]
    failed = [f"{r['size']} {r['case']}" for r in defaults if "error" in r]
    value = f"{len(defaults) - len(failed)}/{len(defaults)} ran" if defaults else None
    out.append({"key": "defaults_run", "what": "the product's defaults run every case", "target": "no error",
                "value": value, "target_text": "no error", "value_text": value or "-",
                "verdict": ("FAIL: " + ", ".join(failed) if failed else "PASS") if defaults else "not measured"})
    for key, what, size, case, target in TARGETS:
        mfu = key.startswith("mfu")
        if case == "publish":
            value = result["publication"].get(size, {}).get("gb_per_s")
        elif key.startswith("packed_over_padded"):
            value = result["packed_over_padded"].get(size)
        else:
            run = next((r for r in defaults if r["size"] == size and r["case"] == case), None)
            value = run.get("mfu") if run is not None else None
            if run is not None and "error" in run:
                out.append({"key": key, "what": what, "target": target, "value": None,
                            "target_text": f">= {target:.0%}", "value_text": "-",
                            "verdict": "FAIL: " + run["error"][:80]})
                continue
        out.append({"key": key, "what": what, "target": target, "value": value,
                    "target_text": f">= {target:.0%}" if mfu else f">= {target:g}", "value_text": fmt(value, mfu),
                    "verdict": verdict(value, target)})
    counted = [r["recompiles"] for r in defaults if "recompiles" in r]
    value = sum(counted) if counted else None
    out.append({"key": "recompiles", "what": "recompiles after a rank's first step, the defaults' cases",
                "target": 0, "value": value, "target_text": "0", "value_text": fmt(value, False),
                "verdict": verdict(value, 0, at_most=True)})
    warm = bool(result.get("compile_cache", {}).get("loaded"))
    first = next((r for r in defaults if r["size"] == "1.5B" and r.get("built_here") and "first_step_s" in r), None)
    target = FIRST_STEP_S["warm" if warm else "cold"]
    value = first["first_step_s"] if first else None
    out.append({"key": "first_step_1.5B", "what": f"1.5B: setup to the first finished step, s ({'warm' if warm else 'cold'}"
                f" compile cache)", "target": target, "value": value, "target_text": f"<= {target:g}",
                "value_text": fmt(value, False), "verdict": verdict(value, target, at_most=True)})
    return out


def target_cell(r: dict, targets: list[dict]) -> str:
    """The table's target cell of run `r`: the MFU target it is judged against, if any."""
    for t in targets:
        hit = next(((size, case) for key, _, size, case, _ in TARGETS if key == t["key"]), None)
        if r.get("defaults") and hit == (r["size"], r["case"]) and t["key"].startswith("mfu_"):
            return f">= {t['target']:.0%}: {t['verdict']}"
    return ""


def first_step_cell(r: dict) -> str:
    """Seconds from the start of the rank's setup (where this case built it; else from the case's start, on the
    rank of the case before) to its first finished step."""
    if "first_step_s" not in r:
        return "-"
    return f"{r['first_step_s']:.1f}" + ("" if r.get("built_here") else " (reused)")


def pct(x: float | None) -> str:
    return f"{x:.1%}" if x is not None else "-"


def print_report(result: dict) -> None:
    d = result["device"]
    print(f"\n$ {result['command']}")
    print(f"   ({d['name']}, torch {result['versions']['torch']}, transformers {result['versions']['transformers']}, "
          f"{result['dtype']}, commit {result['versions']['commit']})")
    peak = f"{d['peak_tflops']:g} TFLOP/s ({d['peak_source']})" if d["peak_tflops"] else d["peak_source"]
    print(f"peak {peak}")
    for name, formula in result["flop_formulas"].items():
        print(f"- {name} = {formula}")
    cats = [c for c, _ in CATEGORIES] + ["other"]
    gpu = d["type"] == "cuda"
    print("\nstep s: median of the timed steps, with the fastest and slowest; kernel time split: "
          + ("CUDA kernel time by kernel name" if gpu else "CPU op self time by op name")
          + " over one more, profiled, step; syncs/step: " + ("CUDA runtime sync calls" if gpu else "none on a CPU")
          + "; levers: packed = padding-free, ckpt = activation checkpointing, chunked = chunked LM head; "
            "defaults: every lever the product's default (the runs the targets judge)\n")
    head = ["size", "case", "rows x response", "levers on", "attention", "defaults", "step s", "min-max s",
            "resp tok/s", "MFU", "MFU (torchtitan)", "HFU", "peak GiB" if gpu else "peak RSS GiB",
            "first step s", "recompiles", "checkpointing"] + cats + ["syncs/step", "target"]
    targets = result.get("targets", [])
    print("| " + " | ".join(head) + " |")
    print("|" + "|".join("---" for _ in head) + "|")
    for r in result["runs"]:
        if r["case"] == "publish" and "error" not in r:  # its numbers are in the publication table
            continue
        s = r["settings"]
        lead = [r["size"], r["case"], f"{r['rows']} x {r['response_min']}-{r['response_max']}", levers_on(s),
                str(s["attention"]), "yes" if r.get("defaults") else "no"]
        if "error" in r:
            error = r["error"] if len(r["error"]) <= 160 else r["error"][:157] + "..."  # whole in the JSON
            print("| " + " | ".join(lead + [error] + [""] * (len(head) - len(lead) - 2) + [target_cell(r, targets)])
                  + " |")
            continue
        mem = r.get("peak_mem_gib", r.get("peak_rss_gib"))
        split = r.get("kernel_split", {})
        cells = lead + [f"{r['step_s']:.3f}", f"{r['step_s_min']:.3f}-{r['step_s_max']:.3f}",
                        f"{r['response_tokens_per_s']:,.0f}", pct(r["mfu"]), pct(r.get("mfu_torchtitan")),
                        pct(r.get("hfu")), f"{mem:.2f}", first_step_cell(r),
                        str(r["recompiles"]) if "recompiles" in r else "-",
                        checkpointing_cell(s, r.get("checkpointing"))]
        cells += [f"{split[c]['share']:.0%}" if c in split else "-" for c in cats]
        cells.append(str(r["host_syncs"]["total"]) if "host_syncs" in r else "-")
        cells.append(target_cell(r, targets))
        print("| " + " | ".join(cells) + " |")
    for r in result["runs"]:
        for lever, error in r.get("levers_off", {}).items():
            print(f"\n{r['size']} {r['case']}: {lever} off, it failed its trial at setup: {error}")
    for r in result["runs"]:
        if r.get("top_kernels"):
            print_top_kernels(r, gpu)
    for size, ratio in result["packed_over_padded"].items():
        print(f"\n{size}: mixed lengths, packed / padded response tokens/s = {ratio:.2f}x")
    if result["publication"]:
        print("\n| size | published GB | unique GB | iter_full_state s | GB/s | pinned copy GB/s | "
              "copy / publication |")
        print("|---|---|---|---|---|---|---|")
    for size, p in result["publication"].items():
        print(f"| {size} | {p['bytes_published'] / 1e9:.3g} | {p['unique_bytes'] / 1e9:.3g} | {p['seconds']:.3g} | "
              f"{p['gb_per_s']:.2f} | {p['copy_gb_per_s']:.2f}{'' if p['copy_pinned'] else ' (plain, CPU)'} | "
              f"{p['copy_gb_per_s'] / p['gb_per_s']:.1f}x |")
    for size, why in result["skipped"].items():
        print(f"\nskipped {size}: {why}")
    if result["publication"] or any(r.get("defaults") for r in result["runs"]):  # not after an A/B run alone
        print_targets(targets)


def print_top_kernels(r: dict, gpu: bool) -> None:
    clock = "CUDA kernel time" if gpu else "CPU op self time"
    print(f"\ntop {len(r['top_kernels'])} kernels, {r['size']} {r['case']} ({levers_on(r['settings'])}): "
          f"{r['kernel_ms'] / 1e3:.3f} s of {clock}; the profiled step took {r['profiled_step_s']:.3f} s "
          f"({r['profile_overhead']:+.0%} on the median step) and reading its trace {r['profile_read_s']:.1f} s more")
    print("| # | kernel | category | ms | share | calls |")
    print("|---|---|---|---|---|---|")
    for i, k in enumerate(r["top_kernels"], 1):
        name = k["name"] if len(k["name"]) <= 90 else k["name"][:87] + "..."  # whole (400 characters) in the JSON
        print(f"| {i} | `{name.replace('|', '/')}` | {k['category']} | {k['ms']:,.1f} | {k['share']:.1%} | "
              f"{k['calls']:,} |")


def print_targets(targets: list[dict]) -> None:
    print("\n| Done when (issue 49) | target | measured | verdict |")
    print("|---|---|---|---|")
    for t in targets:
        print(f"| {t['what']} | {t['target_text']} | {t['value_text']} | {t['verdict']} |")


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
    ap.add_argument("--micro-batch-tokens", type=int, help="learner.micro_batch_tokens (default 18432)")
    ap.add_argument("--pad-multiple", type=int, help="learner.pad_multiple (default auto: 64 on CUDA, 1 elsewhere); "
                                                     "1 is the A/B against rounding padded lengths up")
    ap.add_argument("--steps", type=int, help="timed steps: the median, fastest and slowest reported (default 5; "
                                              "2 with --quick)")
    ap.add_argument("--warmup", type=int, help="untimed steps first (default 1)")
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16", help="compute dtype")
    ap.add_argument("--device", choices=["cuda", "cpu"], help="default cuda where available (cpu with --quick)")
    ap.add_argument("--peak-tflops", type=float, help="the device's dense peak for MFU (default: by device name)")
    ap.add_argument("--compile-backend", help="learner.compile_backend (inductor; aot_eager traces without "
                                              "generating kernels: --quick --compile on a CPU)")
    ap.add_argument("--attn", help="learner.attn_implementation (sdpa, flex_attention, flash_attention_2, ...)")
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
                      help="learner.activation_checkpointing (alone: full; default: the product's); a tree whose "
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
    args = parse_args(argv)
    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(args.seed)
    backend = "nccl" if device.type == "cuda" else "gloo"
    torch.distributed.init_process_group(backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    tflops, source = peak_tflops(device, args.peak_tflops)
    vocab = 512 if args.quick else VOCAB
    command = "python " + " ".join(shlex.quote(a) for a in [os.path.relpath(__file__, Path.cwd())]
                                   + (sys.argv[1:] if argv is None else argv))
    result = {"command": command, "versions": versions(), "dtype": args.dtype,
              "device": {"type": device.type, "peak_tflops": tflops, "peak_source": source,
                         "name": torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU",
                         "memory_gib": round(torch.cuda.get_device_properties(device).total_memory / 2**30, 1)
                         if device.type == "cuda" else None},
              "mfu_formula": "(6 x params + 6 x layers x hidden x row length) x tokens / step_s / peak",
              "flop_formulas": FLOP_FORMULAS, "recompute_counted": False, "vocab": vocab,
              "levers": {flag: getattr(args, flag) for flag in LEVERS} | {"attn": args.attn, "lora": args.lora},
              "runs": [], "publication": {}, "packed_over_padded": {}, "skipped": {}}
    default_packs = product_packs(device, dtype)
    levers_given = any(getattr(args, flag) is not None for flag in LEVERS) or bool(args.lora or args.attn)
    started = time.perf_counter()
    result["compile_cache"] = {"loaded": load_lease_cache(args.compile_cache)}
    rank, rank_key, profiled = None, None, False
    try:
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
            rank = None
        for size in dict.fromkeys(r["size"] for r in result["runs"]):
            mixed = {r["settings"]["packs_padding_free"]: r for r in result["runs"]
                     if r["size"] == size and r["case"] == "mixed" and "error" not in r}
            if len(mixed) == 2:
                result["packed_over_padded"][size] = round(
                    mixed[True]["response_tokens_per_s"] / mixed[False]["response_tokens_per_s"], 3)
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


def load_lease_cache(folder: Path | None) -> list[str]:
    """Load every inductor artifact file a past lease saved into `folder` (`save_lease_cache`), before anything
    compiles: the names loaded. The loading is the learner's (`learner.compile_cache.load_compile_cache`, issue 49
    item 1); on a tree without it, nothing is loaded and the bench says so."""
    if folder is None or not folder.is_dir():
        return []
    try:
        from learner.compile_cache import load_compile_cache
    except ImportError:
        print("[gpu_bench] --compile-cache: this tree has no learner.compile_cache (issue 49 item 1): nothing "
              "loaded", file=sys.stderr)
        return []
    return [f.name for f in sorted(folder.glob("*.bin")) if load_compile_cache(f)]


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

    return resolve_levers(LearnerConfig(), device, dtype)[0].packs_padding_free


def over_budget(args, started: float, runs: list[dict]) -> str | None:
    """Why no further case starts: --budget-s spent, or the last case's time would overrun it."""
    if args.budget_s is None:
        return None
    spent = time.perf_counter() - started
    last = runs[-1]["case_s"] if runs else 0.0
    if spent + last > args.budget_s:
        return f"--budget-s {args.budget_s:g}: {spent:.0f} s spent, the last case took {last:.0f} s"
    return None


def save(result: dict, out: Path) -> None:
    """The JSON, whole, replaced atomically: a bench killed at its time limit leaves every finished case."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(out.suffix + ".tmp")
    tmp.write_text(json.dumps(result, indent=1))
    os.replace(tmp, out)


def progress(run: dict, result: dict, out: Path | None) -> None:
    """One line per finished case (flushed: a lease's output may be all that comes back), and the JSON so far."""
    head = f"[gpu_bench] {run['size']} {run['case']} ({levers_on(run['settings'])}, {run['case_s']:.0f} s)"
    if "error" in run:
        line = f"{head}: {run['error']}"
    elif run["case"] == "publish":
        p = result["publication"].get(run["size"], {})
        line = f"{head}: publication {p.get('gb_per_s', 0):.2f} GB/s, pinned copy {p.get('copy_gb_per_s', 0):.2f} GB/s"
    else:
        mem = run.get("peak_mem_gib", run.get("peak_rss_gib"))
        line = (f"{head}: {run['step_s']:.3f} s/step ({run['step_s_min']:.3f}-{run['step_s_max']:.3f}), "
                f"{run['response_tokens_per_s']:,.0f} response tok/s, MFU {pct(run['mfu'])}, MFU (torchtitan) "
                f"{pct(run['mfu_torchtitan'])}, HFU {pct(run['hfu'])}, peak {mem:.2f} GiB, "
                f"warm-up {sum(run['warmup_s']):.0f} s, first step {first_step_cell(run)} s, "
                f"recompiles {run.get('recompiles', '-')}, checkpointing "
                f"{checkpointing_cell(run['settings'], run.get('checkpointing'))}")
    if run.get("levers_off"):
        off = "; ".join(f"{lever} ({error})" for lever, error in run["levers_off"].items())
        line += f"; off after failing their trial at setup: {off}"
    print(line, file=sys.stderr, flush=True)
    if out is not None:
        save(result, out)


if __name__ == "__main__":
    main()
