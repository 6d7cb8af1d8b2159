"""`exgrpo scale --generators N --run NAME`: ask a running job to resize its generator pool
(`--min-generators`/`--max-generators`: change the bounds of its `cluster.autoscale` instead).

The job's driver polls its named control actor (`<run>/control`) between batches and scales the
pool; new generators fetch the newest weights before leasing, removed ones return their leases.
The driver creates that actor once its first learner update is done (its start would take CPU from
the components'): a request to a run whose folder says RUNNING waits for it, at most CONTROL_WAIT_S.
"""

from __future__ import annotations

import json
import socket
import sys
import time
from pathlib import Path

CONTROL_WAIT_S = 120.0
"""How long `exgrpo scale` waits for a running job's control actor (created after its first learner update)."""


def _address(args) -> str:
    """--address, else the address the run wrote into its folder, else `auto` (the local cluster)."""
    if args.address is not None:
        return args.address
    p = Path(args.runs_root).expanduser() / args.run / "ray_address"
    return p.read_text().strip() if p.is_file() else "auto"


def _run_state(args) -> dict | None:
    """The run's state.json when its folder is under --runs-root (None when it is not there or unreadable)."""
    try:
        state = json.loads((Path(args.runs_root).expanduser() / args.run / "state.json").read_text())
    except (OSError, ValueError):
        return None
    return state if isinstance(state, dict) else None


def _not_running(args, state: dict | None) -> str:
    """What to tell the user when the run's job cannot be reached."""
    folder = Path(args.runs_root).expanduser() / args.run
    if state is None:
        return (f"run {args.run!r} is not running: no job of that name answers and there is no run folder {folder} "
                "(pass --runs-root where the run's folder is, or --address of the cluster it runs on)")
    status, step = state.get("status", "RUNNING"), state.get("step")
    if status != "RUNNING":
        return (f"run {args.run!r} is not running: it ended ({status}{f' at step {step}' if step is not None else ''}); "
                f"to continue it with N generators: exgrpo train --resume {folder} generator.num_generators=N")
    return (f"run {args.run!r} is not running: its folder says RUNNING but its job does not answer (the driver was "
            f"killed?); resume it with: exgrpo train --resume {folder}")


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


def _control(ray, name: str, namespace: str, wait_s: float):
    """The job's control actor; while it is not there, asked again every second for `wait_s` (a run whose folder
    says RUNNING creates it after its first learner update), saying so once. None when it never came."""
    deadline = time.monotonic() + wait_s
    said = False
    while True:
        try:
            return ray.get_actor(name, namespace=namespace)
        except ValueError:
            if time.monotonic() >= deadline:
                return None
        if not said:
            print(f"{name.split('/')[0]}: its folder says RUNNING but its job takes requests only after its first "
                  f"learner update; waiting for it (at most {wait_s:.0f} s)", file=sys.stderr)
            said = True
        time.sleep(1.0)


def scale_main(args) -> int:
    if args.generators is None and args.min_generators is None and args.max_generators is None:
        print("error: exgrpo scale needs --generators N, or --min-generators/--max-generators (autoscale bounds)",
              file=sys.stderr)
        return 2
    from cluster.auth import ClusterAuthError, use_token_auth_when_connecting

    address, state = _address(args), _run_state(args)
    try:
        use_token_auth_when_connecting(address)  # before ray is imported
    except ClusterAuthError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    import ray

    from common.interfaces import actor_name

    if state is not None and state.get("status", "RUNNING") != "RUNNING":
        print(f"error: {_not_running(args, state)}", file=sys.stderr)
        return 2
    why = _unreachable(address)
    if why is not None:
        print(f"error: cannot reach the Ray cluster at {address!r} ({why}); {_not_running(args, state)}",
              file=sys.stderr)
        return 2
    try:
        ray.init(address=address, namespace=args.namespace, log_to_driver=False, logging_level="ERROR")
    except (ConnectionError, RuntimeError) as e:
        print(f"error: cannot reach the Ray cluster at {address!r} ({str(e).splitlines()[0]}); "
              f"{_not_running(args, state)}", file=sys.stderr)
        return 2
    ctl = _control(ray, actor_name(args.run, "control"), args.namespace, wait_s=CONTROL_WAIT_S if state else 0.0)
    if ctl is None:
        print(f"error: no running job named {args.run!r} in namespace {args.namespace!r} at {address}"
              f"{f' (waited {CONTROL_WAIT_S:.0f} s for its first learner update)' if state else ''}; "
              f"{_not_running(args, state)}", file=sys.stderr)
        return 2
    try:
        if args.generators is not None:
            n = ray.get(ctl.set_target.remote(args.generators), timeout=30)
            print(f"{args.run}: generator target set to {n}; the driver applies it before its next batch")
        if args.min_generators is not None or args.max_generators is not None:
            b = ray.get(ctl.set_bounds.remote(args.min_generators, args.max_generators), timeout=30)
            print(f"{args.run}: autoscale bounds set to {', '.join(f'{k}={v}' for k, v in sorted(b.items()))}; "
                  "the driver applies them at its next scaling decision (cluster.autoscale.enabled)")
    except ray.exceptions.RayTaskError as e:
        print(f"error: {e.cause}", file=sys.stderr)
        return 2
    return 0
