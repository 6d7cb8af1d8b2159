"""The vLLM carry for the GPU machine without network (scripts/vllm_carry.py, scripts/vllm_install_offline.sh), on
small fake sets built here (wheels with only a METADATA file, or a tiny `vllm` package): no network, no GPU.

- the dry run: a complete set passes (markers evaluated for CPython 3.12 although this is 3.11, extras followed,
  image packages met by name and, where the image list gives one, by version); a requirement met by neither, a
  version outside the range, a carried torch, a carried CUDA library torch loads, or a carried image package each
  fail it, named;
- what is carried: the walk over pip's resolution stops at the image's packages (torch's nvidia libraries stay out);
- the parts: cut, staged one call at a time (a part with a wrong sha256 is refused), joined, every wheel identical;
- the install script on this machine: one call per part, exit 3 until the last, then the install, the requirement
  check and `import vllm` printing the fake's version;
- the engine's start check read from a wheel's sources (`api`).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _load():
    spec = importlib.util.spec_from_file_location("vllm_carry", ROOT / "scripts" / "vllm_carry.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["vllm_carry"] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


vc = _load()


def wheel(folder: Path, name: str, version: str, requires: list[str] = (), files: dict[str, str] | None = None) -> Path:
    """A wheel holding `files` and a METADATA with these Requires-Dist lines."""
    folder.mkdir(parents=True, exist_ok=True)
    dist = f"{name.replace('-', '_')}-{version}"
    path = folder / f"{dist}-py3-none-any.whl"
    meta = "Metadata-Version: 2.1\nName: {}\nVersion: {}\n{}".format(
        name, version, "".join(f"Requires-Dist: {r}\n" for r in requires))
    with zipfile.ZipFile(path, "w") as z:
        for f, text in (files or {}).items():
            z.writestr(f, text)
        z.writestr(f"{dist}.dist-info/METADATA", meta)
        z.writestr(f"{dist}.dist-info/WHEEL",
                   "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{dist}.dist-info/RECORD", "")
    return path


IMAGE = {"torch": "2.11.0", "numpy": "2.5.2", "httpx": None, "numba": None, "six": None, "nvidia-cublas": None}


def fake_set(folder: Path, **changes) -> dict:
    """vllm and what it needs beyond IMAGE, as vLLM 0.25's metadata writes such requirements."""
    spec = {
        "vllm": ("0.25.1", ["openai>=2.0.0", "torch==2.11.0", "numpy", "numba==0.65.0",
                             "six>=1.16.0; python_version > \"3.11\"", "fastapi[standard]<0.137.0,>=0.133.0",
                             "tensorizer==2.10.1; extra == \"tensorizer\"",
                             "zentorch; platform_machine == \"aarch64\""]),
        "openai": ("3.57.0", ["httpx>=0.23.0,<1", "jiter<1,>=0.10.0"]),
        "jiter": ("0.19.0", []),
        "fastapi": ("0.136.3", ["starlette>=0.40.0", "uvicorn[standard]>=0.12.0; extra == \"standard\""]),
        "starlette": ("1.10.0", []),
        "uvicorn": ("0.54.0", ["websockets>=13.0; extra == \"standard\""]),
        "websockets": ("17.4", []),
    }
    spec.update(changes)
    for name, entry in spec.items():
        if entry is not None:
            wheel(folder, name, *entry)
    return vc.read_set(folder)


def test_a_complete_set_passes_with_markers_for_python_3_12_and_extras_followed(tmp_path):
    r = vc.dry_run(fake_set(tmp_path), IMAGE)
    assert r.ok, "\n".join(r.lines())
    assert r.needed == {"vllm", "openai", "jiter", "fastapi", "starlette", "uvicorn", "websockets"}
    assert [who for who, _, _ in r.accepted] == ["vllm"]  # numba==0.65.0 against the image's: ACCEPTED, with reason
    # the image's six and httpx, at versions not known here (six: asked for on Python > 3.11 only)
    assert r.to_read == [("vllm", 'six>=1.16.0; python_version > "3.11"'), ("openai", "httpx>=0.23.0,<1")]
    assert "dry run: OK" in r.lines()


