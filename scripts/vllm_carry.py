"""Build the vLLM carry: the official vLLM wheel and what it needs that the lent GPU machines' image lacks, cut into
parts that one device call each can take in, and the checks that the set is complete and leaves torch alone.

    python scripts/vllm_carry.py [--vllm 0.25.1] [--out vllm-carry]   here: resolve, download, dry run, split
    python scripts/vllm_carry.py check [--out vllm-carry]             here: the dry run again, on the wheels
    python scripts/vllm_carry.py api WHEEL                            here: the engine's start check on its calls
    python3 scripts/vllm_carry.py stage|assemble|installed ...        there: scripts/vllm_install_offline.sh's steps

The image (scripts/device_image_all.txt: every package of it, versions where they were seen) has Python 3.12,
torch 2.11 (CUDA 13), transformers, numba, opencv, ...; it has no network. Only vllm 0.21-0.26 are built for torch
2.11. The build:

1. resolves `vllm==VERSION` with pip's resolver for CPython 3.12 on x86-64 Linux (binary wheels only, manylinux up
   to glibc 2.39: the image's Python 3.12.3 is Ubuntu 24.04's), torch constrained to 2.11.* and every image package
   whose version is known to that version (`pip install --dry-run --report`: metadata only, nothing installed,
   no torch downloaded). A CPython 3.12 runs pip when one is found (`--pip-python`): pip evaluates environment
   markers for the Python that runs it;
2. keeps what vLLM needs that the image lacks: the walk from vllm over the resolved metadata (markers for CPython
   3.12 on Linux, extras followed) stops at every image package; so torch, triton and the nvidia-* libraries
   torch loads are never carried, nor anything only they require;
3. downloads those wheels (`pip download --no-deps`) into OUT/wheels;
4. the dry run (`dry_run`): every requirement of every carried wheel (their own METADATA) is met by the set or the
   image, at a version the set or the image list has (an image version not known here: "to read there"); no
   carried package is one the image has (it would shadow it: `--target` goes first on PYTHONPATH); no carried file
   is torch's, triton's, or one of the CUDA libraries torch loads from nvidia/*/lib;
5. packs the wheels in one tar and cuts it into OUT/part-000, part-001, ... of at most 60 MB (`--part-mb`), and
   writes OUT/manifest.json: the sha256 and bytes of every wheel, of the tar and of every part.

On the device (scripts/vllm_install_offline.sh): each call carries OUT/manifest.json and ONE part; `stage` checks the
part's sha256 and keeps it on the machine's disk (/tmp/vllm-carry-stage); the call that brings the last missing
part `assemble`s the tar (its sha256 and each wheel's checked), pip-installs the wheels with --no-index --no-deps
--target, runs `installed` (the same requirement check against what is really installed there, torch's version
and file checked) and imports vllm. So it takes as many calls as there are parts, all while ONE machine is warm: a
machine that goes back (idle, given back, or 30 minutes held) loses the staged parts, and the next call starts
again from the first part. manifest.json says how many.
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
import tarfile
import zipfile
from dataclasses import dataclass, field
from email.parser import Parser
from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import InvalidVersion, Version

ROOT = Path(__file__).resolve().parents[1]
IMAGE_ALL = ROOT / "scripts" / "device_image_all.txt"
VLLM = "0.25.1"
TORCH = "2.11.*"
PART_MB = 60
"""A device call carries at most 64 MiB (67.1 MB) with the working tree: a 60 MB part leaves ~7 MB for the tree."""
GLIBC_MAX = 39
PLATFORMS = ("manylinux1_x86_64", "manylinux2010_x86_64", "manylinux2014_x86_64",
             *(f"manylinux_2_{n}_x86_64" for n in range(5, GLIBC_MAX + 1)))
"""pip matches a platform tag exactly: every manylinux tag up to the image's glibc (llguidance 1.7 needs 2.31)."""
TARGET_ENV = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
              "platform_system": "Linux", "platform_machine": "x86_64", "implementation_name": "cpython",
              "platform_python_implementation": "CPython", "os_name": "posix", "platform_release": "",
              "platform_version": "", "implementation_version": "3.12.3", "extra": ""}
