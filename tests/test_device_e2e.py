"""The device carry is complete before a GPU sees it (issue 43): `scripts/device_e2e.sh --quick` passes from a bare
virtual environment that holds only the GPU image's packages (scripts/device_image.txt) plus the carry built for
this machine's Python (`scripts/device_carry.py --python 3.11`). A module the image lacks and the carry does not
bring fails here, not on a lent GPU.

The bare environment is a link farm, built in seconds on every run: a venv without site-packages of its own
(`--without-pip`) whose site-packages holds a symbolic link to every installed file of the image's distributions
and of what they require (their metadata's requirements, markers evaluated, extras left out), taken from this
.venv, except what the carry brings (`CARRIED_ELSEWHERE`: the traversal stops there, so a package that only those
require is left out too). It was a pip install of the same list (~9 minutes cold on 2 cores, most of the suite's
growth).

Differences from the image, on purpose: the versions are this .venv's (torch 2.13.0's CPU build, not the image's
2.11 CUDA build; transformers as installed here), and the image's pip is this .venv's.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
CACHE = Path(os.environ.get("EXGRPO_DEVICE_CACHE", "~/.cache/exgrpo")).expanduser()
CARRIED_ELSEWHERE = ("pydantic", "pydantic-core", "annotated-types", "typing-inspection", "jsonschema",
                     "jsonschema-specifications", "referencing", "rpds-py", "ray", "math-verify",
                     "latex2sympy2-extended", "antlr4-python3-runtime", "mlflow", "vllm")
"""What the image lacks (or only the lacking packages bring): never linked into the bare environment."""

pytestmark = pytest.mark.slow


def _image_requirements() -> list[str]:
    lines = (ln.split("#", 1)[0].strip() for ln in (ROOT / "scripts/device_image.txt").read_text().splitlines())
    return [ln for ln in lines if ln] + ["pip"]


def _bare_env() -> dict[str, str]:
    """This process's environment without the project's .venv (PATH, VIRTUAL_ENV, PYTHONPATH)."""
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME")}
    venv_bin = str(Path(sys.prefix) / "bin")
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep) if p != venv_bin)
    return env


def image_closure(roots: list[str]) -> list[metadata.Distribution]:
    """The installed distributions `roots` need: each root and, transitively, its requirements whose markers hold
    here (no extras), never entering CARRIED_ELSEWHERE. KeyError-free: a requirement not installed here is left out
    (its marker excluded it, or the image does not need it to import what we use)."""
    skip = {canonicalize_name(n) for n in CARRIED_ELSEWHERE}
    seen: dict[str, metadata.Distribution] = {}
    todo = [canonicalize_name(r) for r in roots]
    while todo:
        name = todo.pop()
        if name in seen or name in skip:
            continue
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
        seen[name] = dist
        for spec in dist.requires or []:
            req = Requirement(spec)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(canonicalize_name(req.name))
    return list(seen.values())


def bare_venv(where: Path) -> Path:
    """A venv at `where` holding links to the image closure's files; returns its python."""
    base = getattr(sys, "_base_executable", None) or "python3"
    subprocess.run([base, "-m", "venv", "--without-pip", str(where)], check=True, env=_bare_env())
    site = where / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}" / "site-packages"
    for dist in image_closure(_image_requirements()):
        for rel in dist.files or []:
            if rel.parts and rel.parts[0] == "..":  # console scripts: `python -m` runs everything here
                continue
            src, dst = Path(dist.locate_file(rel)), site / rel
            if src.is_file() and not dst.exists():
                dst.parent.mkdir(parents=True, exist_ok=True)
                dst.symlink_to(src)
    return where / "bin" / "python"


def test_the_bare_environment_has_the_images_packages_and_not_the_carrys(tmp_path):
    python = bare_venv(tmp_path / "venv")
    names = {canonicalize_name(d.metadata["Name"]) for d in image_closure(_image_requirements())}
    assert {"torch", "transformers", "numpy", "safetensors", "tokenizers", "pip"} <= names, names
    assert not names & {canonicalize_name(n) for n in CARRIED_ELSEWHERE}, names
    probe = ("import torch, transformers, msgpack, yaml, pytest, pip; import importlib.util as u; "
             "print(torch.__version__, [m for m in ('pydantic', 'ray', 'mlflow', 'vllm', 'jsonschema') if u.find_spec(m)])")
    r = subprocess.run([str(python), "-c", probe], capture_output=True, text=True, env=_bare_env(), cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert re.search(r"^\S+ \[\]$", r.stdout.strip()), r.stdout  # torch imports; none of the carried ones do


def test_device_e2e_quick_runs_from_the_image_packages_and_the_carry(tmp_path):
    python = bare_venv(tmp_path / "venv")
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
