"""What per-layer compile costs a run after its first step: inductor's cache across processes, and a watch on
recompiles (`learner.levers.apply_compile` builds the graphs; `learner.trial` builds them before the first step).

    note = enable_cache()                         # FX graph + AOTAutograd caches on, in TORCHINDUCTOR_CACHE_DIR
    load_compile_cache("/data/cc.bin")            # a lease's start: the kernels the last lease built (False: none)
    watch = RecompileWatch()                      # at a step's start
    ...                                           # the step
    n = watch.done("step 7")                      # graphs compiled during it; one line naming the guard if n > 0
    save_compile_cache("/data/cc.bin")            # a lease's end: every kernel this process compiled, in one file

Nothing here raises. Why (compile times measured), counting recompiles: docs/internals.md#learnercompile_cachepy
"""

from __future__ import annotations

import gzip
import logging
import os
import sys
from pathlib import Path

import torch

from common.disk import atomic_write_bytes
from common.text import one_line

log = logging.getLogger(__name__)


def cache_dir() -> str:
    """Inductor's on-disk cache folder (TORCHINDUCTOR_CACHE_DIR, else torch's default under the temp dir)."""
    try:
        from torch._inductor.runtime.cache_dir_utils import cache_dir as inductor_cache_dir

        return inductor_cache_dir()
    except ImportError:  # an older torch: the variable or torch's documented default
        return os.environ.get("TORCHINDUCTOR_CACHE_DIR", "/tmp/torchinductor_" + os.environ.get("USER", "user"))