"""The environment markers of the image's python3 (CPython 3.12.3, x86-64 Linux)."""
RESOLVE_FREE = ("numpy",)
"""Image packages whose known version pip's resolution is not held to: vllm 0.25.1 pins numba==0.65.0, whose numpy
is <2.5, and the image has numpy 2.5.2 (pinned, pip finds no resolution). The image's numpy and numba stay."""
ACCEPTED = {
    ("vllm", "numba"): "vLLM imports numba only for n-gram speculative decoding (vllm/v1/spec_decode/"
                       "ngram_proposer.py) and Kimi-K2.5's vision processor, neither of which the engine uses; "
                       "numba 0.65 needs numpy<2.5",
    ("mistral-common", "numpy"): "mistral_common caps numpy (<2.4 on Python 3.12); vLLM uses it for Mistral-format "
                                 "tokenizers (tokenizer_mode mistral) only, the engine loads Hugging Face tokenizers",
}
"""(requirer, requirement) pairs that the image does not meet at the version asked, accepted after reading vLLM's
sources: the dry run and `installed` list them with the reason instead of failing."""
TORCH_FAMILY = ("torch", "torchvision", "torchaudio", "triton")
TORCH_CUDA_LIBS = ("libcudart", "libcublas", "libcublasLt", "libnvrtc", "libnvJitLink", "libcufft", "libcurand",
                   "libcusolver", "libcusparse", "libcusparseLt", "libcudnn", "libnccl", "libnvshmem", "libcupti",
                   "libnvToolsExt", "libnvtx", "libcufile")
"""The CUDA libraries torch preloads from the first sys.path entry that has nvidia/<lib>/lib/<name>: a carried copy
installed first on PYTHONPATH would replace the image's."""


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def protected(name: str, image: dict[str, str | None]) -> bool:
    """A package of the image's CUDA torch: torch's family, or an nvidia-*/cuda-* package the image has."""
    n = norm(name)
    return n in TORCH_FAMILY or (n in image and n.startswith(("nvidia-", "cuda-")))


def image_versions(path: Path = IMAGE_ALL) -> dict[str, str | None]:
    """{name: version or None (not known here)} of the image's packages (`name` or `name==version` lines)."""
    out: dict[str, str | None] = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            req = Requirement(line)
            pins = [s.version for s in req.specifier if s.operator == "=="]
            out[norm(req.name)] = pins[0] if pins else None
    return out


# ------------------------------------------------------------------------------------------ the dry run


@dataclass
class Dist:
    """A distribution as its METADATA says: name, version, Requires-Dist lines; its files (a wheel's names)."""
    name: str
    version: str
    requires: list[str]
    files: list[str] = field(default_factory=list)


def parse_metadata(text: str, files: list[str] | None = None) -> Dist:
    msg = Parser().parsestr(text)
    return Dist(norm(msg["Name"]), msg["Version"], msg.get_all("Requires-Dist") or [], files or [])


def read_wheel(path: Path) -> Dist:
    with zipfile.ZipFile(path) as z:
        names = z.namelist()
        meta = next(n for n in names if n.count("/") == 1 and n.endswith(".dist-info/METADATA"))
        return parse_metadata(z.read(meta).decode("utf-8", "replace"), names)


def read_set(folder: Path) -> dict[str, Dist]:
    return {d.name: d for d in map(read_wheel, sorted(folder.glob("*.whl")))}


