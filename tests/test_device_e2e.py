"""The device carry is complete before a GPU sees it (issue 43): `scripts/device_e2e.sh --quick` passes from a bare
virtual environment that holds only the GPU image's packages (scripts/device_image.txt) plus the carry built for
this machine's Python (`scripts/device_carry.py --python 3.11`). A module the image lacks and the carry does not
bring fails here, not on a lent GPU. Its learning run is ExGRPO's own machinery (issue 50): mixed mode switches on,
stored trajectories are replayed in the learner's step, rewards are above 0, and the summary judges it; the summary
is printed from whatever the parts left (`bench/device_e2e.py summary`, tested here on hand-made parts too).

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


@pytest.mark.slow
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


@pytest.mark.slow
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
    learn, probe, parts = fig["learning"], fig["probe"], {p["name"]: p for p in fig["parts"]}
    # ExGRPO's machinery ran: the switch, o* candidates shipped and scored, mixed groups trained with replayed tokens
    assert learn["mixed_mode"] == 1 and learn["mixed_from_step"] >= 1, learn
    assert learn["replayed_rows"] > 0 and learn["replayed_tokens"] > 0, learn
    assert learn["candidates_shipped"] > 0 and learn["candidates_scored"] > 0, learn
    assert learn["reward_max"] > 0 and learn["steps"] >= 1, learn
    # the first update's time: measured from the process's start, so within the learning part's own seconds
    assert 0 < learn["first_update_s"] <= parts["learning run"]["seconds"], (learn, parts)
    assert probe["tokens"] > 0 and probe["median_exp_abs_diff"] >= 1.0 and probe["generated_tokens_per_s"] > 0, probe
    assert fig["passed"] and {g["gate"] for g in fig["gates"] if g["passed"] is None} >= {"reward rising"}, fig
    assert "device_e2e: PASSED" in out and "skipped" in out  # the summary; tests/gpu skipped without CUDA
    # $OUT holds what one device call brings back (scripts/device_out.py): the summary's files, the rest packed; no
    # compile cache, since nothing compiled (tests/gpu skipped)
    back = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert back == ["device_e2e.json", "device_e2e.log", "parts.tsv", "results.tar.gz"], back
    subprocess.run([sys.executable, "scripts/device_out.py", "unpack", str(tmp_path / "out"), str(tmp_path / "back")],
                   cwd=ROOT, check=True, capture_output=True)
    assert (tmp_path / "back" / "run" / "metrics-unsent.jsonl").is_file(), sorted(os.listdir(tmp_path / "back"))
    assert "skipped" in (tmp_path / "back" / "pytest-gpu.log").read_text()


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


def _device_e2e():
    import importlib.util

    spec = importlib.util.spec_from_file_location("device_e2e", ROOT / "bench" / "device_e2e.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _points(path: Path, series: dict[str, list[float]]) -> None:
    """A metrics-unsent.jsonl as the offline tracker writes it: one point per line, steps from 1."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for key, values in series.items():
            for step, v in enumerate(values, 1):
                f.write(json.dumps({"key": key, "value": v, "timestamp": 0, "step": step}) + "\n")
        f.write('{"key": "train/reward_mean", "val')  # a line cut short by a killed run


def test_the_summary_judges_a_run_that_replayed_and_prints_the_parts_that_did_not_finish(tmp_path, capsys):
    """Six steps: mixed mode from step 3, one mixed group at steps 4-6 (3 replayed rows), rewards 0.2, 0.2, 0.3, 0.3,
    0.4, 0.4 (first third's mean 0.2, last third's 0.4: rising), first update 42 s; the probe ran, tests/gpu ran out of
    time after two tests passed. Every gate but tests/gpu passes; the summary says so and exits 1."""
    de = _device_e2e()
    out, run = tmp_path / "out", tmp_path / "run"
    _points(run / de.UNSENT_FILE, {
        "train/reward_mean": [0.2, 0.2, 0.3, 0.3, 0.4, 0.4], "train/mixed_mode": [0, 0, 1, 1, 1, 1],
        "train/mixed_groups": [0, 0, 0, 1, 1, 1], "learner/replay_tokens": [0, 0, 0, 5, 6, 7],
        "buffer/candidates_shipped": [0, 0, 2, 4, 9, 9], "driver/first_update_s": [42.0]})
    out.mkdir()
    (out / "parts.tsv").write_text("carry install\t0\t2.0\t60\t\nlearning run\t0\t80.5\t110\t\n"
                                   "mismatch probe\t0\t20.0\t45\t\ntests/gpu\t124\t40.0\t40\t\n")
    (out / "probe.json").write_text(json.dumps({
        "tokens": 4000, "median_exp_abs_diff": 1.004, "mean_abs_diff": 0.004, "max_abs_diff": 0.05, "kl_k3": 2e-5,
        "kl_k1": 1e-5, "generated_tokens_per_s": 9000.0, "scored_tokens_per_s": 50000.0, "train_tokens_per_s": 20000.0,
        "parameters": 3.6e8, "device": "cuda", "dtype": "bfloat16"}))
    (out / "pytest-gpu.log").write_text("tests/gpu/test_a.py::test_x PASSED\ntests/gpu/test_a.py::test_y PASSED\n")
    assert de.summary(out, run, quick=False, budget_s=240, whole_s=230.0, device="cuda (test)") == 1
    text = capsys.readouterr().out
    fig = json.loads((out / "device_e2e.json").read_text())
    assert fig["learning"]["replayed_rows"] == 3 and fig["learning"]["mixed_from_step"] == 3, fig["learning"]
    assert fig["learning"]["reward_first"] == pytest.approx(0.2) and fig["learning"]["reward_last"] == pytest.approx(0.4)
    assert fig["learning"]["candidates_shipped"] == 9 and fig["learning"]["first_update_s"] == 42.0
    judged = {g["gate"]: g["passed"] for g in fig["gates"]}
    assert [g for g, ok in judged.items() if not ok] == ["tests/gpu passed"], judged
    assert "2 passed before it stopped (out of time)" in text and "FAILED (9 of 10 gates; failed: tests/gpu passed)" in text
    assert len(text.splitlines()) <= 30  # one screen


def test_the_summary_of_a_check_whose_parts_never_ran_fails_every_gate_it_cannot_judge(tmp_path, capsys):
    """The carry failed: no parts ran, no run folder, no probe. The summary still prints, and --quick judges the
    replay, reward, probe and tests/gpu gates (all failed) and shows the rest."""
    de = _device_e2e()
    out = tmp_path / "out"
    out.mkdir()
    (out / "parts.tsv").write_text("carry install\t2\t0.5\t60\tdevice-carry into /tmp/site\n")
    assert de.summary(out, None, quick=True, budget_s=900, whole_s=1.0, device="cpu") == 1
    fig = json.loads((out / "device_e2e.json").read_text())
    assert {g["gate"]: g["passed"] for g in fig["gates"]} == {
        "replayed rows > 0": False, "mixed mode on": False, "candidates shipped > 0": False, "rewards > 0": False,
        "reward rising": None, "first update <= 60 s": None, "probe median exp|d| < 1.1": False,
        "probe KL < 0.0005": False, "tests/gpu passed": False, "whole check <= 900 s": None}
    assert "failed (2)" in capsys.readouterr().out
