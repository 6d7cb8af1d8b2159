"""Log-probs and entropies of chosen tokens without ever materialising `[R, L, V]` logits.

The learner needs, at the response positions only, log softmax(z)[target] and the full-vocabulary
entropy H(softmax(z)), where z = W h is the LM head applied to the final hidden state h. At a real
vocabulary (V = 151,936) and real lengths the logits of one micro-batch are tens of GB, and autograd
would keep several copies of them. Here:

- `TokenStatsHead` replaces the model's `lm_head` module (same `weight` Parameter, so tied embeddings
  stay tied and the state dict keeps the name `lm_head.weight`). Inside the model's own forward, which
  is where FSDP2 has the root's parameters unsharded, it selects the requested positions of the
  hidden states and calls the chunked function below. Without a request it is an ordinary linear
  layer (full logits), so evaluation and generation code keeps working.
- `chunked_logprob_entropy` is a custom autograd function: the forward applies the head to
  `chunk` tokens at a time and keeps only [N] log-probs and entropies; the backward recomputes each
  chunk's logits and forms the gradient of both outputs in closed form:

      d logp / dz = onehot(target) - p
      d H / dz    = -p * (log p + H)

  Peak memory is O(chunk x V) for the head instead of O(R x L x V), whatever the response length.
  The matmul runs in the hidden states' dtype (bf16 under mixed precision, like `nn.Linear`), the
  softmax in float32; the weight gradient is accumulated over chunks in float32.

Usage (what `learner.forward` does):

    install_token_stats_head(model, chunk_tokens=None)          # once, before fully_shard
    logp, ent, anchor = token_stats(model, input_ids, attention_mask, targets, mask)  # [R, L-1] x2, scalar
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.nn import functional as F

LOGITS_PER_CHUNK = 1 << 25  # 32M float32 logits (128 MB) per chunk when `chunk_tokens` is None


class HeadError(ValueError):
    """A model whose output layer the chunked path cannot reproduce exactly (the message says why)."""


def auto_chunk_tokens(vocab_size: int) -> int:
    """Tokens per chunk so that one chunk's float32 logits are about `LOGITS_PER_CHUNK` values."""
    return max(16, LOGITS_PER_CHUNK // max(1, vocab_size))


def _acc_dtype(t: Tensor) -> torch.dtype:
    """The softmax's dtype: float32, or the input's where it is wider (float64 in gradcheck)."""
    return torch.promote_types(t.dtype, torch.float32)


class _LogprobEntropy(torch.autograd.Function):
    """(hidden [N, H], weight [V, H], targets [N]) -> (log-probs [N], entropies [N]), both float32."""

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, targets: Tensor, chunk: int) -> tuple[Tensor, Tensor]:
        n, acc = hidden.shape[0], _acc_dtype(hidden)
        logp = torch.empty(n, dtype=acc, device=hidden.device)  # [N]
        ent = torch.empty(n, dtype=acc, device=hidden.device)  # [N]
        for s in range(0, n, chunk):
            z = F.linear(hidden[s:s + chunk], weight).to(acc)  # [c, V]
            lse = torch.logsumexp(z, dim=-1)  # [c]
            logp[s:s + chunk] = z.gather(-1, targets[s:s + chunk, None]).squeeze(-1) - lse
            ent[s:s + chunk] = lse - torch.softmax(z, dim=-1).mul_(z).sum(-1)
            del z
        ctx.save_for_backward(hidden, weight, targets, ent)
        ctx.chunk = chunk
        return logp, ent

    @staticmethod
    def backward(ctx, grad_logp: Tensor | None, grad_ent: Tensor | None):
        hidden, weight, targets, ent = ctx.saved_tensors
        chunk = ctx.chunk
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.zeros_like(hidden) if need_h else None  # [N, H]
        acc = _acc_dtype(hidden)
        grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_w else None  # [V, H]
        if not (need_h or need_w):
            return None, None, None, None
        n = hidden.shape[0]
        for s in range(0, n, chunk):
            h = hidden[s:s + chunk]  # [c, H]
            z = F.linear(h, weight).to(acc)  # [c, V]
            logp_all = torch.log_softmax(z, dim=-1)  # [c, V]
            del z
            p = logp_all.exp()  # [c, V]
            if grad_ent is not None:  # g = -grad_H * p * (log p + H), in the buffer of log p
                g = logp_all.add_(ent[s:s + chunk, None]).mul_(p).mul_(-grad_ent[s:s + chunk, None].to(acc))
            else:
                g = logp_all.zero_()  # [c, V]: d loss / d z
            if grad_logp is not None:  # g += grad_logp * (onehot(target) - p)
                gl = grad_logp[s:s + chunk, None].to(acc)  # [c, 1]
                g.addcmul_(p, gl, value=-1.0)
                g.scatter_add_(-1, targets[s:s + chunk, None], gl)
            del p
            g = g.to(hidden.dtype)
            if need_h:
                grad_h[s:s + chunk] = g @ weight  # [c, H]
            if need_w:
                grad_w += (g.t() @ h).to(acc)  # [V, H]
            del g
        return grad_h, (grad_w.to(weight.dtype) if need_w else None), None, None