@dataclass
class DryRun:
    root: str
    carried: dict[str, str]                                           # name: version
    needed: set[str] = field(default_factory=set)                     # carried names the walk from root reached
    missing: list[tuple[str, str]] = field(default_factory=list)      # (who, requirement): neither set nor image
    conflicts: list[tuple[str, str, str]] = field(default_factory=list)  # (who, requirement, what is there)
    to_read: list[tuple[str, str]] = field(default_factory=list)      # (who, requirement): image version not known
    shadowing: list[str] = field(default_factory=list)                # carried and in the image
    accepted: list[tuple[str, str, str]] = field(default_factory=list)  # (who, requirement, what is there)
    replacing_torch: list[str] = field(default_factory=list)          # carried and torch's (package or file)

    @property
    def ok(self) -> bool:
        return not (self.missing or self.conflicts or self.shadowing or self.replacing_torch
                    or self.root not in self.carried)

    def lines(self) -> list[str]:
        unused = sorted(set(self.carried) - self.needed)
        out = [f"dry run: {len(self.carried)} carried wheels for {self.root}, checked against the image's list",
               f"  missing (neither carried nor in the image): {len(self.missing)}"]
        out += [f"    {who} needs {req}" for who, req in self.missing]
        out.append(f"  version conflicts: {len(self.conflicts)}")
        out += [f"    {who} needs {req}; there: {have}" for who, req, have in self.conflicts]
        out.append(f"  accepted mismatches (ACCEPTED, with the reason): {len(self.accepted)}")
        out += [f"    {who} needs {req}; there: {have}: {ACCEPTED[(who, norm(Requirement(req).name))]}"
                for who, req, have in self.accepted]
        out.append(f"  replacing torch or its CUDA libraries: {len(self.replacing_torch)}")
        out += [f"    {w}" for w in self.replacing_torch]
        out.append(f"  carried although the image has them (would shadow the image's): {len(self.shadowing)}")
        out += [f"    {w}" for w in self.shadowing]
        out.append(f"  met by the image at a version not known here (`installed` reads it there): {len(self.to_read)}")
        out += [f"    {who} needs {req}" for who, req in self.to_read]
        if unused:
            out.append(f"  carried but needed by nothing: {', '.join(unused)}")
        if self.root not in self.carried:
            out.append(f"  {self.root} itself is not in the set")
        out.append("dry run: " + ("OK" if self.ok else "FAILED"))
        return out


def _contains(req: Requirement, version: str) -> bool:
    try:
        return req.specifier.contains(Version(version), prereleases=True)
    except InvalidVersion:
        return False


def _active(req: Requirement, extras: frozenset[str], env: dict[str, str], only_extras: bool) -> bool:
    """Whether `req` applies with these extras requested (only_extras: whether it applies because of one of them,
    for a package whose base requirements someone else, the image, answers for)."""
    if req.marker is None:
        return not only_extras
    base = req.marker.evaluate({**env, "extra": ""})
    if only_extras and base:
        return False
    return base or any(req.marker.evaluate({**env, "extra": e}) for e in extras)


_TORCH_LIB = re.compile(r"^(?:%s)(?:_\w+)?\.so" % "|".join(TORCH_CUDA_LIBS))
_NAMESPACES = ("nvidia/__init__.py", "nvidia/cu12/__init__.py", "nvidia/cu13/__init__.py", "cuda/__init__.py")


def torch_files(files: list[str]) -> list[str]:
    """The files of a wheel that belong to the image's CUDA torch: under torch's family's folders, a CUDA library
    torch loads from nvidia/*/lib (TORCH_CUDA_LIBS), or an __init__.py that would turn the nvidia namespace (split
    over several folders of sys.path) into one folder, hiding the image's (cuda: cuda-bindings' namespace)."""
    return [f for f in files if f.split("/", 1)[0] in TORCH_FAMILY or f in _NAMESPACES
            or (f.startswith("nvidia/") and "/lib/" in f and _TORCH_LIB.match(f.rsplit("/", 1)[-1]))]


def dry_run(dists: dict[str, Dist], image: dict[str, str | None], root: str = "vllm",
            image_meta: dict[str, Dist] | None = None, env: dict[str, str] = TARGET_ENV) -> DryRun:
    """Walk from `root` over the carried set `dists` (by name) with the image's packages `image` as installed:
    every requirement whose markers hold for `env` (the extras asked for followed) must be met by a carried
    package or an image package, at a version the set has or the image list names. `image_meta`: metadata of
    image packages (the resolution's, their versions may differ) for the extras someone asks of them."""
    r = DryRun(root, {n: d.version for n, d in dists.items()})
    for n, d in sorted(dists.items()):
        if protected(n, image):
            r.replacing_torch.append(f"{n} {d.version} (package)")
        elif n in image:
            r.shadowing.append(f"{n} {d.version} (the image has {image[n] or 'a version not known here'})")
        r.replacing_torch += [f"{n} {d.version}: {f}" for f in torch_files(d.files)]
    walk(r, dists, image, image_meta or {}, env)
    return r