def test_what_is_missing_out_of_range_or_torch_s_is_named(tmp_path):
    r = vc.dry_run(fake_set(tmp_path / "a", websockets=None), IMAGE)  # only uvicorn[standard] asks for it
    assert r.missing == [("uvicorn", 'websockets>=13.0; extra == "standard"')] and not r.ok

    r = vc.dry_run(fake_set(tmp_path / "b", openai=("1.99.0", [])), IMAGE)
    assert r.conflicts == [("vllm", "openai>=2.0.0", "1.99.0")] and not r.ok

    r = vc.dry_run(fake_set(tmp_path / "c", vllm=("0.25.1", ["numpy<2.5"])), IMAGE)
    assert r.conflicts == [("vllm", "numpy<2.5", "the image's 2.5.2")]

    r = vc.dry_run(fake_set(tmp_path / "d", torch=("2.11.0", []), numpy=("2.3.5", [])), IMAGE)
    assert r.replacing_torch == ["torch 2.11.0 (package)"] and r.shadowing[0].startswith("numpy 2.3.5") and not r.ok

    lib = {"nvidia/cu13/lib/libcublasLt.so.13": "", "nvidia/cu13/bin/nvcc": "", "nvidia/__init__.py": ""}
    r = vc.dry_run(fake_set(tmp_path / "e", **{"nvidia-cuda-nvcc": ("13.2.86", [], lib)}), IMAGE)
    assert r.replacing_torch == ["nvidia-cuda-nvcc 13.2.86: nvidia/cu13/lib/libcublasLt.so.13",
                                 "nvidia-cuda-nvcc 13.2.86: nvidia/__init__.py"], r.replacing_torch
    assert "carried but needed by nothing: nvidia-cuda-nvcc" in "\n".join(r.lines())


def test_the_carried_pins_stop_at_the_image(tmp_path):
    """pip's resolution holds torch and its CUDA libraries (vllm pins torch==2.11.0); the carry does not."""
    def item(name, version, requires):
        return {"metadata": {"name": name, "version": version, "requires_dist": requires}}

    report = {"install": [
        item("vllm", "0.25.1", ["torch==2.11.0", "openai>=2", "cuda-tile[tileiras]"]),
        item("torch", "2.11.0", ["nvidia-cublas==13.1.0.3", "triton==3.6.0"]),
        item("nvidia-cublas", "13.1.0.3", []), item("triton", "3.6.0", []),
        item("openai", "3.57.0", ["httpx<1"]), item("httpx", "0.28.1", ["idna"]), item("idna", "3.20", []),
        item("cuda-tile", "1.3.0", ["nvidia-cuda-tileiras; extra == 'tileiras'"]),
        item("nvidia-cuda-tileiras", "13.2.86", []),
    ]}
    image = {"torch": "2.11.0", "nvidia-cublas": None, "triton": "3.6.0", "httpx": None}
    assert vc.carried_pins(report, image) == ["cuda-tile==1.3.0", "nvidia-cuda-tileiras==13.2.86", "openai==3.57.0",
                                              "vllm==0.25.1"]


def test_the_image_lists_agree():
    """scripts/device_image_all.txt (the vLLM carry's) holds every package of scripts/device_image.txt (the
    ExGRPO carry's), and pins the image's torch."""
    full = vc.image_versions()
    assert set(vc.image_versions(ROOT / "scripts" / "device_image.txt")) <= set(full)
    assert full["torch"] == "2.11.0" and full["transformers"] == "5.17.0"
    assert all(vc.protected(n, full) for n in ("torch", "triton", "nvidia-cublas", "cuda-toolkit"))


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _carry(tmp_path: Path, vllm_files: dict[str, str] | None = None) -> tuple[Path, dict]:
    """vllm-carry/ of a fake set whose vllm requires only what this .venv has, cut into ~3 kB parts."""
    wheels = tmp_path / "build" / "wheels"
    wheel(wheels, "vllm", "0.25.1", ["packaging", "tiny-dep>=1"],
          vllm_files or {"vllm/__init__.py": '__version__ = "0.25.1"\n' + "# padding\n" * 400})
    wheel(wheels, "tiny-dep", "1.0", [], {"tiny_dep.py": "X = 1\n" + "# padding\n" * 300})
    m = vc.split(wheels, tmp_path / "build", 3000, "0.25.1")
    return tmp_path / "build", m


