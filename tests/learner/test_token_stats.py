"""The chunked log-prob/entropy path is exact against full logits: values and gradients, float32 and
bfloat16, tied embeddings, any block size (one block, many vocabulary slices), either output alone, no
tokens, the all-masked dummy, and 2 FSDP2 ranks over gloo. The weight gradient is written once per call."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torch.nn import functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from common.modeling import TinyLlama, TinyQwen2
from learner import loss as L
from learner.token_stats import (BLOCK_BYTES_CAP, HeadError, TokenStatsHead, auto_chunk_tokens,
                                 chunk_tokens_from_free_memory, chunked_logprob_entropy, install_token_stats_head,
                                 token_stats, vocab_slice)
from tests.ports import rendezvous_store

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
    model = compare(lambda: TinyQwen2(vocab_size=V, hidden_size=32, num_heads=2, num_kv_heads=1, seed=1).build(),
                    torch.float32, chunk, rtol=1e-5, atol=1e-5, grad_rtol=1e-5)
    assert model.lm_head.weight is model.model.embed_tokens.weight  # still tied
    assert "lm_head.weight" in dict(model.named_parameters(remove_duplicate=False))


def test_float32_untied_llama_exact():
    compare(lambda: TinyLlama(vocab_size=V, hidden_size=32, num_layers=2, num_heads=1, seed=2).build(), torch.float32,
            5, rtol=1e-5, atol=1e-5, grad_rtol=1e-5)


def test_bfloat16_within_its_rounding():
    compare(lambda: TinyQwen2(vocab_size=V, hidden_size=32, num_heads=2, num_kv_heads=1, seed=3).build(),
            torch.bfloat16, 9, rtol=2e-2, atol=2e-2, grad_rtol=3e-2)


def test_function_against_autograd_on_random_tensors():
    g = torch.Generator().manual_seed(4)
    h = torch.randn(37, 16, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(50, 16, generator=g, dtype=torch.float64, requires_grad=True)
    t = torch.randint(0, 50, (37,), generator=g)
    assert torch.autograd.gradcheck(lambda a, b: chunked_logprob_entropy(a, b, t, 8), (h, w))


def tensors(dtype, n=37, vocab=300, hidden=16, seed=8):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, hidden, generator=g).to(dtype)  # [N, H]
    w = (torch.randn(vocab, hidden, generator=g) / 2).to(dtype)  # [V, H]
    t = torch.randint(0, vocab, (n,), generator=g)  # [N]
    coef = torch.randn(2, n, generator=g)  # weights of logp and entropy in the test loss
    return h, w, t, coef


def values_and_grads(fn, h, w, t, coef, outputs=(0, 1)):
    """fn(h, w, t) -> (logp [N], ent [N]); the loss sums the chosen outputs weighted by `coef`."""
    h, w = h.clone().requires_grad_(), w.clone().requires_grad_()
    out = fn(h, w, t)
    sum(((coef[i] * out[i]).sum() for i in outputs), torch.zeros(())).backward()
    return out[0].detach(), out[1].detach(), h.grad, w.grad


def full_logits(h, w, t):
    """The reference: autograd through [N, V] logits, cast to float32 once, so that d loss / dz is rounded to
    the hidden dtype once (`L.token_logprobs` and `L.token_entropy` each casting bf16 logits would round
    each output's gradient separately, 2e-3 apart, which is the reference's rounding, not ours)."""
    z = F.linear(h, w).float()  # [N, V]
    return L.token_logprobs(z, t), L.token_entropy(z)


def rel(a, b) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-12))


# chunk 1 at N = 37, V = 300: slices of 8 rows (38 blocks); 5: 40 rows (8 blocks); 10**6: one block
@pytest.mark.parametrize("chunk", [1, 5, 10**6])
@pytest.mark.parametrize("outputs", [(0, 1), (0,), (1,)])
def test_blocks_exact_against_full_logits_float32(chunk, outputs):
    h, w, t, coef = tensors(torch.float32)
    lp, ent, gh, gw = values_and_grads(lambda *a: chunked_logprob_entropy(*a, chunk), h, w, t, coef, outputs)
    lp_r, ent_r, gh_r, gw_r = values_and_grads(full_logits, h, w, t, coef, outputs)
    torch.testing.assert_close(lp, lp_r, rtol=1e-6, atol=2e-6)  # the forward runs the full-logits formulas
    torch.testing.assert_close(ent, ent_r, rtol=1e-6, atol=2e-6)
    assert rel(gh, gh_r) < 1e-5 and rel(gw, gw_r) < 1e-5, (rel(gh, gh_r), rel(gw, gw_r))


@pytest.mark.parametrize("chunk", [1, 5, 10**6])
@pytest.mark.parametrize("outputs", [(0, 1), (0,), (1,)])
def test_blocks_bfloat16_within_its_rounding(chunk, outputs):
    """Values come from the same bf16 logits by the same float32 formulas: equal to 1e-6. One block computes
    both gradients as autograd does (equal up to a rare bf16 rounding of d loss / dz); several slices sum the
    hidden-state gradient over slices, each slice's product rounded to bf16 first (about one bf16 rounding)."""
    h, w, t, coef = tensors(torch.bfloat16)
    lp, ent, gh, gw = values_and_grads(lambda *a: chunked_logprob_entropy(*a, chunk), h, w, t, coef, outputs)
    lp_r, ent_r, gh_r, gw_r = values_and_grads(full_logits, h, w, t, coef, outputs)
    torch.testing.assert_close(lp, lp_r, rtol=1e-6, atol=2e-6)  # the forward runs the full-logits formulas
    torch.testing.assert_close(ent, ent_r, rtol=1e-6, atol=2e-6)
    assert gh.dtype == gw.dtype == torch.bfloat16
    assert rel(gw, gw_r) < 1e-4, rel(gw, gw_r)
    assert rel(gh, gh_r) < (1e-4 if chunk == 10**6 else 1e-2), rel(gh, gh_r)


