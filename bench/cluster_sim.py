"""Cluster simulation: asynchronous vs synchronous ExGRPO at 4-64 generators, with real Ray actors and
SIMULATED generation and learning.

    .venv/bin/python bench/cluster_sim.py [--quick] [--generators 4 16 64] [--lags 1 2 4] [--steps 8]
                                          [--learner-step-s 1.0] [--sweep-step-s 0.5 2] [--tokens-per-s 400] ...

Real: the buffer shards (`BufferClient`, S shard actors), the generator actors (`actors.generator`:
streaming or batch-at-a-time, scoring thread, in-flight weight updates), the weight store and its
`ObjectStorePublisher`. Simulated: the engine (`generator.engine.kind: synthetic`: random tokens at
`--tokens-per-s` per sequence, `--max-num-seqs` decoded at once, lognormal lengths) with the `synthetic`
reward, and the learner: `simulated_learner` below takes a batch, sleeps `--learner-step-s`, publishes a
tiny state dict as version v+1, sends entropy feedback for the mixed groups with version v+1 (`end_step`),
in the order of `cluster.driver.Trainer.run`.

Tables:
(a) wall time to the same number of learner steps (so the same number of trained rollouts), sync
    (buffer.max_lag 0) vs async (max_lag 1, 2, 4), per N; speed-up = sync wall / this wall. `s/step` is
    the steady state (first batch excluded: it holds the pipeline fill, paid once per run); `learner idle`
    = time in get_batch / wall; `publish+feedback` = the rest of the loop per step besides the sleep.
(b) generator utilisation, continuous batching (generator.streaming true) vs batch-at-a-time (false),
    generators flat out (max_lag 1000: back-pressure never binds, no learner): `busy` = busy_fraction
    (time inside engine.step() / wall); `slots` = tokens / (wall x tokens_per_s x max_num_seqs), the share
    of the engine's decode slots that produced tokens (busy_fraction counts a step with one sequence left
    as busy; on a real engine a step costs about the same with 1 or 64 sequences, so `slots` is the
    utilisation that matters for throughput).
(c) buffer ingest: groups/s submitted at the shards in the same flat-out runs (continuous batching).
(d) weight-sync fan-out: publish -> every generator acked (`WeightStore.wait_for_acks`, the event behind
    status()["acked"]), over the publications of the sync and the max_lag 1 runs.
(e) with --sweep-step-s: speed-up at the middle N for other learner step times (sync vs the largest lag).

The regime (defaults):
- Lengths lognormal, median 64 tokens, sigma 1, capped at 512: cap = 8x the median, as for reasoning
  RL with a median of ~1-2k tokens capped at 8k; 1.9% of the samples hit the cap, so every batch of
  512 samples has a few.
- 400 tokens/s per sequence, 64 sequences at once per generator: a capped sample takes 1.28 s, the floor
  of a synchronous batch's generation time. B = 64 questions x K = 8 per batch, 2 shards,
  max_in_flight 16 (the default), questions_per_lease 8.
- Learner step 1.0 s, against ~1.9 s of generation + hand-over per synchronous step: generation is
  ~65% of a synchronous step, as in colocated RLVR runs (profiles of verl-style runs put rollout at
  60-80% of the step).
- Generators poll weights every 0.25 s and the buffer every 0.2 s when it has no work for them (the
  defaults 0.1 / 0.05 make ~50 Ray calls/s per generator: too many for 64 actors on 2 cores); engine
  step 50 ms, weight load 50 ms.

What limits the speed-up (measured on this machine):
- Async hides generation behind learning, so speed-up <= sync s/step / learner step (2.9x at 1.0 s,
  1.85x at 2 s, 4.5x at 0.5 s: table (e)). max_lag 1 keeps at most ~one batch ahead: the next batch
  still waits for its own tail, step ~ (sync generation + learner step) / 2, speed-up <= 2.
- max_lag >= 2: the back-pressure window (max_lag + 1) x B fills with ready groups, so groups reach the
  learner near the staleness limit and the long-tailed ones pass it. The buffer takes the oldest groups of
  all shards first (per-version ready counts), which halved these drops (N=16, max_lag 2: 144 -> 63 of
  ~560 groups); the rest are groups still generating when newer ones fill max_lag batches (`stale
  dropped`: generated again).
- The learner-side hand-over (get_batch: wait_ready + take, publish, end_step: ~4 Ray round trips) costs
  ~0.1-0.15 s per step at N=16 on this machine; the async s/step is the learner step plus that. Fetching
  the next batch during the learner step would hide get_batch (not done: the buffer would need a
  "taken for the next version" count in its back-pressure, or it over-leases by a batch).
- Continuous batching leases by decode slots: it keeps samples in flight >= the engine's slots
  (max_num_seqs) with about half a lease waiting, so a finished sample's slot is refilled at the next
  step (busy ~0.94, slots ~0.89 at N=4 on a quiet machine; before, with a cap of 16 questions, slots
  were ~0.6 because a question's slowest sample held its place). Batch-at-a-time scores busy ~0.95 but
  uses ~20% of the slots: each batch waits for its longest sample.

Machine: 2 cores. Actors are created once (importing torch costs ~3 CPU-s per actor: 64 take ~3 min
here) and re-pointed between runs while stopped (`RebindableGenerator.rebind`: the state `__init__`
gives a new actor, the engine object kept); each run gets new buffer shards, the weight store is reset.
The synthetic engine's clock is wall time, so a CPU-starved generator notices finished samples late but
does not decode fewer tokens. `cpu` = the machine's busy share during the run (/proc/stat, other
processes included): rows at ~100% (N=64 everywhere, N>=16 flat out) measure this machine, not the
design. The default run takes ~10 min here (64 actor starts and the N=64 runs); --quick ~3 min.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

K = 8
FLAT_LAG = 1000  # max_lag of the flat-out runs: capacity (lag + 1) x B never binds
WEIGHTS_RUN = "simw"  # one weight store for all runs (reset between them): its actor imports torch (~3 CPU-s)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from common.config import GeneratorConfig

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="small run: N = 2 8, lags 1 2, 5 steps, 3 s flat out")
    p.add_argument("--generators", type=int, nargs="+", default=[4, 16, 64], help="N values")
    p.add_argument("--lags", type=int, nargs="+", default=[1, 2, 4], help="async max_lag values (0 always runs)")
    p.add_argument("--steps", type=int, default=8, help="learner steps per run in (a) and (e)")
    p.add_argument("--batch", type=int, default=64, help="B: questions per batch")
    p.add_argument("--learner-step-s", type=float, default=1.0, help="simulated learner step (sleep)")
    p.add_argument("--shards", type=int, default=2)
    p.add_argument("--tokens-per-s", type=float, default=400.0, help="decode rate of one sequence")
    p.add_argument("--max-num-seqs", type=int, default=64, help="sequences one engine decodes at once")
    p.add_argument("--median", type=int, default=64, help="median response length (tokens)")
    p.add_argument("--sigma", type=float, default=1.0, help="lognormal sigma of the length")
    p.add_argument("--max-new-tokens", type=int, default=512)
    p.add_argument("--max-in-flight", type=int, default=GeneratorConfig.model_fields["max_in_flight"].default,
                   help="streaming: at most this many questions in flight per generator")
    p.add_argument("--questions-per-lease", type=int, default=8)
    p.add_argument("--step-s", type=float, default=0.05, help="synthetic engine step")
    p.add_argument("--load-s", type=float, default=0.05, help="synthetic weight load")
    p.add_argument("--weight-poll-s", type=float, default=0.25)
    p.add_argument("--idle-sleep-s", type=float, default=0.2)
    p.add_argument("--lease-wait-s", type=float, default=1.0, help="generator.lease_wait_s (long-poll lease)")
    p.add_argument("--idle", action="store_true",
                   help="only (f): calls/s per shard with every generator idle, polling vs long-poll lease")
    p.add_argument("--flat-s", type=float, default=4.0, help="measured seconds of each flat-out run (after 2 s)")
    p.add_argument("--sweep-step-s", type=float, nargs="*", default=[],
                   help="(e): more learner step times, sync vs the largest lag, at the middle N")
    p.add_argument("--questions", type=int, default=12_000)
    p.add_argument("--no-flat", action="store_true", help="only (a) and (d)")
    args = p.parse_args(argv)
    if args.quick:
        args.generators, args.lags, args.steps, args.flat_s, args.sweep_step_s = [2, 8], [1, 2], 5, 3.0, []
    return args


# ------------------------------------------------------------------------------------------ building


def make_questions(n: int):
    import numpy as np

    from common.messages import Question, int32_array

    return [Question(f"q{i}", f"synthetic prompt {i}", "correct", int32_array(np.arange(16) + 16 * i))
            for i in range(n)]


def gen_cfg(args, streaming: bool, lease_wait_s: float | None = None):
    from common.config import GeneratorConfig, SyntheticEngineConfig

    engine = SyntheticEngineConfig(tokens_per_s=args.tokens_per_s, max_num_seqs=args.max_num_seqs, length="lognormal",
                                   length_median=args.median, length_sigma=args.sigma, step_s=args.step_s,
                                   load_s=args.load_s)
    return GeneratorConfig(engine=engine, max_new_tokens=args.max_new_tokens, streaming=streaming,
                           max_in_flight=args.max_in_flight, questions_per_lease=args.questions_per_lease,
                           weight_poll_s=args.weight_poll_s, idle_sleep_s=args.idle_sleep_s, num_cpus=0,
                           retry_backoff_s=0.5, stop_timeout_s=60,
                           lease_wait_s=args.lease_wait_s if lease_wait_s is None else lease_wait_s,
                           # (f) compares everything polling with both long-polls; elsewhere the product default
                           weight_wait_s=0.0 if lease_wait_s == 0 else GeneratorConfig.model_fields[
                               "weight_wait_s"].default)


def buffer_cfg(args, max_lag: int):
    from common.config import BufferConfig

    return BufferConfig(num_shards=args.shards, group_size=K, batch_questions=args.batch, max_lag=max_lag,
                        call_timeout_s=60)


def rebindable_generator_class():
    import ray

    from actors.generator import GeneratorWorker

    class RebindableGenerator(GeneratorWorker):
        """`GeneratorWorker` that can be pointed at another buffer and weight store while stopped (see the
        module docstring): the state is the one `__init__` gives a new actor; the engine object is kept,
        its version reset to 0 (the new weight store numbers from 0)."""

        def rebind(self, gen_cfg, work_source, weight_source) -> None:
            if self._thread is not None and self._thread.is_alive():
                raise RuntimeError(f"{self.generator_id}: stop() before rebind()")
            engine = self.engine
            if engine is not None and (engine.cfg != gen_cfg.engine or engine.in_flight()):
                raise RuntimeError(f"{self.generator_id}: rebind keeps the engine: same engine settings, "
                                   "nothing in flight")
            GeneratorWorker.__init__(self, self.generator_id, gen_cfg, self.reward_cfg, self.model_path, work_source,
                                     weight_source, self.task_name)
            # a weight watcher of the last run still waiting ends by itself: its loader's stop event stays set
            if engine is not None:
                engine.version = 0
                engine.sampling = type(engine.sampling).from_config(gen_cfg)
            self.engine = engine

    return ray.remote(max_concurrency=4, max_restarts=0, max_task_retries=0)(RebindableGenerator)


def start_actors(n: int, args):
    from actors.generator import actor_options
    from common.config import RewardConfig
    from common.interfaces import actor_name

    cls = rebindable_generator_class()
    cfg = gen_cfg(args, True)
    opts = {**actor_options(cfg), "max_restarts": 0}
    actors = []
    for i in range(n):
        gid = actor_name("sim", "generator", i)
        actors.append(cls.options(name=gid, **opts).remote(gid, cfg, RewardConfig(name="synthetic"), "", None, None,
                                                           None))
    return actors


# ------------------------------------------------------------------------------------- measuring


class CpuMeter:
    """Busy share of all CPUs between start and stop (/proc/stat; other processes included)."""

    def __init__(self):
        self.t0 = self._read()

    @staticmethod
    def _read() -> tuple[int, int]:
        try:
            vals = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
        except OSError:
            return 0, 0
        idle = vals[3] + vals[4]
        return sum(vals) - idle, sum(vals)

    def busy(self) -> float:
        b1, t1 = self._read()
        return (b1 - self.t0[0]) / (t1 - self.t0[1]) if t1 > self.t0[1] else float("nan")


class FanoutWatch:
    """Times publish -> every registered generator acked (one waiting thread per publication)."""

    def __init__(self, store):
        self.store, self.times, self.missing, self.threads = store, [], [], []

    def published(self, version: int, t0: float) -> None:
        """`version` was published at `t0` (monotonic, taken before the publish call)."""

        def wait() -> None:
            import ray

            missing = ray.get(self.store.wait_for_acks.remote(version, 60.0), timeout=90)
            self.times.append(time.monotonic() - t0)
            self.missing.extend(missing)

        t = threading.Thread(target=wait, daemon=True)
        t.start()
        self.threads.append(t)

    def join(self) -> None:
        for t in self.threads:
            t.join(timeout=90)


def simulated_learner(buffer, publisher, watch: FanoutWatch, steps: int, step_s: float) -> dict:
    """SIMULATED learner, in the order of `cluster.driver.Trainer.run`: batch, step (a sleep), publish
    v+1 (a tiny state dict through the real publisher), feedback + set_version (`end_step`). Returns timings."""
    import numpy as np
    import torch

    from common.messages import LearnerFeedback

    rng = np.random.default_rng(0)
    tiny = {"w": torch.zeros(4)}
    version, rollouts, wait_s, other_s, lags, done_at = 0, 0, 0.0, 0.0, [], []
    for _ in range(steps):
        t0 = time.monotonic()
        batch = buffer.get_batch(version, timeout_s=120)
        wait_s += time.monotonic() - t0
        if batch is None:
            raise RuntimeError(f"no batch within 120 s at version {version}: {buffer.accounting()}")
        rollouts += sum(len(g.rollouts) for g in batch.groups)
        lags += [version - min(r.version for r in g.rollouts) for g in batch.groups]
        time.sleep(step_s)  # the learner step
        t1 = time.monotonic()
        version += 1
        publisher.publish(version, tiny)
        watch.published(version, t1)
        keys = [c.key for g in batch.groups if g.mixed for c in g.candidates]
        ents = rng.uniform(0.1, 2.0, len(keys)).astype(np.float32)
        chosen, i = [], 0
        for g in batch.groups:
            if g.mixed:
                n = len(g.candidates)
                chosen.append(keys[i + int(np.argmin(ents[i:i + n]))])
                i += n
        buffer.end_step(LearnerFeedback(version - 1, keys, ents, chosen), version)
        done_at.append(time.monotonic())
        other_s += done_at[-1] - t1
    return dict(rollouts=rollouts, learner_wait_s=wait_s, learner_other_s=other_s, lag_mean=statistics.fmean(lags),
                lag_max=max(lags),
                done_at=done_at)


@dataclass
class Case:
    n: int
    max_lag: int
    streaming: bool
    flat: bool = False  # generators flat out, no learner: measure (b) and (c)
    learner_step_s: float | None = None  # None: --learner-step-s; else a row of the sweep (e)
    idle_wait_s: float | None = None  # (f): every generator idle (no learner); generator.lease_wait_s


def run_case(case: Case, actors, publisher, args, index: int) -> dict:
    """One run on the first `case.n` actors: new buffer shards, the weight store reset (versions from 0)."""
    import ray

    from buffer.client import BufferClient
    from learner.weights import ObjectStoreWeightSource

    buffer = BufferClient.create(buffer_cfg(args, case.max_lag), args.qs, run=f"sim{index}", namespace=None,
                                 snapshot_dir=None)
    ray.get(publisher.store.reset.remote())
    source = ObjectStoreWeightSource(WEIGHTS_RUN)
    cfg = gen_cfg(args, case.streaming, case.idle_wait_s)
    gens = actors[: case.n]
    ray.get([a.rebind.remote(cfg, buffer, source) for a in gens])
    ray.get([a.start.remote() for a in gens])
    cpu, t0 = CpuMeter(), time.monotonic()
    out = dict(n=case.n, max_lag=case.max_lag, streaming=case.streaming, learner_step_s=case.learner_step_s)
    if case.idle_wait_s is not None:  # no learner: the window of max_lag 0 fills, then every generator is idle
        time.sleep(3.0)
        c0, w0, t_0 = shard_calls(buffer), store_calls(publisher), time.monotonic()
        time.sleep(args.flat_s)
        dt = time.monotonic() - t_0
        out.update(calls_s=(shard_calls(buffer) - c0) / dt / args.shards, store_calls_s=(store_calls(publisher) - w0) / dt)
    elif case.flat:
        time.sleep(2.0)  # leases out, engines full
        m0, s0, c0 = ray.get([a.metrics.remote() for a in gens]), shard_submitted(buffer), time.monotonic()
        time.sleep(args.flat_s)
        m1, s1, c1 = ray.get([a.metrics.remote() for a in gens]), shard_submitted(buffer), time.monotonic()
        out.update(groups_s=(s1 - s0) / (c1 - c0), **utilisation(m0, m1, args))
        out["rollouts_s"] = sum(b["rollouts"] - a["rollouts"] for a, b in zip(m0, m1)) / (c1 - c0)
    else:
        watch = FanoutWatch(publisher.store)
        step_s = args.learner_step_s if case.learner_step_s is None else case.learner_step_s
        res = simulated_learner(buffer, publisher, watch, args.steps, step_s)
        wall = time.monotonic() - t0
        watch.join()
        m = ray.get([a.metrics.remote() for a in gens])
        steady = (res["done_at"][-1] - res["done_at"][0]) / max(1, len(res["done_at"]) - 1)
        out.update(wall_s=wall, s_per_step=steady, rollouts=res["rollouts"], learner_idle=res["learner_wait_s"] / wall,
                   other_s=res["learner_other_s"] / args.steps,
                   lag_mean=res["lag_mean"], lag_max=res["lag_max"], fanout=sorted(watch.times),
                   fanout_missing=len(watch.missing), busy=statistics.fmean(x["busy_fraction"] for x in m),
                   spanning=sum(x["rollouts_spanning"] for x in m) / max(1.0, sum(x["rollouts"] for x in m)),
                   stale=buffer.accounting()["stale_dropped"])
    out["cpu"] = cpu.busy()
    ray.get([a.stop.remote(drain=False) for a in gens], timeout=120)
    acc = buffer.accounting()
    if acc["balance"] != 0:
        raise RuntimeError(f"buffer accounting does not balance after {case}: {acc}")
    buffer.shutdown()
    return out


def shard_calls(buffer) -> float:
    """Generator-side calls the shards answered so far (lease, long-poll lease, submit), summed."""
    return sum(m.get("calls_lease", 0.0) + m.get("calls_lease_wait", 0.0) + m.get("calls_submit", 0.0)
               for m in buffer.shard_metrics())


def store_calls(publisher) -> float:
    """Version queries the weight store answered so far (latest, wait_newer)."""
    import ray

    return float(sum(ray.get(publisher.store.status.remote())["calls"].values()))


def shard_submitted(buffer) -> float:
    """Groups the shards received so far (accepted, kept out as zero-signal, rejected, or late)."""
    return sum(m["accepted"] + m["zero_signal"] + m["rejected"] + m["late_submissions"] for m in buffer.shard_metrics())


def utilisation(m0: list[dict], m1: list[dict], args) -> dict:
    """Mean busy fraction and decode-slot occupancy of the generators between two metrics snapshots."""
    busy, slots = [], []
    for a, b in zip(m0, m1):
        dt = b["uptime_s"] - a["uptime_s"]
        busy.append((b["generate_s"] - a["generate_s"]) / dt)
        slots.append((b["tokens"] - a["tokens"]) / (dt * args.tokens_per_s * args.max_num_seqs))
    return dict(busy=statistics.fmean(busy), slots=statistics.fmean(slots), busy_min=min(busy))


# ------------------------------------------------------------------------------------------ output


def pct(xs: list[float], q: float) -> float:
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def markdown(head: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
    line = lambda cells: "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"  # noqa: E731
    return "\n".join([line(head), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, rows)])


def table_a(rows: list[dict]) -> str:
    body = []
    for r in rows:
        sync = next(x for x in rows if x["n"] == r["n"] and x["max_lag"] == 0)
        body.append([str(r["n"]), "sync" if r["max_lag"] == 0 else "async", str(r["max_lag"]), str(r["rollouts"]),
                     f"{r['wall_s']:.1f}", f"{r['s_per_step']:.2f}", f"{sync['wall_s'] / r['wall_s']:.2f}x",
                     f"{sync['s_per_step'] / r['s_per_step']:.2f}x", f"{r['learner_idle']:.2f}",
                     f"{1000 * r['other_s']:.0f}", f"{r['busy']:.2f}",
                     f"{r['lag_mean']:.2f}", str(r["lag_max"]), str(r["stale"]), f"{r['spanning']:.2f}",
                     f"{r['cpu']:.0%}"])
    return markdown(["N", "mode", "max_lag", "rollouts", "wall s", "s/step", "speed-up", "steady speed-up",
                     "learner idle", "publish+feedback ms", "gen busy", "lag mean", "lag max", "stale dropped",
                     "spanning", "cpu"], body)


def table_b(rows: list[dict]) -> str:
    body = [[str(r["n"]), "continuous" if r["streaming"] else "batch-at-a-time", f"{r['busy']:.2f}",
             f"{r['busy_min']:.2f}", f"{r['slots']:.2f}", f"{r['rollouts_s'] / r['n']:.0f}", f"{r['cpu']:.0%}"]
            for r in rows]
    return markdown(["N", "batching", "busy (mean)", "busy (min)", "slots", "rollouts/s per gen", "cpu"], body)


def table_c(rows: list[dict], args) -> str:
    body = [[str(r["n"]), str(args.shards), f"{r['groups_s']:.0f}", f"{r['groups_s'] / args.shards:.0f}",
             f"{r['rollouts_s']:.0f}", f"{r['busy']:.2f}", f"{r['cpu']:.0%}"] for r in rows]
    return markdown(["N", "shards", "groups/s", "groups/s per shard", "rollouts/s", "gen busy", "cpu"], body)


def table_d(rows: list[dict]) -> str:
    body = []
    for r in rows:
        f = r["fanout"]
        body.append([str(r["n"]), "sync" if r["max_lag"] == 0 else f"async lag {r['max_lag']}", str(len(f)),
                     f"{1000 * pct(f, 0.5):.0f}", f"{1000 * pct(f, 0.9):.0f}", f"{1000 * max(f):.0f}",
                     str(r["fanout_missing"])])
    return markdown(["N", "run", "publications", "p50 ms", "p90 ms", "max ms", "not acked in 60 s"], body)


def table_e(rows: list[dict]) -> str:
    body = []
    for step_s in sorted({r["learner_step_s"] for r in rows}):
        sync = next(r for r in rows if r["learner_step_s"] == step_s and r["max_lag"] == 0)
        a = next(r for r in rows if r["learner_step_s"] == step_s and r["max_lag"] > 0)
        gen_share = 1 - step_s / sync["s_per_step"]
        body.append([f"{step_s:g}", f"{sync['s_per_step']:.2f}", f"{gen_share:.0%}", f"{a['s_per_step']:.2f}",
                     f"{sync['wall_s'] / a['wall_s']:.2f}x", f"{sync['s_per_step'] / a['s_per_step']:.2f}x",
                     f"{(sync['s_per_step']) / step_s:.2f}x", str(a["stale"])])
    return markdown(["learner step s", "sync s/step", "sync: not learning", "async s/step", "speed-up",
                     "steady speed-up", "bound (sync s/step / learner step)", "async stale dropped"], body)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    import ray

    from common.config import ObjectStoreSyncConfig
    from learner.weights import ObjectStorePublisher

    tmp = tempfile.mkdtemp(prefix="exgrpo-sim-ray-", dir="/tmp")
    ray.init(address="local", num_cpus=2, _temp_dir=tmp, include_dashboard=False, log_to_driver=False,
             logging_level="ERROR", runtime_env={"env_vars": {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}})
    t_all = time.monotonic()
    try:
        args.qs = make_questions(args.questions)
        t0 = time.monotonic()
        actors = start_actors(max(args.generators), args)
        ray.get([a.ping.remote() for a in actors], timeout=900)
        print(f"  {len(actors)} generator actors up in {time.monotonic() - t0:.0f}s", file=sys.stderr, flush=True)
        cases = []
        if args.idle:
            cases = [Case(n, 0, True, idle_wait_s=w) for n in args.generators for w in (0.0, args.lease_wait_s)]
        for n in ([] if args.idle else args.generators):
            cases += [Case(n, lag, True) for lag in [0, *args.lags]]
            if not args.no_flat:
                cases += [Case(n, FLAT_LAG, True, flat=True), Case(n, FLAT_LAG, False, flat=True)]
        sweep_n = sorted(args.generators)[len(args.generators) // 2]
        for step_s in args.sweep_step_s:
            cases += [Case(sweep_n, lag, True, learner_step_s=step_s) for lag in (0, max(args.lags))]
        publisher = ObjectStorePublisher(ObjectStoreSyncConfig(), run=WEIGHTS_RUN, namespace=None, timeout_s=60)
        results = []
        for i, case in enumerate(cases):
            t0 = time.monotonic()
            results.append((case, run_case(case, actors, publisher, args, i)))
            print(f"  {case} in {time.monotonic() - t0:.0f}s", file=sys.stderr, flush=True)
    finally:
        ray.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)
    if args.idle:
        from common.config import GeneratorConfig

        print("$ " + shlex.join([sys.executable.rsplit("/", 1)[-1], *sys.argv]))
        print(f"\n(f) calls/s per shard with every generator idle (no learner: the max_lag 0 window is full), "
              f"{args.shards} shards, idle_sleep_s {args.idle_sleep_s:g}, {args.flat_s:g} s measured\n")
        rows = [[str(r["n"]), f"poll (idle_sleep_s {args.idle_sleep_s:g}, weight_poll_s {args.weight_poll_s:g})"
                 if not c.idle_wait_s else f"long-poll (lease_wait_s {c.idle_wait_s:g}, weight_wait_s "
                 f"{GeneratorConfig.model_fields['weight_wait_s'].default:g})",
                 f"{r['calls_s']:,.1f}", f"{r['store_calls_s']:,.1f}", f"{r['cpu']:.0%}"] for c, r in results]
        print(markdown(["N", "idle generators", "calls/s per shard", "weight-store calls/s", "cpu"], rows))
        return 0
    train = [r for c, r in results if not c.flat and c.learner_step_s is None]
    sweep = [r for c, r in results if c.learner_step_s is not None]
    if sweep:
        sweep = [{**r, "learner_step_s": args.learner_step_s} for r in train if r["n"] == sweep_n
                 and r["max_lag"] in (0, max(args.lags))] + sweep
    flat = [r for c, r in results if c.flat]
    print("$ " + shlex.join([sys.executable.rsplit("/", 1)[-1], *sys.argv]))
    print(f"(SIMULATION: synthetic engine {args.tokens_per_s:g} tokens/s per sequence, {args.max_num_seqs} sequences "
          f"at once, lognormal lengths median {args.median} sigma {args.sigma:g} cap {args.max_new_tokens}; simulated "
          f"learner step {args.learner_step_s:g} s; B={args.batch} x K={K}, {args.shards} shards; "
          f"max_in_flight {args.max_in_flight}, questions_per_lease {args.questions_per_lease}; "
          f"total {time.monotonic() - t_all:.0f}s)")
    print(f"\n(a) sync vs async, {args.steps} learner steps per run; speed-up = sync / this row\n")
    print(table_a(train))
    if flat:
        print(f"\n(b) generator utilisation, flat out (max_lag {FLAT_LAG}), {args.flat_s:g} s measured per run\n")
        print(table_b(flat))
        print("\n(c) buffer ingest, same flat-out runs (continuous batching)\n")
        print(table_c([r for r in flat if r["streaming"]], args))
    print("\n(d) weight-sync fan-out, publish -> all N acked (sync and max_lag 1 runs)\n")
    print(table_d([r for r in train if r["max_lag"] in (0, 1)]))
    if sweep:
        print(f"\n(e) speed-up vs the simulated learner step, N={sweep_n}, sync vs max_lag {max(args.lags)}\n")
        print(table_e(sweep))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
