"""scripts/device_out.py: a lease's $OUT packed into what one device call brings back (8 files, 16 MiB each, 64
MiB together, plain names, 2 folders down at most), and unpacked here whole, the compile cache merged into the
folder the next call carries."""

from __future__ import annotations

import gzip
import importlib.util
import os
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MIB = 2**20


def _device_out():
    spec = importlib.util.spec_from_file_location("device_out", ROOT / "scripts" / "device_out.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _files(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_a_lease_folder_comes_back_within_the_limits_and_unpacks_whole(tmp_path):
    """12 part files, a run folder 2 deep and a 20 MiB log that does not compress; a cache of 28 MiB (the defaults'
    build), another 28 MiB that cannot also fit, a 1 MiB one rebuilt this call beside the copy carried in. The
    defaults' and the rebuilt one come back, the other is named as left out; everything else comes back whole."""
    do = _device_out()
    out = tmp_path / "out"
    (out / "run" / "logs").mkdir(parents=True)
    for part in ("defaults", "eager", "ckpt-full", "ckpt-selective", "ckpt-none", "lora"):
        (out / f"gpu-bench-{part}.json").write_text('{"part": "%s"}' % part)
        (out / f"gpu-bench-{part}.log").write_text(f"[gpu_bench] {part}\n" * 100)
    (out / "device_bench.md").write_text("## device_bench: every case\n")
    (out / "run" / "logs" / "driver.log").write_text("step 1\n")
    (out / "big.log").write_bytes(os.urandom(20 * MIB))
    cache = out / "inductor-cache"
    cache.mkdir()
    defaults, ckpt, lora = os.urandom(28 * MIB), os.urandom(28 * MIB), bytes(MIB)
    (cache / "gpu-bench-defaults.bin").write_bytes(defaults)
    (cache / "gpu-bench-ckpt-full.bin").write_bytes(ckpt)
    (cache / "gpu-bench-lora.bin").write_bytes(lora)
    (cache / "gpu-bench-lora.bin.gz").write_bytes(gzip.compress(b"the last lease's build"))
    (cache / "part-seconds.txt").write_text("defaults 243\n")
    before = {k: v for k, v in _files(out).items() if not k.startswith("inductor-cache/")}

    lines = do.pack(out, ["device_bench.md", "missing.json"], cache, ["gpu-bench-defaults", "gpu-bench-ckpt"])

    back = _files(out)
    # device_bench.md; results.tar.gz in 2 pieces (the random log); the cache tar (the defaults' 28 MiB) in 2 pieces
    assert sorted(back) == ["compile-cache.tar.000of002", "compile-cache.tar.001of002", "device_bench.md",
                            "results.tar.gz.000of002", "results.tar.gz.001of002"], sorted(back)
    assert len(back) <= 8 and sum(map(len, back.values())) <= 64 * MIB
    assert all(len(v) <= 16 * MIB and re.fullmatch(r"[A-Za-z0-9._-]+", k) for k, v in back.items())
    said = "\n".join(lines)
    assert "inductor-cache/gpu-bench-ckpt-full.bin.gz (28.0 MiB gzip'd): LEFT OUT" in said, said
    assert "device_out: back: results.tar.gz.000of002 (15.0 MiB)" in said

    carry = tmp_path / "carry"
    carry.mkdir()
    (carry / "gpu-bench-lora.bin").write_bytes(b"an older, unzipped build")  # replaced by this lease's
    (carry / "gpu-bench-eager.bin.gz").write_bytes(b"kept: not built this lease")
    do.unpack(out, tmp_path / "here", carry)
    here = _files(tmp_path / "here")
    assert {k: v for k, v in here.items() if not k.startswith("inductor-cache/")} == before
    got = _files(carry)
    assert sorted(got) == ["gpu-bench-defaults.bin.gz", "gpu-bench-eager.bin.gz", "gpu-bench-lora.bin.gz",
                           "part-seconds.txt"]
    assert gzip.decompress(got["gpu-bench-defaults.bin.gz"]) == defaults
    assert gzip.decompress(got["gpu-bench-lora.bin.gz"]) == lora  # this call's build, not the carried one
    assert got["part-seconds.txt"] == b"defaults 243\n"

    # a piece the call did not bring back: named, and nothing half-joined is taken for whole
    (out / "compile-cache.tar.001of002").unlink()
    with pytest.raises(SystemExit, match=r"compile-cache.tar is missing piece\(s\) \[1\] of 2"):
        do.unpack(out, tmp_path / "again", None)


def test_a_folder_without_a_cache_packs_its_files_and_a_large_kept_file_goes_in_the_archive(tmp_path):
    do = _device_out()
    out = tmp_path / "out"
    out.mkdir()
    (out / "device_e2e.json").write_text("{}")
    (out / "device_e2e.log").write_bytes(os.urandom(16 * MIB))  # over a piece: archived, not kept as it is
    lines = do.pack(out, ["device_e2e.json", "device_e2e.log"], out / "compile-cache", [])
    assert sorted(_files(out)) == ["device_e2e.json", "results.tar.gz.000of002", "results.tar.gz.001of002"]
    assert any("device_e2e.log: into results.tar.gz" in line for line in lines), lines
    do.unpack(out, tmp_path / "here", tmp_path / "carry")
    assert len((tmp_path / "here" / "device_e2e.log").read_bytes()) == 16 * MIB
    assert not (tmp_path / "carry").exists()  # no cache came back: nothing to merge
