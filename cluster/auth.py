"""Ray token authentication for processes that join a cluster. Imports nothing heavy (no ray)."""

from __future__ import annotations

import os
from pathlib import Path


def use_token_auth_when_connecting() -> None:
    """Ray 2.60 starts clusters with token auth on, but a process that *joins* one sends its token
    (~/.ray/auth_token, RAY_AUTH_TOKEN or RAY_AUTH_TOKEN_PATH) only when RAY_AUTH_MODE=token; without
    it the connection retries until it times out. Set it when a token is available and the user chose
    nothing. Ray reads the mode when it is imported, so call this before the first `import ray`."""
    if "RAY_AUTH_MODE" in os.environ:
        return
    if os.environ.get("RAY_AUTH_TOKEN") or os.environ.get("RAY_AUTH_TOKEN_PATH") or (
        Path.home() / ".ray" / "auth_token"
    ).is_file():
        os.environ["RAY_AUTH_MODE"] = "token"
