"""Learner benchmark: training tokens/s for 1 and 2 FSDP ranks, and weight publication against its floor.

    python bench/learner_bench.py [--steps 4] [--groups 16] [--group-size 8]

Models: the built-in size (hidden 96, 3 layers, 3 heads) and a ~10M-parameter Llama (hidden 320,
8 layers, 5 heads), both untrained (speed does not depend on the weights). Tokens/s counts the
response tokens trained on per second of `LearnerPool.step` wall time (driver side, median of
--steps steps after one warm-up). Publication: `LearnerPool.publish()` (all-rank gather + ray.put
on rank 0 + hand-over to the weight store) followed by a generator-side `fetch`, against the floor
of a plain `ray.put` + `ray.get` of the same state dict in the same process and run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODELS = {"built-in (h96 L3)": dict(hidden_size=96, num_layers=3, num_heads=3),
          "~10M (h320 L8)": dict(hidden_size=320, num_layers=8, num_heads=5)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--groups", type=int, default=16)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    os.environ.setdefault("OMP_NUM_THREADS", "1")

    import ray
    import torch

    from common.config import LearnerConfig
    from common.modeling import make_tiny_model_folder
    from learner.pool import LearnerPool
    from learner.shape import TrainShape
    from learner.weights import ObjectStoreWeightSource
    from bench.batches import make_batch

    tmp = Path(tempfile.mkdtemp(prefix="learner-bench-"))
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False, namespace="bench",
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
    rows = []
    for name, size in MODELS.items():
        path = make_tiny_model_folder(tmp / name.split()[0], **size)
        batches = [make_batch(s, groups=args.groups, group_size=args.group_size, prompt_len=(16, 32),
                              response_len=(8, 24)) for s in range(args.steps + 1)]
        for ranks in args.ranks:
            cfg = LearnerConfig(num_ranks=ranks, batching=dict(micro_batch_rows=32, mini_batches=2),
                                optim=dict(lr=1e-5))
            run = f"bench-{len(rows)}"
            pool = LearnerPool(cfg, str(path), TrainShape(max_new_tokens=24), run=run, namespace="bench")
            source = ObjectStoreWeightSource(run, "bench")
            try:
                times, tokens = [], 0.0
                pub, floor = [], []
                for i, batch in enumerate(batches):
                    t0 = time.perf_counter()
                    res = pool.step(batch)
                    dt = time.perf_counter() - t0
                    if i:  # first step is warm-up
                        times.append(dt)
                        tokens = res.metrics["learner/tokens"]
                    t0 = time.perf_counter()
                    ann = pool.publish()
                    sd = source.fetch(ann)
                    t_pub = time.perf_counter() - t0
                    t0 = time.perf_counter()
                    ref = ray.put(sd)
                    ray.get(ref)
                    t_floor = time.perf_counter() - t0
                    del ref
                    if i:
                        pub.append(t_pub)
                        floor.append(t_floor)
                n_params = sum(v.numel() for v in sd.values())
                step_s = statistics.median(times)
                p, f = statistics.median(pub), statistics.median(floor)
                rows.append((name, n_params, ranks, tokens, step_s, tokens / step_s, p * 1e3, f * 1e3, p / f))
            finally:
                pool.shutdown()
    ray.shutdown()

    cmd = "python " + " ".join([os.path.relpath(__file__, ROOT)] + sys.argv[1:])
    print(f"\n$ {cmd}    (torch {torch.__version__}, {os.cpu_count()} CPUs, "
          f"batch {args.groups}x{args.group_size} rows, 2 mini-batches, micro-batch 32 rows, float32)\n")
    head = ("model", "params", "ranks", "tokens/step", "step s", "tokens/s", "publish+fetch ms", "put+get ms", "ratio")
    print("| " + " | ".join(head) + " |")
    print("|" + "|".join("---" for _ in head) + "|")
    for name, n, r, tok, s, tps, p, f, ratio in rows:
        print(f"| {name} | {n / 1e6:.2f}M | {r} | {tok:.0f} | {s:.2f} | {tps:,.0f} | {p:.1f} | {f:.1f} "
              f"| {ratio:.2f}x |")


if __name__ == "__main__":
    main()
