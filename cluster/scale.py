"""`exgrpo scale --generators N --run NAME`: ask a running job to resize its generator pool.

The job's driver polls its named control actor (`<run>/control`) between batches and scales the
pool; new generators fetch the newest weights before leasing, removed ones return their leases.
"""

from __future__ import annotations

import socket
import sys
from pathlib import Path


def _address(args) -> str:
    if args.address != "auto":
        return args.address
    p = Path(args.runs_root) / args.run / "ray_address"
    return p.read_text().strip() if p.is_file() else "auto"


def _unreachable(address: str, timeout_s: float = 5.0) -> str | None:
    """Why a host:port GCS address cannot be reached (None when it can, or when it is not host:port).

    ray.init retries an unreachable GCS for minutes; a TCP probe answers at once."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or "://" in address:
        return None
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except OSError as e:
        return f"{type(e).__name__}: {e}"
    return None


def scale_main(args) -> int:
    from cluster.auth import use_token_auth_when_connecting

    use_token_auth_when_connecting()  # before ray is imported
    import ray

    from common.interfaces import actor_name

    address = _address(args)
    why = _unreachable(address)
    if why is not None:
        print(f"error: cannot reach the Ray cluster at {address!r} ({why}); is the job still running?",
              file=sys.stderr)
        return 2
    try:
        ray.init(address=address, namespace=args.namespace, log_to_driver=False, logging_level="ERROR")
    except (ConnectionError, RuntimeError) as e:
        print(f"error: cannot reach the Ray cluster at {address!r}: {e}", file=sys.stderr)
        return 2
    try:
        ctl = ray.get_actor(actor_name(args.run, "control"), namespace=args.namespace)
    except ValueError:
        print(f"error: no running job named {args.run!r} in namespace {args.namespace!r} at {address}",
              file=sys.stderr)
        return 2
    try:
        n = ray.get(ctl.set_target.remote(args.generators), timeout=30)
    except ray.exceptions.RayTaskError as e:
        print(f"error: {e.cause}", file=sys.stderr)
        return 2
    print(f"{args.run}: generator target set to {n}; the driver applies it before its next batch")
    return 0
