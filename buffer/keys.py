"""Stable identities: trajectory keys and the question -> shard partition.

Both use blake2b, never Python's `hash()` (which is salted per process), so every process — client,
shard, generator, learner — agrees on them across restarts.
"""

from __future__ import annotations

import hashlib

import numpy as np


def response_digest(response_ids: np.ndarray) -> bytes:
    """8-byte blake2b digest of a response's int32 token ids (the dedup identity of a trajectory)."""
    ids = np.ascontiguousarray(response_ids, dtype="<i4")
    return hashlib.blake2b(ids.tobytes(), digest_size=8).digest()


def trajectory_key(question_id: str, response_ids: np.ndarray) -> str:
    """`f"{question_id}#{digest}"` with digest = 16 hex chars of blake2b over the response ids' bytes."""
    return f"{question_id}#{response_digest(response_ids).hex()}"


def make_key(question_id: str, digest: bytes) -> str:
    return f"{question_id}#{digest.hex()}"


def split_key(key: str) -> tuple[str, bytes]:
    """key -> (question_id, 8-byte digest). Raises ValueError for a key not made by `trajectory_key`."""
    qid, sep, hexdigest = key.rpartition("#")
    if not sep or len(hexdigest) != 16:
        raise ValueError(f"trajectory key {key[:80]!r} is not of the form '<question_id>#<16 hex chars>'")
    return qid, bytes.fromhex(hexdigest)


def shard_of(question_id: str, num_shards: int) -> int:
    """The shard owning a question: blake2b(question_id) mod num_shards."""
    h = hashlib.blake2b(question_id.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(h, "little") % num_shards
