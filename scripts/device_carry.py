"""Build the device carry: one folder of wheels holding what the lent GPU machines' image lacks for a run.

    python scripts/device_carry.py [--python 3.12] [--out device-carry]      (or: make device-carry [PY=3.11])

The image (scripts/device_image.txt) has torch, transformers and the rest of the list; it lacks ray, pydantic,
jsonschema, math-verify (and vllm and mlflow, which do not travel: vllm's wheel is larger than a call carries, and
a run without MLflow keeps its metric points in the run folder, see cluster/tracking.py). The carry is

    wheels/  ray (repacked without the parts below), the dependency closure of ray, pydantic, jsonschema and
             math-verify that the image's packages do not already bring, at this environment's versions, for
             CPython `--python` on x86-64 Linux; and the project's own wheel (built from the working tree)
    carry.json  what is in it, the bytes of each wheel, what was cut out of ray

Ray 2.60's wheel is 79 MB; a Python-only local cluster (`ray.init`, `ray start`) needs none of `ray/jars` (the Java
worker, 34.5 MB), the dashboard's JavaScript build, or the data/rllib/tune/train/serve/llm libraries, so they are
left out (`RAY_CUT`). The third-party wheels are downloaded once per set of pins (a stamp holds their hash); the
project's wheel is rebuilt on every call (seconds). The folder must stay under `LIMIT_MB` (a device call carries
64 MiB in all): a larger one is an error.

Install it on the device (scripts/device_e2e.sh does): `python3 -m pip install --no-index --no-deps --target DIR
device-carry/wheels/*.whl` and put DIR first on PYTHONPATH (DIR/bin holds `exgrpo` and `ray`).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from importlib import metadata
from pathlib import Path

from packaging.markers import Marker
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
IMAGE_LIST = ROOT / "scripts" / "device_image.txt"
NEEDED = ("ray", "pydantic", "jsonschema", "math-verify")
"""What a run needs that the image lacks (their dependencies come along)."""
LACKED = (*NEEDED, "vllm", "mlflow")
"""What the image lacks although this environment's versions of its packages may require it (typer, under this
huggingface-hub, requires pydantic): the walk over the image's dependencies stops there."""
ALSO = ("typing-extensions",)
"""Carried although the image's torch brings them: pydantic 2.14 needs a newer typing-extensions than older
images may hold (45 kB)."""
RAY_CUT = ("ray/jars/", "ray/dashboard/client/", "ray/data/", "ray/rllib/", "ray/tune/", "ray/train/",
           "ray/serve/", "ray/llm/")
"""Left out of ray's wheel: not needed by a Python-only cluster (tests/test_device_e2e.py starts one from it)."""
LIMIT_MB = 60
PLATFORMS = ("manylinux2014_x86_64", "manylinux_2_17_x86_64", "manylinux_2_28_x86_64", "linux_x86_64")


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def image_packages(path: Path = IMAGE_LIST) -> list[str]:
    """The image's requirement names (comments and blank lines skipped)."""
    lines = (line.split("#", 1)[0].strip() for line in path.read_text().splitlines())
    return [Requirement(line).name for line in lines if line]


def closure(names: list[str] | tuple[str, ...], python: str, stop: tuple[str, ...] = ()) -> set[str]:
    """`names` and everything they require (no extras) for CPython `python` on Linux, as installed here; a name
    not installed here stops the walk there (it is still in the result), a name in `stop` is left out."""
    env = {"python_version": python, "python_full_version": f"{python}.0", "extra": "",
           "sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64",
           "implementation_name": "cpython", "platform_python_implementation": "CPython", "os_name": "posix"}
    seen, todo = set(), [norm(n) for n in names]
    while todo:
        name = todo.pop()
        if name in seen or name in {norm(n) for n in stop}:
            continue
        seen.add(name)
        try:
            requires = metadata.requires(name) or []
        except metadata.PackageNotFoundError:
            continue
        for line in requires:
            req = Requirement(line)
            if req.marker is None or Marker(str(req.marker)).evaluate(env):
                todo.append(norm(req.name))
    return seen


def carried_pins(python: str) -> list[str]:
    """`name==version` of every package the carry holds besides ray's repack and the project (sorted)."""
    names = (closure(NEEDED, python) - closure(image_packages(), python, stop=LACKED)) | {norm(n) for n in ALSO}
    missing = [n for n in sorted(names) if not _installed(n)]
    if missing:
        sys.exit(f"device_carry: {', '.join(missing)} not installed in {sys.prefix}: run `make setup` first")
    return sorted(f"{n}=={metadata.version(n)}" for n in names)


def _installed(name: str) -> bool:
    try:
        metadata.version(name)
        return True
    except metadata.PackageNotFoundError:
        return False