def walk(r: DryRun, dists: dict[str, Dist], image: dict[str, str | None], image_meta: dict[str, Dist],
         env: dict[str, str]) -> None:
    """`dry_run`'s walk from r.root: fills r.needed, r.missing, r.conflicts and r.to_read."""
    seen: set[tuple[str, frozenset[str]]] = set()
    todo = [(norm(r.root), frozenset())]
    while todo:
        name, extras = todo.pop()
        if (name, extras) in seen:
            continue
        seen.add((name, extras))
        if name in dists:
            r.needed.add(name)
            meta, only_extras = dists[name], False
        elif name in image and extras and name in image_meta:
            meta, only_extras = image_meta[name], True
        else:
            continue
        for line in meta.requires:
            req = Requirement(line)
            if not _active(req, extras, env, only_extras):
                continue
            target = norm(req.name)
            conflicts = r.accepted if (name, target) in ACCEPTED else r.conflicts
            if target in dists:
                if req.specifier and not _contains(req, dists[target].version):
                    conflicts.append((name, line, f"{dists[target].version}"))
            elif target in image:
                have = image[target]
                if have is None:
                    if req.specifier and (name, target) in ACCEPTED:
                        r.accepted.append((name, line, "the image's, at a version not known here"))
                    elif req.specifier:
                        r.to_read.append((name, line))
                elif req.specifier and not _contains(req, have):
                    conflicts.append((name, line, f"the image's {have}"))
                if req.extras and target not in image_meta:
                    r.to_read.append((name, f"{line} (the extras of an image package)"))
            else:
                r.missing.append((name, line))
                continue
            todo.append((target, frozenset(req.extras)))
    for name in ("missing", "conflicts", "to_read", "accepted"):  # a package reached with several sets of extras
        setattr(r, name, list(dict.fromkeys(getattr(r, name))))


# --------------------------------------------------------------------------------------- building here


def find_pip_python(version: str = "3.12") -> str:
    """A CPython `version` that runs pip (markers are evaluated for the Python running pip); else this Python."""
    cands = [shutil.which(f"python{version}"),
             *sorted(Path.home().glob(f".pyenv/versions/{version}.*/bin/python{version}")),
             f"/usr/bin/python{version}", f"/usr/local/bin/python{version}"]
    for c in filter(None, cands):
        try:
            if subprocess.run([str(c), "-m", "pip", "--version"], capture_output=True, timeout=60).returncode == 0:
                return str(c)
        except (OSError, subprocess.TimeoutExpired):
            continue
    print(f"vllm_carry: no Python {version} with pip here: pip evaluates markers for Python "
          f"{sys.version_info[0]}.{sys.version_info[1]}; the dry run below evaluates them for {version}",
          file=sys.stderr)
    return sys.executable


def _pip_target_args() -> list[str]:
    plat = [a for p in PLATFORMS for a in ("--platform", p)]
    return ["--only-binary=:all:", "--python-version", TARGET_ENV["python_version"], "--implementation", "cp", *plat]


def resolve(vllm: str, out: Path, pip_python: str, image: dict[str, str | None]) -> dict:
    """pip's resolution of vllm==`vllm` for the image (its report: every package with its metadata)."""
    constraints = out / "constraints.txt"
    pins = {"torch": f"torch=={TORCH}"}
    pins.update({n: f"{n}=={v}" for n, v in image.items() if v and n != "torch" and n not in RESOLVE_FREE})
    constraints.write_text("\n".join(sorted(pins.values())) + "\n")
    report = out / "resolution.json"
    empty = out / ".resolve-target"
    cmd = [pip_python, "-m", "pip", "install", "--disable-pip-version-check", "-q", "--dry-run", "--ignore-installed",
           "--report", str(report), "--target", str(empty), *_pip_target_args(), "-c", str(constraints),
           f"vllm=={vllm}"]
    print("vllm_carry: " + " ".join(cmd), file=sys.stderr)
    subprocess.run(cmd, check=True)
    shutil.rmtree(empty, ignore_errors=True)
    return json.loads(report.read_text())


