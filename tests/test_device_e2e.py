"""The device carry is complete before a GPU sees it (issue 43): `scripts/device_e2e.sh --quick` passes from a bare
virtual environment that holds only the GPU image's packages (scripts/device_image.txt, pip-installed by name) plus
the carry built for this machine's Python (`scripts/device_carry.py --python 3.11`). A module the image lacks and the
carry does not bring fails here, not on a lent GPU.

The bare environment is built once per package list and kept in ~/.cache/exgrpo/device-image-venv-<hash> (outside
the checkout, so a clean clone reuses it, as the built-in model's cache): cold ~9 min on 2 cores, then nothing. The
carry's third-party wheels are kept the same way (~1 min cold); the project's wheel is rebuilt on every run.

Differences from the image, on purpose: torch is 2.13.0's CPU wheel (the image has 2.11, a CUDA build: from PyPI a
multi-GB download); today's typer (under huggingface-hub) requires pydantic, which the image lacks, so what the carry
brings is uninstalled from the bare environment after the install (`CARRIED_ELSEWHERE`).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CACHE = Path(os.environ.get("EXGRPO_DEVICE_CACHE", "~/.cache/exgrpo")).expanduser()
TORCH = "torch==2.13.0"  # the image's torch is 2.11 (CUDA); 2.13.0's CPU wheel is on local disk here
TRANSFORMERS = ("transformers==5.17.0", f"transformers=={metadata.version('transformers')}")  # the image's, else ours
CARRIED_ELSEWHERE = ("pydantic", "pydantic-core", "annotated-types", "typing-inspection", "jsonschema",
                     "jsonschema-specifications", "referencing", "rpds-py", "ray", "math-verify",
                     "latex2sympy2-extended", "antlr4-python3-runtime", "mlflow", "vllm")
"""What the image lacks (or only the lacking packages bring): removed from the bare environment if a dependency
of the image's packages pulled it in."""

pytestmark = pytest.mark.slow


def _image_requirements() -> list[str]:
    lines = (ln.split("#", 1)[0].strip() for ln in (ROOT / "scripts/device_image.txt").read_text().splitlines())
    return [ln for ln in lines if ln and ln not in ("torch", "transformers")]


def _bare_env() -> dict[str, str]:
    """This process's environment without the project's .venv (PATH, VIRTUAL_ENV, PYTHONPATH)."""
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME")}
    venv_bin = str(Path(sys.prefix) / "bin")
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep) if p != venv_bin)
    return env


def bare_venv() -> Path:
    """The bare environment's python (built once per package list)."""
    key = hashlib.sha256(json.dumps([sys.version_info[:2], TORCH, TRANSFORMERS, _image_requirements(),
                                     CARRIED_ELSEWHERE]).encode()).hexdigest()[:12]
    venv = CACHE / f"device-image-venv-{key}"
    python = venv / "bin" / "python"
    if (venv / ".done").is_file():
        return python
    tmp = venv.with_name(venv.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    base = getattr(sys, "_base_executable", None) or shutil.which("python3")
    env = _bare_env()
    subprocess.run([base, "-m", "venv", str(tmp)], check=True, env=env)
    pip = [str(tmp / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    for transformers in TRANSFORMERS:
        r = subprocess.run([*pip, TORCH, transformers, *_image_requirements()], env=env, capture_output=True,
                           text=True)
        if r.returncode == 0:
            break
    assert r.returncode == 0, r.stderr[-3000:]
    subprocess.run([str(tmp / "bin" / "python"), "-m", "pip", "uninstall", "-q", "-y", *CARRIED_ELSEWHERE],
                   env=env, capture_output=True)
    (tmp / ".done").write_text("\n".join([TORCH, transformers, *_image_requirements()]))
    # a venv's scripts name their folder: rebuilt in place under the final name would be simpler, but a crash
    # mid-install must not leave a half-built environment marked done, so the prefix is rewritten after the move
    shutil.rmtree(venv, ignore_errors=True)
    tmp.rename(venv)
    for script in (venv / "bin").iterdir():
        if script.is_file() and not script.is_symlink():
            try:
                text = script.read_text()
            except UnicodeDecodeError:
                continue
            script.write_text(text.replace(str(tmp), str(venv)))
    return python


def test_device_e2e_quick_runs_from_the_image_packages_and_the_carry(tmp_path):
    python = bare_venv()
    missing = subprocess.run([str(python), "-c", "import pydantic"], capture_output=True, env=_bare_env())
    assert missing.returncode != 0, "the bare environment holds pydantic: it would hide a carry without it"
    carry = CACHE / "device-carry-py3.11"
    subprocess.run([sys.executable, "scripts/device_carry.py", "--python", "3.11", "--out", str(carry)],
                   cwd=ROOT, check=True, capture_output=True)
    env = dict(_bare_env(), PYTHON=str(python), OUT=str(tmp_path / "out"), DEVICE_CARRY=str(carry),
               DEVICE_SITE=str(tmp_path / "site"), DEVICE_WORK=str(tmp_path / "work"))
    r = subprocess.run(["bash", "scripts/device_e2e.sh", "--quick"], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=1200)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-6000:]
    assert "exgrpo from " + str(tmp_path / "site") in out, out[-3000:]  # the carry's wheel, not the checkout
    fig = json.loads((tmp_path / "out" / "device_e2e.json").read_text())
    assert fig["steps"] >= 4 and fig["learner_step_time_s"] > 0 and fig["generated_tokens_per_s"] > 0, fig
    assert fig["probe_tokens"] > 0 and fig["probe_median_exp_abs_diff"] >= 1.0, fig
    assert "probe: median exp|d|" in out and "skipped" in out  # the table, then tests/gpu skipped without CUDA


def test_the_carry_holds_what_the_image_lacks_and_nothing_it_has():
    """The pins `scripts/device_carry.py` downloads for the device (cp312): ray, pydantic, jsonschema, math-verify
    and the dependencies only they bring; none of the image's packages (torch, transformers, numpy, ...), and no
    MLflow or vLLM (a run without MLflow is offline; vLLM cannot travel)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("device_carry", ROOT / "scripts" / "device_carry.py")
    dc = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(dc)
    names = {pin.split("==")[0] for pin in dc.carried_pins("3.12")}
    assert {"ray", "pydantic", "pydantic-core", "jsonschema", "math-verify", "typing-extensions"} <= names, names
    assert not names & {"torch", "transformers", "numpy", "tokenizers", "safetensors", "aiohttp", "protobuf", "mlflow",
                        "vllm", "sympy", "pyyaml", "requests"}, names
