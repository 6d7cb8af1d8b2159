"""Padded micro-batches run without an attention mask (learner.forward.attention_inputs): rows are right-padded and
attention is causal, so every trained position gets what the padding mask gave it, gradients included."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from common.config import LearnerConfig
from learner.batching import batch_rows, collate
from learner.forward import _full_attention_only, _stats, attention_inputs, forward_stats, prepare_model
from learner.replay_choice import complete_groups
from bench.batches import make_batch

CPU = torch.device("cpu")
# CPU kernels give the same bits either way; on CUDA is_causal and an explicit mask run different kernels
TOLERANCE = {torch.float32: dict(rtol=1e-5, atol=2e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}


def _uneven_micro_batch(vocab: int):
    """12 rows of 5-22 tokens, right-padded to the longest: one micro-batch of uneven rows."""
    rows = batch_rows(complete_groups(make_batch(7, groups=3, candidates=1, vocab=vocab), {})[0],
                      std_normalize=False, max_positions=512)
    mb = collate(rows, 0, CPU)
    assert mb.uneven and len({r.length for r in rows}) > 3
    return mb


def _dense_mask(mb):
    """The [R, 1, L, L] causal-and-padding mask learner.forward gave sdpa for uneven rows before (the old path)."""
    length = mb.attention_mask.shape[1]
    causal = torch.ones(length, length, dtype=torch.bool).tril_()  # [L, L]
    return causal[None, None] & mb.attention_mask.bool()[:, None, None, :]  # [R, 1, L, L]


def _trained(model, mb, attention_mask):
    """(log-probs [N], entropies [N], {name: gradient}) at the response positions, with `attention_mask` given
    (None: what attention_inputs gives). The loss weighs every position differently so gradients mix them."""
    model.zero_grad()
    if attention_mask is None:
        logp, ent, _ = forward_stats(model, mb)
    else:
        logp, ent, _ = _stats(model, mb.input_ids, attention_mask, None, mb.targets, mb.response_mask,
                              mb.response_index)
    on = mb.response_mask > 0
    weight = torch.linspace(-1, 1, int(on.sum()))  # [N]
    ((logp[on] * weight).sum() + 0.1 * (ent[on] * weight).sum()).backward()
    grads = {n: p.grad.float().clone() for n, p in model.named_parameters()}
    return logp[on].detach().float(), ent[on].detach().float(), grads


def _assert_same(got, want, dtype):
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got[0], want[0], **tol)
    torch.testing.assert_close(got[1], want[1], **tol)
    for name, g in want[2].items():
        scale = max(1.0, float(g.abs().max()))
        torch.testing.assert_close(got[2][name] / scale, g / scale, **tol, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_padded_rows_without_a_mask_train_what_the_padding_mask_trains(tiny_model_dir, impl, dtype):
    """Uneven right-padded rows: no mask and no position_ids (attention_inputs) give the log-probs, entropies and
    every parameter's gradient that the old dense [R, 1, L, L] mask gave (sdpa's old path) and that transformers'
    own 2D padding mask gives (eager's old path), in float32 to its rounding and in bfloat16 within its own."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=dtype, attn_implementation=impl)
    model = prepare_model(model, LearnerConfig()).train()
    mb = _uneven_micro_batch(int(model.config.vocab_size))
    assert attention_inputs(model, mb) == (None, None)
    got = _trained(model, mb, None)
    if impl == "sdpa":  # eager adds a 4D mask to its scores: it never took the boolean one
        _assert_same(got, _trained(model, mb, _dense_mask(mb)), dtype)
    _assert_same(got, _trained(model, mb, mb.attention_mask), dtype)


def test_sliding_window_layers_without_a_mask_train_what_the_padding_mask_trains():
    """A model with sliding-window layers (window 3, shorter than the rows) beside full ones: right padding is
    after every real token of its row, so no window of a real token reaches it and no mask is exact there too
    (against transformers' own 2D padding mask, sdpa and eager)."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    for impl in ("sdpa", "eager"):
        config = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                             use_sliding_window=True, sliding_window=3, max_window_layers=1,
                             layer_types=["full_attention", "sliding_attention"], attn_implementation=impl)
        torch.manual_seed(0)
        model = prepare_model(AutoModelForCausalLM.from_config(config).float(), LearnerConfig()).train()
        assert not _full_attention_only(model.config)
        mb = _uneven_micro_batch(64)
        assert attention_inputs(model, mb) == (None, None)
        got = _trained(model, mb, None)
        _assert_same(got, _trained(model, mb, mb.attention_mask), torch.float32)
        config.layer_types = ["full_attention"] * 2  # the same weights without the window: other log-probs,
        unwindowed = AutoModelForCausalLM.from_config(config).float()  # so the window ran in the forwards above
        unwindowed.load_state_dict(model.state_dict())
        with torch.no_grad():
            logp = _stats(prepare_model(unwindowed, LearnerConfig()), mb.input_ids, None, None, mb.targets,
                          mb.response_mask, mb.response_index)[0]
        assert (logp[mb.response_mask > 0] - got[0]).abs().max() > 1e-3


class _SquareOutputs(TorchDispatchMode):
    """Records every op output whose last two dimensions are both `length` (a mask or score matrix)."""

    def __init__(self, length: int):
        super().__init__()
        self.length, self.found = length, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for o in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(o, torch.Tensor) and o.dim() >= 2 and tuple(o.shape[-2:]) == (self.length, self.length):
                self.found.append((str(func), tuple(o.shape), o.dtype))
        return out


def _saved_bytes(model, mb, attention_mask) -> int:
    """Bytes autograd keeps for the backward of `mb`'s forward (every saved tensor that is not a parameter, once
    per storage)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = {}

    def keep(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        if attention_mask is None:
            forward_stats(model, mb)
        else:
            _stats(model, mb.input_ids, attention_mask, None, mb.targets, mb.response_mask, mb.response_index)
    return sum(saved.values())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_padded_rows_under_sdpa_make_and_keep_no_length_by_length_mask(tiny_model_dir, dtype):
    """What the change saves, counted: under sdpa the forward of uneven padded rows now makes no [.., L, L] tensor
    at all, where the old path made the [R, 1, L, L] boolean mask and, in every layer, sdpa's conversion of it to
    an additive mask in the model's dtype, which autograd kept for the backward: R x L x L x 2 bytes per layer in
    bfloat16 (8 rows of 8k over 28 layers: 28 GiB), counted here exactly."""
    from transformers import AutoModelForCausalLM

    model = prepare_model(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=dtype),
                          LearnerConfig()).train()
    mb = _uneven_micro_batch(int(model.config.vocab_size))
    rows, length = mb.input_ids.shape
    with torch.no_grad():
        with _SquareOutputs(length) as now:
            forward_stats(model, mb)
        with _SquareOutputs(length) as before:
            _stats(model, mb.input_ids, _dense_mask(mb), None, mb.targets, mb.response_mask, mb.response_index)
    assert now.found == []
    assert (("aten.bitwise_and.Tensor", (rows, 1, length, length), torch.bool) in before.found
            and ("aten.where.self", (rows, 1, length, length), dtype) in before.found), before.found
    kept = _saved_bytes(model, mb, _dense_mask(mb)) - _saved_bytes(model, mb, None)
    assert kept == model.config.num_hidden_layers * rows * length * length * dtype.itemsize


def test_a_model_that_is_not_causal_keeps_the_padding_mask(tiny_model_dir):
    """Right padding is invisible only to causal attention: a config with is_causal=False (transformers then
    attends both ways) gets the 2D padding mask."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    mb = _uneven_micro_batch(int(model.config.vocab_size))
    model.config.is_causal = False
    attn, pos = attention_inputs(model, mb)
    assert attn is mb.attention_mask and pos is None
