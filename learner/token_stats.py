"""Log-probs and entropies of chosen tokens without ever materialising `[R, L, V]` logits.

    install_token_stats_head(model, chunk_tokens=None)          # once, before fully_shard (as learner.forward does)
    logp, ent, anchor = token_stats(model, input_ids, attention_mask, targets, mask)  # [R, L-1] x2, scalar

`TokenStatsHead` replaces the model's `lm_head` (same `weight` Parameter; without a request an ordinary linear
layer). `chunked_logprob_entropy` is a custom autograd function that applies the head a block at a time
(`learner.batching.logits_chunk_tokens`), with the values of full logits to the last bit or two, and forms the gradient
in closed form, writing the [V, H] weight gradient once per micro-batch.
Why, the blocks, their cost at Qwen2.5-1.5B shapes: docs/internals.md#learnertoken_statspy
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.nn import functional as F

LOGITS_PER_CHUNK = 1 << 25  # 32M logits per block when `chunk_tokens` is None on CPU (220 tokens' worth at 152k)
BYTES_PER_LOGIT = 8  # peak temporaries per logit of a block: two float32 buffers (`_chunk_stats`, `_slice_grad`)
FREE_MEMORY_FRACTION = 0.25  # CUDA default: a block's temporaries take at most this share of the free memory...
BLOCK_BYTES_CAP = 2 << 30  # ...and at most 2 GiB: with the [V, H] gradient, the per-chunk path's peak at 1.5B
SLICE_ALIGN = 128  # vocabulary slices are whole multiples of this many rows (the last one excepted)
# torch.compile (inductor) the per-block float32 math, so that its [N, V] elementwise passes fuse (~0.37 s
# of a 1.5B step's kernel time, estimated). Off: `learner.levers.compile_head_math=true` opts in; it becomes a CUDA
# default only after tests/gpu/test_head_math.py shows it exact on a GPU (never run on one yet).
COMPILE_BLOCK_MATH = False


class HeadError(ValueError):
    """A model whose output layer the chunked path cannot reproduce exactly (the message says why)."""


def auto_chunk_tokens(vocab_size: int) -> int:
    """Tokens' worth of logits per block so that one block is about `LOGITS_PER_CHUNK` values (the CPU default)."""
    return max(16, LOGITS_PER_CHUNK // max(1, vocab_size))


def chunk_tokens_from_free_memory(free_bytes: int, vocab_size: int) -> int:
    """The CUDA default: tokens' worth of logits per block whose temporaries (`BYTES_PER_LOGIT` each) take
    `FREE_MEMORY_FRACTION` of `free_bytes`, at most `BLOCK_BYTES_CAP`, and never less than the CPU default."""
    budget = min(BLOCK_BYTES_CAP, int(free_bytes * FREE_MEMORY_FRACTION))
    return max(auto_chunk_tokens(vocab_size), budget // (BYTES_PER_LOGIT * max(1, vocab_size)))


def vocab_slice(n_tokens: int, vocab_size: int, chunk_tokens: int) -> int:
    """Vocabulary rows per block of [n_tokens, v] logits, at most `chunk_tokens` x `vocab_size` of them."""
    v = min(vocab_size, max(1, chunk_tokens * vocab_size // max(1, n_tokens)))
    return v - v % SLICE_ALIGN if SLICE_ALIGN <= v < vocab_size else v


def free_cuda_bytes(device: torch.device) -> int:
    """Memory a new tensor can take on `device`: free in the driver plus cached, unused in the allocator."""
    free, _ = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


def _acc_dtype(t: Tensor) -> torch.dtype:
    """The softmax's dtype: float32, or the input's where it is wider (float64 in gradcheck)."""
    return torch.promote_types(t.dtype, torch.float32)


def _chunk_stats(hidden: Tensor, weight: Tensor, targets: Tensor, acc: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    """One token chunk, hidden [c, H], whole rows of logits z = hidden weight^T [c, V] -> (log-probs, entropies,
    logsumexps), each [c]: the full-logits path's own formulas (`loss.token_logprobs`, `loss.token_entropy`)."""
    z = F.linear(hidden, weight).to(acc)  # [c, V]
    lse = torch.logsumexp(z, dim=-1)  # [c]
    logp = z.gather(-1, targets[:, None]).squeeze(-1) - lse
    return logp, lse - torch.softmax(z, dim=-1).mul_(z).sum(-1), lse


def _slice_grad(hidden: Tensor, w: Tensor, lse: Tensor, ent: Tensor, gl: Tensor | None, ge: Tensor | None,
                local: Tensor) -> Tensor:
    """d loss / d z [N, v] of one vocabulary slice w [v, H], in the hidden dtype (as `nn.Linear`'s autograd
    holds it). lse, ent [N]; gl = d loss / d logp [N, 1], ge = -d loss / d H [N, 1] (None: no gradient)."""
    z = F.linear(hidden, w)  # [N, v]
    y = torch.sub(z, lse[:, None])  # [N, v] in lse's dtype: log p
    del z
    p = y.exp()  # [N, v]
    if ge is None:  # g = -gl p
        g = p.mul_(-gl)
    else:  # g = p (ge (log p + H) - gl) = p (ge log p + c),  ge = -grad_H
        c = ge * ent[:, None] if gl is None else ge * ent[:, None] - gl  # [N, 1]
        g = y.mul_(ge).add_(c).mul_(p)
    del y, p
    if gl is not None:  # g += gl onehot(target)
        inside = ((local >= 0) & (local < g.shape[1]))[:, None]  # [N, 1]
        g.scatter_add_(-1, local.clamp(0, g.shape[1] - 1)[:, None], gl * inside)
    return g.to(hidden.dtype)


_COMPILED: dict = {}


def _block_math(fn, compile_math: bool):
    """`fn` itself, or its torch.compile'd twin (dynamic shapes: one graph for every N and v)."""
    if not compile_math:
        return fn
    if fn not in _COMPILED:
        _COMPILED[fn] = torch.compile(fn, dynamic=True)
    return _COMPILED[fn]


class _LogprobEntropy(torch.autograd.Function):
    """(hidden [N, H], weight [V, H], targets [N]) -> (log-probs [N], entropies [N]), both float32."""

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, targets: Tensor, chunk: int,
                compile_math: bool) -> tuple[Tensor, Tensor]:
        n, acc = hidden.shape[0], _acc_dtype(hidden)
        stats = _block_math(_chunk_stats, compile_math)
        logp, ent, lse = (torch.empty(n, dtype=acc, device=hidden.device) for _ in range(3))  # [N] each
        for s in range(0, n, chunk):
            logp[s:s + chunk], ent[s:s + chunk], lse[s:s + chunk] = stats(
                hidden[s:s + chunk], weight, targets[s:s + chunk], acc)
        ctx.save_for_backward(hidden, weight, targets, lse, ent)
        ctx.chunk, ctx.compile_math = chunk, compile_math
        return logp, ent

    @staticmethod
    def backward(ctx, grad_logp: Tensor | None, grad_ent: Tensor | None):
        hidden, weight, targets, lse, ent = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if not (need_h or need_w):
            return None, None, None, None, None
        n, vocab, acc = hidden.shape[0], weight.shape[0], lse.dtype
        width = vocab_slice(n, vocab, ctx.chunk)
        grad_fn = _block_math(_slice_grad, ctx.compile_math)
        gl = None if grad_logp is None else grad_logp.to(acc)[:, None]  # [N, 1]
        ge = None if grad_ent is None else grad_ent.to(acc).neg()[:, None]  # [N, 1]
        grad_w = torch.empty_like(weight) if need_w else None  # [V, H]: every row written once, below
        several = width < vocab  # then grad_h sums the slices in float32
        grad_h = torch.zeros(hidden.shape, dtype=acc, device=hidden.device) if need_h and several else None  # [N, H]
        for lo in range(0, vocab, width):
            w = weight[lo:lo + width]  # [v, H]
            g = grad_fn(hidden, w, lse, ent, gl, ge, targets - lo)  # [N, v]
            if need_w:
                torch.mm(g.t(), hidden, out=grad_w[lo:lo + width])  # [v, H]
            if need_h and not several:
                grad_h = g @ w  # [N, H]
            elif need_h and grad_h.dtype == g.dtype:
                grad_h.addmm_(g, w)
            elif need_h:
                grad_h += g @ w
            del g
        if grad_h is not None:
            grad_h = grad_h.to(hidden.dtype)
        return grad_h, grad_w, None, None, None


def chunked_logprob_entropy(hidden: Tensor, weight: Tensor, targets: Tensor, chunk: int,
                            compile_math: bool = COMPILE_BLOCK_MATH) -> tuple[Tensor, Tensor]:
    """Log-probs of `targets` and full-vocabulary entropies under logits `hidden @ weight.T`, in blocks of at
    most `chunk` x V logits. hidden [N, H], weight [V, H], targets [N] -> ([N], [N]) float32; differentiable
    in hidden and weight."""
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    return _LogprobEntropy.apply(hidden, weight, targets.long(), int(chunk), bool(compile_math))


class TokenStatsHead(nn.Module):
    """The LM head, computing per-token statistics on request instead of full logits (see module doc)."""

    def __init__(self, weight: nn.Parameter, chunk_tokens: int | None = None,
                 compile_math: bool = COMPILE_BLOCK_MATH):
        super().__init__()
        self.weight = weight  # the same Parameter as before (tied to the embeddings where the model ties them)
        self.chunk_tokens = chunk_tokens or auto_chunk_tokens(weight.shape[0])  # tokens' worth of logits per block
        self.size_from_memory = not chunk_tokens  # None: on CUDA, resized once from the free memory (first forward)
        self.compile_math = compile_math
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
        if self.size_from_memory and hidden.is_cuda:  # once: the activations of this forward are live now
            self.chunk_tokens = chunk_tokens_from_free_memory(free_cuda_bytes(hidden.device), self.out_features)
            self.size_from_memory = False
        picked = hidden.reshape(-1, hidden.shape[-1]).index_select(0, positions)  # [N, H]
        logp, ent = chunked_logprob_entropy(picked, self.weight, targets, self.chunk_tokens, self.compile_math)
        return torch.stack([logp, ent], dim=-1)  # [N, 2] (returned by the model as its "logits")


def install_token_stats_head(model: nn.Module, chunk_tokens: int | None = None,
                             compile_math: bool = COMPILE_BLOCK_MATH) -> TokenStatsHead:
    """Replace `model.lm_head` (a bias-free linear layer) by a `TokenStatsHead` sharing its weight.
    Call before `fully_shard`. A model that transforms its logits after the head is refused. `chunk_tokens`:
    tokens' worth of logits per block (None: sized from the free memory on CUDA, `LOGITS_PER_CHUNK` on CPU);
    `compile_math`: torch.compile the per-block elementwise math."""
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
    new = TokenStatsHead(head.weight, chunk_tokens, compile_math)
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