def carried_pins(report: dict, image: dict[str, str | None], root: str = "vllm") -> list[str]:
    """`name==version` of what the resolution holds that the walk from `root` reaches before the image."""
    resolved = {}
    for item in report["install"]:
        m = item["metadata"]
        resolved[norm(m["name"])] = Dist(norm(m["name"]), m["version"], m.get("requires_dist", []))
    universe = {n: d for n, d in resolved.items() if n not in image}
    walk = dry_run(universe, image, root, image_meta={n: d for n, d in resolved.items() if n in image})
    if walk.missing:
        sys.exit("vllm_carry: the resolution lacks " + "; ".join(f"{w} needs {q}" for w, q in walk.missing)
                 + " (was pip run by a Python other than 3.12? --pip-python)")
    return sorted(f"{n}=={resolved[n].version}" for n in walk.needed)


def download(pins: list[str], dest: Path, pip_python: str) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    subprocess.run([pip_python, "-m", "pip", "download", "-q", "--disable-pip-version-check", "--no-deps",
                    *_pip_target_args(), "-d", str(dest), *pins], check=True)


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def split(wheels: Path, out: Path, part_bytes: int, vllm: str) -> dict:
    """One uncompressed tar of the wheels (wheels are zips already), cut into OUT/part-NNN; OUT/manifest.json."""
    for old in out.glob("part-*"):
        old.unlink()
    files = sorted(wheels.glob("*.whl"))
    tar_path = out / f"vllm-{vllm}-carry.tar"
    with tarfile.open(tar_path, "w", format=tarfile.PAX_FORMAT) as tar:
        for f in files:
            info = tar.gettarinfo(str(f), arcname=f"wheels/{f.name}")
            info.mtime, info.uid, info.gid, info.uname, info.gname = 0, 0, 0, "", ""
            with open(f, "rb") as fh:
                tar.addfile(info, fh)
    parts = []
    with open(tar_path, "rb") as src:
        for i in range(10**4):
            data = src.read(part_bytes)
            if not data:
                break
            p = out / f"part-{i:03d}"
            p.write_bytes(data)
            parts.append({"name": p.name, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()})
    manifest = {
        "vllm": vllm, "python": TARGET_ENV["python_version"], "torch": TORCH, "part_bytes": part_bytes,
        "calls": len(parts),
        "wheels": {f.name: {"bytes": f.stat().st_size, "sha256": sha256(f)} for f in files},
        "tar": {"name": tar_path.name, "bytes": tar_path.stat().st_size, "sha256": sha256(tar_path)},
        "parts": parts,
    }
    tar_path.unlink()
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1))
    return manifest


def build(vllm: str, out: Path, part_mb: float, pip_python: str | None) -> int:
    image = image_versions()
    out.mkdir(parents=True, exist_ok=True)
    pip_python = pip_python or find_pip_python(TARGET_ENV["python_version"])
    report = resolve(vllm, out, pip_python, image)
    pins = carried_pins(report, image)
    wheels = out / "wheels"
    shutil.rmtree(wheels, ignore_errors=True)
    print(f"vllm_carry: downloading {len(pins)} wheels into {wheels}", file=sys.stderr)
    download(pins, wheels, pip_python)
    rc = check(out, vllm)
    if rc:
        return rc
    m = split(wheels, out, int(part_mb * 1e6), vllm)
    print(f"vllm_carry: {len(m['wheels'])} wheels, {m['tar']['bytes'] / 1e6:.1f} MB in one tar, cut into "
          f"{len(m['parts'])} parts of at most {part_mb:g} MB: {len(m['parts'])} device calls on one warm machine")
    print(f"vllm_carry: each call: run(command=\"bash scripts/vllm_install_offline.sh\", "
          f"carry=[\"{out}/manifest.json\", \"{out}/part-NNN\"])")
    return 0


