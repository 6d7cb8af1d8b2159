"""Weight fan-out over rate-limited links: star (every generator pulls from learner rank 0) against the relay
(`learner.weight_sync.relay_fanout`: a chain, k = 1, and a tree, k = 2), for N = 2..16 generators.

Every process gets a network namespace of its own, joined to a bridge by a veth pair whose two ends are both
limited by `tc tbf` to --rate-mbit (each "host" has a NIC of that speed, up and down). Learner rank 0 runs a
real `learner.collective.CollectiveServer`; each generator runs the real receiving side (`ChannelClient` for the
star, `RelayReceiver` for the relay). A version counts as delivered when the last generator holds all of it;
the table shows the median over --repeats versions (after one warm-up version that opens the channels).

    sudo python bench/fanout_bench.py                          # N = 2, 4, 8, 16; 4 MB model, 100 Mbit/s links
    python bench/fanout_bench.py --sizes 2,16 --model-mb 8 --rate-mbit 200

Needs root (ip netns, tc) and the `ip`/`tc` tools; the namespaces and the bridge are removed at exit.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PREFIX, BRIDGE, NET, PORT = "exgfo", "exgfobr", "10.77.0", 29517
MODES = {"star": 0, "chain": 1, "tree2": 2}


def sh(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, check=check, capture_output=True, text=True)


def ip_of(k: int) -> str:
    return f"{NET}.{k + 1}"


class Network:
    """`n` namespaces on a bridge, every link limited to `rate_mbit` in both directions."""

    def __init__(self, n: int, rate_mbit: float):
        self.n = n
        self.teardown()
        sh("ip", "link", "add", BRIDGE, "type", "bridge")
        sh("ip", "link", "set", BRIDGE, "up")
        tbf = ("tbf", "rate", f"{rate_mbit}mbit", "burst", "32kb", "latency", "100ms")
        for k in range(n):
            ns, host_end, ns_end = f"{PREFIX}{k}", f"{PREFIX}h{k}", f"{PREFIX}n{k}"
            sh("ip", "netns", "add", ns)
            sh("ip", "link", "add", host_end, "type", "veth", "peer", "name", ns_end)
            sh("ip", "link", "set", ns_end, "netns", ns)
            sh("ip", "link", "set", host_end, "master", BRIDGE)
            sh("ip", "link", "set", host_end, "up")
            sh("ip", "-n", ns, "addr", "add", f"{ip_of(k)}/24", "dev", ns_end)
            sh("ip", "-n", ns, "link", "set", ns_end, "up")
            sh("ip", "-n", ns, "link", "set", "lo", "up")
            sh("tc", "qdisc", "add", "dev", host_end, "root", *tbf)  # into the namespace: its download
            sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", ns_end, "root", *tbf)  # its upload

    @staticmethod
    def teardown() -> None:
        """Remove the namespaces, the host ends of their links (a deleted namespace frees its links lazily) and the
        bridge."""
        for ns in sh("ip", "netns", "list", check=False).stdout.split():
            if ns.startswith(PREFIX) and ns[len(PREFIX):].isdigit():
                sh("ip", "netns", "del", ns, check=False)
        for line in sh("ip", "-o", "link", "show", check=False).stdout.splitlines():
            name = line.split(":")[1].strip().split("@")[0]
            if name.startswith(f"{PREFIX}h"):
                sh("ip", "link", "del", name, check=False)
        sh("ip", "link", "del", BRIDGE, check=False)


def run_case(args, n: int, mode: str) -> list[float]:
    """Seconds per version until all `n` generators hold it, one value per measured version."""
    net = Network(n + 1, args.rate_mbit)
    procs = []
    try:
        common = ["--model-mb", str(args.model_mb), "--bucket-mb", str(args.bucket_mb), "--fanout",
                  str(MODES[mode]), "--n", str(n), "--repeats", str(args.repeats)]
        me = [sys.executable, str(Path(__file__).resolve())]
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "TORCH_CPP_LOG_LEVEL": "ERROR"}
        root = subprocess.Popen(["ip", "netns", "exec", f"{PREFIX}0", *me, "--role", "root", *common],
                                stdout=subprocess.PIPE, text=True, env=env)
        procs.append(root)
        for k in range(1, n + 1):
            procs.append(subprocess.Popen(["ip", "netns", "exec", f"{PREFIX}{k}", *me, "--role", "gen", "--index",
                                           str(k), *common], env=env))
        out, _ = root.communicate(timeout=args.timeout_s)
        if root.returncode != 0:
            raise RuntimeError(f"{mode} N={n}: rank 0 exited {root.returncode}")
        return json.loads(out.strip().splitlines()[-1])["seconds"]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        for p in procs:
            p.wait()
        net.teardown()


def model(model_mb: float):
    import torch

    n = 16
    per = int(model_mb * (1 << 20) / 2 / n)
    g = torch.Generator().manual_seed(0)
    return {f"layer{i}.weight": torch.randn(per, generator=g).bfloat16() for i in range(n)}


def role_root(args) -> None:
    import datetime

    import torch.distributed as dist

    from common.config import CollectiveSyncConfig
    from learner.collective import CollectiveServer

    cfg = CollectiveSyncConfig(bucket_mb=args.bucket_mb, relay_fanout=args.fanout, port=PORT, timeout_s=120)
    server = CollectiveServer(cfg, timeout_s=120, host=ip_of(0))
    ctl = dist.TCPStore(ip_of(0), PORT + 1, is_master=True, wait_for_workers=False,
                        timeout=datetime.timedelta(seconds=300))
    ctl.set("secret", server.secret)  # a benchmark's own control store; a run carries it by Ray only
    sd = model(args.model_mb)
    seconds = []
    for v in range(args.repeats + 1):  # version 0 opens the channels (not measured)
        sd = {k: t + 1 for k, t in sd.items()} if v else sd
        server.publish(v, sd)
        t0 = time.time()
        ctl.set(f"go/{v}", str(t0))
        ctl.wait([f"done/{v}/{i}" for i in range(1, args.n + 1)], datetime.timedelta(seconds=300))
        done = [float(ctl.get(f"done/{v}/{i}")) for i in range(1, args.n + 1)]
        if v:
            seconds.append(max(done) - t0)
    print(json.dumps({"seconds": seconds, "bytes": sum(t.numel() * 2 for t in sd.values())}), flush=True)
    os._exit(0)  # the channels' threads are daemons blocked on their peers


def role_gen(args) -> None:
    import datetime

    import torch.distributed as dist

    from common.config import CollectiveSyncConfig
    from learner.collective import ChannelClient
    from learner.relay import RelayReceiver

    cfg = CollectiveSyncConfig(bucket_mb=args.bucket_mb, relay_fanout=args.fanout, port=PORT, timeout_s=120)
    address, host = f"{ip_of(0)}:{PORT}", ip_of(args.index)
    deadline = time.monotonic() + 120
    while True:  # rank 0 may still be starting
        try:
            ctl = dist.TCPStore(ip_of(0), PORT + 1, is_master=False, timeout=datetime.timedelta(seconds=300))
            break
        except RuntimeError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
    gid, secret = f"gen-{args.index}", ctl.get("secret").decode()
    client = RelayReceiver(cfg, gid, 120, host, secret=secret) if args.fanout else \
        ChannelClient(address, gid, cfg, 120, host, secret=secret)
    for v in range(args.repeats + 1):
        ctl.wait([f"go/{v}"], datetime.timedelta(seconds=300))
        if args.fanout:
            client.pull(address, v, -1)
        else:
            client.pull(v, -1)
        ctl.set(f"done/{v}/{args.index}", str(time.time()))
    time.sleep(2.0)  # relays may still be serving the last version
    os._exit(0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="2,4,8,16", help="generator counts N")
    ap.add_argument("--modes", default="star,chain,tree2", help=f"of {', '.join(MODES)}")
    ap.add_argument("--rate-mbit", type=float, default=100.0, help="every link's rate, each direction")
    ap.add_argument("--model-mb", type=float, default=4.0)
    ap.add_argument("--bucket-mb", type=float, default=0.25)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--timeout-s", type=float, default=600.0)
    ap.add_argument("--role", choices=["root", "gen"], help=argparse.SUPPRESS)
    ap.add_argument("--index", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--fanout", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--n", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.role == "root":
        return role_root(args)
    if args.role == "gen":
        return role_gen(args)
    if os.geteuid() != 0 or not (shutil.which("ip") and shutil.which("tc")):
        sys.exit("fanout_bench needs root and the ip/tc tools (iproute2): it builds network namespaces with "
                 "rate-limited links; run it as root (sudo) on a Linux machine")
    sizes = [int(s) for s in args.sizes.split(",")]
    modes = args.modes.split(",")
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        sys.exit(f"unknown --modes {unknown}; choose from {list(MODES)}")
    one = args.model_mb * (1 << 20) * 8 / (args.rate_mbit * 1e6)
    results: dict[tuple[str, int], float] = {}
    for mode in modes:
        for n in sizes:
            results[mode, n] = statistics.median(run_case(args, n, mode))
            print(f"# {mode} N={n}: {results[mode, n]:.2f} s", file=sys.stderr, flush=True)
    print(f"command: python bench/fanout_bench.py --sizes {args.sizes} --modes {args.modes} --rate-mbit "
          f"{args.rate_mbit:g} --model-mb {args.model_mb:g} --bucket-mb {args.bucket_mb:g} --repeats {args.repeats}")
    print(f"one transfer of the model at the link rate: {one:.2f} s\n")
    print("| N | " + " | ".join(f"{m} s" for m in modes) + " | " + " | ".join(f"{m} / its N={sizes[0]}" for m in modes)
          + " |")
    print("|---" * (1 + 2 * len(modes)) + "|")
    for n in sizes:
        cells = [f"{results[m, n]:.2f}" for m in modes]
        ratios = [f"{results[m, n] / results[m, sizes[0]]:.2f}×" for m in modes]
        print(f"| {n} | " + " | ".join(cells + ratios) + " |")


if __name__ == "__main__":
    main()
