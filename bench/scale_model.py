"""Cost model of one ExGRPO step at the target scale (docs/scale.md), from constants measured on this machine at
small N and stated hardware assumptions.

    python bench/scale_model.py                      # the target: 7B, 64 generator + 64 learner GPUs, B = 128 x 8
    python bench/scale_model.py --gpus 8 16 32 64 128 256   # the sweep table (generator GPUs = learner GPUs = N)
    python bench/scale_model.py --measure            # re-measure the Ray call constants here first (~20 s)
    python bench/scale_model.py --gpu-json gpu_bench.json   # the GPU constants from bench/gpu_bench.py's JSON

Each term names what it is built from. MEASURED are points taken on the 2-CPU development machine (the
command that produced each is next to it); GPU are the learner's MFU and the publication's gather to host,
measured on a GPU by bench/gpu_bench.py (--gpu-json; without it, one H100 on 2026-11-27,
docs/gpu.md) or, where no size near the target was measured, assumed from the nearest one (each says which);
HARDWARE are the assumptions for an H100 cluster (change any constant with --set name=value). The model is a
roofline: it says which term grows first and by how much, not a promise of seconds; docs/scale.md walks through it.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from dataclasses import dataclass

# ------------------------------------------------------------------------------------------------ constants

MEASURED = {
    # name: (value, unit, what, command on this machine)
    "ray_call_s": (0.00088, "s", "one Ray actor call round trip, caller waits",
                   "python bench/scale_model.py --measure"),
    "actor_calls_per_s": (5941.0, "calls/s", "calls one plain Ray actor answers per second, many callers in flight",
                          "python bench/scale_model.py --measure"),
    "shard_ingest_groups_per_s": (3829.0, "groups/s", "one buffer shard actor, client.submit, K=8 x 256 tokens",
                                  "python bench/buffer_bench.py --sizes 10000 --groups 2048"),
    "shard_bytes_per_token": (9.5, "B/token", "shard memory per stored token (2,421 B per 256-token trajectory)",
                              "python bench/buffer_bench.py --sizes 10000 --groups 2048"),
    "snapshot_bytes_per_s": (191e6 * 1.048576, "B/s", "first (full) shard snapshot: 7,689 MiB in 40.2 s",
                             "python bench/shapes_bench.py --snapshot"),
    "snapshot_incremental_ratio": (0.013, "x", "bytes of a snapshot after 1% of trajectories changed vs a full one",
                                   "python bench/shapes_bench.py --snapshot"),
    "restore_s_per_gib": (15.78 / 7.48, "s/GiB", "restore (read + verify + rebuild) of a shard snapshot",
                          "python bench/shapes_bench.py --snapshot"),
    "handover_s": (0.12, "s", "learner-side hand-over per step (get_batch, publish call, end_step) at N=16",
                   "python bench/cluster_sim.py --quick (table a: publish+feedback)"),
    "collective_overhead": (1.07, "x", "collective publish+load vs a plain ray.put/get+load of the same bytes",
                            "python bench/weights_bench.py --repeats 6"),
}

HARDWARE = {
    # name: (value, unit, what)
    "gpu_flops": (989e12, "FLOP/s", "H100 SXM dense bf16 (the H200's too)"),
    "hbm_bytes_per_s": (3.35e12, "B/s", "H100 SXM memory bandwidth"),
    "decode_bw_efficiency": (0.6, "x", "share of HBM bandwidth a decode step reaches (vLLM, paged KV)"),
    "gpu_mem_bytes": (80e9, "B", "H100 memory"),
    "vllm_mem_fraction": (0.9, "x", "vLLM gpu_memory_utilization"),
    "max_num_seqs": (256, "seqs", "vLLM max_num_seqs per engine"),
    "nic_bytes_per_s": (50e9, "B/s", "one node's NIC: 400 Gb/s"),
    "hop_latency_s": (20e-6, "s", "one network hop (RDMA/TCP, same fabric)"),
    "gpus_per_node": (8, "GPUs", ""),
    "fs_bytes_per_s_per_node": (2e9, "B/s", "checkpoint write bandwidth of one node to shared storage"),
    "fs_bytes_per_s_total": (40e9, "B/s", "shared storage aggregate write bandwidth"),
    "delta_fraction": (0.08, "x", "bytes of a delta publication vs a full one at lr 1e-6 (sparse index+value); "
                                  "measured here: 6.6% at lr 1e-6 on 0.4M and 10M models, bench/weights_bench.py --delta"),
    "bucket_bytes": (256 * 2**20, "B", "weight-sync bucket (learner.weight_sync.bucket_mb)"),
}


LEASE_49 = "measured: H100 80GB, 2026-11-27 (torch 2.11, docs/gpu.md)"
# MFU per Qwen2.5 size by bench/gpu_report.py's formula (step_flops): (6 x params + 6 x layers x hidden x row
# length) FLOPs per token over every token, recompute not counted. size: (MFU, parameters, the step measured, source)
MFU_MEASURED = {
    "1.5B": (0.383, 1.544e9, "8 x (256 + 8,192) tokens, compiled, no checkpointing (auto's choice)", LEASE_49),
    "3B": (0.386, 3.086e9, "14 mixed rows (1,273-7,837), compiled, selective at 9,216 tokens (what auto now "
                           "chooses; set by hand then)", LEASE_49),
}
GPU = {
    # name: (value, unit, what, source)
    "mfu": (0.386, "x", "learner MFU of the target model (FSDP2, bf16, compiled; recompute not counted)",
            "assumed: the 3B's (the size measured nearest)"),
    "gather_bytes_per_s": (47.48e9, "B/s", "publication's gather + copy to host on learner rank 0 "
                                           "(bf16, 3B: 6.2 GB in 0.130 s)", LEASE_49),
    "pinned_copy_bytes_per_s": (54.42e9, "B/s", "the same bytes into reused pinned host buffers, non-blocking "
                                                "(the machine's limit)", LEASE_49),
}


def load_gpu_json(path: str, params: float) -> None:
    """Take the GPU constants from bench/gpu_bench.py's JSON: the MFU of every size measured in the fixed case
    (the runs at the product's defaults where the JSON marks them, `defaults`; else, in older JSONs, runs with
    activation checkpointing where there are any; the best of them), the publication GB/s and the pinned-copy
    limit of the largest size published. The target's MFU is that of the size measured nearest to `params`:
    measured within 25% of it, assumed otherwise."""
    with open(path) as f:
        r = json.load(f)
    where = f"measured: {r['device']['name']}, {path} (commit {r['versions']['commit']}; {r['command']})"
    runs = [x for x in r["runs"] if x["case"] == "fixed" and x.get("mfu") is not None and "error" not in x]
    if runs:
        MFU_MEASURED.clear()
    for size in dict.fromkeys(x["size"] for x in runs):
        mine = [x for x in runs if x["size"] == size]
        mine = ([x for x in mine if x.get("defaults")] if any("defaults" in x for x in mine) else
                [x for x in mine if _checkpointing(x) != "no checkpointing"]) or mine
        best = max(mine, key=lambda x: x["mfu"])
        step = f"{best['rows']} x ({best['prompt_tokens']} + {best['response_max']:,}) tokens, {_checkpointing(best)}"
        MFU_MEASURED[size] = (best["mfu"], float(best["params"]), step, where)
    if r["publication"]:
        size, pub = max(r["publication"].items(), key=lambda kv: kv[1]["bytes_published"])
        GPU["gather_bytes_per_s"] = (pub["gb_per_s"] * 1e9, "B/s", "publication's gather + copy to host on learner "
                                     f"rank 0 (iter_full_state, bf16, {size})", where)
        GPU["pinned_copy_bytes_per_s"] = (pub["copy_gb_per_s"] * 1e9,) + GPU["pinned_copy_bytes_per_s"][1:3] + (where,)
    if MFU_MEASURED:
        size, (mfu, n, _, src) = min(MFU_MEASURED.items(), key=lambda kv: abs(kv[1][1] - params))
        how = src if abs(n - params) <= 0.25 * params else f"assumed: the {size}'s (the size measured nearest)"
        GPU["mfu"] = (mfu,) + GPU["mfu"][1:3] + (how,)


def _checkpointing(run: dict) -> str:
    """A bench run's activation checkpointing in words: the JSON holds a bool (older benches) or a mode name."""
    mode = run["settings"].get("activation_checkpointing")
    if mode in (None, False, "none"):
        return "no checkpointing"
    return "checkpointing" if mode is True else f"{mode} checkpointing"