def glibc_needed(wheel_name: str) -> tuple[int, int]:
    """The oldest glibc a wheel installs on: the lowest of its manylinux tags (2, 5 for a pure-Python wheel)."""
    from packaging.utils import parse_wheel_filename

    legacy = {"manylinux1": (2, 5), "manylinux2010": (2, 12), "manylinux2014": (2, 17)}
    found = []
    for tag in parse_wheel_filename(wheel_name)[3]:
        m = re.match(r"manylinux_(\d+)_(\d+)_", tag.platform)
        found.append((int(m[1]), int(m[2])) if m else legacy.get(tag.platform.rsplit("_x86_64", 1)[0], (2, 5)))
    return min(found, default=(2, 5))


def check(out: Path, vllm: str | None = None) -> int:
    """The dry run on OUT/wheels, with the set's list (name, version, MB) and the highest manylinux tag used."""
    wheels = out / "wheels"
    dists = read_set(wheels)
    image = image_versions()
    sizes = {read_wheel(w).name: (w.name, w.stat().st_size) for w in sorted(wheels.glob("*.whl"))}
    for n in sorted(sizes, key=lambda n: -sizes[n][1]):
        print(f"  {n:<42} {dists[n].version:<24} {sizes[n][1] / 1e6:8.2f} MB")
    total = sum(s for _, s in sizes.values())
    glibc = max(map(glibc_needed, (f for f, _ in sizes.values())), default=(2, 5))
    print(f"vllm_carry: {len(dists)} wheels, {total / 1e6:.1f} MB; the highest glibc a wheel needs: "
          f"{glibc[0]}.{glibc[1]}")
    r = dry_run(dists, image)
    if vllm and dists.get("vllm") and dists["vllm"].version != vllm:
        print(f"vllm_carry: the set holds vllm {dists['vllm'].version}, not {vllm}")
        return 1
    print("\n".join(r.lines()))
    return 0 if r.ok else 1


# ------------------------------------------------------------------------------------- the engine's calls


API_SOURCES = {
    "LLM": ("vllm/entrypoints/llm.py", "LLM", ("reset_prefix_cache", "collective_rpc")),
    "V1": ("vllm/v1/worker/gpu_model_runner.py", "GPUModelRunner", ("reload_weights",)),
    "V2": ("vllm/v1/worker/gpu/model_runner.py", "GPUModelRunner", ("reload_weights",)),
    "RequestOutputKind": ("vllm/sampling_params.py", "RequestOutputKind", ()),
}
"""Where vLLM defines what `actors.engines.vllm_engine.api_problem` checks (the V2 runner: from mid-2026)."""


def api_stubs(read) -> tuple[dict[str, type], list[str]]:
    """Classes with the signatures (defaults and annotations dropped) and enum members that vLLM's sources define,
    read with `read(path) -> str | None`; and `file:line` of each. A file or class not there: left out."""
    import ast

    stubs, where = {}, []
    for key, (path, cls_name, methods) in API_SOURCES.items():
        text = read(path)
        tree = ast.parse(text) if text is not None else None
        cls = next((n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == cls_name), None) \
            if tree else None
        if cls is None:
            where.append(f"{path}: no class {cls_name}")
            continue
        ns: dict = {}
        if not methods:  # an enum: its members
            names = [t.id for n in cls.body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)]
            stubs[key] = type(cls_name, (), dict.fromkeys(names, 0))
            where.append(f"{path}:{cls.lineno} {cls_name}: {', '.join(names)}")
            continue
        for fn in (n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name in methods):
            args = fn.args
            for a in (*args.posonlyargs, *args.args, *args.kwonlyargs, args.vararg, args.kwarg):
                if a is not None:
                    a.annotation = None
            args.defaults = [ast.Constant(None) for _ in args.defaults]
            args.kw_defaults = [None if d is None else ast.Constant(None) for d in args.kw_defaults]
            stub = ast.FunctionDef(fn.name, args, [ast.Pass()], [], None, type_params=[])
            exec(compile(ast.fix_missing_locations(ast.Module([stub], [])), path, "exec"), ns)
            where.append(f"{path}:{fn.lineno} {cls_name}.{fn.name}{ast.unparse(args).join('()')}")
        stubs[key] = type(cls_name, (), ns)
    return stubs, where


