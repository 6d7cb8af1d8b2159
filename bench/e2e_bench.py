"""End-to-end benchmark: synchronous (max_lag 0) vs asynchronous (max_lag 1, 2) ExGRPO training.

Each mode runs `exgrpo train` (a real subprocess with its embedded Ray, the configured engine, the
learner pool and MLflow) for the same number of learner steps, so the same number of rollouts is
trained, with the same resources. Reported per mode, from the run's MLflow metrics:
wall time of the training loop (first to last step) and of the whole command, learner idle
fraction, weight publication and load latency, and the throughput of each component.

    python bench/e2e_bench.py [--steps 30] [--lags 0 1 2] [--generators 1] [--no-paper] [-- extra overrides ...]

Besides the `--lags` rows, a `paper` row runs the paper's optimisation setting at max_lag 1:
2 optimizer updates per learner step (`learner.batching.mini_batches=2`) and 2 buffer shards. Its
`stale_dropped` column shows whether asynchrony survives it (before one policy version per learner
step, everything generated one batch ago was dropped there).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from mlflow.tracking import MlflowClient

ROOT = Path(__file__).resolve().parents[1]


PAPER = ["learner.batching.mini_batches=2", "buffer.num_shards=2"]


def run_mode(root: Path, lag: int, steps: int, generators: int, extra: list[str], label: str = "") -> dict:
    name = f"bench-{label or f'lag{lag}'}"
    cmd = [sys.executable, "-m", "cluster.cli", "train", f"name={name}", f"checkpoint.runs_root={root}",
           f"total_steps={steps}", f"buffer.max_lag={lag}", "checkpoint.every_steps=0",
           f"generator.num_generators={generators}", "tracking.log_plots=false", *extra]
    t0 = time.monotonic()
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    wall = time.monotonic() - t0
    if out.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{out.stderr[-3000:]}")
    import json

    run_id = json.loads((root / name / "state.json").read_text())["mlflow_run_id"]
    client = MlflowClient(tracking_uri=f"sqlite:///{root / 'mlflow.db'}")

    def hist(key: str) -> list:
        return client.get_metric_history(run_id, key)

    def mean(key: str, skip_first: bool = True) -> float:
        vals = [m.value for m in hist(key)][1 if skip_first else 0:]
        return statistics.fmean(vals) if vals else float("nan")

    def last(key: str) -> float:
        h = hist(key)
        return h[-1].value if h else float("nan")

    steps_h = hist("policy/version")
    loop_s = (steps_h[-1].timestamp - steps_h[0].timestamp) / 1000 if len(steps_h) > 1 else float("nan")
    trained = last("accounting/trained")
    return {
        "mode": label or f"lag {lag}", "max_lag": lag, "steps": steps, "loop_s": loop_s, "command_s": wall,
        "rollouts_trained": trained * 8, "learner_idle": last("driver/learner_wait_fraction"),
        "publish_ms": 1000 * mean("driver/weight_publish_s"), "load_ms": 1000 * mean("generator/weight_load_s_last"),
        "gen_rollouts_s": mean("generator/rollouts_per_s"), "gen_tokens_s": mean("generator/tokens_per_s"),
        "learner_tokens_s": mean("learner/tokens_per_s"), "buffer_groups_s": mean("buffer/groups_per_s"),
        "stale_dropped": last("accounting/stale_dropped"), "mean_lag": mean("staleness/mean", skip_first=False),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--lags", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--generators", type=int, default=1)
    ap.add_argument("--no-paper", action="store_true", help="leave out the paper-settings row")
    ap.add_argument("extra", nargs="*", help="extra dotted.key=value overrides for every mode (after --)")
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="exgrpo-e2e-bench-"))
    try:
        rows = [run_mode(root, lag, args.steps, args.generators, args.extra) for lag in args.lags]
        if not args.no_paper:
            rows.append(run_mode(root, 1, args.steps, args.generators, args.extra + PAPER, label="paper"))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"$ python bench/e2e_bench.py {' '.join(sys.argv[1:])}".rstrip())
    print(f"({args.steps} learner steps x 16 groups x 8 rollouts per mode, {args.generators} generator(s), "
          f"1 learner rank, built-in model and task; paper = max_lag 1 + {' '.join(PAPER)})")
    cols = [("mode", "{}"), ("max_lag", "{:.0f}"), ("loop_s", "{:.1f}"), ("command_s", "{:.1f}"), ("rollouts_trained", "{:.0f}"),
            ("learner_idle", "{:.2f}"), ("publish_ms", "{:.0f}"), ("load_ms", "{:.0f}"),
            ("gen_rollouts_s", "{:.0f}"), ("gen_tokens_s", "{:.0f}"), ("learner_tokens_s", "{:.0f}"),
            ("buffer_groups_s", "{:.1f}"), ("stale_dropped", "{:.0f}"), ("mean_lag", "{:.2f}")]
    print("| " + " | ".join(c for c, _ in cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(f.format(r[c]) for c, f in cols) + " |")


if __name__ == "__main__":
    main()
