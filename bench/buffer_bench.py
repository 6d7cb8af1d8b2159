"""Buffer benchmark: ingest rate vs the msgpack floor, replay sampling latency, memory per trajectory.

    python bench/buffer_bench.py [--tokens 256] [--groups 4096] [--sizes 10000,100000,1000000] [--no-ray]

Prints one table (and the command that produced it). Goals (issue 3): ingest >= 50% of the floor,
p99 sampling < 1 ms at 1M stored trajectories, memory <= 1.5x the raw payload.
- floor: `codec.encode_list` + `codec.decode_list` of the same ScoredGroup batches, in the same run.
- core ingest: decode + `ShardCore.submit` (what the actor does, without Ray).
- actor ingest: `BufferClient.submit` to one shard actor (encode, one Ray call per batch, decode, submit).
- sampling: `ExperienceStore.sample(ceil(rho*B))` for B = 128, rho = 0.5 (bucket draw + the candidates
  shipped to the learner), p50/p99 over many requests; wall clock and the thread's CPU time (the latter is immune
  to other processes preempting this one on a shared machine).
- memory: tracemalloc growth of the store per trajectory vs `len(codec.encode(rollout))`.
"""

from __future__ import annotations

import argparse
import gc
import math
import random
import shlex
import sys
import time
import tracemalloc
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from buffer.core import ShardCore  # noqa: E402
from buffer.sampling import GaussianBuckets, LowestEntropy  # noqa: E402
from buffer.store import ExperienceStore  # noqa: E402
from common import codec  # noqa: E402
from common.config import BufferConfig  # noqa: E402
from common.messages import Question, Rollout, ScoredGroup, int32_array  # noqa: E402

K = 8
CHUNK = 64  # groups per submit call


def questions(n: int) -> list[Question]:
    return [Question(f"q{i}", f"prompt {i}", str(i), int32_array(np.arange(64) + i)) for i in range(n)]


def rollout(rng: np.random.Generator, t: int, correct: bool) -> Rollout:
    return Rollout(response_ids=rng.integers(0, 32000, t, dtype=np.int32),
                   logprobs=-rng.random(t, dtype=np.float32), reward=1.0 if correct else 0.0, correct=correct,
                   entropy=float(rng.random()), version=0, finish_reason="stop")


def groups_for(items, t: int, seed: int) -> list[ScoredGroup]:
    rng = np.random.default_rng(seed)
    out = []
    for it in items:
        k = int(rng.integers(1, it.num_samples))  # 1..K-1 correct: every group stores experience
        out.append(ScoredGroup(it.lease_id, it.question.id,
                               [rollout(rng, t, j < k) for j in range(it.num_samples)], "bench"))
    return out


def bench_cfg(n_groups: int) -> BufferConfig:
    return BufferConfig(group_size=K, batch_questions=n_groups, max_lag=0, collect_before_mixed=True,
                        lease_timeout_s=3600, max_traj_total=10_000_000, call_timeout_s=120)


def rate(n: int, seconds: float) -> float:
    return n / seconds if seconds > 0 else float("inf")


def ingest(args) -> list[tuple[str, str]]:
    cfg = bench_cfg(args.groups)
    qs = questions(args.groups)
    core = ShardCore(cfg, qs, batch_share=args.groups)
    items = core.lease("bench", args.groups)
    groups = groups_for(items, args.tokens, 0)
    chunks = [groups[i : i + CHUNK] for i in range(0, len(groups), CHUNK)]

    t0 = time.perf_counter()
    payloads = [codec.encode_list(c, ScoredGroup) for c in chunks]
    for p in payloads:
        codec.decode_list(p, ScoredGroup)
    floor = rate(len(groups), time.perf_counter() - t0)

    t0 = time.perf_counter()
    for p in payloads:
        core.submit(codec.decode_list(p, ScoredGroup))
    core_rate = rate(len(groups), time.perf_counter() - t0)
    assert core.n["accepted"] + core.n["zero_signal"] == len(groups)

    rows = [("msgpack encode+decode floor (groups/s)", f"{floor:,.0f}"),
            ("pure core ingest, decode+submit (groups/s)", f"{core_rate:,.0f}  ({core_rate / floor:.0%} of floor)")]
    if not args.no_ray:
        rows.append(ray_ingest(args, cfg, qs, floor))
    return rows


def ray_ingest(args, cfg, qs, floor) -> tuple[str, str]:
    import ray

    from buffer.client import BufferClient

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        client = BufferClient.create(cfg.model_copy(update={"num_shards": 1}), qs, run="bench", namespace=None,
                                     snapshot_dir=None)
        items = []
        while len(items) < args.groups:
            items += client.lease("bench", args.groups - len(items))
        groups = groups_for(items, args.tokens, 1)
        chunks = [groups[i : i + CHUNK] for i in range(0, len(groups), CHUNK)]
        client.submit(chunks[0])  # warm-up call
        t0 = time.perf_counter()
        for c in chunks[1:]:
            client.submit(c)
        n = sum(len(c) for c in chunks[1:])
        r = rate(n, time.perf_counter() - t0)
        acc = client.accounting()
        assert acc["balance"] == 0, acc
        client.shutdown()
    finally:
        ray.shutdown()
    return ("Ray shard actor ingest, client.submit (groups/s)", f"{r:,.0f}  ({r / floor:.0%} of floor)")