def download(pins: list[str], python: str, dest: Path) -> None:
    """Binary wheels of `pins` for CPython `python` on x86-64 Linux into `dest` (no dependency resolution)."""
    plat = [a for p in PLATFORMS for a in ("--platform", p)]
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--disable-pip-version-check", "--no-deps",
                    "--only-binary=:all:", "--python-version", python, "--implementation", "cp", *plat,
                    "-d", str(dest), *pins], check=True)


def repack_ray(wheel: Path) -> dict[str, int]:
    """Rewrite ray's wheel in place without `RAY_CUT` (RECORD rewritten to match). Returns bytes cut per prefix
    (compressed)."""
    cut = dict.fromkeys(RAY_CUT, 0)
    tmp = wheel.with_suffix(".tmp")
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as dst:
        for info in src.infolist():
            prefix = next((p for p in RAY_CUT if info.filename.startswith(p)), None)
            if prefix is not None:
                cut[prefix] += info.compress_size
                continue
            data = src.read(info)
            if info.filename.endswith(".dist-info/RECORD"):
                kept = [ln for ln in data.decode().splitlines() if not ln.startswith(RAY_CUT)]
                data = ("\n".join(kept) + "\n").encode()
            dst.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED)
    tmp.replace(wheel)
    return cut


def project_wheel(dest: Path) -> Path:
    """The project's wheel, built from a copy of the working tree's files that git does not ignore (so a stale
    build/ folder never leaks into it)."""
    for old in dest.glob("exgrpo-*.whl"):
        old.unlink()
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, check=True,
                           capture_output=True).stdout.decode().split("\0")
    with tempfile.TemporaryDirectory(prefix="exgrpo-src-") as tmp:
        for f in filter(None, files):
            if (ROOT / f).is_file():
                (Path(tmp) / f).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(ROOT / f, Path(tmp) / f)
        subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--disable-pip-version-check", "--no-deps",
                        "-w", str(dest), tmp], check=True)
    return next(dest.glob("exgrpo-*.whl"))


def build(python: str, out: Path) -> dict:
    pins = carried_pins(python)
    wheels = out / "wheels"
    key = hashlib.sha256(json.dumps([python, pins, RAY_CUT, PLATFORMS]).encode()).hexdigest()[:16]
    stamp = out / ".stamp"
    manifest_path = out / "carry.json"
    if stamp.is_file() and stamp.read_text() == key and manifest_path.is_file():
        manifest = json.loads(manifest_path.read_text())
        print(f"device_carry: third-party wheels up to date in {wheels} ({key})", file=sys.stderr)
    else:
        shutil.rmtree(out, ignore_errors=True)
        wheels.mkdir(parents=True)
        print(f"device_carry: downloading {len(pins)} wheels for CPython {python} into {wheels}", file=sys.stderr)
        download(pins, python, wheels)
        ray_wheel = next(wheels.glob("ray-*.whl"))
        before = ray_wheel.stat().st_size
        cut = repack_ray(ray_wheel)
        manifest = {"python": python, "pins": pins, "ray_wheel_bytes_before": before, "ray_cut_bytes": cut}
        stamp.write_text(key)
    project_wheel(wheels)
    manifest["wheels"] = {w.name: w.stat().st_size for w in sorted(wheels.glob("*.whl"))}
    manifest["total_bytes"] = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    manifest_path.write_text(json.dumps(manifest, indent=1))
    return manifest


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--python", default="3.12", help="CPython version of the machine the carry is for (3.12: the "
                   "lent GPU machines; 3.11: this machine's, for tests/test_device_e2e.py)")
    p.add_argument("--out", default=None, help="the folder (default device-carry, or device-carry-pyX.Y for a "
                   "Python other than 3.12)")
    args = p.parse_args()
    out = Path(args.out or ("device-carry" if args.python == "3.12" else f"device-carry-py{args.python}"))
    m = build(args.python, out)
    width = max(map(len, m["wheels"]))
    for name, size in m["wheels"].items():
        print(f"  {name:<{width}}  {size / 1e6:6.2f} MB")
    ray_now = next(size for name, size in m["wheels"].items() if name.startswith("ray-"))
    print(f"device_carry: {out} holds {len(m['wheels'])} wheels, {m['total_bytes'] / 1e6:.1f} MB in all (limit "
          f"{LIMIT_MB} MB); ray {m['ray_wheel_bytes_before'] / 1e6:.1f} MB -> {ray_now / 1e6:.1f} MB without "
          f"{', '.join(RAY_CUT)}")
    print("device_carry: no MLflow on the device: the run's metric points go to <run>/metrics-unsent.jsonl, and "
          "`exgrpo track --replay <run>` sends them to a store later")
    if m["total_bytes"] > LIMIT_MB * 1e6:
        print(f"device_carry: {out} is {m['total_bytes'] / 1e6:.1f} MB, over {LIMIT_MB} MB", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    os.chdir(ROOT)
    sys.exit(main())
