"""The chunked log-prob/entropy path is exact against full logits: values and gradients, float32 and
bfloat16, tied embeddings, any chunk size, the all-masked dummy, and 2 FSDP2 ranks over gloo."""

from __future__ import annotations

import copy
import os
import socket
import subprocess
import sys
import textwrap

import pytest
import torch

from common.modeling import init_tiny_llama, init_tiny_qwen2
from learner import loss as L
from learner.token_stats import (HeadError, TokenStatsHead, auto_chunk_tokens, chunked_logprob_entropy,
                                 install_token_stats_head, token_stats)

V = 1000


def inputs(seed: int = 0, rows: int = 3, length: int = 24, vocab: int = V):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (rows, length), generator=g)  # [R, L]
    attn = torch.ones_like(ids)
    attn[1, length - 5:] = 0  # a right-padded row
    mask = (torch.rand(rows, length - 1, generator=g) > 0.4).float()  # [R, L-1]
    mask[1, length - 6:] = 0
    coef = torch.randn(2, rows, length - 1, generator=g)  # weights of logp and entropy in the test loss
    return ids, attn, mask, coef


def direct(model, ids, attn, mask):
    """The reference: full [R, L, V] logits, then the loss module's chunk-free functions."""
    logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1]  # [R, L-1, V]
    lp = L.token_logprobs(logits, ids[:, 1:]) * mask
    ent = L.token_entropy(logits) * mask
    return lp, ent


def loss_and_grads(model, fn):
    model.zero_grad(set_to_none=True)
    lp, ent = fn()
    return lp.detach(), ent.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def compare(build, dtype, chunk, rtol, atol, grad_rtol):
    ids, attn, mask, coef = inputs()
    ref_model = build().to(dtype)
    model = copy.deepcopy(ref_model)
    install_token_stats_head(model, chunk)

    def run_direct():
        lp, ent = direct(ref_model, ids, attn, mask)
        ((coef[0] * lp).sum() + (coef[1] * ent).sum()).backward()
        return lp, ent

    def run_chunked():
        lp, ent, _ = token_stats(model, ids, attn, ids[:, 1:], mask)
        ((coef[0] * lp).sum() + (coef[1] * ent).sum()).backward()
        return lp, ent

    lp_d, ent_d, g_d = loss_and_grads(ref_model, run_direct)
    lp_c, ent_c, g_c = loss_and_grads(model, run_chunked)
    torch.testing.assert_close(lp_c, lp_d, rtol=rtol, atol=atol)
    torch.testing.assert_close(ent_c, ent_d, rtol=rtol, atol=atol)
    assert g_c.keys() == g_d.keys() and len(g_c) > 4
    for name in g_d:
        diff = (g_c[name].float() - g_d[name].float()).norm() / g_d[name].float().norm().clamp(min=1e-12)
        assert diff < grad_rtol, (name, float(diff))
    return model


@pytest.mark.parametrize("chunk", [1, 7, None])
def test_float32_tied_qwen2_exact_values_and_gradients(chunk):
    model = compare(lambda: init_tiny_qwen2(V, hidden_size=32, num_heads=2, num_kv_heads=1, seed=1),
                    torch.float32, chunk, rtol=1e-5, atol=1e-5, grad_rtol=1e-5)
    assert model.lm_head.weight is model.model.embed_tokens.weight  # still tied
    assert "lm_head.weight" in dict(model.named_parameters(remove_duplicate=False))


def test_float32_untied_llama_exact():
    compare(lambda: init_tiny_llama(V, hidden_size=32, num_layers=2, num_heads=1, seed=2), torch.float32, 5,
            rtol=1e-5, atol=1e-5, grad_rtol=1e-5)


def test_bfloat16_within_its_rounding():
    compare(lambda: init_tiny_qwen2(V, hidden_size=32, num_heads=2, num_kv_heads=1, seed=3), torch.bfloat16, 9,
            rtol=2e-2, atol=2e-2, grad_rtol=3e-2)