def fill_store(n_traj: int, t: int, per_question: int = 4) -> ExperienceStore:
    store = ExperienceStore(K, GaussianBuckets(K), LowestEntropy(), max_per_question=8, max_total=n_traj + 1)
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 32000, (per_question, t), dtype=np.int32)
    lps = -rng.random((per_question, t), dtype=np.float32)
    qn = 0
    while store.total < n_traj:
        m = min(per_question, n_traj - store.total)
        rs = []
        for j in range(m):
            resp = ids[j].copy()
            resp[0] = qn  # distinct responses
            rs.append(Rollout(resp, lps[j], 1.0, True, float(rng.random()), 0, "stop"))
        store.observe(f"q{qn}", 1 + qn % (K - 1), rs, collect=True)
        qn += 1
    return store


def sampling(sizes: list[int], reps: int) -> list[tuple[str, str]]:
    n_mixed = math.ceil(0.5 * 128)
    rows = []
    rng = random.Random(0)
    for size in sizes:
        t0 = time.perf_counter()
        store = fill_store(size, 32)
        fill_s = time.perf_counter() - t0
        lat, cpu = [], []
        for _ in range(reps):
            t1, c1 = time.perf_counter_ns(), time.thread_time_ns()
            picks = store.sample(n_mixed, rng)
            cpu.append(time.thread_time_ns() - c1)
            lat.append(time.perf_counter_ns() - t1)
            assert len(picks) == n_mixed
        lat_ms, cpu_ms = np.array(lat) / 1e6, np.array(cpu) / 1e6
        rows.append((f"sample {n_mixed} replay questions @ {size:,} stored, wall p50 / p99 ms",
                     f"{np.percentile(lat_ms, 50):.3f} / {np.percentile(lat_ms, 99):.3f}  "
                     f"(thread CPU p50 / p99 {np.percentile(cpu_ms, 50):.3f} / {np.percentile(cpu_ms, 99):.3f}; "
                     f"fill {fill_s:.1f}s)"))
        del store
        gc.collect()
    return rows


def memory(tokens_list: list[int], n: int) -> list[tuple[str, str]]:
    rows = []
    for t in tokens_list:
        rng = np.random.default_rng(1)
        sample = rollout(rng, t, True)
        payload = len(codec.encode(sample))
        gc.collect()
        tracemalloc.start()
        base = tracemalloc.get_traced_memory()[0]
        store = fill_store(n, t)
        gc.collect()
        used = tracemalloc.get_traced_memory()[0] - base
        tracemalloc.stop()
        per = used / store.total
        rows.append((f"memory per stored trajectory, {t} tokens (bytes)",
                     f"{per:,.0f} vs payload {payload:,}  ({per / payload:.2f}x)"))
        del store
        gc.collect()
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=256, help="response tokens per rollout for ingest")
    p.add_argument("--groups", type=int, default=4096, help="groups ingested per measurement")
    p.add_argument("--sizes", default="10000,100000,1000000", help="stored trajectories for sampling latency")
    p.add_argument("--reps", type=int, default=2000, help="sampling requests per size")
    p.add_argument("--memory-tokens", default="32,256", help="response lengths for the memory rows")
    p.add_argument("--memory-n", type=int, default=50_000, help="trajectories stored for the memory rows")
    p.add_argument("--no-ray", action="store_true", help="skip the Ray actor row")
    args = p.parse_args()

    rows = [("K, tokens/rollout, groups, chunk", f"{K}, {args.tokens}, {args.groups}, {CHUNK}")]
    rows += ingest(args)
    rows += sampling([int(s) for s in args.sizes.split(",")], args.reps)
    rows += memory([int(t) for t in args.memory_tokens.split(",")], args.memory_n)
    load = Path("/proc/loadavg").read_text().split()[:3] if Path("/proc/loadavg").exists() else ["?"]
    rows.append(("machine load average (1/5/15 min) at the end", " ".join(load)))
    print("$ " + " ".join(shlex.quote(a) for a in [sys.executable.rsplit("/", 1)[-1], *sys.argv]))
    w = max(len(r[0]) for r in rows)
    print(f"| {'measure'.ljust(w)} | value |")
    print(f"|{'-' * (w + 2)}|-------|")
    for name, value in rows:
        print(f"| {name.ljust(w)} | {value} |")


if __name__ == "__main__":
    main()