def api(wheel: Path) -> int:
    """The engine's start check (`api_problem`) against the calls as vLLM's wheel defines them, read from its
    sources (no import: the wheel is built for the GPU image's torch)."""
    sys.path.insert(0, str(ROOT))
    from actors.engines.vllm_engine import api_problem

    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        stubs, where = api_stubs(lambda f: z.read(f).decode() if f in names else None)
        version = parse_metadata(z.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()).version
    print("\n".join(where))
    runners = [stubs[k] for k in ("V1", "V2") if k in stubs]
    problem = api_problem(version, stubs.get("LLM", object), runners, stubs.get("RequestOutputKind", object))
    print(f"api: vLLM {version}, runners {', '.join(k for k in ('V1', 'V2') if k in stubs)}: "
          + ("the engine's start check accepts it" if problem is None else problem))
    return 0 if problem is None else 1


# ------------------------------------------------------------------------------------------- on the device


def stage(src: Path, stage_dir: Path) -> int:
    """Copy every part of SRC (the carry's folder) into STAGE after checking its sha256 against SRC/manifest.json
    (`assemble` checks every staged part again). Exit 0 when all parts are staged, 3 when some are still to come,
    2 on a mismatch (the part is not kept)."""
    manifest = json.loads((src / "manifest.json").read_text())
    stage_dir.mkdir(parents=True, exist_ok=True)
    if (stage_dir / "manifest.json").is_file():
        old = json.loads((stage_dir / "manifest.json").read_text())
        if old["tar"]["sha256"] != manifest["tar"]["sha256"]:
            print(f"stage: {stage_dir} held parts of another carry (vllm {old['vllm']}): emptied")
            shutil.rmtree(stage_dir)
            stage_dir.mkdir(parents=True)
    shutil.copyfile(src / "manifest.json", stage_dir / "manifest.json")
    rc = 0
    for part in manifest["parts"]:
        here, kept = src / part["name"], stage_dir / part["name"]
        if kept.is_file() and kept.stat().st_size == part["bytes"]:
            continue
        if here.is_file():
            got = sha256(here)
            if got != part["sha256"]:
                print(f"stage: {here}: sha256 {got}, the manifest says {part['sha256']}: not kept")
                rc = 2
                continue
            shutil.copyfile(here, kept.with_suffix(".tmp"))
            kept.with_suffix(".tmp").replace(kept)
            print(f"stage: {part['name']} ({part['bytes'] / 1e6:.1f} MB) checked and kept in {stage_dir}")
    have = [p["name"] for p in manifest["parts"] if (stage_dir / p["name"]).is_file()]
    lacking = [p["name"] for p in manifest["parts"] if p["name"] not in have]
    print(f"stage: {len(have)} of {len(manifest['parts'])} parts staged"
          + (f"; still to carry (one per call, on this same machine): {', '.join(lacking)}" if lacking else ""))
    return rc or (3 if lacking else 0)


def assemble(stage_dir: Path) -> int:
    """Join the staged parts (each sha256 checked again), check the tar's sha256, extract the wheels into
    STAGE/wheels and check each wheel's sha256; the parts are deleted once the wheels are checked."""
    manifest = json.loads((stage_dir / "manifest.json").read_text())
    tar_path = stage_dir / manifest["tar"]["name"]
    whole = hashlib.sha256()
    with open(tar_path, "wb") as dst:
        for part in manifest["parts"]:
            data = (stage_dir / part["name"]).read_bytes()
            if hashlib.sha256(data).hexdigest() != part["sha256"]:
                print(f"assemble: {part['name']} does not match the manifest")
                return 2
            whole.update(data)
            dst.write(data)
    if whole.hexdigest() != manifest["tar"]["sha256"]:
        print(f"assemble: the joined tar's sha256 {whole.hexdigest()} is not {manifest['tar']['sha256']}")
        return 2
    shutil.rmtree(stage_dir / "wheels", ignore_errors=True)
    with tarfile.open(tar_path) as tar:
        tar.extractall(stage_dir, filter="data")
    tar_path.unlink()
    bad = [n for n, w in manifest["wheels"].items()
           if not (stage_dir / "wheels" / n).is_file() or sha256(stage_dir / "wheels" / n) != w["sha256"]]
    if bad:
        print(f"assemble: wheels missing or not matching the manifest: {', '.join(bad)}")
        return 2
    for part in manifest["parts"]:
        (stage_dir / part["name"]).unlink()
    print(f"assemble: {len(manifest['wheels'])} wheels checked in {stage_dir / 'wheels'}")
    return 0