def enable_cache(folder: str | None = None) -> str:
    """Turn on inductor's FX graph cache and AOTAutograd's cache (process-wide; torch's defaults, made sure of),
    so that a later process reuses the compiled kernels; returns a note naming the folder. `folder`
    (`learner.levers.compile_cache_dir`) becomes TORCHINDUCTOR_CACHE_DIR, which inductor reads at each compile: set
    before the first one, every later compile of this process reads and writes there (on shared storage: every
    node's)."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    if folder:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = folder
    inductor_config.fx_graph_cache = True
    if hasattr(functorch_config, "enable_autograd_cache"):
        functorch_config.enable_autograd_cache = True
    return (f"inductor's cache in {cache_dir()} (learner.levers.compile_cache_dir), reused by every rank that "
            "reaches it"
            if folder else f"inductor's cache in {cache_dir()} (TORCHINDUCTOR_CACHE_DIR), reused by later processes "
                           "on this machine")


def save_compile_cache(path: str | Path) -> int | None:
    """Write every compiled artifact of this process (`torch.compiler.save_cache_artifacts`) to `path`; returns
    its bytes, or None (one log line) where there is nothing to save or torch cannot."""
    save = getattr(torch.compiler, "save_cache_artifacts", None)
    if save is None:
        log.info("compile cache not saved: torch %s has no torch.compiler.save_cache_artifacts", torch.__version__)
        return None
    try:
        saved = save()
    except Exception as e:  # noqa: BLE001 -- torch's own failure to serialise: the run goes on without the file
        log.warning("compile cache not saved to %s: %s: %s", path, type(e).__name__, e)
        return None
    if saved is None:
        log.info("compile cache not saved to %s: nothing was compiled in this process", path)
        return None
    data = saved[0]
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(path, data)  # whole or not at all: a lease cut short leaves the previous file
    log.info("compile cache saved: %s (%.1f MB)", path, len(data) / 1e6)
    return len(data)


def load_compile_cache(path: str | Path) -> bool:
    """Load a file `save_compile_cache` wrote (`torch.compiler.load_cache_artifacts`) before anything compiles,
    gzip'd where its name ends in .gz (as scripts/device_out.py brings a lease's back); True when loaded, else False
    with one log line (no file, a torch without the call, a file it refuses)."""
    path = Path(path)
    load = getattr(torch.compiler, "load_cache_artifacts", None)
    if load is None:
        log.info("compile cache not loaded: torch %s has no torch.compiler.load_cache_artifacts", torch.__version__)
        return False
    if not path.is_file():
        log.info("compile cache not loaded: no file %s (the first lease on this setup compiles from scratch)", path)
        return False
    try:
        data = path.read_bytes()
        info = load(gzip.decompress(data) if path.suffix == ".gz" else data)
    except Exception as e:  # noqa: BLE001 -- a file of another torch or a corrupt one: compile from scratch
        log.warning("compile cache %s not loaded (compiling from scratch): %s: %s", path, type(e).__name__, e)
        return False
    if info is None:  # torch refused the bytes (and said why in its own log)
        log.warning("compile cache %s not loaded (compiling from scratch): torch could not read it", path)
        return False
    log.info("compile cache loaded: %s (%.1f MB)", path, path.stat().st_size / 1e6)
    return True


def load_compile_cache_folder(folder: str | Path) -> list[str]:
    """`load_compile_cache` of every artifact file in `folder` (*.bin, and *.bin.gz as scripts/device_out.py brings
    a lease's back), before anything compiles: the names loaded ([] where there is no such folder)."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    files = sorted([*folder.glob("*.bin"), *folder.glob("*.bin.gz")])
    return [f.name for f in files if load_compile_cache(f)]


def compiled_graphs() -> int:
    """Graphs torch.compile has built in this process so far (dynamo's `counters["stats"]["unique_graphs"]`; 0
    before dynamo is imported, which a run without compile then never pays for)."""
    if "torch._dynamo" not in sys.modules:
        return 0
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def _guard_failures() -> dict:
    """{code object: how many guard failures dynamo has recorded for it} (one per cache entry it tried before each
    recompile; `torch._dynamo.utils.guard_failures`)."""
    if "torch._dynamo" not in sys.modules:
        return {}
    from torch._dynamo.utils import guard_failures

    return {code: len(reasons) for code, reasons in guard_failures.items()}


def _new_guard_failures(before: dict) -> list[str]:
    from torch._dynamo.utils import guard_failures

    return [r for code, reasons in guard_failures.items() for r in reasons[before.get(code, 0):]]


class RecompileWatch:
    """Graphs compiled between its construction and `done()`: 0 in a step after the trial (`learner.trial`)
    compiled the graphs the step uses. `done` logs one line naming the guard that failed when it is not 0 (each
    cached graph's failed guard, as dynamo records them: `0/1: tensor 'hidden_states' ... mismatch`)."""

    def __init__(self) -> None:
        watch_recompile_limit()
        self.graphs, self.failures = compiled_graphs(), _guard_failures()

    def done(self, what: str = "the step", rank: int = 0) -> int:
        """Graphs compiled since the watch began; `what` names the span in the log line (rank 0 logs it)."""
        n = compiled_graphs() - self.graphs
        if n > 0 and rank == 0:
            reasons = _new_guard_failures(self.failures)
            log.warning("learner: %d graph(s) compiled during %s (a compile stall after the warm-up): %s", n, what,
                        "guard failed: " + one_line(" | ".join(reasons), 400, placeholder="...")
                        if reasons else
                        "a first compile of code the setup's trial did not run (no guard failed)")
        return n


class _RecompileLimitHandler(logging.Handler):
    """Dynamo's "hit config.recompile_limit" warning as one WARNING line of ours: past it the function runs eager
    for the rest of the process (a silent slowdown otherwise; torch's own logging may not reach our log)."""

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if "hit config." in message:
            head = one_line(message.split("To log all recompilation reasons")[0], 300, placeholder="...")
            log.warning("learner.levers.compile: dynamo's recompile limit reached, the function below runs EAGER from "
                        "now on (slow; raise torch._dynamo.config.recompile_limit or remove the recompile): %s", head)


_HANDLER = _RecompileLimitHandler(level=logging.WARNING)


def watch_recompile_limit() -> None:
    """Route dynamo's recompile-limit warning to this module's logger (idempotent, process-wide)."""
    dynamo_log = logging.getLogger("torch._dynamo.convert_frame")
    if _HANDLER not in dynamo_log.handlers:
        dynamo_log.addHandler(_HANDLER)