@dataclass
class Model:
    """Qwen2.5-7B-like."""
    params: float = 7.6e9
    layers: int = 28
    hidden: int = 3584
    kv_heads: int = 4
    head_dim: int = 128
    vocab: int = 152_064
    dtype_bytes: int = 2


@dataclass
class Run:
    gen_gpus: int = 64
    learn_gpus: int = 64
    batch_questions: int = 128
    group_size: int = 8
    prompt_tokens: int = 256
    response_mean: int = 4096  # reasoning RL: mean ~half the cap
    response_max: int = 8192
    questions: int = 46_000  # the paper's training set
    shards: int = 2
    idle_sleep_s: float = 0.05  # generator.idle_sleep_s
    lease_wait_s: float = 1.0  # generator.lease_wait_s (long-poll lease; 0: poll every idle_sleep_s)
    weight_poll_s: float = 0.1  # generator.weight_poll_s (when weight_wait_s is 0)
    weight_wait_s: float = 2.0  # generator.weight_wait_s (the weight watcher's long-poll; 0: poll)
    leases_per_group: float = 1 / 8  # questions_per_lease 8


def _c(table: dict, name: str) -> float:
    return table[name][0]


# ---------------------------------------------------------------------------------------------------- terms

def generation(m: Model, r: Run) -> dict[str, float]:
    """Decode roofline: each step reads the weights once and every running sequence's KV cache."""
    kv_per_token = 2 * m.layers * m.kv_heads * m.head_dim * m.dtype_bytes
    weights = m.params * m.dtype_bytes
    kv_budget = _c(HARDWARE, "gpu_mem_bytes") * _c(HARDWARE, "vllm_mem_fraction") - weights - 4e9  # activations
    ctx_mean = r.prompt_tokens + r.response_mean / 2  # a running sequence is halfway through on average
    seqs = min(_c(HARDWARE, "max_num_seqs"), kv_budget / (kv_per_token * (r.prompt_tokens + r.response_mean)))
    step_s = (weights + seqs * ctx_mean * kv_per_token) / (_c(HARDWARE, "hbm_bytes_per_s")
                                                         * _c(HARDWARE, "decode_bw_efficiency"))
    per_seq = 1 / step_s
    per_gpu = seqs * per_seq
    batch_tokens = r.batch_questions * r.group_size * r.response_mean
    return {"kv_bytes_per_token": kv_per_token, "seqs_per_gpu": seqs, "decode_step_s": step_s,
            "tokens_per_s_per_seq": per_seq, "tokens_per_s_per_gpu": per_gpu, "batch_tokens": batch_tokens,
            "throughput_s": batch_tokens / (per_gpu * r.gen_gpus),
            "longest_response_s": r.response_max / per_seq}


