"""Ray start/connect, run folders, and the small control actor that `exgrpo scale` talks to."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import tempfile
import threading
import time
from collections import Counter
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import ray

from common.config import ClusterConfig, RunConfig, load_saved_config, to_yaml
from common.disk import atomic_write_text
from common.interfaces import actor_name, near_caller

log = logging.getLogger("exgrpo")

# Environment of every actor: vLLM inside Ray actors on CPU needs in-process engines and one OMP
# thread per process; log levels keep vLLM/transformers chatter in the actors' log files.
ACTOR_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "OMP_NUM_THREADS": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "VLLM_LOGGING_LEVEL": "WARNING",
    "TRANSFORMERS_VERBOSITY": "error",
    "RAY_DEDUP_LOGS": "0",
}


def start_ray(cfg: ClusterConfig, run_dir: Path, py_modules: list[str] = ()) -> str:
    """Join `cfg.address`, or start an embedded local Ray with its own temp dir. Returns the GCS address.
    `py_modules`: the user's modules (a reward module) that Ray uploads to every worker of every node."""
    return RayStart(cfg, py_modules).finish(run_dir)


class RayStart:
    """`ray.init` in a background thread, begun as soon as the config's quick checks pass, so that Ray's processes
    start while this process loads the model, tokenizer and data. `finish(run_dir)` waits for it (raising its
    error) and records the address in the run folder; `cancel()`, when nothing will run, stops it and leaves
    nothing behind.

    The thread lives until Ray is shut down: Ray's processes die with the thread that started them (their parent
    death signal is the starting thread's), so a pool thread that ended would take the embedded cluster with it."""

    def __init__(self, cfg: ClusterConfig, py_modules: list[str] = ()):
        self._result: Future = Future()
        self._down = threading.Event()
        _HOLDING.append(self._down)
        threading.Thread(target=self._hold, args=(cfg, list(py_modules)), name="ray-start", daemon=True).start()

    def _hold(self, cfg: ClusterConfig, py_modules: list[str]) -> None:
        try:
            self._result.set_result(_init_ray(cfg, py_modules))
        except BaseException as e:  # noqa: BLE001 (raised in the waiting thread by finish)
            self._result.set_exception(e)
            return
        self._down.wait()

    def finish(self, run_dir: Path) -> str:
        address, temp = self._result.result()
        if temp is not None:  # an embedded Ray's temp folder
            (run_dir / "ray_temp_dir").write_text(temp)
        if "temp" in _OWNED_TEMP:  # ours: its actors' logs go to the run folder at shutdown
            _OWNED_TEMP["logs"] = str(run_dir / "logs" / "ray")
        (run_dir / "ray_address").write_text(address)
        return address

    def cancel(self) -> None:
        try:
            self._result.result()
        except BaseException:  # noqa: BLE001 (a start that failed has nothing left to stop but its temp folder)
            pass
        shutdown_ray()


_HOLDING: list[threading.Event] = []
"""One per thread that started Ray and holds it; shutdown_ray sets them (the thread may end)."""


def _init_ray(cfg: ClusterConfig, py_modules: list[str]) -> tuple[str, str | None]:
    """(the GCS address, the embedded Ray's temp folder or None when joining)."""
    env = dict(ACTOR_ENV)
    # every worker process: our INFO lines to its stderr, kept by Ray and copied into the run's logs/ray
    runtime_env = {"env_vars": env, "worker_process_setup_hook": "cluster.console.setup_worker"}
    if py_modules:
        runtime_env["py_modules"] = list(py_modules)
    # Ray announces its defaults (token auth on, local instance started) at WARNING/INFO on the console;
    # the user's console is for training progress. Token auth itself stays on. Started off the main thread, it
    # says it leaves SIGTERM alone: the run sets its own handlers before anything starts.
    logging.getLogger("ray._private.authentication.authentication_token_setup").setLevel(logging.ERROR)
    worker_log = logging.getLogger("ray._private.worker")
    if not any(isinstance(f, _NotMainThreadNote) for f in worker_log.filters):
        worker_log.addFilter(_NotMainThreadNote())
    temp = None
    if cfg.address:
        ctx = ray.init(address=cfg.address, namespace=cfg.namespace, log_to_driver=False,
                       runtime_env=runtime_env, logging_level=logging.WARNING)
        from cluster.auth import unauthenticated_join_warning

        if warning := unauthenticated_join_warning(cfg.address):
            log.warning(warning)
    else:
        # Unix socket paths are limited to ~107 bytes, so the temp dir stays short (not inside run_dir).
        temp = cfg.temp_dir or tempfile.mkdtemp(prefix="exgrpo-ray-", dir="/tmp")
        if cfg.temp_dir is None:  # ours: removed by shutdown_ray(), even when ray.init fails
            _OWNED_TEMP.update(temp=temp)
        # no idle workers started ahead of the actors (they never take them: each actor starts its own), which
        # on a small machine only take CPU from the start
        ctx = ray.init(address="local", num_cpus=cfg.num_cpus, namespace=cfg.namespace, _temp_dir=temp,
                       include_dashboard=False, log_to_driver=False, runtime_env=runtime_env,
                       logging_level=logging.WARNING,
                       _system_config={"prestart_worker_first_driver": False, "enable_worker_prestart": False})
    return ctx.address_info.get("gcs_address") or ctx.address_info.get("address") or "", temp


