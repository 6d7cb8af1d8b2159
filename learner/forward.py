"""The model's side of a learner step: how a loaded model is prepared, and how a micro-batch's response
log-probs and entropies come out of its forward.

Memory: log-probs and entropies come from the final hidden states through the chunked LM head of
`learner.token_stats` (training, candidate scoring, TIS old log-probs and the reference KL alike), so
no [rows, length, vocabulary] logits exist; `learner.logits_chunk_tokens=0` restores full logits.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from common.config import LearnerConfig
from learner import loss as L
from learner.batching import MicroBatch, Row, collate
from learner.levers import apply_compile
from learner.token_stats import TokenStatsHead, install_token_stats_head, token_stats


def response_logprobs_and_entropy(logits: Tensor, targets: Tensor, mask: Tensor,
                                  index: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Log-probs of the targets and token entropies where `mask` > 0 only; zeros elsewhere.

    logits [R, L, V], targets and mask [R, L-1] -> ([R, L-1], [R, L-1]). The full-logits path
    (`learner.logits_chunk_tokens=0`). `index` [N]: the flat positions of `mask` > 0 (host-made; see
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
    `logits_chunk_tokens=0`) and, on the trained model, per-layer activation checkpointing and, with
    `compile` true (`levers.resolve_levers` decides "auto"; unresolved it means off), per-layer torch.compile."""
    if cfg.logits_chunk_tokens != 0:
        install_token_stats_head(model, cfg.logits_chunk_tokens)
    if trainable and cfg.activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if trainable and cfg.compile is True:
        apply_compile(model, cfg.compile_backend)
    return model


def forward_stats(model: torch.nn.Module, mb: MicroBatch) -> tuple[Tensor, Tensor, Tensor]:
    """(log-probs [R, L-1], entropies [R, L-1], anchor) of a micro-batch's response tokens.

    With the chunked head installed (`learner.token_stats`; the default) no [R, L, V] tensor exists;
    otherwise full logits are computed. `anchor` is a scalar reaching every parameter the forward used:
    `0 * anchor` lets an all-masked dummy micro-batch run the backward FSDP's collectives wait for.
    A packed micro-batch (`mb.packed`) runs the forward on its padding-free layout and returns the same
    [R, L-1] tensors: its response tokens are in the same row order in both layouts.

    Nothing here reads the device: the response positions (`response_index`) and, where the attention allows it,
    the attention mask (`attention_inputs`) come from the layout the host built."""
    if mb.packed is None:
        attn, pos = attention_inputs(model, mb)
        return _stats(model, mb.input_ids, attn, pos, mb.targets, mb.response_mask, mb.response_index)
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


def _full_attention_only(config) -> bool:
    """Whether every layer attends causally to the whole sequence (no sliding or chunked windows), so that one
    causal mask serves them all."""
    types = getattr(config, "layer_types", None) or ["full_attention"]
    return set(types) == {"full_attention"} and not getattr(config, "attention_chunk_size", None)


def attention_inputs(model: torch.nn.Module, mb: MicroBatch) -> tuple[object, Tensor | None]:
    """(attention_mask, position_ids) for the forward of `mb`, built from its host-made layout.

    transformers finds row boundaries and padding by reading the tensors (one host sync per forward); where the
    layout is known and the attention allows it, the mask is given instead, with exactly transformers' values:
    - padded rows of equal length: no mask (causal; sdpa keeps its is_causal fast path);
    - padded rows of different lengths under sdpa: the [R, 1, L, L] boolean causal-and-padding mask;
    - packed rows under flex_attention: the block-diagonal causal BlockMask of `Packing.document_ids`;
    - otherwise transformers' own: the 2D mask, or, packed, position_ids restarting at every row."""
    impl = getattr(model.config, "_attn_implementation", None)
    full = _full_attention_only(model.config)
    p = mb.packed
    if p is not None:
        if impl == "flex_attention" and full and p.document_ids is not None:
            return _document_block_mask(p.document_ids[0]), p.position_ids
        return None, p.position_ids
    if not mb.uneven:
        return None, None
    if impl == "sdpa" and full:
        n, length = mb.attention_mask.shape
        causal = torch.ones(length, length, dtype=torch.bool, device=mb.attention_mask.device).tril_()  # [L, L]
        return causal[None, None] & mb.attention_mask.bool()[:, None, None, :], None  # [R, 1, L, L]
    return mb.attention_mask, None


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
    """A model whose attention lets rows packed into one sequence see each other (learner.padding_free)."""


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
            "learner.padding_free=false, or an attention that reads position_ids as row boundaries "
            "(learner.attn_implementation: sdpa, eager, flash_attention_2, flex_attention)")
    return gap


def _stats(model: torch.nn.Module, input_ids: Tensor, attention_mask, position_ids: Tensor | None,
           targets: Tensor, mask: Tensor, index: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    if isinstance(getattr(model, "lm_head", None), TokenStatsHead):
        return token_stats(model, input_ids, attention_mask, targets, mask, position_ids=position_ids, index=index)
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                   use_cache=False).logits  # [R, L, V]
    logp, ent = response_logprobs_and_entropy(logits, targets, mask, index)
    return logp, ent, logits.sum()