def learner(m: Model, r: Run) -> dict[str, float]:
    """6P per trained token + attention, + 2P (and a third of the attention) for the start-of-step log-probs, at
    the GPU bench's MFU, whose formula counts the same 6P + attention and not the recompute of activation
    checkpointing (its time is in the measured MFU)."""
    rows = r.batch_questions * r.group_size
    tokens = rows * (r.prompt_tokens + r.response_mean)
    attn = 12 * m.layers * m.hidden * (r.prompt_tokens + r.response_mean) / 2  # causal: half the context on average
    flops = tokens * ((6 + 2) * m.params + attn * (1 + 1 / 3))
    rate = r.learn_gpus * _c(HARDWARE, "gpu_flops") * _c(GPU, "mfu")
    return {"tokens": tokens, "flops": flops, "step_s": flops / rate}


def publication(m: Model, r: Run) -> dict[str, float]:
    """Per version: first the gather to host on learner rank 0 (the whole version before it is announced; the
    learner's next step waits behind it), then the fan-out: star (rank 0 sends N copies through one NIC; the object
    store's one object is the same bound), relay (a pipelined chain: the first copy plus one bucket per hop), and
    both with delta publications (taken from the gathered host copy, so the gather stays whole)."""
    bytes_ = m.params * m.dtype_bytes
    bw, hop, bucket = _c(HARDWARE, "nic_bytes_per_s"), _c(HARDWARE, "hop_latency_s"), _c(HARDWARE, "bucket_bytes")
    over = _c(MEASURED, "collective_overhead")
    n = r.gen_gpus
    gather = bytes_ / _c(GPU, "gather_bytes_per_s")
    star = over * n * bytes_ / bw + hop
    relay = over * (bytes_ / bw + (n - 1) * (bucket / bw + hop))
    d = _c(HARDWARE, "delta_fraction")
    relay_delta = over * (d * bytes_ / bw + (n - 1) * (min(bucket, d * bytes_) / bw + hop))
    return {"bytes": bytes_, "gather_s": gather, "copy_limit_s": bytes_ / _c(GPU, "pinned_copy_bytes_per_s"),
            "star_s": gather + star, "relay_s": gather + relay, "star_delta_s": gather + star * d,
            "relay_delta_s": gather + relay_delta, "star_bytes_out_of_rank0": n * bytes_}


