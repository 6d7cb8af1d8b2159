"""A multi-node Ray cluster on this machine, made with Ray's own test utility (`ray.cluster_utils.Cluster`) in a
process of its own, driven over stdin by a test:

    add <cpus> [<labels json>]   add a worker node (a raylet of its own), with node labels; prints "added <node id>"
    remove       kill the newest worker node's raylet and workers (a node loss); prints "removed <node id>"
    quit         stop every node

It prints "address <host:port>" once the head runs. Its own process keeps the cluster's settings (no token
authentication, its own temp folder) apart from the test process's Ray.

    python -m tests.cluster.cluster_nodes <head cpus> <temp dir>
"""

from __future__ import annotations

import json
import os
import sys


def main() -> None:
    import ray._private.utils
    from ray.cluster_utils import Cluster

    head_cpus, temp_dir = int(sys.argv[1]), sys.argv[2]
    # Cluster writes the head's address to Ray's default temp folder (/tmp/ray), which a fresh machine lacks
    os.makedirs(os.path.dirname(ray._private.utils.get_ray_address_file(None)), exist_ok=True)
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": head_cpus, "temp_dir": temp_dir})
    print("address", cluster.address, flush=True)
    workers = []
    try:
        for line in sys.stdin:
            cmd, *args = line.split()
            if cmd == "add":
                labels = json.loads(" ".join(args[1:])) if len(args) > 1 else None
                workers.append(cluster.add_node(num_cpus=int(args[0]), temp_dir=temp_dir, labels=labels))
                print("added", workers[-1].node_id, flush=True)
            elif cmd == "remove":
                node = workers.pop()
                cluster.remove_node(node)
                print("removed", node.node_id, flush=True)
            elif cmd == "quit":
                break
    finally:
        cluster.shutdown()


if __name__ == "__main__":
    main()
