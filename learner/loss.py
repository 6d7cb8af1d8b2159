"""The ExGRPO objective as pure tensor functions (no Ray, no FSDP, no config objects).

    A            = group_advantages(rewards, group_ids)                       # [R]
    logp, H      = token_logprobs(logits, targets), token_entropy(logits)     # [R, T]
    pg, extras   = policy_loss(logp, behaviour_logp, A, mask, replay_mask, normalizer=n)
    loss         = pg + entropy_bonus(H, mask, coef, n) + kl_penalty(logp, ref_logp, mask, coef, n)

`[R, T]` = rows x response-aligned token positions; masked positions (0 in `response_mask`) contribute nothing.
Departures from the textbook (replayed tokens' policy shaping, aggregation, TIS, the surrogates):
docs/internals.md#learnerlosspy (the rules: docs/algorithm.md)
"""

from __future__ import annotations

import math

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


POLICY_LOSSES = ("ppo_clip", "gspo", "cispo", "sapo")
"""`learner.policy_loss`: the surrogate of fresh tokens (and of replayed ones with replay_loss="policy_loss")."""


def _grad_carrier(logprobs: Tensor, mask: Tensor) -> Tensor:
    """exp(logp - sg(logp)) [R, T]: 1 in value, d/dtheta = d logp/dtheta (0 where masked, garbage or not)."""
    return torch.exp(torch.where(mask > 0, logprobs - logprobs.detach(), torch.zeros_like(logprobs)))


def sequence_ratio(logprobs: Tensor, log_ratio: Tensor, mask: Tensor) -> Tensor:
    """GSPO's sequence-level importance ratio in its token form [R, T] (Zheng et al. 2025, "Group Sequence Policy
    Optimization", GSPO-token; verl's compute_policy_loss_gspo): s_i = exp(mean over the row's masked tokens of
    log_ratio), taken as s_i,t = sg(s_i) * pi(y_t) / sg(pi(y_t)). Every token of a row has the value s_i, and
    d/dtheta sum_t s_i,t / |y_i| = d s_i / dtheta, so with a per-row token mean the gradient is GSPO's own.
    log s_i is capped at 10 (exp overflow, as verl)."""
    n = mask.sum(-1).clamp(min=1)  # [R]
    seq_log = ((log_ratio * mask).sum(-1) / n).clamp(max=10.0)  # [R]
    return _grad_carrier(logprobs, mask) * torch.exp(seq_log.detach()).unsqueeze(-1)  # [R, T]


