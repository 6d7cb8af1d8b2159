"""The model's side of a learner step: how a loaded model is prepared, and how a micro-batch's response
log-probs and entropies come out of its forward.

Memory: log-probs and entropies come from the final hidden states through the chunked LM head of
`learner.token_stats` (training, candidate scoring, TIS old log-probs and the reference KL alike), so
no [rows, length, vocabulary] logits exist; `learner.batching.logits_chunk_tokens=0` restores full logits.
"""

from __future__ import annotations

import functools

import numpy as np
import torch
from torch import Tensor

from common.config import LearnerConfig
from learner import loss as L
from learner.batching import MicroBatch, Row, collate
from learner.activation_checkpointing import apply_checkpointing
from learner.levers import apply_compile
from learner.token_stats import TokenStatsHead, install_token_stats_head, token_stats


def response_logprobs_and_entropy(logits: Tensor, targets: Tensor, mask: Tensor,
                                  index: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Log-probs of the targets and token entropies where `mask` > 0 only; zeros elsewhere.

    logits [R, L, V], targets and mask [R, L-1] -> ([R, L-1], [R, L-1]). The full-logits path
    (`learner.batching.logits_chunk_tokens=0`). `index` [N]: the flat positions of `mask` > 0 (host-made; see
    `token_stats`), else found from `mask`.
    """
    rows, width = mask.shape
    if index is None:
        index = (mask > 0).reshape(-1).nonzero()[:, 0]  # [N]
    picked = logits.reshape(rows * (width + 1), -1).index_select(0, index + index // width)  # [N, V]
    lp = L.token_logprobs(picked, targets.reshape(-1).index_select(0, index))  # [N]
    ent = L.token_entropy(picked)  # [N]
    zeros = torch.zeros(rows * width, dtype=torch.float32, device=logits.device)  # [R (L-1)]
    return zeros.index_put((index,), lp).view(rows, width), zeros.index_put((index,), ent).view(rows, width)


def prepare_model(model: torch.nn.Module, cfg: LearnerConfig, *, trainable: bool = True) -> torch.nn.Module:
    """The learner's changes to a freshly loaded model, before any sharding: the chunked LM head (unless
    `logits_chunk_tokens=0`) and, on the trained model, per-layer activation checkpointing
    (`learner.levers.activation_checkpointing`: full, selective or none; `resolve_checkpointing` decides "auto",
    unresolved it means none) and then, with `compile` true (`levers.resolve_levers` decides "auto"; unresolved it means
    off), per-layer torch.compile, which compiles the selectively checkpointed forward as torchtitan does. The model
    keeps `learner.levers.pad_multiple` (`exgrpo_pad_multiple`; "auto" unresolved means 1): `forward_stats` rounds
    padded micro-batches' length up to it."""
    if cfg.batching.logits_chunk_tokens != 0:
        install_token_stats_head(model, cfg.batching.logits_chunk_tokens, compile_math=cfg.levers.compile_head_math)
    if trainable:
        apply_checkpointing(model, cfg.levers.activation_checkpointing)
    if trainable and cfg.levers.compile is True:
        apply_compile(model, cfg.levers.compile_backend)
    pad = cfg.levers.pad_multiple
    model.exgrpo_pad_multiple = pad if isinstance(pad, int) else 1  # `round_up_length`
    return model


def forward_stats(model: torch.nn.Module, mb: MicroBatch) -> tuple[Tensor, Tensor, Tensor]:
    """(log-probs [R, L-1], entropies [R, L-1], anchor) of a micro-batch's response tokens.

    With the chunked head installed (`learner.token_stats`; the default) no [R, L, V] tensor exists;
    otherwise full logits are computed. `anchor` is a scalar reaching every parameter the forward used:
    `0 * anchor` lets an all-masked dummy micro-batch run the backward FSDP's collectives wait for.
    A packed micro-batch (`mb.packed`) runs the forward on its padding-free layout and returns the same
    [R, L-1] tensors: its response tokens are in the same row order in both layouts.

    The response positions (`response_index`) and the attention's inputs (`attention_inputs`) come from the layout
    the host built; the one device read is transformers' own look for packed rows where no mask is given."""
    if mb.packed is None:
        attn, pos = attention_inputs(model, mb)
        width = mb.targets.shape[1]  # L-1
        ids, attn, targets, mask, index = round_up_length(model, mb, attn)
        logp, ent, anchor = _stats(model, ids, attn, pos, targets, mask, index)  # [R, L'-1] each
        if targets.shape[1] == width:
            return logp, ent, anchor
        return logp[:, :width].contiguous(), ent[:, :width].contiguous(), anchor
    p = mb.packed
    attn, pos = attention_inputs(model, mb)
    logp, ent, anchor = _stats(model, p.input_ids, attn, pos, p.targets, p.mask, p.index)  # [1, T-1] each
    index = mb.response_index
    if index is None or p.index is None:
        index = (mb.response_mask > 0).reshape(-1).nonzero()[:, 0]
    packed_index = (p.mask[0] > 0).nonzero()[:, 0] if p.index is None else p.index  # [N], in the same row order
    zeros = torch.zeros(mb.response_mask.numel(), dtype=torch.float32, device=logp.device)  # [R (L-1)]
    shape = mb.response_mask.shape
    return (zeros.index_put((index,), logp[0].index_select(0, packed_index)).view(shape),
            zeros.index_put((index,), ent[0].index_select(0, packed_index)).view(shape), anchor)


