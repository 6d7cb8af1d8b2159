"""The chunked head's compiled block math (`learner.levers.compile_head_math`, opt-in) is exact on CUDA: log-probs,
entropies and gradients of the hidden states and the head's weight against autograd through full logits, at
Qwen2.5's vocabulary, in bfloat16 (the learner's compute dtype) and float32, beside the eager chunked head. Until
this has passed on a GPU the switch stays off by default there (issue 49).

    pytest tests/gpu/test_head_math.py -m gpu        # on a GPU machine (scripts/device_e2e.sh runs tests/gpu)
"""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from learner import loss as L
from learner.token_stats import chunked_logprob_entropy

pytestmark = pytest.mark.gpu

VOCAB = 151_936  # Qwen2.5's


def tensors(device, dtype, n, hidden, vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, hidden, generator=g).to(device, dtype)  # [N, H]
    w = (torch.randn(vocab, hidden, generator=g) / hidden ** 0.5).to(device, dtype)  # [V, H]
    t = torch.randint(0, vocab, (n,), generator=g).to(device)  # [N]
    coef = torch.randn(2, n, generator=g).to(device)  # weights of logp and entropy in the test loss
    return h, w, t, coef


def values_and_grads(fn, h, w, t, coef):
    h, w = h.clone().requires_grad_(), w.clone().requires_grad_()
    lp, ent = fn(h, w, t)
    ((coef[0] * lp).sum() + (coef[1] * ent).sum()).backward()
    return lp.detach(), ent.detach(), h.grad, w.grad


def full_logits(h, w, t):
    z = F.linear(h, w).float()  # [N, V]
    return L.token_logprobs(z, t), L.token_entropy(z)


def rel(a, b) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-12))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("chunk", [64, 10**6])  # many blocks and vocabulary slices; one block
def test_compiled_head_math_exact_on_the_device(device, dtype, chunk):
    small = device.type != "cuda"  # EXGRPO_GPU_TESTS_DEVICE=cpu: a dry run on small shapes
    n, hidden, vocab = (37, 16, 1000) if small else (1024, 1536, VOCAB)
    h, w, t, coef = tensors(device, dtype, n, hidden, vocab)
    ref = values_and_grads(full_logits, h, w, t, coef)
    eager = values_and_grads(lambda *a: chunked_logprob_entropy(*a, chunk, compile_math=False), h, w, t, coef)
    fused = values_and_grads(lambda *a: chunked_logprob_entropy(*a, chunk, compile_math=True), h, w, t, coef)
    # values: the same logits by the same float32 formulas (inductor may reassociate the float32 sums)
    for got in (eager, fused):
        torch.testing.assert_close(got[0], ref[0], rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(got[1], ref[1], rtol=1e-5, atol=1e-4)
    # gradients: the fused math within the eager chunked head's own distance from full logits (bf16: its rounding)
    bound = 1e-5 if dtype == torch.float32 else (1e-4 if chunk == 10**6 else 1e-2)
    for i, name in ((2, "hidden"), (3, "weight")):
        assert rel(eager[i], ref[i]) < bound, (name, rel(eager[i], ref[i]))
        assert rel(fused[i], ref[i]) < bound, (name, rel(fused[i], ref[i]))
        assert fused[i].dtype == dtype
    if dtype == torch.float32:  # fused against eager: reassociation only
        assert all(rel(a, b) < 1e-5 for a, b in zip(fused, eager)), [rel(a, b) for a, b in zip(fused, eager)]