def test_function_against_autograd_on_random_tensors():
    g = torch.Generator().manual_seed(4)
    h = torch.randn(37, 16, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(50, 16, generator=g, dtype=torch.float64, requires_grad=True)
    t = torch.randint(0, 50, (37,), generator=g)
    assert torch.autograd.gradcheck(lambda a, b: chunked_logprob_entropy(a, b, t, 8), (h, w))


def test_all_masked_dummy_computes_one_position_and_reaches_every_parameter():
    model = init_tiny_qwen2(V, hidden_size=32, num_heads=2, num_kv_heads=1, seed=5)
    install_token_stats_head(model, 4)
    ids = torch.zeros(1, 2, dtype=torch.long)
    lp, ent, anchor = token_stats(model, ids, torch.ones_like(ids), ids[:, 1:], torch.zeros(1, 1))
    assert lp.abs().sum() == 0 and ent.abs().sum() == 0
    (0.0 * anchor).backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    assert all(g is not None and float(g.abs().sum()) == 0.0 for g in grads.values()), \
        [n for n, g in grads.items() if g is None]


def test_head_without_request_is_the_linear_layer_and_refusals():
    model = init_tiny_qwen2(V, hidden_size=32, num_heads=2, num_kv_heads=1, seed=6)
    ids = torch.tensor([[5, 6, 7]])
    before = model(input_ids=ids).logits
    head = install_token_stats_head(model)
    assert isinstance(head, TokenStatsHead) and install_token_stats_head(model) is head
    assert head.chunk_tokens == auto_chunk_tokens(V)
    assert torch.equal(model(input_ids=ids).logits, before)  # evaluation/generation still see logits
    assert auto_chunk_tokens(151_936) == 220 and auto_chunk_tokens(32_000) == 1048
    other = init_tiny_qwen2(V, hidden_size=32, num_heads=2, num_kv_heads=1)
    other.config.final_logit_softcapping = 30.0
    with pytest.raises(HeadError, match="final_logit_softcapping=30.0"):
        install_token_stats_head(other)
    plain = init_tiny_qwen2(V, hidden_size=32, num_heads=2, num_kv_heads=1)
    with pytest.raises(HeadError, match="install_token_stats_head"):
        token_stats(plain, ids, torch.ones_like(ids), ids[:, 1:], torch.ones(1, 2))


FSDP_SCRIPT = textwrap.dedent("""
    import os, sys, torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from common.modeling import init_tiny_qwen2
    from learner.token_stats import install_token_stats_head, token_stats
    sys.path.insert(0, os.getcwd())
    from tests.learner.test_token_stats import inputs, V

    rank, world, port, out, dtype = int(sys.argv[1]), 2, sys.argv[2], sys.argv[3], getattr(torch, sys.argv[4])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    model = init_tiny_qwen2(V, hidden_size=32, num_heads=2, num_kv_heads=1, seed=7)
    install_token_stats_head(model, 6)
    mesh = init_device_mesh("cpu", (world,))
    mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    ids, attn, mask, coef = inputs(seed=10 + rank)
    if rank == 1:
        ids, attn, mask = ids[:, :2].clone(), attn[:, :2].clone(), torch.zeros(3, 1)  # the all-masked dummy
    lp, ent, anchor = token_stats(model, ids, attn, ids[:, 1:], mask)
    loss = (coef[0, :, :mask.shape[1]] * lp).sum() + (coef[1, :, :mask.shape[1]] * ent).sum() + 0.0 * anchor
    (loss * world).backward()  # FSDP averages over ranks: x world gives the sum of the ranks' losses
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    if rank == 0:
        torch.save({"lp": lp.detach(), "ent": ent.detach(), "grads": grads}, out)
    dist.barrier()  # neither rank tears gloo down while the other still uses it
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # skip C++ static destructors: a gloo/TCPStore thread of a finished group can abort the exit
    # (CI once: rank 1 "terminate called without an active exception", SIGABRT, after both ranks had finished)
""")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_two_fsdp_ranks_match_one_process_with_full_logits(tmp_path, dtype):
    """Rank 0 trains real tokens, rank 1 only the dummy: the sharded gradients equal rank 0's loss
    computed with full logits in one process (the dummy adds exactly nothing)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "rank0.pt"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-c", FSDP_SCRIPT, str(r), str(port), str(out), dtype],
                              cwd=os.getcwd(), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(2)]
    logs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], logs
    got = torch.load(out)

    model = init_tiny_qwen2(V, hidden_size=32, num_heads=2, num_kv_heads=1, seed=7)
    ids, attn, mask, coef = inputs(seed=10)
    work = copy.deepcopy(model).to(getattr(torch, dtype))
    lp, ent = direct(work, ids, attn, mask)
    ((coef[0] * lp).sum() + (coef[1] * ent).sum()).backward()
    tol = {"float32": (1e-5, 1e-5), "bfloat16": (2e-2, 3e-2)}[dtype]
    torch.testing.assert_close(got["lp"], lp.detach(), rtol=tol[0], atol=tol[0])
    torch.testing.assert_close(got["ent"], ent.detach(), rtol=tol[0], atol=tol[0])
    ref = dict(work.named_parameters())
    assert got["grads"].keys() == ref.keys()
    for name, g in got["grads"].items():
        want = ref[name].grad.float()
        diff = (g.float() - want).norm() / want.norm().clamp(min=1e-12)
        assert diff < tol[1], (name, float(diff))
