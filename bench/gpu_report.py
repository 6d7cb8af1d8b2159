"""GPU bench report: what bench/gpu_bench.py's measured numbers mean, and the tables it prints.

bench/gpu_bench.py runs the cases (builds the rank, times the steps, profiles one, measures the publication);
this module only counts, judges and formats what a case measured, so it imports neither torch nor anything of the
product (and no Ray, vLLM or MLflow: a test checks it). `scripts/device_bench.sh`'s lease summary reads its cells.

- FLOPs (`ParamCounts`, `step_flops`), per token of every row (prompt and response), over step time x the
  device's peak:
  - MFU, as issue 34 counted it (issue 42's target metric): 6 x parameters + 6 x layers x hidden x row length
    (causal attention: half of the full square). With LoRA the frozen base counts 4 x (forward 2, the backward's
    input gradient 2, no weight gradient) and the adapters 6 x.
  - MFU (torchtitan): torchtitan's `get_dense_model_nparams_and_flops`: 6 x parameters without the input
    embedding's lookup (a tied embedding is the head's matmul, so it stays) + 12 x layers x hidden x row length
    (the full square, the convention of not counting causal sparsity).
  - HFU: MFU's FLOPs plus what the step recomputes: full activation checkpointing re-runs each decoder layer's
    forward (2 x layer parameters + 2 x layers x hidden x row length per token); selective re-runs only
    elementwise ops, counted as 0 matmul FLOPs (an approximation); the chunked LM head re-runs its forward in the
    backward (2 x vocabulary x hidden per response token). Like MFU it counts the head on prompt tokens, which
    the product skips.
- The profiled step's kernels by category and the top `TOP_KERNELS` (`kernel_summary`).
- The setup's checkpointing note read back (`checkpointing_choice`): the mode and the numbers `auto` chose it from.
- Issue 49's "Done when" (`judge`), judged on a GPU on the runs of the product's defaults.
- The output: one line per finished case (`progress_line`), then the table headed by the command line, the top
  kernels of each profiled step, the publication table and the targets (`print_report`).
"""

from __future__ import annotations

import json
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

FIRST_STEP_S = {"warm": 60.0, "cold": 120.0}  # 1.5B: setup to the first finished step, with/without a loaded cache
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


# ------------------------------------------------------------------------------------------------- FLOPs

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
    def of(cls, model) -> ParamCounts:
        """The counts of a built (Qwen2-shaped) `torch.nn.Module`."""
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


# ------------------------------------------------------------------------------------------------- profile and setup

def category(name: str) -> str:
    """The kernel category of a CUDA kernel's (or on CPU an aten op's) name: the first of `CATEGORIES` to match."""
    low = name.lower()
    return next((cat for cat, pattern in CATEGORIES if re.search(pattern, low)), "other")


def kernel_summary(kernels: dict[str, list], gpu: bool) -> dict:
    """The profiled step's kernel time (`kernels`: name -> [ms, calls]) by category, each with its launches and
    share of the total, and the `TOP_KERNELS` kernels that took most of it."""
    split = {cat: {"ms": 0.0, "launches": 0} for cat, _ in CATEGORIES}
    split["other"] = {"ms": 0.0, "launches": 0}
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
            "kernel_clock": "CUDA kernel time" if gpu else "CPU op self time",
            "top_kernels": [{"name": name[:400], "category": category(name), "ms": round(ms, 3),
                             "share": round(ms / total, 4), "calls": calls} for name, (ms, calls) in top]}


def checkpointing_choice(lines: list[str]) -> dict | None:
    """The activation checkpointing note of the setup's log (`learner.activation_checkpointing.resolve_checkpointing`): the
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


# ------------------------------------------------------------------------------------------------- judging

def packed_over_padded(runs: list[dict]) -> dict[str, float]:
    """Per size with both mixed cases finished: packed / padded response tokens/s."""
    out = {}
    for size in dict.fromkeys(r["size"] for r in runs):
        mixed = {r["settings"]["packs_padding_free"]: r for r in runs
                 if r["size"] == size and r["case"] == "mixed" and "error" not in r}
        if len(mixed) == 2:
            out[size] = round(mixed[True]["response_tokens_per_s"] / mixed[False]["response_tokens_per_s"], 3)
    return out


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
        if value is None:
            return "-"
        return pct(value) if mfu else f"{value:.2f}" if isinstance(value, float) else str(value)

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
    out.append({"key": "first_step_1.5B",
                "what": f"1.5B: setup to the first finished step, s ({'warm' if warm else 'cold'} compile cache)",
                "target": target, "value": value, "target_text": f"<= {target:g}",
                "value_text": fmt(value, False), "verdict": verdict(value, target, at_most=True)})
    return out


# ------------------------------------------------------------------------------------------------- cells

def pct(x: float | None) -> str:
    """A fraction as a percentage with one decimal, "-" where unknown."""
    return f"{x:.1%}" if x is not None else "-"


def levers_on(s: dict) -> str:
    """The levers a case's settings (`lever_settings`) turn on, in a few words ("none" where none)."""
    ckpt = s.get("activation_checkpointing")
    on = [name for name, yes in (("packed", s["packs_padding_free"]), ("compile", s.get("compile")),
                                 ("fused", s.get("fused_optimizer")), (f"ckpt {ckpt}", ckpt not in (None, "none")),
                                 ("chunked", s.get("logits_chunk_tokens") != 0),
                                 ("head math compiled", s.get("compile_head_math")),
                                 (f"lora r{s.get('lora_rank')}", s.get("lora_rank"))) if yes]
    return " ".join(on) or "none"


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