def test_no_tokens_gives_empty_outputs_and_zero_gradients():
    h, w, t, coef = tensors(torch.float32, n=0)
    lp, ent, gh, gw = values_and_grads(lambda *a: chunked_logprob_entropy(*a, 4), h, w, t, coef)
    assert lp.shape == ent.shape == (0,) and gh.shape == (0, 16)
    assert gw.shape == (300, 16) and float(gw.abs().sum()) == 0.0


class StorageWrites(TorchDispatchMode):
    """Records (op, storage, shape) of every tensor an op writes; views and allocations (`empty*`) write nothing."""

    def __init__(self):
        super().__init__()
        self.log = []  # (op name, data_ptr of the output's storage, shape)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not func.is_view and not func.__name__.startswith("empty"):
            for o in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(o, torch.Tensor):
                    self.log.append((func.__name__, o.untyped_storage().data_ptr(), tuple(o.shape)))
        return out


@pytest.mark.parametrize("chunk, matmuls", [(10**6, 1), (5, 8), (1, 38)])
def test_weight_gradient_written_once_per_call(chunk, matmuls):
    """The [V, H] weight gradient is written once: one matmul over all N tokens when the block holds the whole
    vocabulary, else one per vocabulary slice, each writing its own rows; no [V, H]-sized temporary exists
    (the per-chunk path made, per chunk, a [V, H] product, its float32 copy and a float32 sum)."""
    h, w, t, coef = tensors(torch.float32)
    h, w = h.requires_grad_(), w.requires_grad_()
    lp, ent = chunked_logprob_entropy(h, w, t, chunk)
    with StorageWrites() as mode:
        ((coef[0] * lp).sum() + (coef[1] * ent).sum()).backward()
    ptr = w.grad.untyped_storage().data_ptr()
    writes = [(op, shape) for op, p, shape in mode.log if p == ptr]
    assert len(writes) == matmuls and all(op == "mm.out" for op, _ in writes), writes
    assert sum(shape[0] for _, shape in writes) == w.shape[0]  # every row once
    assert not [shape for _, p, shape in mode.log if p != ptr and shape == tuple(w.shape)]  # no [V, H] temporary


