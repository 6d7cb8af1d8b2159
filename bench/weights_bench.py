"""Weight-sync benchmark: publish + load latency, object store vs collective (gloo), 1 and 2 learner ranks.

    python bench/weights_bench.py [--repeats 4] [--ranks 1 2] [--dtype bfloat16]

Models: the built-in size (hidden 96, 3 layers, 3 heads) and a ~10M-parameter Llama (hidden 320,
8 layers, 5 heads), untrained. One measurement: `LearnerPool.publish()` (bucketed gather on the ranks,
hand-over on rank 0) then, in a separate generator-like actor, `latest` + `fetch` + `load_state_dict`
into a transformers model + `ack`; wall time on the driver. The floor, measured in the same run with
the same state dict and the same actor: the driver `ray.put`s it and the actor `ray.get`s it and loads
it (the cheapest way to move a state dict into another process and load it). Median of --repeats after
one warm-up; a learner step runs between publications (untimed) so each publishes a new version.
`--dtype bfloat16`: the learner computes and publishes in bfloat16 (as a GPU run with model.dtype=bfloat16
does: half the bytes gathered and moved); the floor still moves the float32 master weights, the old path.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from learner_bench import MODELS  # the same two model sizes as the learner benchmark (bench/ is on sys.path)

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--delta", action="store_true",
                    help="instead: delta publications vs whole ones, bf16, over real learner steps at lr 1e-6 and 1e-4")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                    help="model.dtype of the learner = the dtype publications carry")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    os.environ.setdefault("OMP_NUM_THREADS", "1")

    import ray
    import torch

    from common.config import CollectiveSyncConfig, LearnerConfig, ObjectStoreSyncConfig
    from common.modeling import make_tiny_model_folder
    from learner.pool import LearnerPool
    from learner.shape import TrainShape
    from learner.weights import make_weight_source
    from bench.batches import make_batch

    @ray.remote(num_cpus=0)
    class Gen:
        """What a generator does with new weights, without generating."""

        def __init__(self, source, model_path: str):
            from transformers import AutoModelForCausalLM

            self.source = source
            self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
            source.register("bench-gen")

        def pull(self) -> int:
            ann = self.source.latest()
            self.model.load_state_dict(self.source.fetch(ann))
            self.source.ack("bench-gen", ann.version)
            return ann.version

        def load_ref(self, refs: list) -> None:
            self.model.load_state_dict(ray.get(refs[0]))

    tmp = Path(tempfile.mkdtemp(prefix="weights-bench-"))
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False, namespace="bench",
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
    backends = {"object_store": ObjectStoreSyncConfig(), "collective (gloo)": CollectiveSyncConfig()}
    if args.delta:
        return delta_table(args, tmp, Gen)
    rows = []
    for name, size in MODELS.items():
        path = make_tiny_model_folder(tmp / name.split()[0], **size)
        for ranks in args.ranks:
            for bname, sync in backends.items():
                cfg = LearnerConfig(num_ranks=ranks, weight_sync=sync,
                                    batching=dict(micro_batch_rows=8, mini_batches=1), optim=dict(lr=1e-5))
                run = f"wbench-{len(rows)}"
                shape = TrainShape(max_new_tokens=12, dtype=args.dtype, publish_dtype=args.dtype)
                pool = LearnerPool(cfg, str(path), shape, run=run, namespace="bench")
                gen = None
                try:
                    pool.publish()
                    gen = Gen.remote(make_weight_source(sync, run=run, namespace="bench"), str(path))
                    ray.get(gen.pull.remote())  # opens the channel (collective) and warms up
                    sd = pool.state_dict()
                    pub, floor = [], []
                    for i in range(args.repeats + 1):
                        pool.step(make_batch(i, groups=2, group_size=2))
                        t0 = time.perf_counter()
                        pool.publish()
                        assert ray.get(gen.pull.remote()) == pool.version
                        t_pub = time.perf_counter() - t0
                        t0 = time.perf_counter()
                        ref = ray.put(sd)
                        ray.get(gen.load_ref.remote([ref]))
                        t_floor = time.perf_counter() - t0
                        del ref
                        if i:
                            pub.append(t_pub)
                            floor.append(t_floor)
                    n_params = sum(v.numel() for v in sd.values())
                    p, f = statistics.median(pub), statistics.median(floor)
                    rows.append((name, n_params, ranks, bname, p * 1e3, f * 1e3, p / f))
                    print(rows[-1], flush=True)
                finally:
                    if gen is not None:
                        ray.kill(gen)
                    pool.shutdown()
    ray.shutdown()

    cmd = "python " + " ".join([os.path.relpath(__file__, ROOT)] + sys.argv[1:])
    print(f"\n$ {cmd}    (torch {torch.__version__}, {os.cpu_count()} CPUs, {args.dtype} publications)\n")
    head = ("model", "params", "ranks", "backend", "publish+load ms", "put+get+load floor ms", "ratio")
    print("| " + " | ".join(head) + " |")
    print("|" + "|".join("---" for _ in head) + "|")
    for name, n, r, b, p, f, ratio in rows:
        print(f"| {name} | {n / 1e6:.2f}M | {r} | {b} | {p:.1f} | {f:.1f} | {ratio:.2f}x |")


def delta_table(args, tmp: Path, Gen) -> None:
    """Per model, learning rate and backend: `--repeats` publications after real learner steps (bf16 compute and
    publications, 2 ranks), whole (delta off) and as deltas (delta on, each generator one version behind);
    bytes per publication from the announcements, publish+load time as in the main table."""
    import ray

    from common.config import CollectiveSyncConfig, LearnerConfig, ObjectStoreSyncConfig
    from common.modeling import make_tiny_model_folder
    from learner.pool import LearnerPool
    from learner.shape import TrainShape
    from learner.weights import make_weight_source
    from bench.batches import make_batch

    rows = []
    for name, size in MODELS.items():
        path = make_tiny_model_folder(tmp / name.split()[0], **size)
        for lr in (1e-6, 1e-4):
            for bname, kind in (("object_store", ObjectStoreSyncConfig), ("collective (gloo)", CollectiveSyncConfig)):
                res = {}
                for delta in (False, True):
                    sync = kind(delta=delta)
                    cfg = LearnerConfig(num_ranks=2, weight_sync=sync,
                                        batching=dict(micro_batch_rows=8, mini_batches=1), optim=dict(lr=lr))
                    run = f"wdelta-{len(rows)}-{delta}"
                    shape = TrainShape(max_new_tokens=12, dtype="bfloat16", publish_dtype="bfloat16")
                    pool = LearnerPool(cfg, str(path), shape, run=run, namespace="bench")
                    gen = None
                    try:
                        pool.publish()
                        gen = Gen.remote(make_weight_source(sync, run=run, namespace="bench"), str(path))
                        ray.get(gen.pull.remote())
                        times, sent = [], []
                        for i in range(args.repeats + 1):
                            pool.step(make_batch(i, groups=2, group_size=2))
                            t0 = time.perf_counter()
                            ann = pool.publish()
                            assert ray.get(gen.pull.remote()) == pool.version
                            if i:
                                times.append(time.perf_counter() - t0)
                                # what a generator one version behind receives (a delta not offered: whole)
                                sent.append(ann.delta_bytes if delta and ann.delta_bytes else ann.num_bytes)
                        res[delta] = (statistics.median(sent), statistics.median(times))
                    finally:
                        if gen is not None:
                            ray.kill(gen)
                        pool.shutdown()
                (fb, ft), (db, dt) = res[False], res[True]
                rows.append((name, lr, bname, fb, db, fb / max(db, 1), ft * 1e3, dt * 1e3))
                print(rows[-1], flush=True)
    ray.shutdown()
    cmd = "python " + " ".join([os.path.relpath(__file__, ROOT)] + sys.argv[1:])
    print(f"\n$ {cmd}    (2 learner ranks, bf16 compute and publications, real learner steps between publications;"
          f" median of {args.repeats})\n")
    head = ("model", "lr", "backend", "bytes whole", "bytes delta", "fewer bytes", "publish+load ms whole",
            "publish+load ms delta")
    print("| " + " | ".join(head) + " |")
    print("|" + "|".join("---" for _ in head) + "|")
    for name, lr, b, fb, db, ratio, ft, dt in rows:
        print(f"| {name} | {lr:g} | {b} | {fb / 1e6:.2f} MB | {db / 1e6:.3f} MB | {ratio:.1f}x | {ft:.1f} | {dt:.1f} |")


if __name__ == "__main__":
    main()
