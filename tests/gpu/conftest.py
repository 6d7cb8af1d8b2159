"""Tests only a GPU can answer (marked `gpu`): skipped, with the reason, where torch sees no CUDA device.

scripts/device_e2e.sh runs them on the lent GPU machines (`pytest tests/gpu -m gpu`). EXGRPO_GPU_TESTS_DEVICE=cpu
runs them on the CPU instead, as a dry run of their code (the CUDA-only paths they exist for are not exercised)."""

from __future__ import annotations

import os

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
