"""The device carry is complete before a GPU sees it (issue 43): `scripts/device_e2e.sh --quick` passes from a bare
virtual environment that holds only the GPU image's packages (scripts/device_image.txt) plus the carry built for
this machine's Python (`scripts/device_carry.py --python 3.11`). A module the image lacks and the carry does not
bring fails here, not on a lent GPU. Its learning run is ExGRPO's own machinery (issue 50): mixed mode switches on,
stored trajectories are replayed in the learner's step, rewards are above 0, and the summary judges it. Its real-width
run (issue 73) trains the built-in model widened to 512 with the learner's compile on (aot_eager here: dynamo and
AOTAutograd, no inductor kernels) and no graph compiled after its first step. The summary is printed from whatever
the parts left (`bench/device_e2e.py summary`, tested here on hand-made parts too); the real-width run's inductor
cache goes from one lease to the next through scripts/device_out.py (tested here on a hand-made cache).

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
               DEVICE_SITE=str(tmp_path / "site"), DEVICE_WORK=str(tmp_path / "work"),
               DEVICE_E2E_COMPILE_CACHE=str(tmp_path / "no-carried-cache"))
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
    # the real-width run: the built-in model at 512 wide learns with its decoder layers compiled by the setup's trial
    # (aot_eager on the CPU, said so), and no graph is compiled after its first step
    wide, wide_part = fig["real_width"], parts["real-width run"]
    assert wide_part["rc"] == 0 and wide["hidden_size"] == 512 and wide["steps"] >= 2, (wide, wide_part)
    assert wide["compile_on"] and wide["compile_backend"] == "aot_eager" and wide["trial_graphs"] > 0, wide
    assert wide["recompiles_after_first_step"] == 0 and wide["reward_max"] > 0, wide
    assert 0 < wide["first_update_s"] <= wide_part["seconds"], (wide, wide_part)
    assert wide["cache_in"] == {"carried": False, "files": 0, "bytes": 0}, wide
    assert wide["cache_out"]["left_out"] == "nothing compiled", wide  # aot_eager generates no inductor kernels
    assert "inductor NOT exercised" in out, out[-3000:]
    assert probe["tokens"] > 0 and probe["median_exp_abs_diff"] >= 1.0 and probe["generated_tokens_per_s"] > 0, probe
    assert fig["passed"] and {g["gate"] for g in fig["gates"] if g["passed"] is None} >= {"reward rising"}, fig
    assert "device_e2e: PASSED" in out and "skipped" in out  # the summary; tests/gpu skipped without CUDA
    # $OUT holds what one device call brings back (scripts/device_out.py): the summary's files, the rest packed; no
    # compile cache, since inductor compiled nothing (tests/gpu skipped, the real-width run under aot_eager)
    back = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert back == ["device_e2e.json", "device_e2e.log", "parts.tsv", "results.tar.gz"], back
    subprocess.run([sys.executable, "scripts/device_out.py", "unpack", str(tmp_path / "out"), str(tmp_path / "back")],
                   cwd=ROOT, check=True, capture_output=True)
    assert (tmp_path / "back" / "run" / "metrics-unsent.jsonl").is_file(), sorted(os.listdir(tmp_path / "back"))
    assert (tmp_path / "back" / "wide-run" / "metrics-unsent.jsonl").is_file(), sorted(os.listdir(tmp_path / "back"))
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


def _real_width_run(run: Path, model: Path, first_update_s: float, recompiles: list[float]) -> None:
    """A real-width run folder as `exgrpo train` leaves it: metric points, its learner's start line in a Ray log,
    state.json, config.yaml naming its model, whose config.json says 1024 wide."""
    _points(run / "metrics-unsent.jsonl", {
        "train/reward_mean": [0.3, 0.4, 0.4], "train/mixed_mode": [0, 1, 1], "train/mixed_groups": [0, 0, 2],
        "learner/replay_tokens": [0, 0, 11], "driver/first_update_s": [first_update_s],
        "learner/recompiles": recompiles})
    (run / "logs" / "ray").mkdir(parents=True)
    (run / "logs" / "ray" / "worker-1.err").write_text(
        "2026-12-02 06:53:15,417 INFO learner.setup: learner levers on cuda: compile on (set): each decoder layer, "
        "backend inductor, rows and length dynamic (every other size a constant); the lever trial compiles ...; "
        "inductor's cache in /tmp/c (learner.levers.compile_cache_dir), reused by every rank that reaches it; "
        "the trial compiled 6 graph(s) in 21.5 s (the run's warm-up: a graph compiled later is counted in learner/recompiles)\n")
    (run / "state.json").write_text(json.dumps({"name": run.name, "levers_off": {}}))
    (run / "config.yaml").write_text(f"name: {run.name}\nmodel:\n  path: {model}\n")
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"hidden_size": 1024}))


def test_the_summary_judges_a_run_that_replayed_and_prints_the_parts_that_did_not_finish(tmp_path, capsys):
    """Six steps: mixed mode from step 3, one mixed group at steps 4-6 (3 replayed rows), rewards 0.2, 0.2, 0.3, 0.3,
    0.4, 0.4 (first third's mean 0.2, last third's 0.4: rising), first update 42 s; the real-width run (1024 wide,
    inductor, 6 graphs in its trial) compiled 2 graphs in its first step and none after, replayed 2 rows at step 3,
    and made its first update 35 s after its start from a carried inductor cache (the gate: 30 s); the probe ran,
    tests/gpu ran out of time after two tests passed. Every gate but those two passes; the summary says so, exits 1."""
    de = _device_e2e()
    out, run, wide = tmp_path / "out", tmp_path / "run", tmp_path / "wide"
    _real_width_run(wide, tmp_path / "wide-model", 35.0, [2, 0, 0])
    _points(run / de.UNSENT_FILE, {
        "train/reward_mean": [0.2, 0.2, 0.3, 0.3, 0.4, 0.4], "train/mixed_mode": [0, 0, 1, 1, 1, 1],
        "train/mixed_groups": [0, 0, 0, 1, 1, 1], "learner/replay_tokens": [0, 0, 0, 5, 6, 7],
        "buffer/candidates_shipped": [0, 0, 2, 4, 9, 9], "driver/first_update_s": [42.0]})
    out.mkdir()
    (out / "parts.tsv").write_text("carry install\t0\t2.0\t60\t\nlearning run\t0\t80.5\t110\t\n"
                                   "real-width run\t0\t50.0\t75\t\n"
                                   "mismatch probe\t0\t20.0\t45\t\ntests/gpu\t124\t40.0\t40\t\n")
    (out / "real-width-cache-in.json").write_text(json.dumps({"carried": True, "files": 40, "bytes": 3_000_000}))
    (out / "real-width-cache-out.json").write_text(json.dumps({"files": 41, "bytes": 900_000, "left_out": ""}))
    (out / "probe.json").write_text(json.dumps({
        "tokens": 4000, "median_exp_abs_diff": 1.004, "mean_abs_diff": 0.004, "max_abs_diff": 0.05, "kl_k3": 2e-5,
        "kl_k1": 1e-5, "generated_tokens_per_s": 9000.0, "scored_tokens_per_s": 50000.0, "train_tokens_per_s": 20000.0,
        "parameters": 3.6e8, "device": "cuda", "dtype": "bfloat16"}))
    (out / "pytest-gpu.log").write_text("tests/gpu/test_a.py::test_x PASSED\ntests/gpu/test_a.py::test_y PASSED\n")
    assert de.summary(out, run, quick=False, budget_s=285, whole_s=230.0, device="cuda (test)", wide_run=wide) == 1
    text = capsys.readouterr().out
    fig = json.loads((out / "device_e2e.json").read_text())
    assert fig["learning"]["replayed_rows"] == 3 and fig["learning"]["mixed_from_step"] == 3, fig["learning"]
    assert fig["learning"]["reward_first"] == pytest.approx(0.2) and fig["learning"]["reward_last"] == pytest.approx(0.4)
    assert fig["learning"]["candidates_shipped"] == 9 and fig["learning"]["first_update_s"] == 42.0
    assert fig["real_width"]["hidden_size"] == 1024 and fig["real_width"]["trial_graphs"] == 6, fig["real_width"]
    assert fig["real_width"]["recompiles_first_step"] == 2 and fig["real_width"]["recompiles_after_first_step"] == 0
    judged = {g["gate"]: g["passed"] for g in fig["gates"]}
    assert [g for g, ok in judged.items() if not ok] == ["real-width first update <= 30 s", "tests/gpu passed"], judged
    assert judged["real-width compile on"] and judged["real-width replayed rows > 0"], judged
    assert judged["real-width recompiles after step 1 = 0"], judged
    assert "2 passed before it stopped (out of time)" in text and "FAILED (12 of 14 gates; failed: real-width " in text
    assert "35.0 s after exgrpo train started, carried inductor cache" in text
    assert "inductor cache carried (40 files" in text
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
        "reward rising": None, "first update <= 60 s": None, "real-width compile on": False,
        "real-width replayed rows > 0": None, "real-width first update <= 60 s": None,
        "real-width recompiles after step 1 = 0": False, "probe median exp|d| < 1.1": False,
        "probe KL < 0.0005": False, "tests/gpu passed": False, "whole check <= 900 s": None}
    assert "failed (2)" in capsys.readouterr().out


def test_the_real_width_runs_inductor_cache_goes_to_the_next_lease_and_only_there(tmp_path):
    """A lease's inductor cache (a hand-made folder: FX graph, AOTAutograd and kernel files) saved into OUT's
    compile-cache/, packed and unpacked by scripts/device_out.py into the carry's compile-cache/, and loaded by the
    next lease into a fresh folder: the same files, and nothing an earlier call left there. Too large to carry: not
    saved, and said why. An archive cut short: the next run compiles cold, and says why."""
    de = _device_e2e()
    cache, out, carry = tmp_path / "work" / "inductor-cache", tmp_path / "out", tmp_path / "carry" / "compile-cache"
    files = {"fxgraph/ab/fentry": b"x" * 5000, "aotautograd/cd/aentry": b"y" * 300,
             "triton/0/K1/kernel.cubin": os.urandom(2000)}
    for rel, data in files.items():
        (cache / rel).parent.mkdir(parents=True, exist_ok=True)
        (cache / rel).write_bytes(data)
    saved = de.cache_save(cache, out / "compile-cache" / de.REAL_WIDTH_CACHE, max_mib=8)
    assert saved["files"] == 3 and saved["left_out"] == "" and saved["bytes"] > 0, saved
    (out / "device_e2e.json").write_text("{}")
    device_out = [sys.executable, "scripts/device_out.py"]
    subprocess.run([*device_out, "pack", str(out), "--keep", "device_e2e.json", "--cache", str(out / "compile-cache"),
                    "--carry-room-mib", "12"], cwd=ROOT, check=True, capture_output=True)
    assert sorted(p.name for p in out.iterdir()) == ["compile-cache.tar", "device_e2e.json", "results.tar.gz"]
    subprocess.run([*device_out, "unpack", str(out), str(tmp_path / "back"), "--cache-to", str(carry)], cwd=ROOT,
                   check=True, capture_output=True)
    (cache / "stale").write_text("left by an earlier call on a warm machine")
    loaded = de.cache_load(carry / de.REAL_WIDTH_CACHE, cache)
    assert loaded == {"carried": True, "files": 3, "bytes": 7300}, loaded
    assert {str(p.relative_to(cache)): p.read_bytes() for p in cache.rglob("*") if p.is_file()} == files
    too_big = de.cache_save(cache, tmp_path / "big.tar.gz", max_mib=0.001)
    assert "over 0.001" in too_big["left_out"] and not (tmp_path / "big.tar.gz").exists(), too_big
    cut = tmp_path / "cut.tar.gz"
    cut.write_bytes((carry / de.REAL_WIDTH_CACHE).read_bytes()[:200])
    cold = de.cache_load(cut, cache)
    assert not cold["carried"] and "cut.tar.gz" in cold["refused"] and not any(cache.iterdir()), cold
    assert de.cache_load(tmp_path / "none.tar.gz", cache) == {"carried": False, "files": 0, "bytes": 0}