def round_up_length(model: torch.nn.Module, mb: MicroBatch, attention_mask
                    ) -> tuple[Tensor, object, Tensor, Tensor, Tensor | None]:
    """(input_ids [R, L'], attention_mask, targets [R, L'-1], response mask [R, L'-1], response positions [N]) of a
    padded micro-batch, its length L rounded up to the model's `exgrpo_pad_multiple` (`learner.levers.pad_multiple`; at
    most the model's max_position_embeddings, never below L). The new positions are padding after every row's
    last token: no real token attends to them (causal; a 2D padding mask gets zeros), their targets are masked
    out, so every real token's log-prob, entropy and gradient is the unrounded micro-batch's. The response
    positions, flat in [R, L-1], move to [R, L'-1] on the device (no host read). Unchanged where L is already a
    multiple (and always with a multiple of 1)."""
    ids, targets, mask, index = mb.input_ids, mb.targets, mb.response_mask, mb.response_index
    multiple = getattr(model, "exgrpo_pad_multiple", 1)
    rows, length = ids.shape
    limit = max(length, int(getattr(model.config, "max_position_embeddings", None) or length))
    extra = min(-(-length // multiple) * multiple, limit) - length
    if extra <= 0:
        return ids, attention_mask, targets, mask, index
    pad = getattr(model.config, "pad_token_id", None)
    ids = torch.nn.functional.pad(ids, (0, extra), value=0 if pad is None else int(pad))  # [R, L']
    targets = torch.nn.functional.pad(targets, (0, extra), value=0)  # [R, L'-1]
    mask = torch.nn.functional.pad(mask, (0, extra), value=0.0)  # [R, L'-1]
    if index is not None:
        index = index + (index // (length - 1)) * extra  # [N]: row r's positions shift by r x extra
    if isinstance(attention_mask, Tensor) and attention_mask.dim() == 2:
        attention_mask = torch.nn.functional.pad(attention_mask, (0, extra), value=0)  # [R, L']
    return ids, attention_mask, targets, mask, index


def _full_attention_only(config) -> bool:
    """Whether every layer attends causally to the whole sequence (no sliding or chunked windows), so that one
    causal mask serves them all."""
    types = getattr(config, "layer_types", None) or ["full_attention"]
    return set(types) == {"full_attention"} and not getattr(config, "attention_chunk_size", None)


def attention_inputs(model: torch.nn.Module, mb: MicroBatch) -> tuple[object, Tensor | None]:
    """(attention_mask, position_ids) for the forward of `mb`, exact on every position the loss reads.

    - padded rows (`collate` pads on the right) of a causal model: no mask and no position_ids, whatever the rows'
      lengths. Every attention of a causal language model (full, sliding window, chunked) lets a token see only
      keys at or before it, and a row's padding comes after all of its tokens, so no real token sees padding: the
      log-probs, entropies and gradients of the real tokens are those of the padding mask (only the padding
      positions' outputs differ, and nothing reads them). transformers makes position_ids 0..L-1, as it does with
      the 2D mask. sdpa keeps its is_causal path (the flash kernel, GQA); the [R, 1, L, L] causal-and-padding mask
      this gave sdpa before cost R x L x L bytes per micro-batch, and sdpa turned it into a mask of the model's
      dtype in every layer that autograd kept for the backward (bf16, 8 rows of 8k, 28 layers: 28 GiB). The price:
      transformers looks for packed rows in the position_ids it made (one host read per forward), except in models
      whose forward takes a mask per layer type (Qwen2, Qwen3, ...; `_takes_mask_per_layer_type`) with full
      attention only, which get {"full_attention": None}: no mask made, nothing read;
    - padded rows of a model whose config says `is_causal=False`: the 2D padding mask (transformers' own);
    - packed rows under flex_attention: the block-diagonal causal BlockMask of `Packing.document_ids`;
    - packed rows otherwise: transformers' own, from position_ids restarting at every row."""
    p = mb.packed
    if p is None:
        if not getattr(model.config, "is_causal", True):
            return mb.attention_mask, None
        if _full_attention_only(model.config) and _takes_mask_per_layer_type(model):
            return {"full_attention": None}, None  # sdpa's is_causal, and transformers makes no mask: no host read
        return None, None
    if (getattr(model.config, "_attn_implementation", None) == "flex_attention" and _full_attention_only(model.config)
            and p.document_ids is not None):
        return _document_block_mask(p.document_ids[0]), p.position_ids
    return None, p.position_ids


@functools.cache
def _mask_mapping_forward(cls: type) -> bool:
    import inspect

    try:
        return "causal_mask_mapping := attention_mask, dict" in inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return False


def _takes_mask_per_layer_type(model: torch.nn.Module) -> bool:
    """Whether the base model's forward takes `attention_mask` as a dict of ready masks per layer type (then
    transformers builds none itself), as transformers' Qwen2/Qwen3 do."""
    base = getattr(model, "model", None)
    return base is not None and any(_mask_mapping_forward(c) for c in type(base).__mro__
                                    if "forward" in vars(c) and c.__module__.startswith("transformers."))


def _document_block_mask(doc: Tensor):
    """flex_attention's BlockMask for rows packed one after another: token q sees token k when both are in the
    same row and k <= q. doc [T] int64: each token's row. Compiled on CUDA (as transformers builds its own)."""
    from torch.nn.attention.flex_attention import create_block_mask

    def mask_mod(b, h, q, k):
        return (doc[q] == doc[k]) & (k <= q)

    length = doc.shape[0]
    return create_block_mask(mask_mod, B=1, H=None, Q_LEN=length, KV_LEN=length, device=doc.device,
                             _compile=doc.device.type == "cuda")


class PackingError(RuntimeError):
    """A model whose attention lets rows packed into one sequence see each other (learner.levers.padding_free)."""


@torch.no_grad()
def check_packing(model: torch.nn.Module, device: torch.device, tolerance: float = 1e-3) -> float:
    """Refuse a model that does not keep packed rows apart; returns the largest change measured (0 when exact).

    Runs two rows packed, then again with every token of the first row changed: where the attention reads
    the restarts of position_ids as boundaries, the second row's log-probs cannot change (up to rounding).
    Collective under FSDP: every rank calls it."""
    vocab = int(model.config.vocab_size)
    g = torch.Generator().manual_seed(0)
    lo, hi = min(3, vocab - 1), min(vocab, 1000)
    first, second = torch.randint(lo, hi, (2, 9), generator=g).tolist()

    def second_row_logprobs(first_ids: list[int]) -> Tensor:
        rows = [Row(np.array(first_ids[:3]), np.array(first_ids[3:]), np.zeros(6, np.float32), 0.0, False, "", 0),
                Row(np.array(second[:3]), np.array(second[3:]), np.zeros(6, np.float32), 0.0, False, "", 1)]
        logp, _, _ = forward_stats(model, collate(rows, 0, device, packed=True))  # [2, 8]
        return logp[1].float().cpu()

    was_training = model.training
    model.eval()
    try:
        changed = [(t - lo + 1 + (hi - lo) // 2) % (hi - lo) + lo for t in first]  # every token different
        gap = float((second_row_logprobs(first) - second_row_logprobs(changed)).abs().max())
    finally:
        model.train(was_training)
    if not gap <= tolerance:
        raise PackingError(
            f"{type(model).__name__} with attn_implementation={model.config._attn_implementation!r} lets rows "
            f"packed into one sequence attend to each other (a row's log-probs moved by {gap:.3g} when the row "
            "before it changed), so padding-free micro-batches would train on wrong log-probs: set "
            "learner.levers.padding_free=false, or an attention that reads position_ids as row boundaries "
            "(learner.levers.attn_implementation: sdpa, eager, flash_attention_2, flex_attention)")
    return gap


def _stats(model: torch.nn.Module, input_ids: Tensor, attention_mask, position_ids: Tensor | None,
           targets: Tensor, mask: Tensor, index: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    if isinstance(getattr(model, "lm_head", None), TokenStatsHead):
        return token_stats(model, input_ids, attention_mask, targets, mask, position_ids=position_ids, index=index)
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                   use_cache=False).logits  # [R, L, V]
    logp, ent = response_logprobs_and_entropy(logits, targets, mask, index)
    return logp, ent, logits.sum()
