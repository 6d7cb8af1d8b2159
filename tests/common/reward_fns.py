"""User reward functions for the reward-pool tests (imported by name: tests.common.reward_fns:<fn>)."""

from __future__ import annotations

import os
import sys
import time

import numpy as np


def good(response: str, answer: str) -> float:
    return 1.0 if response.strip() == answer else 0.0


def as_fraction(response: str, answer: str) -> float:
    return int(response) / 100


def raises(response: str, answer: str) -> float:
    raise RuntimeError(f"broken on {response!r}")


def hangs(response: str, answer: str) -> float:
    if response == "hang":
        time.sleep(3600)
    return 1.0


def nan(response: str, answer: str) -> float:
    return float("nan")


def out_of_range(response: str, answer: str) -> float:
    return 1.5


def negative(response: str, answer: str) -> float:
    return -0.1


def string(response: str, answer: str):
    return "1.0"


def none(response: str, answer: str):
    return None


def boolean(response: str, answer: str):
    return response == answer


def numpy_float(response: str, answer: str):
    return np.float32(0.25)


def huge_int(response: str, answer: str):
    return 10**400


def prints(response: str, answer: str) -> float:
    print("noise on stdout \x93\x01", flush=True)
    sys.stdout.buffer.write(b"\xc1\xc1 raw bytes")
    sys.stdout.flush()
    return 1.0


def crashes(response: str, answer: str) -> float:
    if response == "crash":
        os._exit(3)
    return 1.0


def memory_bomb(response: str, answer: str) -> float:
    block = bytearray(64 << 30)  # 64 GiB: refused by the worker's address-space limit
    return float(len(block) > 0)


def tail_check(response: str, answer: str) -> float:
    return 1.0 if len(response) <= 100 and response.endswith("END") else 0.0


not_callable = 3


def zero(response: str, answer: str) -> float:
    return 0.0


def one(response: str, answer: str) -> float:
    return 1.0


def slow_exact(response: str, answer: str) -> float:
    """A reward that takes 20 ms (a verifier with real work to do)."""
    time.sleep(0.02)
    return 1.0 if response.strip() == answer else 0.0


def sleeps(response: str, answer: str) -> float:
    """A verifier that hangs on every input (sympy on a pathological answer, say)."""
    time.sleep(60)
    return 1.0


def hangs_sometimes(response: str, answer: str) -> float:
    """The countdown verifier, except that it hangs on about one response in sixteen."""
    import zlib

    from common.tasks import verify_countdown

    if zlib.crc32(response.encode()) % 16 == 0:
        time.sleep(3600)
    return verify_countdown(response, answer)


_CALLS = [0]


def countdown_slows_down(response: str, answer: str) -> float:
    """The countdown verifier, fast for this process's first 600 calls, then 10 ms a call: a run's generators go
    from faster than its learner to several times slower partway through, by their own progress (test_stale_e2e)."""
    from common.tasks import verify_countdown

    _CALLS[0] += 1
    if _CALLS[0] > 600:
        time.sleep(0.01)
    return verify_countdown(response, answer)


def recurses(response: str, answer: str) -> float:
    """A recursive-descent verifier without a depth bound: RecursionError on a long enough answer."""
    def depth(text: str) -> int:
        return 0 if not text else 1 + depth(text[1:])

    return float(depth(response) > 0)


def exits(response: str, answer: str) -> float:
    """`sys.exit(0)` on `exit`: the worker must answer it, not end."""
    if response == "exit":
        sys.exit(0)
    return 1.0


def broken_message(response: str, answer: str) -> float:
    """Raises with a message msgpack cannot encode (a lone surrogate) on `x`."""
    if response == "x":
        raise ValueError("bad \ud800 surrogate")
    return 1.0