def buffer(m: Model, r: Run, step_s: float) -> dict[str, float]:
    tokens_per_group = r.group_size * (r.prompt_tokens + r.response_mean)
    per_shard_groups = _c(MEASURED, "shard_ingest_groups_per_s") * (8 * 256) / tokens_per_group  # scaled by bytes
    need = r.batch_questions / step_s / r.shards
    stored = r.questions * r.group_size * (r.prompt_tokens + r.response_mean) * _c(MEASURED, "shard_bytes_per_token")
    full = stored / r.shards / _c(MEASURED, "snapshot_bytes_per_s")
    return {"ingest_need_groups_per_s_per_shard": need, "ingest_capacity_groups_per_s_per_shard": per_shard_groups,
            "stored_bytes": stored, "stored_bytes_per_shard": stored / r.shards, "snapshot_full_s": full,
            "snapshot_incremental_s": full * _c(MEASURED, "snapshot_incremental_ratio"),
            "restore_s": stored / r.shards / 2**30 * _c(MEASURED, "restore_s_per_gib")}


def calls(r: Run, step_s: float) -> dict[str, float]:
    """Idle generators ask every shard each idle_sleep_s and the weight store each weight_poll_s; busy ones lease
    and submit per lease; the driver makes a handful of calls per step."""
    idle_per_shard = r.gen_gpus / r.idle_sleep_s  # polling: each idle generator asks every shard
    # long-poll: per lease_wait_s, one ask of every shard and one waiting call at one of them
    long_poll_per_shard = r.gen_gpus * (1 + 1 / r.shards) / r.lease_wait_s if r.lease_wait_s else idle_per_shard
    store = r.gen_gpus / r.weight_poll_s  # polling
    # the watcher: one waiting call per generator, answered at each new version or after weight_wait_s
    watched = r.gen_gpus / min(step_s, r.weight_wait_s) if r.weight_wait_s else store
    busy_per_shard = 2 * r.batch_questions * r.leases_per_group / step_s  # a lease and a submit reach every shard
    cap = _c(MEASURED, "actor_calls_per_s")
    return {"idle_calls_per_s_per_shard": idle_per_shard, "long_poll_calls_per_s_per_shard": long_poll_per_shard,
            "weight_store_calls_per_s": store, "weight_store_watch_calls_per_s": watched,
            "busy_calls_per_s_per_shard": busy_per_shard, "actor_capacity_calls_per_s": cap,
            "driver_handover_s": _c(MEASURED, "handover_s")}


