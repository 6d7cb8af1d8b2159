"""One local Ray cluster that the end-to-end runs of tests/cluster join (`cluster.address`, token authentication on,
as a user's runs join a cluster), held by a process of its own and driven over stdin:

    idle <seconds>   wait until no named actor of a run is left and every CPU is free (their drivers ended), at
                     most <seconds>; then kill the named ones left; prints "idle ok", "idle killed
                     <namespace/name> ..." or "idle busy: ..."
    quit             stop the cluster

It prints "address <host:port>" once the cluster runs. A run that joins it starts no Ray of its own (the embedded
start and stop are 5-10 s of CPU on 2 cores); the tests that need a cluster of their own (a set number of CPUs,
processes found as the driver's children, an embedded Ray's log copy) still start one.

    python -m tests.cluster.shared_ray <cpus> <temp dir>
"""

from __future__ import annotations

import sys
import time


def main() -> None:
    import ray

    cpus, temp_dir = int(sys.argv[1]), sys.argv[2]
    ctx = ray.init(address="local", num_cpus=cpus, _temp_dir=temp_dir, include_dashboard=False, log_to_driver=False,
                   namespace="shared-ray-holder",
                   _system_config={"prestart_worker_first_driver": False, "enable_worker_prestart": False})
    print("address", ctx.address_info["gcs_address"], flush=True)
    try:
        for line in sys.stdin:
            cmd, *args = line.split()
            if cmd == "idle":
                print("idle", _idle(float(args[0])), flush=True)
            elif cmd == "quit":
                break
    finally:
        ray.shutdown()


def _idle(timeout_s: float) -> str:
    """Wait for the runs' named actors to end with their drivers; kill the ones still there after `timeout_s`."""
    import ray

    deadline = time.monotonic() + timeout_s
    while True:
        left = [a for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"] != "shared-ray-holder"]
        free = ray.available_resources().get("CPU", 0.0) >= ray.cluster_resources().get("CPU", 0.0) - 1e-6
        if not left and free:
            return "ok"
        if time.monotonic() > deadline:
            break
        time.sleep(0.5)
    if not left:  # unnamed actors (a run's reward workers, say) still hold CPUs
        held = ray.cluster_resources().get("CPU", 0.0) - ray.available_resources().get("CPU", 0.0)
        return f"busy: {held:g} CPU still held by actors of ended runs"
    for a in left:
        try:
            ray.kill(ray.get_actor(a["name"], namespace=a["namespace"]), no_restart=True)
        except ValueError:  # ended meanwhile
            pass
    return "killed " + " ".join(f"{a['namespace']}/{a['name']}" for a in left)


if __name__ == "__main__":
    main()
