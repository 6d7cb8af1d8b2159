"""Real shapes: peak memory and speed of one learner step at real vocabularies and response lengths.

    python bench/shapes_bench.py [--vocab 32000 151936] [--lengths 512 2048 8192] [--tokens 8192]
                                 [--budget 16384] [--old-limit-gib 16]

Model: a tiny Qwen2 (hidden 64, 2 layers, GQA 2/1 heads, tied embeddings, 10,240 positions) with the
vocabulary given, so that the LM head and the lengths dominate as they do for a real model's logits.
Each case runs in its own process (peak RSS = that process's VmHWM): one warm-up step, then one
timed `TrainStep.run` (1 rank, float32, AdamW) over a batch of `--tokens` response tokens (rows of
64 prompt + LENGTH response tokens, groups of 4 with 0/1 rewards).

- old: full [R, L, V] logits (`learner.batching.logits_chunk_tokens=0`) with `micro_batch_rows=1`, its most
  frugal setting. A case whose estimated peak (7 x rows x length x vocabulary x 4 bytes) is above
  `--old-limit-gib` is not run and shows the estimate.
- new: the chunked LM head (default chunk) and `micro_batch_tokens=--budget`.

Columns: peak RSS (GiB) and, in brackets, the step's own memory (peak minus the RSS before the first
step: interpreter, torch, model), tokens/s (response tokens trained per second of the timed step), and
new/old ratios. `--case JSON` runs one case and prints its JSON line (tests use it).

`--publication`: learner rank 0's memory during one publication of a ~105M-parameter Llama (vocabulary
32,000, hidden 640, 12 layers, float32) from 2 FSDP ranks over gloo: the private memory (RssAnon,
sampled every 2 ms) it gains above its resident shard, for the streamed object-store publication (one
object per `bucket_mb` bucket) and for assembling the whole state dict (what every publication did
before, and what the collective backend still does), and for the checkpoint's streamed model export. The ranks
run with glibc's mmap threshold fixed at 128 KiB (MALLOC_MMAP_THRESHOLD_, set before Ray starts them), so every
large buffer is mapped on allocation and unmapped on free and RssAnon counts live buffers; with glibc's default
(a threshold that rises as large buffers are freed), freed heap stays resident and the collective row varies by
+-50 MiB from run to run.

`--loading`: each of 2 FSDP ranks' private memory (RssAnon, sampled every 2 ms) while it loads the same ~105M
float32 model and shards it, the old way (`from_pretrained` on every rank, then `fully_shard`) and the new one
(`learner.loading`: built without weights, sharded, each rank reading only its rows).

`--packing`: the new path padded vs packed without padding (`learner.levers.padding_free=true`, the same budget) on
responses of mixed lengths (uniform in [LENGTH/8, LENGTH], as reasoning responses vary), attention sdpa (on
CPU the packed micro-batch carries a [tokens, tokens] block-diagonal mask; flash-attention's varlen kernel on
GPU needs none). Columns: peak RSS (step), tokens/s, the share of forward tokens that were padding.

`--snapshot`: one buffer shard holding `--trajectories` stored trajectories of `--traj-tokens` tokens (8 per
question, real `ExperienceStore.observe`), snapshotted in full, then again after `--changed` of them changed
(as many new lower-entropy trajectories as that share, each evicting one at the per-question cap, and learner
feedback with replays for as many others), then restored. Time and bytes written of each, and the restore.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROMPT = 64
GIB = 1024 ** 3


def peak_rss() -> int:
    """This process's peak resident bytes (VmHWM). Not ru_maxrss: Linux carries that across exec, so a case spawned
    by a large process (the test suite's, after it loaded engines) would report the parent's peak as its own."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def run_case(case: dict) -> dict:
    """One learner step in this process; the keys of `case`: vocab, length, tokens, path (old|new), budget."""
    sys.path.insert(0, str(ROOT))
    import numpy as np
    import torch

    from common.config import LearnerConfig
    from common.messages import Rollout, TrainGroup, TrainingBatch, float32_array, int32_array
    from common.modeling import TinyQwen2
    from learner.forward import prepare_model
    from learner.shape import TrainShape
    from learner.step import TrainStep

    torch.set_num_threads(int(case.get("threads", 1)))
    vocab, length = int(case["vocab"]), int(case["length"])
    rows = max(1, int(case["tokens"]) // length)
    rng = np.random.default_rng(0)
    lengths = [length] * rows
    if case.get("mixed"):  # as many response tokens in all, in rows of lengths uniform in [length/8, length]
        lengths = []
        while sum(lengths) < int(case["tokens"]):
            lengths.append(int(rng.integers(max(1, length // 8), length + 1)))
        rows = len(lengths)
    if case["path"] == "old":
        cfg = LearnerConfig(batching=dict(logits_chunk_tokens=0, micro_batch_rows=1), optim=dict(lr=1e-5))
    else:
        cfg = LearnerConfig(batching=dict(micro_batch_tokens=int(case["budget"]), micro_batch_rows=100_000),
                            optim=dict(lr=1e-5),
                            levers=dict(activation_checkpointing=bool(case.get("checkpointing", False)),
                                        padding_free=bool(case.get("padding_free", False))))
    model = prepare_model(TinyQwen2(vocab_size=vocab, hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1,
                                    max_positions=max(10_240, PROMPT + length)).build(), cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.optim.lr)
    shape = TrainShape(max_new_tokens=length, max_positions=model.config.max_position_embeddings)
    step = TrainStep(model, opt, cfg, shape, rank=0, device=torch.device("cpu"))

    def batch(version: int) -> TrainingBatch:
        groups = []
        for g in range(-(-rows // 4)):
            n = min(4, rows - 4 * g)
            ros = [Rollout(response_ids=int32_array(rng.integers(3, vocab, lengths[4 * g + i])),
                           logprobs=float32_array(np.full(lengths[4 * g + i], -np.log(vocab))), reward=float(i % 2),
                           correct=bool(i % 2), entropy=1.0, version=version, finish_reason="length", key=f"{g}-{i}")
                   for i in range(n)]
            groups.append(TrainGroup(question_id=f"q{g}", prompt_ids=int32_array(rng.integers(3, vocab, PROMPT)),
                                     rollouts=ros, mixed=False))
        return TrainingBatch(groups=groups, version=version)

    base = peak_rss()
    step.run(batch(0))  # warm-up
    t0 = time.perf_counter()
    stats = step.run(batch(1))
    seconds = time.perf_counter() - t0
    peak = peak_rss()
    tokens = stats.sums["fresh_tokens"]
    return {**case, "rows": rows, "tokens_trained": tokens, "seconds": round(seconds, 2),
            "tokens_per_s": round(tokens / seconds, 1), "peak_rss_gib": round(peak / GIB, 3),
            "base_rss_gib": round(base / GIB, 3), "updates": stats.updates,
            "padding_frac": round(1 - stats.sums["row_tokens"] / stats.sums["forward_tokens"], 4)}


def spawn(case: dict) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": str(case.get("threads", 1))}
    out = subprocess.run([sys.executable, __file__, "--case", json.dumps(case)], capture_output=True, text=True,
                         env=env, cwd=ROOT)
    if out.returncode != 0:
        return {**case, "error": (out.stderr.strip().splitlines() or ["?"])[-1]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def old_estimate_gib(vocab: int, length: int) -> float:
    return 7 * (PROMPT + length) * vocab * 4 / GIB  # one row per micro-batch: ~7 copies of its logits


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, nargs="+", default=[32_000, 151_936])
    ap.add_argument("--lengths", type=int, nargs="+", default=[512, 2048, 8192])
    ap.add_argument("--tokens", type=int, default=8192, help="response tokens per step")
    ap.add_argument("--budget", type=int, default=16_384, help="learner.batching.micro_batch_tokens of the new path")
    ap.add_argument("--old-limit-gib", type=float, default=16.0)
    ap.add_argument("--publication", action="store_true", help="only the publication measurement")
    ap.add_argument("--bucket-mb", type=float, default=32.0)
    ap.add_argument("--snapshot", action="store_true", help="only the buffer snapshot measurement")
    ap.add_argument("--packing", action="store_true", help="only padded vs padding-free micro-batches")
    ap.add_argument("--loading", action="store_true", help="only the learner loading measurement")
    ap.add_argument("--trajectories", type=int, default=1_000_000)
    ap.add_argument("--traj-tokens", type=int, default=1000)
    ap.add_argument("--changed", type=float, default=0.01)
    ap.add_argument("--dir", help="where the snapshot measurement writes (default: a temp folder)")
    ap.add_argument("--case", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.case:
        print(json.dumps(run_case(json.loads(args.case))))
        return
    if args.publication:
        publication(args.bucket_mb)
        return
    if args.loading:
        loading()
        return
    if args.snapshot:
        snapshot(args.trajectories, args.traj_tokens, args.changed, args.dir)
        return
    if args.packing:
        packing(args.vocab, args.lengths, args.tokens, args.budget)
        return
    print("command: python bench/shapes_bench.py " + " ".join(sys.argv[1:]))
    print(f"one TrainStep.run, 1 rank, float32, {args.tokens} response tokens per step, prompts {PROMPT} tokens; "
          f"old = full logits, micro_batch_rows=1; new = chunked head, micro_batch_tokens={args.budget}\n")
    print("| vocab | response | rows | old peak GiB (step) | new peak GiB (step) | new/old step memory | "
          "old tok/s | new tok/s | new/old tok/s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for vocab in args.vocab:
        for length in args.lengths:
            case = {"vocab": vocab, "length": length, "tokens": args.tokens, "budget": args.budget}
            new = spawn({**case, "path": "new"})
            est = old_estimate_gib(vocab, length)
            old = spawn({**case, "path": "old"}) if est <= args.old_limit_gib else {"skipped": est}
            if "error" in new or "error" in old:
                print(f"| {vocab:,} | {length:,} | error: {new.get('error') or old.get('error')} |", flush=True)
                continue
            new_step = new["peak_rss_gib"] - new["base_rss_gib"]
            cells = [f"{vocab:,}", f"{length:,}", str(new["rows"])]
            if "skipped" in old:
                cells += [f"not run (~{est:.0f} GiB estimated)", f"{new['peak_rss_gib']:.2f} ({new_step:.2f})",
                          f"< {new_step / est:.3f}", "—", f"{new['tokens_per_s']:,.0f}", "—"]
            else:
                old_step = old["peak_rss_gib"] - old["base_rss_gib"]
                cells += [f"{old['peak_rss_gib']:.2f} ({old_step:.2f})", f"{new['peak_rss_gib']:.2f} ({new_step:.2f})",
                          f"{new_step / old_step:.3f}", f"{old['tokens_per_s']:,.0f}", f"{new['tokens_per_s']:,.0f}",
                          f"{new['tokens_per_s'] / old['tokens_per_s']:.2f}"]
            print("| " + " | ".join(cells) + " |", flush=True)
    print("\n(step) = peak RSS minus the RSS before the first step (interpreter, torch, model, batch)")


def packing(vocabs: list[int], lengths: list[int], tokens: int, budget: int) -> None:
    print("command: python bench/shapes_bench.py --packing " + " ".join(a for a in sys.argv[1:] if a != "--packing"))
    print(f"one TrainStep.run, 1 rank, float32, sdpa, chunked head, micro_batch_tokens={budget}, about {tokens} "
          f"response tokens per step in rows of mixed lengths (uniform in [max/8, max]), prompts {PROMPT} tokens\n")
    print("| vocab | max response | rows | padded peak GiB (step) | packed peak GiB (step) | padded tok/s | "
          "packed tok/s | packed/padded tok/s | padding share padded | packed |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for vocab in vocabs:
        for length in lengths:
            case = {"vocab": vocab, "length": length, "tokens": tokens, "budget": budget, "path": "new", "mixed": True}
            pad, packed = spawn(case), spawn({**case, "padding_free": True})
            if "error" in pad or "error" in packed:
                print(f"| {vocab:,} | {length:,} | error: {pad.get('error') or packed.get('error')} |", flush=True)
                continue
            step = [r["peak_rss_gib"] - r["base_rss_gib"] for r in (pad, packed)]
            print(f"| {vocab:,} | {length:,} | {pad['rows']} | {pad['peak_rss_gib']:.2f} ({step[0]:.2f}) | "
                  f"{packed['peak_rss_gib']:.2f} ({step[1]:.2f}) | {pad['tokens_per_s']:,.0f} | "
                  f"{packed['tokens_per_s']:,.0f} | {packed['tokens_per_s'] / pad['tokens_per_s']:.2f} | "
                  f"{pad['padding_frac']:.1%} | {packed['padding_frac']:.1%} |", flush=True)
    print("\n(step) = peak RSS minus the RSS before the first step; padding share = padding tokens / forward tokens")


def _probe(rank, version: int, streamed: bool, export: str | None = None) -> dict:
    """Runs inside learner rank 0 (`__ray_call__`): its RssAnon before and at peak during the publication."""
    import threading

    def anon() -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssAnon:"))

    shard = sum(t.to_local().numel() * t.element_size() if hasattr(t, "to_local") else t.numel() * t.element_size()
                for t in rank.model.state_dict().values())
    base = anon()
    peak, stop = [base], threading.Event()

    def watch() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], anon())
            time.sleep(0.002)

    t = threading.Thread(target=watch)
    t.start()
    try:
        if export:
            rank.export_model(export)
        elif streamed:
            rank.publish(version)
        else:
            held = rank.full_state_dict(rank.publish_dtype)
            peak[0] = max(peak[0], anon())
            del held
    finally:
        stop.set()
        t.join()
    return {"base": base, "peak": peak[0], "shard": shard}


def publication(bucket_mb: float) -> None:
    sys.path.insert(0, str(ROOT))
    import tempfile

    import ray

    from common.config import CollectiveSyncConfig, LearnerConfig, ObjectStoreSyncConfig
    from common.modeling import TinyLlama, build_char_tokenizer, save_model_folder
    from learner.pool import LearnerPool
    from learner.shape import TrainShape

    mb = 1 << 20
    with tempfile.TemporaryDirectory() as tmp:
        model = TinyLlama(vocab_size=32_000, hidden_size=640, num_layers=12, num_heads=10).build()
        params = sum(p.numel() for p in model.parameters())
        largest = max(p.numel() * 4 for p in model.parameters())
        save_model_folder(model, build_char_tokenizer(), Path(tmp) / "m")
        del model
        os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(128 << 10))  # inherited by the ranks (see above)
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
                 _temp_dir=str(Path(tmp) / "ray"))
        try:
            cfg = LearnerConfig(num_ranks=2, weight_sync=ObjectStoreSyncConfig(bucket_mb=bucket_mb))
            pool = LearnerPool(cfg, str(Path(tmp) / "m"), TrainShape(max_new_tokens=8), run="pub", namespace="bench")
            rows = []
            for version, streamed in ((1, True), (2, False), (3, True)):
                others = [r.publish.remote(version) if streamed else r.full_state_dict.remote(None)
                          for r in pool.ranks[1:]]
                res = ray.get(pool.ranks[0].__ray_call__.remote(_probe, version, streamed))
                ray.get(others)
                rows.append(("streamed, an object per bucket" if streamed else "whole state dict (before)", res))
            out = str(Path(tmp) / "export")
            others = [r.export_model.remote(out) for r in pool.ranks[1:]]
            rows.append(("checkpoint's model folder (streamed into model.safetensors)",
                         ray.get(pool.ranks[0].__ray_call__.remote(_probe, 4, True, out))))
            ray.get(others)
            pool.shutdown()
            # the collective backend keeps the packed version for its channels: the gather is packed as it comes
            cfg = LearnerConfig(num_ranks=2, weight_sync=CollectiveSyncConfig(bucket_mb=bucket_mb, keep_versions=1))
            pool = LearnerPool(cfg, str(Path(tmp) / "m"), TrainShape(max_new_tokens=8), run="pubc", namespace="bench")
            others = [r.publish.remote(1) for r in pool.ranks[1:]]  # the first version: nothing older is kept
            rows.append(("collective: packed as gathered, then kept for the channels",
                         ray.get(pool.ranks[0].__ray_call__.remote(_probe, 1, True))))
            ray.get(others)
            pool.shutdown()
        finally:
            ray.shutdown()
    full = params * 4
    bucket = max(bucket_mb, largest / mb)  # a tensor larger than bucket_mb is an object of its own
    print(f"command: python bench/shapes_bench.py --publication --bucket-mb {bucket_mb:g}  "
          f"(MALLOC_MMAP_THRESHOLD_={os.environ['MALLOC_MMAP_THRESHOLD_']})")
    print(f"rank 0 of 2 FSDP ranks, {params / 1e6:.0f}M parameters, float32 ({full / mb:.0f} MiB); buckets of "
          f"{bucket_mb:g} MiB, the largest tensor {largest / mb:.0f} MiB\n")
    print("| publication | rank 0 shard MiB | rank 0 private memory above the shard, peak MiB | in buckets |")
    print("|---|---|---|---|")
    for name, r in rows[1:]:  # the first streamed run warms up the object store connection
        extra = (r["peak"] - r["base"]) / mb
        print(f"| {name} | {r['shard'] / mb:.0f} | {extra:.0f} | {extra / bucket:.1f} |")


def snapshot(trajectories: int, tokens: int, changed: float, folder: str | None) -> None:
    sys.path.insert(0, str(ROOT))
    import random
    import shutil
    import tempfile

    import numpy as np

    from buffer.core import ShardCore
    from buffer.keys import make_key
    from buffer.snapshot import load_core, save_core, snapshot_path
    from buffer.records import record_digest
    from common.config import BufferConfig
    from common.messages import Question, Rollout, int32_array

    per_q = 8
    n_q = trajectories // per_q
    questions = [Question(id=f"q{i}", prompt="p", answer="0", prompt_ids=int32_array([1, 2])) for i in range(n_q)]
    cfg = BufferConfig(group_size=16, batch_questions=4, max_traj_per_question=per_q, max_traj_total=trajectories,
                       seed=0)
    core = ShardCore(cfg, questions)
    rng = np.random.default_rng(0)
    lp = np.full(tokens, -0.5, dtype=np.float32)

    def rollouts(n: int, entropy: float) -> list[Rollout]:
        ids = rng.integers(0, 150_000, size=(n, tokens), dtype=np.int32)
        return [Rollout(response_ids=ids[j], logprobs=lp, reward=1.0, correct=True, entropy=entropy + 0.01 * j,
                        version=0, finish_reason="stop") for j in range(n)]

    t0 = time.perf_counter()
    for q in questions:
        core.store.observe(q.id, per_q, rollouts(per_q, 1.0), collect=True)
    build_s = time.perf_counter() - t0
    tmp = tempfile.mkdtemp(dir=folder, prefix="snapshot-bench-")
    rows = []

    def timed_save(name: str, core: ShardCore) -> None:
        before = {p: p.stat().st_ino for p in Path(tmp).iterdir()}
        t = time.perf_counter()
        save_core(core, tmp)
        dt = time.perf_counter() - t
        written = sum(p.stat().st_size for p in Path(tmp).iterdir() if before.get(p) != p.stat().st_ino)
        rows.append((name, dt, written))

    try:
        timed_save("first (everything)", core)
        n = int(trajectories * changed)
        pick = random.Random(0).sample(range(n_q), min(n_q, 2 * n))
        for q in pick[:n]:  # a new trajectory, lower entropy than the stored ones: it evicts one at the cap
            core.store.observe(f"q{q}", per_q, rollouts(1, 0.5), collect=True)
        keys = [make_key(f"q{q}", record_digest(core.store.entries[f"q{q}"].recs[0])) for q in pick[n:]]
        core.store.feedback(keys, [0.3] * len(keys), version=1, chosen=keys)
        timed_save(f"after {changed:.0%} changed", core)
        total, stored = core.store.total, core.store.bytes
        del core  # the restore builds a second store of the same size
        t = time.perf_counter()
        back = load_core(cfg, questions, snapshot_path(tmp, 0))
        load_s = time.perf_counter() - t
        assert back.store.total == total and back.store.bytes == stored
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    full = rows[0]
    print(f"command: python bench/shapes_bench.py --snapshot --trajectories {trajectories} --traj-tokens {tokens} "
          f"--changed {changed:g}")
    print(f"one buffer shard, {trajectories:,} stored trajectories of {tokens:,} tokens ({stored / GIB:.2f} GiB "
          f"of records; built in {build_s:.0f}s); changed: {n:,} new trajectories (each evicting one) and learner "
          f"feedback + a replay for {len(keys):,} others\n")
    print("| snapshot | seconds | bytes written | vs first: time | vs first: bytes |")
    print("|---|---|---|---|---|")
    for name, dt, written in rows:
        print(f"| {name} | {dt:.2f} | {written / 2**20:,.0f} MiB | {dt / full[1]:.3f} | {written / full[2]:.3f} |")
    print(f"| restore (read + verify + rebuild) | {load_s:.2f} | — | — | — |")
    print(f"\npeak RSS of this process: {peak_rss() / GIB:.1f} GiB")


def _load_rank(rank: int, folder: str, port: int, sharded_load: bool, out: str) -> None:
    """One of 2 gloo ranks: its peak private memory above its start while it loads and shards the model."""
    import threading

    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM

    from learner.loading import build_empty, load_shards, materialize

    def status(key: str) -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))

    def anon() -> int:
        return status("RssAnon")

    store = torch.distributed.TCPStore("127.0.0.1", port, is_master=False)
    torch.distributed.init_process_group("gloo", store=store, rank=rank, world_size=2)
    mesh = init_device_mesh("cpu", (2,))
    base, peak, stop = anon(), [0], threading.Event()
    rss0 = status("VmRSS")

    def watch() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], anon())
            time.sleep(0.002)

    t = threading.Thread(target=watch)
    t.start()
    model = build_empty(folder) if sharded_load else AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if sharded_load:
        materialize(model, torch.device("cpu"))
        load_shards(model, folder, rank, 2)
    import gc

    gc.collect()
    stop.set()
    t.join()
    shard = sum(p.to_local().numel() * 4 for p in model.parameters())
    Path(out).write_text(json.dumps({"base": base, "peak": max(peak[0], anon()), "shard": shard,
                                     "rss_peak": status("VmHWM") - rss0}))
    torch.distributed.destroy_process_group()


def loading() -> None:
    sys.path.insert(0, str(ROOT))
    import tempfile

    import torch.multiprocessing as mp

    from common.modeling import TinyLlama, build_char_tokenizer, save_model_folder
    from learner.collective import listening_store

    mb = 1 << 20
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model = TinyLlama(vocab_size=32_000, hidden_size=640, num_layers=12, num_heads=10).build()
        params = sum(p.numel() for p in model.parameters())
        folder = str(save_model_folder(model, build_char_tokenizer(), Path(tmp) / "m"))
        del model
        for sharded_load in (False, True):
            store = listening_store("127.0.0.1", 0, 300)  # the OS picks the port; held while the ranks run
            port = store.port
            outs = [str(Path(tmp) / f"r{r}-{int(sharded_load)}.json") for r in range(2)]
            ctx = mp.get_context("spawn")
            procs = [ctx.Process(target=_load_rank, args=(r, folder, port, sharded_load, outs[r])) for r in range(2)]
            for p in procs:
                p.start()
            for p in procs:
                p.join()
            rows.append((sharded_load, [json.loads(Path(o).read_text()) for o in outs]))
    print("command: python bench/shapes_bench.py --loading")
    print(f"2 FSDP ranks (gloo), a {params / 1e6:.0f}M-parameter Llama, float32 ({params * 4 / mb:.0f} MiB)\n")
    print("| loading | rank | shard MiB | peak private memory above the start, MiB | peak resident above the "
          "start (mapped weight file included), MiB | resident in shards |")
    print("|---|---|---|---|---|---|")
    for sharded_load, res in rows:
        name = "sharded (learner.loading)" if sharded_load else "whole model per rank (before)"
        for r, x in enumerate(res):
            extra, rss, shard = (x["peak"] - x["base"]) / mb, x["rss_peak"] / mb, x["shard"] / mb
            print(f"| {name} | {r} | {shard:.0f} | {extra:.0f} | {rss:.0f} | {rss / shard:.2f} |")


if __name__ == "__main__":
    main()