def checkpoint(m: Model, r: Run) -> dict[str, float]:
    """Sharded: fp32 master weights + 2 fp32 Adam moments over the learner ranks; HF export: the engine-dtype
    weights, streamed from rank 0."""
    sharded = m.params * 12
    nodes = max(1, r.learn_gpus // int(_c(HARDWARE, "gpus_per_node")))
    rate = min(nodes * _c(HARDWARE, "fs_bytes_per_s_per_node"), _c(HARDWARE, "fs_bytes_per_s_total"))
    export = m.params * m.dtype_bytes
    return {"sharded_bytes": sharded, "sharded_s": sharded / rate, "export_bytes": export,
            "export_s": export / _c(HARDWARE, "fs_bytes_per_s_per_node")}


# ---------------------------------------------------------------------------------------------------- report

def _fmt(v: float, unit: str = "") -> str:
    if unit == "B":
        for u, k in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6)):
            if v >= k:
                return f"{v / k:,.1f} {u}"
        return f"{v:,.0f} B"
    if unit == "s":
        return f"{v * 1000:,.1f} ms" if v < 1 else f"{v:,.1f} s"
    return f"{v:,.0f}" if v >= 100 else f"{v:,.2f}"


def target_table(m: Model, r: Run) -> list[tuple[str, str, str]]:
    g, lr, p = generation(m, r), learner(m, r), publication(m, r)
    # async: generation hides behind learning, or the reverse; the learner's next step waits for the gather
    step = max(g["throughput_s"], lr["step_s"] + p["gather_s"])
    b, c, ck = buffer(m, r, step), calls(r, step), checkpoint(m, r)
    rows = [
        ("generation", "KV cache per token / running sequences per GPU",
         f"{_fmt(g['kv_bytes_per_token'], 'B')} / {g['seqs_per_gpu']:.0f}"),
        ("generation", "decode step / tokens/s per sequence / per GPU",
         f"{_fmt(g['decode_step_s'], 's')} / {g['tokens_per_s_per_seq']:.1f} / {g['tokens_per_s_per_gpu']:,.0f}"),
        ("generation", f"batch tokens ({r.batch_questions} x {r.group_size} x {r.response_mean}) over {r.gen_gpus} GPUs",
         _fmt(g["throughput_s"], "s")),
        ("generation", f"one {r.response_max}-token response (the synchronous step's floor)",
         _fmt(g["longest_response_s"], "s")),
        ("learner", f"FLOPs per step ({lr['tokens'] / 1e6:.1f}M tokens) at MFU {_c(GPU, 'mfu'):.1%} on "
                    f"{r.learn_gpus} GPUs", f"{lr['flops']:.2e} -> {_fmt(lr['step_s'], 's')}"),
        ("learner", f"+ the publication's gather to host it waits behind ({_c(GPU, 'gather_bytes_per_s') / 1e9:.2f} "
                    "GB/s)", _fmt(lr["step_s"] + p["gather_s"], "s")),
        ("step", "async step = max(generation, learner + gather) + hand-over",
         _fmt(step + c["driver_handover_s"], "s")),
        ("step", f"learner versions one {r.response_max}-token response spans (its lag at the end)",
         f"{g['longest_response_s'] / (step + c['driver_handover_s']):.1f}"),
        ("publication", "bytes per version (bf16)", _fmt(p["bytes"], "B")),
        ("publication", f"gather + copy to host on learner rank 0 at {_c(GPU, 'gather_bytes_per_s') / 1e9:.2f} GB/s "
                        f"/ at the pinned-copy limit ({_c(GPU, 'pinned_copy_bytes_per_s') / 1e9:.1f} GB/s)",
         f"{_fmt(p['gather_s'], 's')} / {_fmt(p['copy_limit_s'], 's')}"),
        ("publication", f"star (collective or object store): gather, then {r.gen_gpus} copies out of rank 0's NIC",
         f"{_fmt(p['star_bytes_out_of_rank0'], 'B')} -> {_fmt(p['star_s'], 's')}"),
        ("publication", "relay (gather, then a pipelined chain, one bucket per hop)", _fmt(p["relay_s"], "s")),
        ("publication", f"delta ({_c(HARDWARE, 'delta_fraction'):.0%} of the bytes, after the whole gather): "
                        "star / relay",         f"{_fmt(p['star_delta_s'], 's')} / {_fmt(p['relay_delta_s'], 's')}"),
        ("buffer", "ingest needed / capacity per shard (groups/s)",
         f"{b['ingest_need_groups_per_s_per_shard']:.1f} / {b['ingest_capacity_groups_per_s_per_shard']:,.0f}"),
        ("buffer", f"stored ({r.questions:,} questions x {r.group_size}), per shard",
         f"{_fmt(b['stored_bytes'], 'B')}, {_fmt(b['stored_bytes_per_shard'], 'B')}"),
        ("buffer", "snapshot full / incremental (1% changed) / restore, per shard",
         f"{_fmt(b['snapshot_full_s'], 's')} / {_fmt(b['snapshot_incremental_s'], 's')} / {_fmt(b['restore_s'], 's')}"),
        ("calls", f"idle generators -> each shard, polling (every {r.idle_sleep_s}s, every shard asked)",
         f"{c['idle_calls_per_s_per_shard']:,.0f}/s vs ~{c['actor_capacity_calls_per_s']:,.0f}/s per actor"),
        ("calls", f"idle generators -> each shard, long-poll lease (lease_wait_s {r.lease_wait_s:g}, the default)",
         f"{c['long_poll_calls_per_s_per_shard']:,.0f}/s"),
        ("calls", f"weight store: polls (every {r.weight_poll_s}s) / watcher (weight_wait_s {r.weight_wait_s:g}, "
                  "the default)", f"{c['weight_store_calls_per_s']:,.0f}/s / {c['weight_store_watch_calls_per_s']:,.0f}/s"),
        ("calls", "busy: lease + submit per shard", f"{c['busy_calls_per_s_per_shard']:.1f}/s"),
        ("checkpoint", "sharded (fp32 master + Adam) / HF export (bf16)",
         f"{_fmt(ck['sharded_bytes'], 'B')} in {_fmt(ck['sharded_s'], 's')} / "
         f"{_fmt(ck['export_bytes'], 'B')} in {_fmt(ck['export_s'], 's')}"),
    ]
    return rows