class _NotMainThreadNote(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "SIGTERM handler is not set" not in record.getMessage()


def shutdown_ray() -> None:
    """Stop this process's Ray (an embedded one ends with it) and remove the temp folder start_ray
    created, after copying the actors' logs into the run folder's `logs/ray` (when a run folder took them)."""
    if ray.is_initialized():
        ray.shutdown()
    while _HOLDING:
        _HOLDING.pop().set()
    temp, logs = _OWNED_TEMP.pop("temp", None), _OWNED_TEMP.pop("logs", None)
    if temp is None:
        return
    src = Path(temp) / "session_latest" / "logs"
    if logs is not None and src.is_dir():
        try:
            shutil.copytree(src, logs, dirs_exist_ok=True, ignore_dangling_symlinks=True)
            _private(Path(logs))  # Ray makes its log folders 0o777; copied, they are the run's own
        except (OSError, shutil.Error) as e:  # the logs stay where they are, and the line says where
            log.warning("%s", log_copy_failure(e, src, logs))
            return
    shutil.rmtree(temp, ignore_errors=True)


def _private(folder: Path) -> None:
    """Folders under `folder` 0o700 and files 0o600 (what a run writes under its umask 0o077)."""
    for d, dirs, files in os.walk(folder):
        os.chmod(d, 0o700)
        for f in files:
            p = os.path.join(d, f)
            if not os.path.islink(p):
                os.chmod(p, 0o600)


def log_copy_failure(e: OSError | shutil.Error, src: Path, dst: Path) -> str:
    """One line for a failed copy of Ray's logs: how many files, the commonest reason, where they still are
    (shutil.Error carries one (source, destination, reason) per file: thousands on a full disk)."""
    if isinstance(e, shutil.Error) and e.args and isinstance(e.args[0], list):
        reasons = Counter(str(why).split(": '", 1)[0] for *_, why in e.args[0])
        n, (why, _) = len(e.args[0]), reasons.most_common(1)[0]
    else:
        n, why = 1, str(e).split(": '", 1)[0]
    return (f"Ray's logs: {n} file{'s' if n != 1 else ''} not copied to {dst} ({why}); they are still in {src}, "
            "left in place for you (remove that folder when done)")


_OWNED_TEMP: dict[str, str] = {}
"""The embedded Ray's temp folder created by start_ray (`temp`) and where its logs go (`logs`)."""


# ------------------------------------------------------------------------------------------- runs


class RunFolderError(Exception):
    """A run folder that cannot be used as asked (taken, not a run, unwritable, corrupt); the message says
    what to do instead."""


RUN_ENTRIES = frozenset({"config.yaml", "state.json", "checkpoints", "logs", "plots", "buffer-live", "ray_address",
                         "ray_temp_dir", "prompt_example.txt", "metrics-unsent.jsonl", "profile.json"})
"""Every entry a run writes at the top of its folder (the only ones `RunDir.remove_own` removes)."""
_OWN_TEMP = re.compile(r"\.(?:%s)\.(?:\d+-[0-9a-f]{8}\.tmp|tmp-\d+)"
                       % "|".join(re.escape(n) for n in sorted(RUN_ENTRIES)))
"""The temp files `common.disk.atomic_write_bytes` makes for RUN_ENTRIES (`.state.json.<pid>-<random>.tmp`), and
`.state.json.tmp-<pid>` as an earlier release named them."""


def _refuse_unless_empty(path: Path) -> None:
    """RunFolderError when the existing folder `path` holds anything: a new run never adopts a folder with content."""
    found = sorted(p.name for p in path.iterdir())
    if found:
        shown = ", ".join(found[:3]) + (f" and {len(found) - 3} more" if len(found) > 3 else "")
        raise RunFolderError(f"{path} already exists and is not empty ({shown}); a new run goes into a new or empty "
                             "folder: pass name=<new name> or point checkpoint.runs_root elsewhere")


_STATE_LOCK = threading.Lock()
"""state.json's read-modify-write (`RunDir.update_state`) from several threads of one process."""


class RunDir:
    """A run's folder: config.yaml, state.json, checkpoints/step-NNNNNN/, plots/, logs/. Self-contained: every path
    it records is relative to it, so a copied or moved folder resumes from its own checkpoints.

    state.json holds `name`, `mlflow_run_id`, `checkpoints` (oldest first, relative to the folder), `folder` (where
    it was last used: tells a copy from a move), `status` (RUNNING, or how the last attempt ended: FINISHED, KILLED,
    FAILED) and `step` (the last step reached)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.made_folder = False  # `make` created the folder itself (it was not there before)
        self.renamed: list[str] = []  # old names its config.yaml was read under ("learner.lr -> learner.optim.lr")

    @classmethod
    def planned(cls, cfg: RunConfig) -> RunDir:
        """Where a new run of `cfg` goes (nothing is created yet): a folder that does not exist or is empty, never
        one that holds anything (a run may later remove what it wrote there); RunFolderError otherwise."""
        root = Path(cfg.checkpoint.runs_root).expanduser()
        path = root / (cfg.name or time.strftime("run-%Y%m%d-%H%M%S"))
        if (path / "state.json").exists():
            raise RunFolderError(f"{path} already holds a run; pass name=<new name> or resume it with "
                                 f"`exgrpo train --resume {path}`")
        existing = next((p for p in (path, *path.parents) if p.exists()), None)
        if existing is not None and not existing.is_dir():
            raise RunFolderError(f"checkpoint.runs_root: {existing} is a file, not a folder; point "
                                 "checkpoint.runs_root at a folder")
        if existing is not None and not os.access(existing, os.W_OK | os.X_OK):
            raise RunFolderError(f"checkpoint.runs_root: cannot create {path}: {existing} is not writable; "
                                 "point checkpoint.runs_root at a writable folder")
        if existing == path:
            _refuse_unless_empty(path)
        return cls(path)

    @classmethod
    def create(cls, cfg: RunConfig) -> RunDir:
        """`planned(cfg).make(cfg)`."""
        return cls.planned(cfg).make(cfg)

    def make(self, cfg: RunConfig) -> RunDir:
        """Create this planned folder (private: 0700) with config.yaml and state.json; RunFolderError when it cannot
        be made or something else took it meanwhile. `self.made_folder`: whether the folder itself is ours."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            try:
                self.path.mkdir(mode=0o700)
                self.made_folder = True
            except FileExistsError:
                if (self.path / "state.json").exists():
                    raise RunFolderError(f"{self.path} already holds a run; pass name=<new name>") from None
                _refuse_unless_empty(self.path)
            self.save_config(cfg)
            self.write_state({"name": self.path.name, "mlflow_run_id": None, "checkpoints": [],
                              "folder": str(self.path.resolve())})
        except OSError as e:
            raise RunFolderError(f"checkpoint.runs_root: cannot create {self.path} ({e.strerror}); point "
                                 "checkpoint.runs_root at a writable folder") from None
        return self

    def remove_own(self) -> list[str]:
        """Remove what a run writes into its folder (`RUN_ENTRIES` and its own temp files), then the folder itself
        when this run made it and nothing else is left; returns what was left (names of entries it did not write)."""
        if not self.path.is_dir():
            return []
        for entry in self.path.iterdir():
            if entry.name in RUN_ENTRIES or _OWN_TEMP.fullmatch(entry.name):
                if entry.is_dir() and not entry.is_symlink():
                    shutil.rmtree(entry, ignore_errors=True)
                else:
                    entry.unlink(missing_ok=True)
        left = sorted(e.name for e in self.path.iterdir())
        if self.made_folder and not left:
            self.path.rmdir()
        return left

    @property
    def name(self) -> str:
        return self.read_state()["name"]

    def config(self) -> RunConfig:
        """The run's config; keys an earlier release saved under old names are read under their new ones
        (`self.renamed` says which: `resume` writes the file back)."""
        cfg, self.renamed = load_saved_config(self.path / "config.yaml")
        return cfg

    def save_config(self, cfg: RunConfig) -> None:
        atomic_write_text(self.path / "config.yaml", to_yaml(cfg))

    def read_state(self) -> dict[str, Any]:
        """state.json; RunFolderError when the folder is not a run or the file is damaged."""
        p = self.path / "state.json"
        if not p.is_file():
            raise RunFolderError(f"{self.path} is not a run folder (no state.json); "
                                 "pass the folder printed by `exgrpo train`")
        try:
            state = json.loads(p.read_text())
        except (ValueError, OSError) as e:
            state, problem = None, f"{type(e).__name__}: {e}"
        else:
            problem = None if isinstance(state, dict) and isinstance(state.get("name"), str) and isinstance(
                state.get("checkpoints", []), list) and all(isinstance(c, str) for c in state.get(
                    "checkpoints", [])) else "not a mapping with name and checkpoints"
        if problem is not None:
            found = sorted(f"checkpoints/{c.name}" for c in (self.path / "checkpoints").glob("step-*") if c.is_dir())
            raise RunFolderError(
                f"{p} is corrupt ({problem}). It lists the run's name, MLflow run id and checkpoints; restore it "
                'from a backup, or write it again as {"name": "%s", "mlflow_run_id": null, "checkpoints": [%s]} '
                "(oldest first), or start a new run with name=<new name>"
                % (self.path.name, ", ".join(json.dumps(c) for c in found)))
        return state

    def write_state(self, state: dict[str, Any]) -> None:
        atomic_write_text(self.path / "state.json", json.dumps(state, indent=1))

    def update_state(self, **kv: Any) -> None:
        """Set `kv` in state.json; one update at a time in this process (the driver's and the MLflow thread's)."""
        with _STATE_LOCK:
            s = self.read_state()
            s.update(kv)
            self.write_state(s)

    def checkpoint_dir(self, step: int) -> Path:
        return self.path / "checkpoints" / f"step-{step:06d}"

    def entry(self, ckpt: Path) -> str:
        """How state.json lists one of this folder's checkpoints: its path relative to the folder."""
        return Path(ckpt).relative_to(self.path).as_posix()

    def own(self, listed: str) -> Path:
        """The checkpoint that a state.json entry names, inside this folder. An absolute entry (written by an earlier
        release, or before the folder was copied or moved; also one relative to the directory that release ran in) is
        read as this folder's `checkpoints/<its name>`, never the path itself; an entry that leads outside the folder
        is refused and named."""
        rel = Path(listed)
        if len(rel.parts) >= 3 and rel.parts[-2] == "checkpoints" and ".." not in rel.parts:
            rel = Path("checkpoints", rel.name)  # absolute, or relative to where an earlier release was started
        path = self.path / rel
        if rel.is_absolute() or ".." in rel.parts or not path.resolve().is_relative_to(self.path.resolve()):
            raise RunFolderError(f"{self.path / 'state.json'} lists checkpoint {listed!r}, which is outside the run "
                                 "folder; a run reads and deletes only its own files: remove that entry from "
                                 "state.json (its checkpoints are the folders under checkpoints/)")
        return path

    def checkpoints(self) -> list[Path]:
        """The listed checkpoints (oldest first), each inside this folder (`own`)."""
        return [self.own(c) for c in self.read_state().get("checkpoints", [])]

    def list_checkpoints(self, ckpts: list[Path]) -> None:
        """state.json lists exactly `ckpts` (oldest first), relative to the folder."""
        self.update_state(checkpoints=[self.entry(c) for c in ckpts])

    def moved_from(self) -> tuple[Path, bool] | None:
        """(where this folder was last used, whether a run is still there) when that was somewhere else: a move, or,
        when the other folder still holds this run, a copy; None when it is where it was."""
        state = self.read_state()
        before = state.get("folder")
        if before is None:  # saved by an earlier release: where its absolute checkpoint paths lead
            listed = [Path(c) for c in state.get("checkpoints", []) if Path(c).is_absolute()]
            before = str(listed[-1].parent.parent) if listed else None
        if before is None or Path(before) == self.path.resolve():
            return None
        other = RunDir(before)
        try:
            still_there = other.read_state().get("mlflow_run_id") == state.get("mlflow_run_id")
        except RunFolderError:
            still_there = False
        return Path(before), still_there

    def forget_vanished_checkpoints(self) -> str | None:
        """Listed checkpoints that are gone (deleted from outside while the run goes on) leave state.json; returns
        the warning naming them and what is left to resume from (None: every listed one is still there)."""
        listed = self.checkpoints()
        gone = [c for c in listed if not (c / "driver.json").is_file()]
        if not gone:
            return None
        left = [c for c in listed if c not in gone]
        self.list_checkpoints(left)
        return (f"{len(gone)} earlier checkpoint(s) of this run vanished while it ran ({', '.join(map(str, gone))}: "
                "deleted from outside?); " + (f"left to resume from: {', '.join(map(str, left))}" if left else
                                              "nothing is left to resume from until the checkpoint being written is "
                                              "complete"))

    def latest_checkpoint(self) -> Path | None:
        ckpts = self.checkpoints()
        return ckpts[-1] if ckpts else None

    def usable_checkpoint(self, num_shards: int) -> Path | None:
        """The newest listed checkpoint that can be resumed from (None when none was listed). Newer unusable
        ones are renamed `<name>.unusable` (kept for inspection, inside this folder) and dropped from state.json,
        each with a warning saying why. RunFolderError, changing nothing, when checkpoints are listed but none is
        usable."""
        from cluster.preflight import checkpoint_problem

        listed = self.checkpoints()
        bad: list[tuple[Path, str]] = []
        for ckpt in reversed(listed):
            problem = checkpoint_problem(ckpt, num_shards)
            if problem is None:
                break
            bad.append((ckpt, problem))
        else:
            if listed:
                raise RunFolderError(f"{self.path} has no usable checkpoint:\n  " + "\n  ".join(
                    f"{c.name}: {p}" for c, p in bad) + "\n  start a new run with name=<new name> (the run "
                    "folder is left as it is)")
            return None
        good = listed[: len(listed) - len(bad)]
        for ckpt, problem in bad:
            aside = ckpt.with_name(ckpt.name + ".unusable")
            for n in range(2, 1000):
                if not aside.exists():
                    break
                aside = ckpt.with_name(f"{ckpt.name}.unusable-{n}")
            if ckpt.is_dir() and not ckpt.is_symlink():
                ckpt.rename(aside)
            log.warning("checkpoint %s is unusable (%s); moved to %s, resuming from %s", ckpt.name, problem,
                        aside.name, good[-1].name)
        if bad or any(Path(c).is_absolute() for c in self.read_state().get("checkpoints", [])):
            self.list_checkpoints(good)
        return good[-1]


# ---------------------------------------------------------------------------------------- control


@ray.remote(num_cpus=0)
class Control:
    """Named per run (`<run>/control`): holds requests from outside the driver (scale, stop)."""

    def __init__(self, generators: int, configured: dict[str, int] | None = None, autoscale: bool = False):
        self.target = generators
        self.autoscale = autoscale  # cluster.autoscale.enabled: it may bring a run at 0 generators back up
        self.stop_requested = False
        self.configured = dict(configured or {})  # cluster.autoscale's min_generators / max_generators at start
        self.bounds: dict[str, int] = {}  # autoscale bounds set while the run goes on (min_generators, max_generators)

    def set_target(self, n: int) -> int:
        if n < 0:
            raise ValueError(f"--generators must be >= 0, got {n}")
        if n == 0 and not self.autoscale:
            raise ValueError("--generators 0 would leave the run without a generator, and with cluster.autoscale off "
                             "it would never train another step; to stop the run, send its `exgrpo train` SIGTERM "
                             "(Ctrl-C): it stops after the current step with a checkpoint")
        self.target = n
        return n

    def set_bounds(self, min_generators: int | None, max_generators: int | None) -> dict[str, int]:
        """Change cluster.autoscale's bounds of the running job; returns them (only those ever set)."""
        new = {**self.bounds, **{k: v for k, v in (("min_generators", min_generators),
                                                    ("max_generators", max_generators)) if v is not None}}
        if any(v < 0 for v in new.values()):
            raise ValueError(f"autoscale bounds must be >= 0, got {new}")
        lo, hi = ({**self.configured, **new}.get(k) for k in ("min_generators", "max_generators"))
        if lo is not None and hi is not None and lo > hi:
            raise ValueError(f"min_generators {lo} would exceed max_generators {hi} (set with --min-generators / "
                             "--max-generators, else from cluster.autoscale); change both together")
        self.bounds = new
        return new

    def get(self) -> dict[str, Any]:
        return {"target": self.target, "stop": self.stop_requested, "bounds": dict(self.bounds)}

    def request_stop(self) -> None:
        self.stop_requested = True


def create_control(run: str, namespace: str, generators: int, autoscale_bounds: dict[str, int] | None = None,
                   autoscale: bool = False):
    return Control.options(name=actor_name(run, "control"), namespace=namespace, lifetime=None,
                           **near_caller()).remote(generators, autoscale_bounds, autoscale)
