"""A Ray cluster with Ray's own autoscaler on this machine: `ray start --head` with the fake multi-node provider
(`provider.type: fake_multinode`), which "launches" a node by starting a raylet here and "terminates" it by
killing that raylet. Pending demand makes the autoscaler add nodes of `worker_cpus` CPUs (up to `max_workers`);
nodes idle for `idle_timeout_s` are removed.

    cluster = AutoscalingCluster(temp_dir, head_cpus=2, worker_cpus=1, max_workers=1)
    cluster.address          # "127.0.0.1:<port>", for cluster.address=...
    cluster.nodes()          # alive node ids
    cluster.stop()           # kills this cluster's processes by pid (never a broad `ray stop`)

Ray's own `ray.cluster_utils.AutoscalingCluster` runs `ray stop --force` (every Ray on the machine) and reads an
example config that the wheel does not ship, hence this small equivalent.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.ports import port_for_a_server


class AutoscalingCluster:
    def __init__(self, temp_dir: str, *, head_cpus: int, worker_cpus: int, max_workers: int,
                 idle_timeout_s: float = 5.0):
        # ray start --head takes a port number, and the fake autoscaler's config names the GCS address first
        self.temp_dir, port = temp_dir, port_for_a_server()
        self.address = f"127.0.0.1:{port}"
        config = {
            "cluster_name": f"exgrpo-fake-{port}",
            "max_workers": max_workers,
            "upscaling_speed": 1.0,
            "idle_timeout_minutes": idle_timeout_s / 60,
            "provider": {"type": "fake_multinode", "gcs_address": self.address, "use_node_id_as_ip": True,
                         "disable_node_updaters": True, "disable_launch_config_check": True},
            "available_node_types": {
                "ray.head.default": {"resources": {"CPU": head_cpus}, "node_config": {}, "max_workers": 0},
                "worker": {"resources": {"CPU": worker_cpus}, "node_config": {}, "min_workers": 0,
                           "max_workers": max_workers},
            },
            "head_node_type": "ray.head.default",
            "auth": {}, "docker": {}, "file_mounts": {}, "cluster_synced_files": [],
            "file_mounts_sync_continuously": False, "rsync_exclude": [], "rsync_filter": [],
            "initialization_commands": [], "setup_commands": [], "head_setup_commands": [],
            "worker_setup_commands": [], "head_start_ray_commands": [], "worker_start_ray_commands": [],
        }
        cfg = Path(temp_dir) / "autoscaling.json"
        cfg.write_text(json.dumps(config))
        env = dict(os.environ, RAY_FAKE_CLUSTER="1", AUTOSCALER_UPDATE_INTERVAL_S="1")
        ray_cli = str(Path(sys.executable).parent / "ray")
        subprocess.run([ray_cli, "start", "--head", f"--port={port}", f"--num-cpus={head_cpus}",
                        f"--temp-dir={temp_dir}", f"--autoscaling-config={cfg}", "--include-dashboard=false",
                        "--disable-usage-stats"], env=env, check=True, capture_output=True, timeout=300)

    def nodes(self) -> list[str]:
        """Alive node ids, as the GCS lists them (`ray list nodes`, a process of its own)."""
        env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
        out = subprocess.run([sys.executable, "-c", _LIST_NODES, self.address], env=env, capture_output=True,
                             text=True, timeout=120, cwd=Path(__file__).resolve().parents[2])
        if out.returncode != 0:
            raise RuntimeError(f"listing the nodes of {self.address} failed: {out.stderr[-2000:]}")
        return json.loads(out.stdout.strip().splitlines()[-1])

    def stop(self) -> None:
        """SIGKILL every process whose command line names this cluster's temp folder or address, twice over (a
        raylet that dies can start nothing new, but a worker may be forking just then)."""
        for _ in range(2):
            for pid in _pids_mentioning((self.temp_dir, self.address)):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.5)


_LIST_NODES = """
import json, sys
from cluster.auth import use_token_auth_when_connecting
use_token_auth_when_connecting(sys.argv[1])
import ray
ray.init(address=sys.argv[1], logging_level="ERROR", log_to_driver=False)
print(json.dumps([n["NodeID"] for n in ray.nodes() if n["Alive"]]))
"""


def _pids_mentioning(words: tuple[str, ...]) -> list[int]:
    me, out = os.getpid(), []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == me:
            continue
        try:
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if any(w in cmd for w in words):
            out.append(int(d.name))
    return out