def chunked_logprob_entropy(hidden: Tensor, weight: Tensor, targets: Tensor, chunk: int) -> tuple[Tensor, Tensor]:
    """Log-probs of `targets` and full-vocabulary entropies under logits `hidden @ weight.T`, chunked.
    hidden [N, H], weight [V, H], targets [N] -> ([N], [N]) float32; differentiable in hidden and weight."""
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    return _LogprobEntropy.apply(hidden, weight, targets.long(), int(chunk))


class TokenStatsHead(nn.Module):
    """The LM head, computing per-token statistics on request instead of full logits (see module doc)."""

    def __init__(self, weight: nn.Parameter, chunk_tokens: int):
        super().__init__()
        self.weight = weight  # the same Parameter as before (tied to the embeddings where the model ties them)
        self.chunk_tokens = chunk_tokens
        self.request: tuple[Tensor, Tensor] | None = None  # (targets [N], hidden positions [N] flat in [R*L])

    @property
    def in_features(self) -> int:
        return self.weight.shape[1]

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    def forward(self, hidden: Tensor) -> Tensor:
        if self.request is None:
            return F.linear(hidden, self.weight)  # [R, L, V]: ordinary logits
        targets, positions = self.request
        picked = hidden.reshape(-1, hidden.shape[-1]).index_select(0, positions)  # [N, H]
        logp, ent = chunked_logprob_entropy(picked, self.weight, targets, self.chunk_tokens)
        return torch.stack([logp, ent], dim=-1)  # [N, 2] (returned by the model as its "logits")


def install_token_stats_head(model: nn.Module, chunk_tokens: int | None = None) -> TokenStatsHead:
    """Replace `model.lm_head` (a bias-free linear layer) by a `TokenStatsHead` sharing its weight.
    Call before `fully_shard`. A model that transforms its logits after the head is refused."""
    if isinstance(model.lm_head, TokenStatsHead):
        return model.lm_head
    head = getattr(model, "lm_head", None)
    if not isinstance(head, nn.Linear):
        raise HeadError(f"{type(model).__name__}: the chunked log-prob path needs an nn.Linear `lm_head`, "
                        f"found {type(head).__name__}")
    if head.bias is not None:
        raise HeadError(f"{type(model).__name__}: an LM head with a bias is not supported by the chunked path")
    cfg = model.config
    for name in ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale"):
        value = getattr(cfg, name, None)
        if value not in (None, 1, 1.0):
            raise HeadError(f"{type(model).__name__} transforms its logits after the head ({name}={value}); "
                            "the chunked log-prob path would not reproduce them")
    chunk = chunk_tokens or auto_chunk_tokens(head.weight.shape[0])
    new = TokenStatsHead(head.weight, chunk)
    model.lm_head = new
    return new


def token_stats(model: nn.Module, input_ids: Tensor, attention_mask: Tensor | None, targets: Tensor,
                mask: Tensor, position_ids: Tensor | None = None,
                index: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """Log-probs of `targets` and entropies at the positions where `mask` > 0, zeros elsewhere.

    input_ids, attention_mask [R, L]; targets, mask [R, L-1] -> (logp [R, L-1], entropy [R, L-1],
    anchor), where `anchor` is a scalar that depends on every parameter the forward used: a rank whose
    micro-batch has no response token (the all-masked dummy) backpropagates `0 * anchor` to join FSDP's
    gradient collectives. Such a batch computes one position, not full logits. `position_ids` with no
    `attention_mask`: rows packed into one sequence (`learner.batching.Packing`). No KV cache is built (a cache
    would also turn off transformers' packed-sequence masking). `attention_mask` may also be a 4D mask or a
    flex_attention BlockMask, used as given. `index` [N]: the flat positions in [R, L-1] where `mask` > 0, in
    order, as computed on the host (`MicroBatch.response_index`): then nothing waits for the device (without it
    they are found from `mask`, which reads the device)."""
    head = model.lm_head
    if not isinstance(head, TokenStatsHead):
        raise HeadError("token_stats needs install_token_stats_head(model) first")
    rows, width = mask.shape  # [R, L-1]
    if index is None:
        index = (mask > 0).reshape(-1).nonzero()[:, 0]  # [N]
    n = index.numel()
    picked = index if n else torch.zeros(1, dtype=torch.long, device=mask.device)  # the dummy: one position
    # keeps the head and every layer in the graph; target (r, t) is predicted by the hidden state at r*L + t
    head.request = (targets.reshape(-1).index_select(0, picked), picked + picked // width)
    try:
        out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                    use_cache=False).logits  # [N, 2]
    finally:
        head.request = None
    zeros = torch.zeros(rows * width, dtype=torch.float32, device=out.device)  # [R (L-1)]
    if n == 0:
        return zeros.view(rows, width), zeros.clone().view(rows, width), out.sum()
    logp = zeros.index_put((index,), out[:, 0]).view(rows, width)
    return logp, zeros.index_put((index,), out[:, 1]).view(rows, width), out.sum()