def test_block_sizes_worked_by_hand():
    # CPU default at Qwen2.5's vocabulary: 2^25 // 151,936 = 220 tokens' worth of logits per block
    assert auto_chunk_tokens(151_936) == 220
    # 16,384 tokens: 220 x 151,936 // 16,384 = 2,040 rows -> 1,920 (multiple of 128); 80 slices
    assert vocab_slice(16_384, 151_936, 220) == 1_920
    # CUDA, 40 GiB free: a quarter is 10 GiB, capped at 2 GiB; 2^31 // (8 B x 151,936) = 1,766 tokens' worth
    assert BLOCK_BYTES_CAP == 2 << 30 and chunk_tokens_from_free_memory(40 << 30, 151_936) == 1_766
    # 16,384 tokens: 1,766 x 151,936 // 16,384 = 16,376 -> 16,256 rows; 10 slices
    assert vocab_slice(16_384, 151_936, 1_766) == 16_256
    # 2 GiB free: a quarter, 512 MiB, is 441 tokens' worth; 100 MiB free: never below the CPU default
    assert chunk_tokens_from_free_memory(2 << 30, 151_936) == 441
    assert chunk_tokens_from_free_memory(100 << 20, 151_936) == 220
    # one block when the tokens fit: chunk >= N, and the dummy's single token
    assert vocab_slice(220, 151_936, 220) == vocab_slice(1, 151_936, 220) == vocab_slice(0, 151_936, 220) == 151_936
    # tiny blocks: below 128 rows no rounding, never below one row
    assert vocab_slice(37, 300, 1) == 8 and vocab_slice(10**6, 300, 1) == 1


@pytest.mark.slow
def test_compiled_block_math_equals_eager():
    """The opt-in torch.compile of the per-block math (`compile_math`, off by default) gives the eager
    numbers (inductor's fused kernels: float32 to its reassociation). About a minute of compiling on a CPU."""
    h, w, t, coef = tensors(torch.float32)
    for chunk in (5, 10**6):
        eager = values_and_grads(lambda *a: chunked_logprob_entropy(*a, chunk), h, w, t, coef)
        fused = values_and_grads(lambda *a: chunked_logprob_entropy(*a, chunk, compile_math=True), h, w, t, coef)
        for a, b in zip(fused, eager):
            assert rel(a, b) < 1e-6, (chunk, rel(a, b))


def test_compiled_head_math_is_an_opt_in_switch():
    """learner.levers.compile_head_math (off by default, also on CUDA: never run on a GPU yet) reaches the head."""
    from common.config import LearnerConfig
    from learner.forward import prepare_model
    from learner.token_stats import COMPILE_BLOCK_MATH

    assert COMPILE_BLOCK_MATH is False and LearnerConfig().levers.compile_head_math is False
    for on in (False, True):
        model = TinyQwen2(vocab_size=V, hidden_size=32, num_heads=2, num_kv_heads=1, seed=1).build()
        prepare_model(model, LearnerConfig(levers=dict(compile_head_math=on, compile=False, activation_checkpointing="none")))
        assert isinstance(model.lm_head, TokenStatsHead) and model.lm_head.compile_math is on


@pytest.mark.slow
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_compiled_head_math_through_the_model_is_exact_against_full_logits(dtype, tol):
    """learner.levers.compile_head_math=true, through the model's forward (several token chunks and vocabulary slices):
    log-probs, entropies and every parameter's gradient as the full-logits path gives them (float32 to 1e-5,
    bfloat16 within its rounding: the same bounds as the eager chunked head), and as the eager chunked head to
    1e-6 (values) and 2e-6 (gradients) in float32. Inductor on a CPU: about a minute of compiling."""
    from common.config import LearnerConfig
    from learner.forward import prepare_model

    tiny = TinyQwen2(vocab_size=V, hidden_size=32, num_heads=2, num_kv_heads=1, seed=6)
    build = lambda: tiny.build().to(dtype)  # noqa: E731
    ids, attn, mask, coef = inputs()
    runs = {}
    for name, on in (("eager", False), ("fused", True)):
        model = prepare_model(build(), LearnerConfig(levers=dict(compile_head_math=on, compile=False, activation_checkpointing="none"),
                                                     batching=dict(logits_chunk_tokens=7)))

        def run(model=model):
            lp, ent, _ = token_stats(model, ids, attn, ids[:, 1:], mask)
            ((coef[0] * lp).sum() + (coef[1] * ent).sum()).backward()
            return lp, ent

        runs[name] = loss_and_grads(model, run)
    ref = build()

    def run_direct():
        lp, ent = direct(ref, ids, attn, mask)
        ((coef[0] * lp).sum() + (coef[1] * ent).sum()).backward()
        return lp, ent

    lp_d, ent_d, g_d = loss_and_grads(ref, run_direct)
    lp_f, ent_f, g_f = runs["fused"]
    torch.testing.assert_close(lp_f, lp_d, rtol=tol, atol=tol)
    torch.testing.assert_close(ent_f, ent_d, rtol=tol, atol=tol)
    assert g_f.keys() == g_d.keys() and len(g_f) > 4
    for name in g_d:
        assert rel(g_f[name], g_d[name]) < 1.5 * tol, (name, rel(g_f[name], g_d[name]))
    if dtype == torch.float32:  # against the eager chunked head: inductor's reassociation of float32 sums only
        lp_e, ent_e, g_e = runs["eager"]
        assert rel(lp_f, lp_e) < 1e-6 and rel(ent_f, ent_e) < 1e-6
        # ~1e-7 at the head, up to a few 1e-7 once carried back through the layers: within the eager head's own
        # 1e-5 of full logits
        assert all(rel(g_f[n], g_e[n]) < 2e-6 for n in g_e), {n: rel(g_f[n], g_e[n]) for n in g_e}