def first_step_cell(r: dict) -> str:
    """Seconds from the start of the rank's setup (where this case built it; else from the case's start, on the
    rank of the case before) to its first finished step."""
    if "first_step_s" not in r:
        return "-"
    return f"{r['first_step_s']:.1f}" + ("" if r.get("built_here") else " (reused)")


def target_cell(r: dict, targets: list[dict]) -> str:
    """The table's target cell of run `r`: the MFU target it is judged against, if any."""
    for t in targets:
        hit = next(((size, case) for key, _, size, case, _ in TARGETS if key == t["key"]), None)
        if r.get("defaults") and hit == (r["size"], r["case"]) and t["key"].startswith("mfu_"):
            return f">= {t['target']:.0%}: {t['verdict']}"
    return ""


# ------------------------------------------------------------------------------------------------- printing

def progress_line(run: dict, result: dict) -> str:
    """The line a finished case prints (the publication of `result` for a publish case)."""
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
    return line


def save(result: dict, out: Path) -> None:
    """The JSON, whole, replaced atomically: a bench killed at its time limit leaves every finished case."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(out.suffix + ".tmp")
    tmp.write_text(json.dumps(result, indent=1))
    os.replace(tmp, out)


def progress(run: dict, result: dict, out: Path | None) -> None:
    """One line per finished case (`progress_line`, flushed: a lease's output may be all that comes back), and the
    JSON so far."""
    print(progress_line(run, result), file=sys.stderr, flush=True)
    if out is not None:
        save(result, out)


def print_report(result: dict) -> None:
    """The whole report of a finished bench: the command and device, the formulas, the table of cases, the levers
    that failed their trial, the top kernels, packed / padded, the publication table, the skipped cases, and the
    targets (not after an A/B run alone)."""
    d = result["device"]
    print(f"\n$ {result['command']}")
    print(f"   ({d['name']}, torch {result['versions']['torch']}, transformers {result['versions']['transformers']}, "
          f"{result['dtype']}, commit {result['versions']['commit']})")
    peak = f"{d['peak_tflops']:g} TFLOP/s ({d['peak_source']})" if d["peak_tflops"] else d["peak_source"]
    print(f"peak {peak}")
    for name, formula in result["flop_formulas"].items():
        print(f"- {name} = {formula}")
    gpu = d["type"] == "cuda"
    print_runs(result["runs"], result.get("targets", []), gpu)
    for r in result["runs"]:
        for lever, error in r.get("levers_off", {}).items():
            print(f"\n{r['size']} {r['case']}: {lever} off, it failed its trial at setup: {error}")
    for r in result["runs"]:
        if r.get("top_kernels"):
            print_top_kernels(r, gpu)
    for size, ratio in result["packed_over_padded"].items():
        print(f"\n{size}: mixed lengths, packed / padded response tokens/s = {ratio:.2f}x")
    print_publication(result["publication"])
    for size, why in result["skipped"].items():
        print(f"\nskipped {size}: {why}")
    if result["publication"] or any(r.get("defaults") for r in result["runs"]):  # not after an A/B run alone
        print_targets(result.get("targets", []))


def print_runs(runs: list[dict], targets: list[dict], gpu: bool) -> None:
    """The table of cases, one row each (a publish case only where it failed: its numbers are the publication
    table's), with the legend above it."""
    cats = [c for c, _ in CATEGORIES] + ["other"]
    print("\nstep s: median of the timed steps, with the fastest and slowest; kernel time split: "
          + ("CUDA kernel time by kernel name" if gpu else "CPU op self time by op name")
          + " over one more, profiled, step; syncs/step: " + ("CUDA runtime sync calls" if gpu else "none on a CPU")
          + "; levers: packed = padding-free, ckpt = activation checkpointing, chunked = chunked LM head; "
            "defaults: every lever the product's default (the runs the targets judge)\n")
    head = ["size", "case", "rows x response", "levers on", "attention", "defaults", "step s", "min-max s",
            "resp tok/s", "MFU", "MFU (torchtitan)", "HFU", "peak GiB" if gpu else "peak RSS GiB",
            "first step s", "recompiles", "checkpointing"] + cats + ["syncs/step", "target"]
    print("| " + " | ".join(head) + " |")
    print("|" + "|".join("---" for _ in head) + "|")
    for r in runs:
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


def print_publication(publication: dict[str, dict]) -> None:
    """The publication table, a row per size: bytes published and unique, seconds, GB/s beside the pinned copy."""
    if publication:
        print("\n| size | published GB | unique GB | iter_full_state s | GB/s | pinned copy GB/s | "
              "copy / publication |")
        print("|---|---|---|---|---|---|---|")
    for size, p in publication.items():
        print(f"| {size} | {p['bytes_published'] / 1e9:.3g} | {p['unique_bytes'] / 1e9:.3g} | {p['seconds']:.3g} | "
              f"{p['gb_per_s']:.2f} | {p['copy_gb_per_s']:.2f}{'' if p['copy_pinned'] else ' (plain, CPU)'} | "
              f"{p['copy_gb_per_s'] / p['gb_per_s']:.1f}x |")


def print_top_kernels(r: dict, gpu: bool) -> None:
    """The top kernels of run `r`'s profiled step, with what the profiler cost."""
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
    """Issue 49's "Done when" table (`judge`)."""
    print("\n| Done when (issue 49) | target | measured | verdict |")
    print("|---|---|---|---|")
    for t in targets:
        print(f"| {t['what']} | {t['target_text']} | {t['value_text']} | {t['verdict']} |")
