"""A stored trajectory as one contiguous int32 record: a header of 8 words (digest, version, entropy, the version
its entropy was measured at, times replayed, reward, finish reason and reasoning check), the response's token ids,
then its log-probs as float32. Packing and reading it back are views, not copies.
"""

from __future__ import annotations

import numpy as np

from buffer.keys import make_key
from common.messages import Rollout

# record header (int32 words): digest(2) | version | entropy(f32) | entropy_version | times_replayed | reward(f32) |
# finish index + 256 * (reasoning check + 1)
H = 8
FINISH = ("stop", "length", "abort")
ENGINE_ESTIMATE = -1
"""entropy_version of an estimate made by the generator (not yet measured by the learner)."""


def pack_record(r: Rollout, digest: bytes) -> np.ndarray:
    """Rollout -> one contiguous int32 record."""
    t = len(r.response_ids)
    rec = np.empty(H + 2 * t, dtype=np.int32)  # [8 + 2T]
    rec[0:2] = np.frombuffer(digest, dtype=np.int32)
    rec[2] = r.version
    f = rec.view(np.float32)
    f[3] = r.entropy
    rec[4] = ENGINE_ESTIMATE
    rec[5] = 0
    f[6] = r.reward
    rec[7] = (FINISH.index(r.finish_reason) if r.finish_reason in FINISH else 2) + 256 * (int(r.valid) + 1)
    rec[H : H + t] = r.response_ids
    f[H + t :] = r.logprobs
    return rec


def record_digest(rec: np.ndarray) -> bytes:
    return rec[0:2].tobytes()


def record_entropy(rec: np.ndarray) -> float:
    return float(rec.view(np.float32)[3])


def record_to_rollout(rec: np.ndarray, question_id: str) -> Rollout:
    """The stored trajectory as the replayed rollout of a mixed group (views, no copy)."""
    t = (len(rec) - H) // 2
    f = rec.view(np.float32)
    return Rollout(
        response_ids=rec[H : H + t],
        logprobs=f[H + t :],
        reward=float(f[6]),
        correct=True,
        entropy=float(f[3]),
        version=int(rec[2]),
        finish_reason=FINISH[int(rec[7]) % 256],
        key=make_key(question_id, record_digest(rec)),
        replayed=True,
        valid=int(rec[7]) // 256 - 1,
    )


def record_entropy_version(rec: np.ndarray) -> int:
    return int(rec[4])


def record_times_replayed(rec: np.ndarray) -> int:
    return int(rec[5])


def set_record_entropy(rec: np.ndarray, entropy: float, version: int) -> None:
    """A new entropy measure of the stored trajectory, made under policy `version` (in place)."""
    rec.view(np.float32)[3] = entropy
    rec[4] = version


def set_record_times_replayed(rec: np.ndarray, times: int) -> None:
    rec[5] = times


def with_logprobs(rec: np.ndarray, logprobs) -> np.ndarray | None:
    """A copy of the record with `logprobs` as its behaviour log-probs; None when their length is not the
    response's."""
    t = (len(rec) - H) // 2
    if len(logprobs) != t:
        return None
    new = rec.copy()
    new.view(np.float32)[H + t:] = logprobs
    return new


def record_from_bytes(b: bytes) -> np.ndarray:
    if len(b) < 4 * H or (len(b) - 4 * H) % 8:
        raise ValueError(f"a stored trajectory record of {len(b)} bytes is malformed")
    return np.frombuffer(b, dtype=np.int32).copy()
