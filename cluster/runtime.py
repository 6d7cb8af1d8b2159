"""Ray start/connect, run folders, and the small control actor that `exgrpo scale` talks to."""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import ray

from common.config import ClusterConfig, RunConfig, load_config, to_yaml
from common.interfaces import actor_name

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


def start_ray(cfg: ClusterConfig, run_dir: Path) -> str:
    """Join `cfg.address`, or start an embedded local Ray with its own temp dir. Returns the GCS address."""
    env = dict(ACTOR_ENV)
    # Ray announces its defaults (token auth on, local instance started) at WARNING/INFO on the console;
    # the user's console is for training progress. Token auth itself stays on.
    logging.getLogger("ray._private.authentication.authentication_token_setup").setLevel(logging.ERROR)
    if cfg.address:
        ctx = ray.init(address=cfg.address, namespace=cfg.namespace, log_to_driver=False,
                       runtime_env={"env_vars": env}, logging_level=logging.WARNING)
    else:
        # Unix socket paths are limited to ~107 bytes, so the temp dir stays short (not inside run_dir).
        temp = cfg.temp_dir or tempfile.mkdtemp(prefix="exgrpo-ray-", dir="/tmp")
        if cfg.temp_dir is None:  # ours: removed by shutdown_ray(), even when ray.init fails
            _OWNED_TEMP.update(temp=temp, logs=str(run_dir / "logs" / "ray"))
        ctx = ray.init(address="local", num_cpus=cfg.num_cpus, namespace=cfg.namespace, _temp_dir=temp,
                       include_dashboard=False, log_to_driver=False, runtime_env={"env_vars": env},
                       logging_level=logging.WARNING)
        (run_dir / "ray_temp_dir").write_text(temp)
    address = ctx.address_info.get("gcs_address") or ctx.address_info.get("address") or ""
    (run_dir / "ray_address").write_text(address)
    return address


def shutdown_ray() -> None:
    """Stop this process's Ray (an embedded one ends with it) and remove the temp folder start_ray
    created, after copying the actors' logs into the run folder's `logs/ray`."""
    if ray.is_initialized():
        ray.shutdown()
    temp, logs = _OWNED_TEMP.pop("temp", None), _OWNED_TEMP.pop("logs", None)
    if temp is None:
        return
    src = Path(temp) / "session_latest" / "logs"
    if src.is_dir():
        try:
            shutil.copytree(src, logs, dirs_exist_ok=True, ignore_dangling_symlinks=True)
        except (OSError, shutil.Error) as e:  # keep going: the temp folder must not pile up in /tmp
            log.warning("could not copy Ray's logs from %s to %s: %s", src, logs, e)
    shutil.rmtree(temp, ignore_errors=True)


_OWNED_TEMP: dict[str, str] = {}
"""The embedded Ray's temp folder created by start_ray (`temp`) and where its logs go (`logs`)."""


# ------------------------------------------------------------------------------------------- runs


class RunDir:
    """A run's folder: config.yaml, state.json, checkpoints/step-NNNNNN/, plots/, logs/."""

    def __init__(self, path: str | Path):
        self.path = Path(path)

    @classmethod
    def create(cls, cfg: RunConfig) -> RunDir:
        root = Path(cfg.checkpoint.runs_root).expanduser()
        name = cfg.name or time.strftime("run-%Y%m%d-%H%M%S")
        path = root / name
        if (path / "state.json").exists():
            raise FileExistsError(f"{path} already holds a run; pass name=<new name> or resume it with "
                                  f"`exgrpo train --resume {path}`")
        path.mkdir(parents=True, exist_ok=True)
        rd = cls(path)
        (path / "config.yaml").write_text(to_yaml(cfg))
        rd.write_state({"name": name, "mlflow_run_id": None, "checkpoints": []})
        return rd

    @property
    def name(self) -> str:
        return self.read_state()["name"]

    def config(self) -> RunConfig:
        return load_config(self.path / "config.yaml")

    def read_state(self) -> dict[str, Any]:
        p = self.path / "state.json"
        if not p.is_file():
            raise FileNotFoundError(f"{self.path} is not a run folder (no state.json); "
                                    "pass the folder printed by `exgrpo train`")
        return json.loads(p.read_text())

    def write_state(self, state: dict[str, Any]) -> None:
        atomic_write_text(self.path / "state.json", json.dumps(state, indent=1))

    def update_state(self, **kv: Any) -> None:
        s = self.read_state()
        s.update(kv)
        self.write_state(s)

    def checkpoint_dir(self, step: int) -> Path:
        return self.path / "checkpoints" / f"step-{step:06d}"

    def latest_checkpoint(self) -> Path | None:
        ckpts = self.read_state().get("checkpoints", [])
        return Path(ckpts[-1]) if ckpts else None


def atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


# ---------------------------------------------------------------------------------------- control


@ray.remote(num_cpus=0)
class Control:
    """Named per run (`<run>/control`): holds requests from outside the driver (scale, stop)."""

    def __init__(self, generators: int):
        self.target = generators
        self.stop_requested = False

    def set_target(self, n: int) -> int:
        if n < 0:
            raise ValueError(f"--generators must be >= 0, got {n}")
        self.target = n
        return n

    def get(self) -> dict[str, Any]:
        return {"target": self.target, "stop": self.stop_requested}

    def request_stop(self) -> None:
        self.stop_requested = True


def create_control(run: str, namespace: str, generators: int):
    return Control.options(name=actor_name(run, "control"), namespace=namespace, lifetime=None).remote(generators)