def sweep_table(m: Model, base: Run, ns: list[int]) -> list[list[str]]:
    out = []
    for n in ns:
        r = Run(**{**base.__dict__, "gen_gpus": n, "learn_gpus": n})
        g, lr, p = generation(m, r), learner(m, r), publication(m, r)
        step = max(g["throughput_s"], lr["step_s"] + p["gather_s"])
        c = calls(r, step)
        out.append([str(n), _fmt(g["throughput_s"], "s"), _fmt(lr["step_s"], "s"), _fmt(p["star_s"], "s"),
                    f"{p['star_s'] / step:.2f}", _fmt(p["gather_s"], "s"), _fmt(p["relay_s"], "s"),
                    _fmt(p["relay_delta_s"], "s"),
                    f"{c['idle_calls_per_s_per_shard']:,.0f} / {c['long_poll_calls_per_s_per_shard']:,.0f}",
                    f"{c['weight_store_calls_per_s']:,.0f} / {c['weight_store_watch_calls_per_s']:,.0f}"])
    return out


def measure() -> None:
    """Ray call round trip and one actor's call rate on this machine (a local Ray of its own)."""
    import tempfile

    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
             _temp_dir=tempfile.mkdtemp(prefix="exgrpo-ray-", dir="/tmp"))

    @ray.remote(num_cpus=0)
    class Echo:
        def ping(self, x=None):
            return x

    a = Echo.remote()
    ray.get(a.ping.remote())
    t0, n = time.perf_counter(), 500
    for _ in range(n):
        ray.get(a.ping.remote())
    rtt = (time.perf_counter() - t0) / n
    t0, n = time.perf_counter(), 5000
    ray.get([a.ping.remote() for _ in range(n)])
    rate = n / (time.perf_counter() - t0)
    ray.shutdown()
    MEASURED["ray_call_s"] = (rtt,) + MEASURED["ray_call_s"][1:]
    MEASURED["actor_calls_per_s"] = (rate,) + MEASURED["actor_calls_per_s"][1:]
    print(f"measured here: call round trip {rtt * 1000:.2f} ms, one actor answers {rate:,.0f} calls/s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpus", type=int, nargs="*", default=[8, 16, 32, 64, 128, 256],
                    help="N for the sweep (generator GPUs = learner GPUs = N)")
    ap.add_argument("--measure", action="store_true", help="re-measure the Ray call constants on this machine")
    ap.add_argument("--gpu-json", metavar="PATH",
                    help="take the GPU constants (MFU per size, gather GB/s, pinned-copy GB/s) from the JSON of "
                         "bench/gpu_bench.py --out")
    ap.add_argument("--set", nargs="*", default=[], metavar="NAME=VALUE",
                    help="override a HARDWARE, GPU or MEASURED constant, or a Run field (e.g. response_mean=2048)")
    args = ap.parse_args()
    run = Run()
    m = Model()
    if args.gpu_json:
        load_gpu_json(args.gpu_json, m.params)
    for kv in args.set:
        k, _, v = kv.partition("=")
        if k in HARDWARE:
            HARDWARE[k] = (float(v),) + HARDWARE[k][1:]
        elif k in GPU:
            GPU[k] = (float(v),) + GPU[k][1:3] + ("assumed: --set",)
        elif k in MEASURED:
            MEASURED[k] = (float(v),) + MEASURED[k][1:]
        elif hasattr(run, k):
            setattr(run, k, type(getattr(run, k))(float(v)))
        else:
            sys.exit(f"--set {k}: not a constant or Run field; known: {sorted(HARDWARE) + sorted(GPU) + sorted(MEASURED)}")
    if args.measure:
        measure()
    print("$ python bench/scale_model.py " + " ".join(shlex.quote(a) for a in sys.argv[1:]))
    print(f"\ntarget: {m.params / 1e9:.1f}B params, {run.gen_gpus} generator GPUs, {run.learn_gpus} learner GPUs, "
          f"B = {run.batch_questions} x {run.group_size}, responses mean {run.response_mean} / max {run.response_max} "
          f"tokens, {run.shards} buffer shards\n")
    print("| term | what | value |\n|---|---|---|")
    for row in target_table(m, run):
        print("| " + " | ".join(row) + " |")
    print("\nsweep: N generator GPUs = N learner GPUs; publication per version; `star/step` >= 1: publishing a "
          "version takes longer than a step\n")
    print("| N | generation s | learner s | publish star | star/step | of which gather | relay | relay+delta | "
          "idle calls/s per shard: poll / long-poll | weight-store calls/s: poll / watcher |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for row in sweep_table(m, run, args.gpus):
        print("| " + " | ".join(row) + " |")
    print("\nconstants (MEASURED on the 2-CPU development machine; GPU measured or assumed as each says; "
          "HARDWARE assumed):")
    for name, (v, unit, what, cmd) in MEASURED.items():
        print(f"- {name} = {v:.4g} {unit}: {what} [{cmd}]")
    for size, (v, n, step, src) in MFU_MEASURED.items():
        print(f"- mfu_{size} = {v:.3g} x: learner MFU at {size} ({n / 1e9:.2f}B parameters; {step}) [{src}]")
    for name, (v, unit, what, src) in GPU.items():
        print(f"- {name} = {v:.4g} {unit}: {what} [{src}]")
    for name, (v, unit, what) in HARDWARE.items():
        print(f"- {name} = {v:.4g} {unit}: {what}")


if __name__ == "__main__":
    main()
