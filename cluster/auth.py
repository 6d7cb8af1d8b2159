"""Ray token authentication for processes that join a cluster. Imports nothing heavy (no ray).

A joining process must use the cluster's own mode. Ray 2.60's `ray start` turns token auth on when a token
exists (~/.ray/auth_token), but a cluster made another way (`ray.cluster_utils.Cluster`, a `ray start` with
RAY_AUTH_MODE=disabled, an older Ray) runs without it. Both directions of a mismatch fail badly inside Ray:
a joining driver without the token retries its connection until it times out; a driver in token mode joining
a cluster without auth connects, but its own RPC server then refuses the cluster's unauthenticated calls, so
the cluster believes the driver died and cancels every actor it creates (`SchedulingCancelled`). So the mode
is asked of the cluster itself (one RPC to the GCS) before Ray is imported.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path


class ClusterAuthError(Exception):
    """The cluster's authentication and this process's settings cannot work together; the message says what
    to change."""


def _token_available() -> bool:
    return bool(os.environ.get("RAY_AUTH_TOKEN") or os.environ.get("RAY_AUTH_TOKEN_PATH")
                or (Path.home() / ".ray" / "auth_token").is_file())


def loaded_ray_auth_mode() -> str | None:
    """"token" or "disabled": the mode this process's Ray read when it was imported (it reads RAY_AUTH_MODE once);
    None when Ray is not imported yet (or has no token authentication)."""
    raylet = sys.modules.get("ray._raylet")
    if raylet is None or not hasattr(raylet, "get_authentication_mode"):
        return None
    return "token" if raylet.get_authentication_mode() == raylet.AuthenticationMode.TOKEN else "disabled"


def cluster_auth_mode(address: str, timeout_s: float = 5.0) -> str | None:
    """"token" when the GCS at host:port refuses a call without a token, "none" when it answers one, None when
    it cannot be asked (unreachable, not host:port, or an unexpected answer: the caller decides as before)."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or "://" in address:
        return None
    import grpc

    channel = grpc.insecure_channel(address)
    try:
        # Any GCS method works: the token check runs before the method; GetClusterId is cheap and ungated.
        call = channel.unary_unary("/ray.rpc.NodeInfoGcsService/GetClusterId")
        call(b"", timeout=timeout_s)
        return "none"
    except grpc.RpcError as e:
        code = e.code()
        return "token" if code == grpc.StatusCode.UNAUTHENTICATED else None
    finally:
        channel.close()


def use_token_auth_when_connecting(address: str | None = None) -> None:
    """Set RAY_AUTH_MODE for joining the cluster at `address` to the mode that cluster uses. Ray reads the
    mode when it is imported, so call this before the first `import ray`.

    With no address (an embedded Ray: Ray turns token auth on itself) or a cluster that cannot be asked, token
    mode is chosen when a token is available and the user chose nothing. ClusterAuthError when the user's
    RAY_AUTH_MODE contradicts the cluster, or the cluster wants a token and none is available."""
    asked = cluster_auth_mode(address) if address else None
    loaded = loaded_ray_auth_mode()
    if loaded is not None:  # Ray read its mode when this process imported it: what it starts must use the same
        if (asked == "token") != (loaded == "token") and asked is not None:
            raise ClusterAuthError(
                f"the Ray cluster at {address} {'requires' if asked == 'token' else 'runs without'} token "
                f"authentication, but this process imported Ray before its mode was set (it loaded {loaded!r}); set "
                f"RAY_AUTH_MODE={'token' if asked == 'token' else 'disabled'} before importing ray")
        os.environ["RAY_AUTH_MODE"] = loaded  # an embedded Ray's GCS and raylet read it from the environment
        return
    chosen = os.environ.get("RAY_AUTH_MODE")
    if chosen is not None:
        if chosen.lower() == "token" and asked == "none":
            raise ClusterAuthError(
                f"the Ray cluster at {address} runs without token authentication, but RAY_AUTH_MODE=token is set "
                "here; unset RAY_AUTH_MODE to join it (or restart the cluster with token authentication)")
        if chosen.lower() != "token" and asked == "token":
            raise ClusterAuthError(
                f"the Ray cluster at {address} requires token authentication, but RAY_AUTH_MODE={chosen} is set "
                "here; set RAY_AUTH_MODE=token and provide the cluster's token (~/.ray/auth_token, RAY_AUTH_TOKEN "
                "or RAY_AUTH_TOKEN_PATH)")
    elif asked == "none":
        return  # Ray never turns token auth on by itself for an explicit address
    elif _token_available():
        os.environ["RAY_AUTH_MODE"] = "token"
    if asked == "token" and not _token_available():
        raise ClusterAuthError(
            f"the Ray cluster at {address} requires token authentication and no token is available here; copy "
            "the cluster's token to ~/.ray/auth_token (`ray get-auth-token` on its head node prints it) or set "
            "RAY_AUTH_TOKEN")


def unauthenticated_join_warning(address: str) -> str | None:
    """The console's one warning line after this process joined the cluster at `address` without token
    authentication, else None. Its mode was matched to the cluster's before Ray was imported
    (`use_token_auth_when_connecting`), so a join without a token means a cluster without one: anyone who reaches
    its GCS, dashboard or Jobs API can run code there, this run's weights and secrets included."""
    if loaded_ray_auth_mode() == "token":
        return None
    return (f"the Ray cluster at {address} runs without token authentication: anyone who can reach its ports can "
            "run code on it; start it with RAY_AUTH_MODE=token (docs/cluster.md)")
