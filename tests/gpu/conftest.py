"""Tests only a GPU can answer (marked `gpu`): skipped, with the reason, where torch sees no CUDA device.

scripts/device_e2e.sh runs them on the lent GPU machines (`pytest tests/gpu -m gpu`). EXGRPO_GPU_TESTS_DEVICE=cpu
runs them on the CPU instead, as a dry run of their code (the CUDA-only paths they exist for are not exercised).

Inductor's compile is most of their time on a GPU (123 s of 133 on the H100, issue 49). EXGRPO_GPU_COMPILE_CACHE
names a folder whose artifact files (*.bin, *.bin.gz) are loaded before any test compiles, and
EXGRPO_GPU_COMPILE_CACHE_OUT one where the session's are saved (tests-gpu.bin); scripts/device_e2e.sh sets both,
loading what the last lease brought back (device-carry/compile-cache) and packing what this one built into $OUT."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

DEVICE = os.environ.get("EXGRPO_GPU_TESTS_DEVICE", "cuda")


def pytest_collection_modifyitems(config, items):
    if DEVICE != "cuda" or torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA: torch.cuda.is_available() is False on this machine "
                                   "(scripts/device_e2e.sh runs these on a lent GPU)")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def _compile_cache():
    """The artifacts of the last lease loaded, and this session's saved (module docstring); unset: nothing."""
    src, dst = os.environ.get("EXGRPO_GPU_COMPILE_CACHE"), os.environ.get("EXGRPO_GPU_COMPILE_CACHE_OUT")
    if src or dst:
        from learner.compile_cache import load_compile_cache_folder, save_compile_cache
    if src:
        load_compile_cache_folder(src)
    yield
    if dst:
        save_compile_cache(Path(dst) / "tests-gpu.bin")


@pytest.fixture
def device() -> torch.device:
    return torch.device(DEVICE)


def small_qwen2(device: torch.device, dtype: torch.dtype = torch.float32, *, layers: int = 2, seed: int = 0,
                attn: str | None = None):
    """A random Qwen2 (hidden 256, 4 heads, 2 KV heads, vocabulary 512) on `device`."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    cfg = Qwen2Config(vocab_size=512, hidden_size=256, num_hidden_layers=layers, num_attention_heads=4,
                      num_key_value_heads=2, intermediate_size=512, max_position_embeddings=1024,
                      tie_word_embeddings=True)
    if attn is not None:
        cfg._attn_implementation = attn
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(cfg, dtype=dtype).to(device)
