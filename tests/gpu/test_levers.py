"""The learner's GPU levers on CUDA: per-layer torch.compile (learner/levers.py apply_compile) trains a step as the
eager model does, and padding-free packing through flex_attention (its block mask, learner/forward.py) gives the
padded micro-batch's log-probs and gradients, backward included (issue 42: it failed on an H100 under compile)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from common.config import LearnerConfig
from learner.batching import Row, collate
from learner.forward import check_packing, forward_stats, prepare_model
from learner.levers import apply_compile
from tests.gpu.conftest import small_qwen2

pytestmark = pytest.mark.gpu
BACKEND = {"cuda": "inductor", "cpu": "aot_eager"}  # the CPU dry run: inductor's C++ builds take minutes on 2 cores


def _rows(n: int = 4, seed: int = 0) -> list[Row]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        p, t = int(rng.integers(3, 12)), int(rng.integers(4, 40))
        out.append(Row(rng.integers(3, 512, p), rng.integers(3, 512, t), np.zeros(t, np.float32), 1.0, False,
                       f"r{i}", i))
    return out


def _step(model, mb) -> tuple[float, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    logp, _, anchor = forward_stats(model, mb)
    loss = -(logp * mb.response_mask).sum() / mb.response_mask.sum() + 0 * anchor
    loss.backward()
    return float(loss.detach()), {n: p.grad.detach().float().clone() for n, p in model.named_parameters() if p.grad is not None}


def _close(a: dict, b: dict, rtol: float) -> None:
    assert a.keys() == b.keys()
    for n in a:
        scale = b[n].abs().max().clamp(min=1e-6)
        assert float((a[n] - b[n]).abs().max() / scale) < rtol, n


def test_per_layer_compile_trains_a_step_as_eager(device):
    cfg = LearnerConfig(levers=dict(compile=False))
    eager = prepare_model(small_qwen2(device), cfg)
    compiled = prepare_model(small_qwen2(device), cfg)
    assert apply_compile(compiled, BACKEND[device.type]) == 2
    for seed in (0, 1):  # a second set of lengths: dynamic shapes, no failure
        mb = collate(_rows(seed=seed), 0, device)
        (le, ge), (lc, gc) = _step(eager, mb), _step(compiled, mb)
        assert abs(le - lc) < 1e-4 * max(1.0, abs(le))
        _close(gc, ge, 1e-3)
    opt = torch.optim.AdamW(compiled.parameters(), lr=1e-3, fused=device.type == "cuda")
    opt.step()
    assert all(torch.isfinite(p).all() for p in compiled.parameters())


@pytest.mark.parametrize("compiled", [False, True])
def test_flex_attention_packing_matches_padded_forward_and_backward(device, compiled):
    if device.type != "cuda":
        pytest.skip("flex_attention has no backward on the CPU (the dry run's device)")
    cfg = LearnerConfig(levers=dict(compile=False))
    padded = prepare_model(small_qwen2(device, attn="sdpa"), cfg)
    packed = prepare_model(small_qwen2(device, attn="flex_attention"), cfg)
    if compiled:
        apply_compile(packed, BACKEND[device.type])
    assert check_packing(packed, device) <= 1e-3
    rows = _rows(6, seed=1)
    lp, gp = _step(padded, collate(rows, 0, device))
    lk, gk = _step(packed, collate(rows, 0, device, packed=True))
    assert abs(lp - lk) < 1e-4 * max(1.0, abs(lp))
    _close(gk, gp, 1e-3)
