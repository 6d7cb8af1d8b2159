"""Ports for tests that start processes which meet over TCP.

    store = rendezvous_store()     # torch ranks in subprocesses: the OS hands the port out, the test holds it
    # a rank: dist.init_process_group("gloo", store=dist.TCPStore("127.0.0.1", port, is_master=False), ...)
    port = port_for_a_server()     # a third party's server (mlflow, ray) that takes a port number, not a socket
"""

from __future__ import annotations

import socket


def rendezvous_store(timeout_s: float = 300):
    """A torch TCPStore server on 127.0.0.1 at a port the OS chose (`store.port`), for ranks started as
    subprocesses to join with `is_master=False`. The socket stays bound from the OS's choice to the last rank's
    exit, so no other process can take the port in between. Keep the store referenced while the ranks run."""
    from learner.collective import listening_store

    return listening_store("127.0.0.1", 0, timeout_s)


def port_for_a_server() -> int:
    """A port that was free a moment ago on 127.0.0.1: bound to port 0, read, and closed. The one place a port is
    found that way, for a server started as a subprocess that takes only a port number (`mlflow server --port`,
    `ray start --head --port`, whose address the fake autoscaler's config must name before the head starts):
    neither can be handed a bound socket. Another process may take the port before the server binds it; the
    server then fails to start, and the test says so."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