def test_all_masked_dummy_computes_one_position_and_reaches_every_parameter():
    model = TinyQwen2(vocab_size=V, hidden_size=32, num_heads=2, num_kv_heads=1, seed=5).build()
    install_token_stats_head(model, 4)
    ids = torch.zeros(1, 2, dtype=torch.long)
    lp, ent, anchor = token_stats(model, ids, torch.ones_like(ids), ids[:, 1:], torch.zeros(1, 1))
    assert lp.abs().sum() == 0 and ent.abs().sum() == 0
    (0.0 * anchor).backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    assert all(g is not None and float(g.abs().sum()) == 0.0 for g in grads.values()), \
        [n for n, g in grads.items() if g is None]


def test_head_without_request_is_the_linear_layer_and_refusals():
    model = TinyQwen2(vocab_size=V, hidden_size=32, num_heads=2, num_kv_heads=1, seed=6).build()
    ids = torch.tensor([[5, 6, 7]])
    before = model(input_ids=ids).logits
    head = install_token_stats_head(model)
    assert isinstance(head, TokenStatsHead) and install_token_stats_head(model) is head
    assert head.chunk_tokens == auto_chunk_tokens(V)
    assert torch.equal(model(input_ids=ids).logits, before)  # evaluation/generation still see logits
    assert auto_chunk_tokens(151_936) == 220 and auto_chunk_tokens(32_000) == 1048
    other = TinyQwen2(vocab_size=V, hidden_size=32, num_heads=2, num_kv_heads=1).build()
    other.config.final_logit_softcapping = 30.0
    with pytest.raises(HeadError, match="final_logit_softcapping=30.0"):
        install_token_stats_head(other)
    plain = TinyQwen2(vocab_size=V, hidden_size=32, num_heads=2, num_kv_heads=1).build()
    with pytest.raises(HeadError, match="install_token_stats_head"):
        token_stats(plain, ids, torch.ones_like(ids), ids[:, 1:], torch.ones(1, 2))


FSDP_SCRIPT = textwrap.dedent("""
    import os, sys, torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from common.modeling import TinyQwen2
    from learner.token_stats import install_token_stats_head, token_stats
    sys.path.insert(0, os.getcwd())
    from tests.learner.test_token_stats import inputs, V

    rank, world, port, out, dtype = int(sys.argv[1]), 2, sys.argv[2], sys.argv[3], getattr(torch, sys.argv[4])
    dist.init_process_group("gloo", store=dist.TCPStore("127.0.0.1", int(port), is_master=False), rank=rank,
                            world_size=world)
    torch.set_num_threads(1)
    model = TinyQwen2(vocab_size=V, hidden_size=32, num_heads=2, num_kv_heads=1, seed=7).build()
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
    store = rendezvous_store()  # held until the ranks are done
    port = store.port
    out = tmp_path / "rank0.pt"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-c", FSDP_SCRIPT, str(r), str(port), str(out), dtype],
                              cwd=os.getcwd(), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(2)]
    logs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], logs
    got = torch.load(out)

    model = TinyQwen2(vocab_size=V, hidden_size=32, num_heads=2, num_kv_heads=1, seed=7).build()
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
