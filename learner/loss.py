"""The ExGRPO objective's tensor functions besides the policy loss (no Ray, no FSDP, no config objects).

    A            = group_advantages(rewards, group_ids)                       # [R]
    logp, H      = token_logprobs(logits, targets), token_entropy(logits)     # [R, T]
    pg, extras   = loss_fn(logp, LossBatch(behaviour_logp, A, mask, replay_mask), n)   # learner.loss.policy_loss
    loss         = pg + entropy_bonus(H, mask, coef, n) + kl_penalty(logp, ref_logp, mask, coef, n)

`[R, T]` = rows x response-aligned token positions; masked positions (0 in `response_mask`) contribute nothing.
Departures from the textbook: docs/internals.md#learnerlosspy (the rules: docs/algorithm.md)
"""

from __future__ import annotations

import torch
from torch import Tensor


def group_advantages(rewards: Tensor, group_ids: Tensor, std_normalize: bool = False, eps: float = 1e-6) -> Tensor:
    """A_i = r_i - mean(r over i's group), optionally divided by (group std + eps).

    `rewards` [R] float, `group_ids` [R] int (any labels). A mixed group includes its replayed
    trajectory. The std is the unbiased one (torch default, as in GRPO); a single-rollout group has
    advantage 0.
    """
    _, inverse, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)  # [G], [R], [G]
    rewards = rewards.to(torch.float32)
    sums = torch.zeros(len(counts), dtype=torch.float32).index_add_(0, inverse, rewards)  # [G]
    means = sums / counts  # [G]
    adv = rewards - means[inverse]  # [R]
    if std_normalize:
        sq = torch.zeros(len(counts), dtype=torch.float32).index_add_(0, inverse, adv * adv)  # [G]
        std = torch.sqrt(sq / (counts - 1).clamp(min=1))  # [G]
        adv = adv / (std[inverse] + eps)
    return adv


def aggregate(per_token: Tensor, mask: Tensor, normalizer: float | None = None) -> Tensor:
    """Sum of masked per-token values divided by `normalizer`, or their mean when it is None."""
    total = (per_token * mask).sum()
    if normalizer is None:
        return total / mask.sum().clamp(min=1)
    return total / normalizer


def logprob_gap(logprobs: Tensor, behaviour_logprobs: Tensor, mask: Tensor, lag0_mask: Tensor) -> dict[str, Tensor]:
    """Train/inference mismatch of sampled tokens, as sums (so that ranks and micro-batches add up).

    d = logp_learner - logp_behaviour on `mask` tokens; `lag0_mask` marks those sampled by the very
    weights the learner holds (rollout version == batch version), where exp(d) would be exactly 1
    without numerical mismatch. All inputs [R, T]; returns 0-d float64 tensors: abs_sum (sum |d|),
    abs_max, tokens, and over lag-0 tokens ratio_sum (sum exp(d)), ratio_sq_sum (sum exp(d)^2), lag0_tokens.
    """
    mask = mask > 0
    lag0 = mask & (lag0_mask > 0)
    d = (logprobs.detach() - behaviour_logprobs).double()  # [R, T]
    absd = torch.where(mask, d.abs(), torch.zeros_like(d))
    ratio = torch.where(lag0, torch.exp(d), torch.zeros_like(d))  # [R, T]
    return {
        "abs_sum": absd.sum(),
        "abs_max": absd.max() if absd.numel() else absd.new_zeros(()),
        "tokens": mask.sum().double(),
        "ratio_sum": ratio.sum(),
        "ratio_sq_sum": (ratio * ratio).sum(),
        "lag0_tokens": lag0.sum().double(),
    }


def token_logprobs(logits: Tensor, targets: Tensor, chunk_size: int = 1024) -> Tensor:
    """log softmax(logits)[target] in float32. logits [..., V], targets [...] -> [...].

    Computed over chunks of `chunk_size` positions so that only one chunk's float32 copy of the
    logits exists at a time (logits may be bf16).
    """
    flat = logits.reshape(-1, logits.shape[-1])  # [N, V]
    tgt = targets.reshape(-1)  # [N]
    out = []
    for start in range(0, flat.shape[0], chunk_size):
        chunk = flat[start:start + chunk_size].float()  # [n, V]
        picked = chunk.gather(-1, tgt[start:start + chunk_size].unsqueeze(-1)).squeeze(-1)  # [n]
        out.append(picked - torch.logsumexp(chunk, dim=-1))
    return torch.cat(out).reshape(targets.shape) if out else flat.new_zeros(targets.shape, dtype=torch.float32)


def token_entropy(logits: Tensor, chunk_size: int = 1024) -> Tensor:
    """Full-vocabulary entropy H = logsumexp(z) - sum softmax(z) z, float32. logits [..., V] -> [...].

    Chunked like `token_logprobs`. Differentiable (the entropy bonus back-propagates through it).
    """
    flat = logits.reshape(-1, logits.shape[-1])  # [N, V]
    out = []
    for start in range(0, flat.shape[0], chunk_size):
        chunk = flat[start:start + chunk_size].float()  # [n, V]
        probs = torch.softmax(chunk, dim=-1)  # [n, V]
        out.append(torch.logsumexp(chunk, dim=-1) - (probs * chunk).sum(-1))  # [n]
    return torch.cat(out).reshape(logits.shape[:-1]) if out else flat.new_zeros(logits.shape[:-1], dtype=torch.float32)


def row_mean(values: Tensor, mask: Tensor) -> Tensor:
    """Mean of each row's masked values; NaN for a row without masked tokens. [R, T] -> [R]."""
    mask = mask.to(values.dtype)
    count = mask.sum(-1)  # [R]
    mean = (values * mask).sum(-1) / count.clamp(min=1)
    return torch.where(count > 0, mean, torch.full_like(mean, float("nan")))


def entropy_bonus(entropy: Tensor, response_mask: Tensor, coef: float, normalizer: float | None = None) -> Tensor:
    """The entropy bonus as a loss term: -coef * aggregate(H). entropy, response_mask [R, T]."""
    return -coef * aggregate(entropy, response_mask.to(entropy.dtype), normalizer)


def kl_penalty(logprobs: Tensor, ref_logprobs: Tensor, response_mask: Tensor, coef: float,
               normalizer: float | None = None) -> Tensor:
    """KL to a reference policy as a loss term: coef * aggregate(k3), k3 = exp(d) - d - 1, d = ref - logp.

    The k3 estimator (Schulman) is non-negative and unbiased for KL(pi_theta || pi_ref) on samples
    of pi_theta. All inputs [R, T].
    """
    mask = response_mask.to(logprobs.dtype)
    d = torch.where(mask > 0, ref_logprobs - logprobs, torch.zeros_like(logprobs))  # [R, T]
    return coef * aggregate(torch.exp(d) - d - 1.0, mask, normalizer)


def overlong_penalty(lengths: Tensor, max_new_tokens: int, buffer: int) -> Tensor:
    """DAPO's soft overlong penalty per response: 0 for length <= L - b, (L - b - length) / b above it
    (reaching -1 at length L = max_new_tokens), -1 beyond. lengths [R] -> [R] float32."""
    b = max(1, min(buffer, max_new_tokens))
    start = max_new_tokens - b
    pen = (start - lengths.to(torch.float32)) / b  # [R]
    return pen.clamp(min=-1.0, max=0.0)