def surrogate(kind: str, logprobs: Tensor, log_ratio: Tensor, adv: Tensor, mask: Tensor, *, clip_low: float,
              clip_high: float, tau_pos: float = 1.0, tau_neg: float = 1.05, clip: bool = True,
              clip_ratio_c: float | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """One policy loss per token over the tokens in `mask` [R, T]: (loss_t [R, T], weight [R, T], active [R, T]).

    `log_ratio` [R, T]: log pi_theta - log pi_old (0 where masked); `adv` [R, 1]. `weight` (detached): the importance
    weight the loss applies; `active` (0/1): where its clip or gate acts. `clip_low`/`clip_high`: the loss's band.
    - ppo_clip: r = exp(log_ratio); max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high)) (-A r without `clip`).
      With `clip_ratio_c` (verl's dual-clip, compute_policy_loss_vanilla) tokens with A < 0 take
      min(that, -A clip_ratio_c): their loss is bounded however far r rises above the band (active there too).
    - gspo: the same with GSPO's sequence ratio s (`sequence_ratio`) for r: a row is clipped whole.
    - cispo (MiniMax-M1, arXiv 2506.13585, eq. 4-5; bands as ScaleRL, arXiv 2510.13786): -A sg(w) exp(logp - sg(logp))
      with w = clip(r, 1 - clip_low, 1 + clip_high): the gradient -A w d logp of the paper's sg(w) A log pi,
      the value -A w (not -A w log pi: comparable with the other losses). No token loses its gradient; active
      where r lies outside the band (its weight truncated).
    - sapo ("Soft Adaptive Policy Optimization", Qwen 2025, arXiv 2511.20347; verl's compute_policy_loss_sapo):
      -A (4 / tau) sigmoid(tau (r - 1)), tau = tau_pos where A > 0, else tau_neg. Its gradient weight
      4 sigmoid (1 - sigmoid) r is r at r = 1 and decays smoothly away from it; active where the gate's factor
      4 sigmoid (1 - sigmoid) is below 1/2 (the token's gradient at least halved).
    gspo, cispo and sapo have no unclipped form here (`clip` False is refused: their band or gate is the loss)."""
    if kind != "ppo_clip" and not clip:
        raise ValueError(f"surrogate: {kind} has no unclipped form (its band or gate is the loss)")
    if clip_ratio_c is not None and (kind != "ppo_clip" or clip_ratio_c <= 1.0):
        raise ValueError(f"surrogate: clip_ratio_c is ppo_clip's dual-clip and must be > 1, got {clip_ratio_c} "
                         f"with {kind}")
    if kind in ("ppo_clip", "gspo"):
        ratio = torch.exp(log_ratio) if kind == "ppo_clip" else sequence_ratio(logprobs, log_ratio, mask)
        pg_loss1 = -adv * ratio
        if not clip:
            return pg_loss1, ratio.detach(), torch.zeros_like(ratio)
        pg_loss2 = -adv * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
        clipped, active = torch.maximum(pg_loss1, pg_loss2), pg_loss2 > pg_loss1  # [R, T]
        if clip_ratio_c is not None:  # dual-clip: A < 0 tokens' loss capped at -A c
            pg_loss3 = -adv * clip_ratio_c  # [R, 1]
            dual = (adv < 0) & (clipped > pg_loss3)  # [R, T]
            clipped, active = torch.where(dual, pg_loss3.expand_as(clipped), clipped), active | dual
        return clipped, ratio.detach(), active.to(ratio.dtype)
    ratio = torch.exp(log_ratio).detach()
    if kind == "cispo":
        w = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
        return -adv * w * _grad_carrier(logprobs, mask), ratio, (w != ratio).to(ratio.dtype)
    if kind == "sapo":
        tau = torch.where(adv > 0, tau_pos, tau_neg).to(logprobs.dtype)  # [R, 1]
        gate = torch.sigmoid(tau * (torch.exp(log_ratio) - 1.0))  # [R, T]
        active = (4.0 * gate * (1.0 - gate) < 0.5).to(ratio.dtype).detach()
        return -adv * gate * (4.0 / tau), ratio, active
    raise ValueError(f"surrogate: policy loss must be one of {POLICY_LOSSES}, got {kind!r}")


def _mismatch_corrections(logprobs: Tensor, behaviour_logprobs: Tensor, old_logprobs: Tensor, mask: Tensor,
                          fresh: Tensor, tis_cap: float | None, icepop_band: tuple[float, float] | None, mis: str,
                          mis_cap: float) -> tuple[Tensor, Tensor | None, Tensor | None, Tensor | None]:
    """With the learner's start-of-step log-probs: the fresh log-ratio centred on them [R, T], and the detached
    corrections of the train/inference gap m_t = exp(logp_old - logp_behaviour) that `policy_loss` documents:
    TIS weights [R, T], IcePop's keep mask [R, T], MIS row weights [R] (None where not asked)."""
    old = old_logprobs.detach()
    fresh_log_ratio = torch.where(mask > 0, logprobs - old, torch.zeros_like(logprobs))  # [R, T]
    mm_log = torch.where(fresh > 0, old - behaviour_logprobs, torch.zeros_like(logprobs))  # [R, T] detached
    tis = keep = row_w = None
    if tis_cap is not None:
        tis = torch.exp(mm_log).clamp(max=tis_cap)  # [R, T]
    if icepop_band is not None:
        mm = torch.exp(mm_log)
        keep = ((mm >= icepop_band[0]) & (mm <= icepop_band[1])).to(logprobs.dtype)  # [R, T]
    if mis != "none":
        seq_log = mm_log.sum(-1)  # [R] log rho of each row's fresh tokens
        if mis == "truncate":
            row_w = torch.exp(seq_log.clamp(max=math.log(mis_cap)))  # [R] min(rho, cap)
        else:
            row_w = ((seq_log >= -math.log(mis_cap)) & (seq_log <= math.log(mis_cap))).to(logprobs.dtype)
    return fresh_log_ratio, tis, keep, row_w


def policy_loss(
    logprobs: Tensor,
    behaviour_logprobs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    replay_mask: Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    clip_fresh: bool = True,
    shaping_beta: float | None = 0.1,
    normalizer: float | None = None,
    old_logprobs: Tensor | None = None,
    tis_cap: float | None = None,
    icepop_band: tuple[float, float] | None = None,
    mis: str = "none",
    mis_cap: float = 2.0,
    loss: str = "ppo_clip",
    tau_pos: float = 1.0,
    tau_neg: float = 1.05,
    replay_loss: str = "shaping",
    seq_mean: bool = False,
    clip_ratio_c: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The mixed-policy surrogate. Returns (loss, metrics) with metrics as detached 0-d tensors.

    logprobs, behaviour_logprobs, response_mask, replay_mask: [R, T]; advantages: [R].
    - fresh tokens (replay_mask 0): ratio r = exp(logp - logp_behaviour); with `loss` ppo_clip (the default)
      loss_t = max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high)) (plain -A r when not clip_fresh); gspo, cispo
      and sapo as `surrogate` says, `clip_low`/`clip_high` then being their own band (gspo's, cispo's) and
      `tau_pos`/`tau_neg` sapo's temperatures; `clip_ratio_c` ppo_clip's dual-clip (`surrogate`), wherever it clips.
    - fresh tokens with `tis_cap` (truncated importance sampling, as verl/OpenRLHF's TIS on top of
      decoupled PPO): `old_logprobs` [R, T] are the learner's log-probs under the weights at the start
      of the step (no gradient). The trust region is centred on that policy, r = exp(logp - logp_old),
      and the off-policy gap to the sampler (train/inference mismatch, staleness) is corrected by the
      detached weight c = min(exp(logp_old - logp_behaviour), tis_cap):
      loss_t = c * max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high)).
    - replayed tokens (replay_mask 1), `replay_loss` "shaping" (ExGRPO's): w = exp(logp - logp_stored),
      loss_t = -A w / (w + beta), no clipping; beta None gives -A w; with gspo, w is the row's sequence ratio
      against the stored log-probs (`sequence_ratio`), shaped the same way. "policy_loss": the fresh tokens' loss
      with its ratio against the stored log-probs. TIS does not apply to them: w already weights against the
      stored log-probs.
    - mismatch corrections of fresh tokens beside TIS, all from m_t = exp(logp_old - logp_behaviour)
      (detached, so `old_logprobs` is required): `icepop_band` (low, high) multiplies a token's loss by
      0 when m_t is outside [low, high] (IcePop); `mis` (sequence level, rho = prod_t m_t over a row's fresh
      tokens) "truncate" multiplies the row's fresh loss by min(rho, mis_cap), "mask" by 0 when rho is
      outside [1/mis_cap, mis_cap]. Whenever `old_logprobs` is given (also alone: learner.recompute_old_logprobs)
      the trust region is centred on it, r = exp(logp - logp_old).
    The loss is aggregated over all masked tokens (see `aggregate`); with `seq_mean` each token counts
    1 / (its row's response tokens), so that `normalizer` (then the mini-batch's rows; None: this batch's rows
    with tokens) divides a sum of per-row token means (GRPO's own seq-mean-token-mean). `fresh_loss` +
    `replay_loss` = `loss`. Metrics: clip_frac (fraction of fresh tokens where the loss's clip or gate is
    active), mean/max importance weight of fresh tokens (gspo: their row's sequence ratio), mean/max weight of
    replayed tokens, token counts; replay_clip_frac with replay_loss "policy_loss"; with `tis_cap` also
    tis_weight_mean (mean c over fresh tokens) and tis_truncated_frac (fraction with c = tis_cap).
    """
    if (tis_cap is not None or icepop_band is not None or mis != "none") and old_logprobs is None:
        raise ValueError("policy_loss: tis_cap, icepop_band and mis need old_logprobs (the learner's log-probs at "
                         "the start of the step)")
    if mis not in ("none", "truncate", "mask"):
        raise ValueError(f"policy_loss: mis must be none, truncate or mask, got {mis!r}")
    if replay_loss not in ("shaping", "policy_loss"):
        raise ValueError(f"policy_loss: replay_loss must be shaping or policy_loss, got {replay_loss!r}")
    mask = response_mask.to(logprobs.dtype)
    replay = replay_mask.to(logprobs.dtype) * mask  # [R, T]
    fresh = mask - replay  # [R, T]
    adv = advantages.to(logprobs.dtype).unsqueeze(-1)  # [R, 1]
    # Masked positions may hold garbage (padding): zero the log-ratio there so exp() stays finite.
    log_ratio = torch.where(mask > 0, logprobs - behaviour_logprobs, torch.zeros_like(logprobs))  # [R, T]
    ratio = torch.exp(log_ratio)  # [R, T] against the behaviour log-probs
    fresh_log_ratio, tis, keep, row_w = log_ratio, None, None, None
    if old_logprobs is not None:  # recomputed pi_old: the trust region is centred on it
        fresh_log_ratio, tis, keep, row_w = _mismatch_corrections(logprobs, behaviour_logprobs, old_logprobs, mask,
                                                                  fresh, tis_cap, icepop_band, mis, mis_cap)

    fresh_loss_t, fresh_w, clipped = surrogate(loss, logprobs, fresh_log_ratio, adv, fresh, clip_low=clip_low,
                                               clip_high=clip_high, tau_pos=tau_pos, tau_neg=tau_neg,
                                               clip=clip_fresh, clip_ratio_c=clip_ratio_c if clip_fresh else None
                                               )  # [R, T] each
    if tis is not None:
        fresh_loss_t = tis * fresh_loss_t
    if keep is not None:
        fresh_loss_t = keep * fresh_loss_t
    if row_w is not None:
        fresh_loss_t = row_w.unsqueeze(-1) * fresh_loss_t
    replay_clipped = None
    if replay_loss == "policy_loss":
        replay_loss_t, replay_w, replay_clipped = surrogate(loss, logprobs, log_ratio, adv, replay, clip_low=clip_low,
                                                            clip_high=clip_high, tau_pos=tau_pos, tau_neg=tau_neg,
                                                            clip_ratio_c=clip_ratio_c)
    else:
        w = sequence_ratio(logprobs, log_ratio, replay) if loss == "gspo" else ratio  # [R, T]
        replay_loss_t = -adv * w if shaping_beta is None else -adv * w / (w + shaping_beta)  # [R, T]
        replay_w = w.detach()

    agg_fresh, agg_replay, default_norm = fresh, replay, mask.sum().clamp(min=1)
    if seq_mean:  # each token weighs 1 / its row's response tokens; the divisor counts rows
        per_row = mask / mask.sum(-1, keepdim=True).clamp(min=1)  # [R, T]
        agg_fresh, agg_replay = fresh * per_row, replay * per_row
        default_norm = (mask.sum(-1) > 0).sum().clamp(min=1).to(logprobs.dtype)
    norm = normalizer if normalizer is not None else default_norm
    fresh_loss = aggregate(fresh_loss_t, agg_fresh, norm)
    replay_loss_v = aggregate(replay_loss_t, agg_replay, norm)
    total = fresh_loss + replay_loss_v

    with torch.no_grad():
        n_fresh, n_replay = fresh.sum(), replay.sum()
        r, fr = replay_w, fresh_w
        zero = torch.zeros((), dtype=r.dtype, device=r.device)
        metrics = {
            "loss": total.detach(),
            "fresh_loss": fresh_loss.detach(),
            "replay_loss": replay_loss_v.detach(),
            "clip_frac": (clipped * fresh).sum() / n_fresh.clamp(min=1),
            "fresh_ratio_mean": (fr * fresh).sum() / n_fresh.clamp(min=1),
            # 0 where there is none; ratios are positive, so no branch on the count (which would read the device)
            "fresh_ratio_max": torch.where(fresh > 0, fr, zero).max() if fr.numel() else zero,
            "replay_weight_mean": (r * replay).sum() / n_replay.clamp(min=1),
            "replay_weight_max": torch.where(replay > 0, r, zero).max() if r.numel() else zero,
            "fresh_tokens": n_fresh,
            "replay_tokens": n_replay,
        }
        if replay_clipped is not None:
            metrics["replay_clip_frac"] = (replay_clipped * replay).sum() / n_replay.clamp(min=1)
        if keep is not None:
            metrics["icepop_masked_frac"] = ((1 - keep) * fresh).sum() / n_fresh.clamp(min=1)
        if row_w is not None:  # token-weighted: each fresh token carries its row's weight
            metrics["mis_weight_mean"] = (row_w.unsqueeze(-1) * fresh).sum() / n_fresh.clamp(min=1)
            metrics["mis_masked_frac"] = ((row_w.unsqueeze(-1) == 0).to(r.dtype) * fresh).sum() / n_fresh.clamp(min=1)
        if tis is not None:
            metrics["tis_weight_mean"] = (tis * fresh).sum() / n_fresh.clamp(min=1)
            metrics["tis_truncated_frac"] = ((tis >= tis_cap).to(r.dtype) * fresh).sum() / n_fresh.clamp(min=1)
    return total, metrics


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