def installable(wheels: Path) -> list[str]:
    """The wheels this Python cannot install (no tag of theirs among its supported tags)."""
    from packaging.tags import sys_tags
    from packaging.utils import parse_wheel_filename

    supported = set(sys_tags())
    return [w.name for w in sorted(wheels.glob("*.whl")) if not set(parse_wheel_filename(w.name)[3]) & supported]


def installed(site: Path, wheels: Path | None = None, root: str = "vllm") -> int:
    """After the install there: the walk from `root` over what this Python sees installed (SITE first, then its
    path), markers for this Python: every requirement met at a version that satisfies it. And nothing in SITE is
    torch's (package or file, as in `dry_run`); with `wheels`, every wheel installable by this Python (its tags)."""
    from importlib import metadata

    from packaging.markers import default_environment

    dists: dict[str, Dist] = {}
    for d in metadata.distributions(path=[str(site), *sys.path]):
        name = norm(d.metadata["Name"] or "")
        if name and name not in dists:  # the first on the path wins, as an import would
            dists[name] = Dist(name, d.version, d.requires or [])
    r = DryRun(root, {n: d.version for n, d in dists.items()})
    walk(r, dists, {}, {}, {**default_environment(), "extra": ""})
    for d in metadata.distributions(path=[str(site)]):
        name = norm(d.metadata["Name"] or "")
        if name in TORCH_FAMILY:
            r.replacing_torch.append(f"{name} {d.version} (package)")
        r.replacing_torch += [f"{name} {d.version}: {f}" for f in torch_files([str(f) for f in d.files or []])]
    r.carried = {n: v for n, v in r.carried.items() if n in r.needed}
    print("\n".join(ln.replace("carried wheels", "installed packages", 1) for ln in r.lines()
                    if "needed by nothing" not in ln and "the image's list" not in ln))
    bad = installable(wheels) if wheels is not None else []
    if bad:
        print(f"installed: wheels this Python cannot install: {', '.join(bad)}")
    return 0 if r.ok and not bad else 1


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    sub = p.add_subparsers(dest="cmd")
    for name in ("build", "check"):
        q = sub.add_parser(name)
        q.add_argument("--vllm", default=VLLM)
        q.add_argument("--out", default="vllm-carry", type=Path)
        q.add_argument("--part-mb", default=PART_MB, type=float)
        q.add_argument("--pip-python", default=None, help="a CPython 3.12 that runs pip (default: found here)")
    q = sub.add_parser("api")
    q.add_argument("wheel", type=Path)
    q = sub.add_parser("stage")
    q.add_argument("--from", dest="src", default="vllm-carry", type=Path)
    q.add_argument("--stage", default="/tmp/vllm-carry-stage", type=Path)
    q = sub.add_parser("assemble")
    q.add_argument("--stage", default="/tmp/vllm-carry-stage", type=Path)
    q = sub.add_parser("installed")
    q.add_argument("--site", required=True, type=Path)
    q.add_argument("--wheels", default=None, type=Path)
    argv = sys.argv[1:]
    if not argv or argv[0].startswith("-"):
        argv = ["build", *argv]
    a = p.parse_args(argv)
    if a.cmd == "build":
        return build(a.vllm, a.out, a.part_mb, a.pip_python)
    if a.cmd == "check":
        return check(a.out, a.vllm)
    if a.cmd == "api":
        return api(a.wheel)
    if a.cmd == "stage":
        return stage(a.src, a.stage)
    if a.cmd == "assemble":
        return assemble(a.stage)
    return installed(a.site, a.wheels)


if __name__ == "__main__":
    sys.exit(main())