def test_parts_are_staged_one_call_at_a_time_and_join_into_the_same_wheels(tmp_path, capsys):
    build, m = _carry(tmp_path)
    assert m["calls"] == len(m["parts"]) >= 3 and all(p["bytes"] <= 3000 for p in m["parts"])
    stage, call = tmp_path / "stage", tmp_path / "call"
    for i, part in enumerate(m["parts"]):  # each call brings the manifest and one part
        call.mkdir()
        (call / "manifest.json").write_bytes((build / "manifest.json").read_bytes())
        (call / part["name"]).write_bytes((build / part["name"]).read_bytes())
        if i == 1:  # a part damaged on the way is refused and must come again
            bad = bytearray((call / part["name"]).read_bytes())
            bad[0] ^= 1
            (call / part["name"]).write_bytes(bytes(bad))
            assert vc.stage(call, stage) == 2 and not (stage / part["name"]).exists()
            (call / part["name"]).write_bytes((build / part["name"]).read_bytes())
        assert vc.stage(call, stage) == (0 if i == len(m["parts"]) - 1 else 3)
        for f in call.iterdir():
            f.unlink()
        call.rmdir()
    assert vc.assemble(stage) == 0
    for name, w in m["wheels"].items():
        assert _sha(stage / "wheels" / name) == w["sha256"] == _sha(build / "wheels" / name)
    assert not list(stage.glob("part-*"))
    assert "parts staged; still to carry" in capsys.readouterr().out


def test_the_offline_install_script_installs_on_the_last_call_and_imports_vllm(tmp_path):
    build, m = _carry(tmp_path)
    env = {**os.environ, "PYTHON": sys.executable, "VLLM_CARRY": str(tmp_path / "call"),
           "VLLM_STAGE": str(tmp_path / "stage"), "VLLM_SITE": str(tmp_path / "site"), "PIP_NO_INDEX": "1"}
    env.pop("PYTHONPATH", None)
    call = tmp_path / "call"
    for i, part in enumerate(m["parts"]):
        call.mkdir(exist_ok=True)
        for f in call.iterdir():
            f.unlink()
        (call / "manifest.json").write_bytes((build / "manifest.json").read_bytes())
        (call / part["name"]).write_bytes((build / part["name"]).read_bytes())
        p = subprocess.run(["bash", str(ROOT / "scripts" / "vllm_install_offline.sh")], env=env, cwd=tmp_path,
                           capture_output=True, text=True, timeout=300)
        last = i == len(m["parts"]) - 1
        assert p.returncode == (0 if last else 3), p.stdout + p.stderr
    out = p.stdout
    assert "\n0.25.1\n" in out and "dry run: OK" in out, out  # the installed check, then `import vllm`
    assert (tmp_path / "site" / "vllm" / "__init__.py").is_file() and "torch " in out
    again = subprocess.run(["bash", str(ROOT / "scripts" / "vllm_install_offline.sh")], env=env, cwd=tmp_path,
                           capture_output=True, text=True, timeout=300)  # a later call: installed already
    assert again.returncode == 0 and "installing" not in again.stdout and "0.25.1" in again.stdout, again.stdout


def _api_wheel(folder: Path, v2_reload: str) -> Path:
    return wheel(folder, "vllm", "0.25.1", [], {
        "vllm/entrypoints/llm.py": "class LLM:\n"
        "    def collective_rpc(self, method, timeout: float | None = None, args: tuple = (), kwargs=None): ...\n"
        "    def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False): ...\n",
        "vllm/v1/worker/gpu_model_runner.py": "class GPUModelRunner(Base):\n    def reload_weights(\n"
        "        self, weights_iterator=None, weights_path: str | None = None, is_checkpoint_format: bool = True\n"
        "    ) -> None: ...\n",
        "vllm/v1/worker/gpu/model_runner.py": f"class GPUModelRunner:\n    def reload_weights({v2_reload}): ...\n",
        "vllm/sampling_params.py": "from enum import Enum\nclass RequestOutputKind(Enum):\n    CUMULATIVE = 0\n"
        "    DELTA = 1\n    FINAL_ONLY = 2\n",
    })


@pytest.mark.parametrize("v2_reload, accepted", [("self, *args, **kwargs", True),  # 0.25.1's V2 runner
                                                  ("self", False)])
def test_the_engine_start_check_reads_the_calls_from_the_wheel(tmp_path, capsys, v2_reload, accepted):
    assert vc.api(_api_wheel(tmp_path, v2_reload)) == (0 if accepted else 1)
    out = capsys.readouterr().out
    assert "vllm/v1/worker/gpu/model_runner.py:2 GPUModelRunner.reload_weights" in out
    assert ("accepts it" in out) == accepted, out
