"""Reward worker process: `python -m common.reward_worker <spec>` scores batches sent over stdin.

Protocol (msgpack objects streamed on the worker's stdin/stdout; no pickle):
- worker -> parent, once at start: `["ready"]` or `["failed", message]`.
- parent -> worker: `[[response, answer], ...]` (one chunk).
- worker -> parent: `[reward_or_None, error_or_None]` per item, in order, as each item finishes.
`spec` is a registry name (`math`) or `package.module:function`. The worker's own stdout is moved to stderr, and
a worker never outlives its parent. Why each of these: docs/internals.md#commonreward_workerpy
"""

from __future__ import annotations

import math
import os
import signal
import sys
import threading
import time

import msgpack


def check_value(value: object) -> tuple[float | None, str | None]:
    """(reward, None) for a real number in [0, 1] (bools count as 0/1), else (None, problem)."""
    if isinstance(value, bool):
        return float(value), None
    if not isinstance(value, (int, float)) and not _is_numpy_real(value):
        return None, f"returned a {type(value).__name__}, not a number"
    try:
        x = float(value)
    except (OverflowError, ValueError):
        return None, "returned a number that does not fit a float"
    if not math.isfinite(x) or not 0.0 <= x <= 1.0:
        return None, f"returned {x!r}, outside [0, 1]"
    return x, None


def _is_numpy_real(value: object) -> bool:
    np = sys.modules.get("numpy")
    return np is not None and isinstance(value, (np.integer, np.floating))


def score_one(fn, response: str, answer: str) -> tuple[float | None, str | None]:
    """Call the reward function once; any exception becomes an error string (the caller counts it and scores 0).
    RecursionError and MemoryError on a huge or deeply nested answer, and a `sys.exit` inside a user function, are
    per-answer failures too: the worker answers them and goes on to the next item instead of exiting."""
    try:
        value = fn(response, answer)
    except (Exception, SystemExit) as e:  # a user function may raise anything: reported, counted, scored 0
        return None, f"raised {type(e).__name__}: {_message(e)}"
    return check_value(value)


def _message(e: BaseException) -> str:
    """The first 200 characters of the exception's text, as valid UTF-8 (msgpack refuses lone surrogates)."""
    try:
        text = str(e)[:200]
    except Exception:  # a user exception's own __str__ may be what is broken
        return "(its message could not be read)"
    return text.encode("utf-8", "replace").decode("utf-8")


def main(spec: str) -> None:
    _die_with_parent(os.getppid())
    out = os.fdopen(os.dup(1), "wb", buffering=0)
    os.dup2(2, 1)  # the reward function's prints go to stderr
    sys.stdout = sys.stderr
    _limit_memory()
    try:
        from common.reward_registry import BUILTIN_NAMES, resolve_reward

        fn, _ = resolve_reward(spec)
        if spec in BUILTIN_NAMES:
            score_one(fn, "1", "1")  # warm up (math-verify imports sympy) before the per-call clock runs
    except Exception as e:  # reported to the parent, which scores this worker's items 0
        out.write(msgpack.packb(["failed", f"{type(e).__name__}: {e}"]))
        return
    out.write(msgpack.packb(["ready"]))
    unpacker = msgpack.Unpacker(raw=False, max_buffer_size=1 << 30)
    stdin = sys.stdin.buffer
    while True:
        data = stdin.read1(1 << 20)
        if not data:
            return
        unpacker.feed(data)
        for chunk in unpacker:
            for response, answer in chunk:
                out.write(msgpack.packb(list(score_one(fn, response, answer))))


def _die_with_parent(parent: int, every_s: float = 0.5) -> None:
    """Kill this worker's process group (itself and anything the reward function started) once the
    parent process is gone. A polling thread, not prctl(PR_SET_PDEATHSIG): that signal fires when the
    *thread* that started us ends, and generators start workers from short-lived threads."""
    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(every_s)
        os.killpg(0, signal.SIGKILL)

    if parent > 1:
        threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def _limit_memory() -> None:
    """Cap the address space (EXGRPO_REWARD_MEMORY_MB) so a memory bomb fails inside the worker."""
    mb = int(os.environ.get("EXGRPO_REWARD_MEMORY_MB", "0"))
    if mb > 0:
        import resource

        limit = mb << 20
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


if __name__ == "__main__":
    main(sys.argv[1])
