"""The policy loss, chosen once from the config and then called per micro-batch with tensors only.

    loss_fn = setup_policy_loss(cfg.learner.loss, clip_fresh=True)                      # at setup
    pg, metrics = loss_fn(logp, LossBatch(behaviour, A, mask, replay_mask, old), normalizer)

Built from pure pieces over `[R, T]` tensors (rows x response-aligned token positions; masked positions count
for nothing): a surrogate for fresh tokens (ppo_clip, gspo, cispo, sapo; dual-clip around ppo_clip), a replay loss
(shaping, plain IS, or the surrogate), mismatch corrections (TIS, IcePop, MIS) and an aggregation. The config
refuses combinations without meaning, so nothing here branches on a name per call. Rules: docs/algorithm.md
(Policy losses); departures from the textbook: docs/internals.md#learnerpolicy_losspy
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, NamedTuple

import torch
from torch import Tensor

from learner.loss import aggregate

if TYPE_CHECKING:
    from common.config import LossConfig
    from common.config.loss import CispoLoss, GspoLoss, PpoClipLoss, SapoLoss

class TokenLoss(NamedTuple):
    """One loss per token over the tokens of a mask, each [R, T]."""

    loss: Tensor  # the per-token loss (the aggregation multiplies masked positions away)
    weight: Tensor  # detached: the importance weight it applies (gspo: the row's sequence ratio)
    active: Tensor | None  # 0/1 where its clip or gate acts; None: it has none (shaping, plain IS)


Surrogate = Callable[[Tensor, Tensor, Tensor, Tensor], TokenLoss]
"""(logprobs [R, T], log_ratio [R, T] (log pi_theta - log pi_old, 0 where masked), adv [R, 1], mask [R, T])."""
Correction = Callable[[Tensor, Tensor], tuple[Tensor, dict[str, Tensor]]]
"""(mm_log [R, T] = log pi_old - log pi_behaviour on fresh tokens, fresh [R, T]) -> (detached weight [R, T] or
[R, 1] that multiplies the fresh tokens' loss, its metrics as 0-d tensors)."""
Aggregation = Callable[[Tensor], tuple[Tensor, Tensor]]
"""mask [R, T] -> (each token's weight [R, T], the divisor when the caller gives none (0-d))."""


# ----------------------------------------------------------------------------------------------- ratios

def _grad_carrier(logprobs: Tensor, mask: Tensor) -> Tensor:
    """exp(logp - sg(logp)) [R, T]: 1 in value, d/dtheta = d logp/dtheta (0 where masked, garbage or not)."""
    return torch.exp(torch.where(mask > 0, logprobs - logprobs.detach(), torch.zeros_like(logprobs)))


def token_ratio(logprobs: Tensor, log_ratio: Tensor, mask: Tensor) -> Tensor:
    """r_t = exp(log_ratio) [R, T]."""
    return torch.exp(log_ratio)


def sequence_ratio(logprobs: Tensor, log_ratio: Tensor, mask: Tensor) -> Tensor:
    """GSPO's sequence-level importance ratio in its token form [R, T] (Zheng et al. 2025, GSPO-token; verl's
    compute_policy_loss_gspo): s_i = exp(mean over the row's masked tokens of log_ratio), taken as
    s_i,t = sg(s_i) * pi(y_t) / sg(pi(y_t)). Every token of a row has the value s_i, and d/dtheta sum_t s_i,t / |y_i|
    = d s_i / dtheta, so with a per-row token mean the gradient is GSPO's own. log s_i is capped at 10 (as verl)."""
    n = mask.sum(-1).clamp(min=1)  # [R]
    seq_log = ((log_ratio * mask).sum(-1) / n).clamp(max=10.0)  # [R]
    return _grad_carrier(logprobs, mask) * torch.exp(seq_log.detach()).unsqueeze(-1)  # [R, T]


# ------------------------------------------------------------------------------------------- surrogates

def _clipped(ratio: Tensor, adv: Tensor, clip_low: float, clip_high: float) -> TokenLoss:
    """max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high)); active where the clipped term is the larger."""
    pg_loss1 = -adv * ratio  # [R, T]
    pg_loss2 = -adv * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)  # [R, T]
    return TokenLoss(torch.maximum(pg_loss1, pg_loss2), ratio.detach(), (pg_loss2 > pg_loss1).to(ratio.dtype))


def ppo_clip(logprobs: Tensor, log_ratio: Tensor, adv: Tensor, mask: Tensor, *, clip_low: float,
             clip_high: float) -> TokenLoss:
    """PPO's clip with the token ratio r = exp(log_ratio)."""
    return _clipped(torch.exp(log_ratio), adv, clip_low, clip_high)


def gspo(logprobs: Tensor, log_ratio: Tensor, adv: Tensor, mask: Tensor, *, clip_low: float,
         clip_high: float) -> TokenLoss:
    """PPO's clip with GSPO's sequence ratio (`sequence_ratio`) for r: a row is clipped whole."""
    return _clipped(sequence_ratio(logprobs, log_ratio, mask), adv, clip_low, clip_high)


def cispo(logprobs: Tensor, log_ratio: Tensor, adv: Tensor, mask: Tensor, *, clip_low: float,
          clip_high: float) -> TokenLoss:
    """CISPO (MiniMax-M1, arXiv 2506.13585, eq. 4-5): -A sg(w) exp(logp - sg(logp)), w = clip(r, 1 - clip_low,
    1 + clip_high): the gradient -A w d logp of the paper's sg(w) A log pi, the value -A w (comparable with the other
    losses). No token loses its gradient; active where r lies outside the band (its weight truncated)."""
    ratio = torch.exp(log_ratio).detach()  # [R, T]
    w = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    return TokenLoss(-adv * w * _grad_carrier(logprobs, mask), ratio, (w != ratio).to(ratio.dtype))


def sapo(logprobs: Tensor, log_ratio: Tensor, adv: Tensor, mask: Tensor, *, tau_pos: float,
         tau_neg: float) -> TokenLoss:
    """SAPO (Qwen 2025, arXiv 2511.20347; verl's compute_policy_loss_sapo): -A (4 / tau) sigmoid(tau (r - 1)),
    tau = tau_pos where A > 0, else tau_neg. Its gradient weight 4 sigmoid (1 - sigmoid) r is r at r = 1 and decays
    smoothly away from it; active where that factor 4 sigmoid (1 - sigmoid) is below 1/2."""
    ratio = torch.exp(log_ratio).detach()  # [R, T]
    tau = torch.where(adv > 0, tau_pos, tau_neg).to(logprobs.dtype)  # [R, 1]
    gate = torch.sigmoid(tau * (torch.exp(log_ratio) - 1.0))  # [R, T]
    active = (4.0 * gate * (1.0 - gate) < 0.5).to(ratio.dtype).detach()
    return TokenLoss(-adv * gate * (4.0 / tau), ratio, active)


def dual_clip(logprobs: Tensor, log_ratio: Tensor, adv: Tensor, mask: Tensor, *, surrogate: Surrogate,
              clip_ratio_c: float) -> TokenLoss:
    """verl's dual-clip (compute_policy_loss_vanilla; Ye et al. 2020) around a clipped `surrogate`: a token with
    A < 0 loses at most -A clip_ratio_c, however far r rises above the band (active there too)."""
    out = surrogate(logprobs, log_ratio, adv, mask)
    pg_loss3 = -adv * clip_ratio_c  # [R, 1]
    dual = (adv < 0) & (out.loss > pg_loss3)  # [R, T]
    return TokenLoss(torch.where(dual, pg_loss3.expand_as(out.loss), out.loss), out.weight,
                     torch.maximum(out.active, dual.to(out.active.dtype)))


# ------------------------------------------------------------------------------------------ replay losses

def shaping(logprobs: Tensor, log_ratio: Tensor, adv: Tensor, mask: Tensor, *, beta: float,
            ratio: Callable[[Tensor, Tensor, Tensor], Tensor] = token_ratio) -> TokenLoss:
    """ExGRPO's policy shaping of replayed tokens: -A w / (w + beta), w = `ratio` to the stored log-probs, no clip."""
    w = ratio(logprobs, log_ratio, mask)  # [R, T]
    return TokenLoss(-adv * w / (w + beta), w.detach(), None)


def importance_weighted(logprobs: Tensor, log_ratio: Tensor, adv: Tensor, mask: Tensor, *,
                        ratio: Callable[[Tensor, Tensor, Tensor], Tensor] = token_ratio) -> TokenLoss:
    """Plain importance sampling, -A w: replayed tokens without shaping, fresh ones with PPO's clip off."""
    w = ratio(logprobs, log_ratio, mask)  # [R, T]
    return TokenLoss(-adv * w, w.detach(), None)


# ------------------------------------------------------------------------------------ mismatch corrections

CORRECTION_METRICS = ("tis_weight_mean", "tis_truncated_frac", "icepop_masked_frac", "mis_weight_mean",
                      "mis_masked_frac")
"""The metrics the corrections emit, each a mean over the fresh tokens (`learner.objective.METRICS` reduces them
so): a new correction is its function here, its entry in `_corrections`, its names here and its config field."""


def truncated_is(mm_log: Tensor, fresh: Tensor, *, cap: float) -> tuple[Tensor, dict[str, Tensor]]:
    """TIS (verl/OpenRLHF): each fresh token's loss times c = min(m_t, cap), m_t = exp(mm_log)."""
    c = torch.exp(mm_log).clamp(max=cap)  # [R, T]
    n = fresh.sum().clamp(min=1)
    return c, {"tis_weight_mean": (c * fresh).sum() / n,
               "tis_truncated_frac": ((c >= cap).to(fresh.dtype) * fresh).sum() / n}


def icepop(mm_log: Tensor, fresh: Tensor, *, low: float, high: float) -> tuple[Tensor, dict[str, Tensor]]:
    """IcePop: a fresh token whose m_t lies outside [low, high] takes no part in the loss (weight 0)."""
    mm = torch.exp(mm_log)  # [R, T]
    keep = ((mm >= low) & (mm <= high)).to(fresh.dtype)  # [R, T]
    return keep, {"icepop_masked_frac": ((1 - keep) * fresh).sum() / fresh.sum().clamp(min=1)}


def _mis_metrics(row_w: Tensor, fresh: Tensor) -> dict[str, Tensor]:
    """Token-weighted: each fresh token carries its row's weight `row_w` [R, 1]."""
    n = fresh.sum().clamp(min=1)
    return {"mis_weight_mean": (row_w * fresh).sum() / n,
            "mis_masked_frac": ((row_w == 0).to(fresh.dtype) * fresh).sum() / n}


def mis_truncate(mm_log: Tensor, fresh: Tensor, *, cap: float) -> tuple[Tensor, dict[str, Tensor]]:
    """Sequence-level MIS: a row's fresh loss times min(rho, cap), rho = prod_t m_t over its fresh tokens."""
    row_w = torch.exp(mm_log.sum(-1).clamp(max=math.log(cap))).unsqueeze(-1)  # [R, 1]
    return row_w, _mis_metrics(row_w, fresh)


def mis_mask(mm_log: Tensor, fresh: Tensor, *, cap: float) -> tuple[Tensor, dict[str, Tensor]]:
    """Sequence-level MIS: a row's fresh loss times 0 when rho lies outside [1/cap, cap], else 1."""
    seq_log = mm_log.sum(-1)  # [R] log rho
    row_w = ((seq_log >= -math.log(cap)) & (seq_log <= math.log(cap))).to(fresh.dtype).unsqueeze(-1)  # [R, 1]
    return row_w, _mis_metrics(row_w, fresh)


# -------------------------------------------------------------------------------------------- aggregation

def token_mean(mask: Tensor) -> tuple[Tensor, Tensor]:
    """Every token alike; by default the loss is divided by the batch's token count."""
    return mask, mask.sum().clamp(min=1)


def seq_mean_token_mean(mask: Tensor) -> tuple[Tensor, Tensor]:
    """Each token weighs 1 / (its row's response tokens), so a divisor of rows averages the rows' token means
    (GRPO's own); by default the batch's rows with tokens."""
    per_row = mask / mask.sum(-1, keepdim=True).clamp(min=1)  # [R, T]
    return per_row, (mask.sum(-1) > 0).sum().clamp(min=1).to(mask.dtype)


# ------------------------------------------------------------------------------------------- the whole loss

@dataclass(frozen=True)
class LossBatch:
    """One micro-batch's tensors the policy loss reads besides the policy's log-probs (learner step -> loss)."""

    behaviour_logprobs: Tensor  # [R, T] float32: the sampler's (fresh rows) or the stored (replayed rows)
    advantages: Tensor  # [R]
    response_mask: Tensor  # [R, T] 0/1
    replay_mask: Tensor  # [R, T] 0/1 on the tokens of replayed rows
    old_logprobs: Tensor | None = None  # [R, T] the learner's own at the start of the step (no gradient), or None


@dataclass(frozen=True)
class PolicyLoss:
    """The mixed-policy surrogate with its options bound: `loss_fn(logprobs, batch, normalizer)` -> (loss, metrics).

    Fresh tokens (replay_mask 0) take `fresh` with log_ratio = logp - logp_behaviour, or, when the batch has
    `old_logprobs`, logp - logp_old (the trust region centred on the learner's start-of-step policy) and then each
    of `corrections` of the gap m_t = exp(logp_old - logp_behaviour) multiplies their loss. Replayed tokens take
    `replay` with log_ratio = logp - logp_stored (no correction: their weight already compares with the stored
    log-probs). `aggregation` weighs the tokens; their sum is divided by `normalizer` (None: the aggregation's own
    divisor of this batch). Metrics are detached 0-d tensors: loss = fresh_loss + replay_loss, clip_frac (fresh
    tokens where the surrogate's clip or gate acts), the mean/max weight of fresh and replayed tokens, token counts,
    replay_clip_frac when `replay` clips, and each correction's own."""

    fresh: Surrogate
    replay: Surrogate
    corrections: tuple[Correction, ...] = ()
    aggregation: Aggregation = token_mean

    def __call__(self, logprobs: Tensor, batch: LossBatch,
                 normalizer: float | Tensor | None = None) -> tuple[Tensor, dict[str, Tensor]]:
        if self.corrections and batch.old_logprobs is None:
            raise ValueError("policy loss: TIS, IcePop and MIS need old_logprobs (the learner's log-probs at the "
                             "start of the step)")
        mask = batch.response_mask.to(logprobs.dtype)
        replay = batch.replay_mask.to(logprobs.dtype) * mask  # [R, T]
        fresh = mask - replay  # [R, T]
        adv = batch.advantages.to(logprobs.dtype).unsqueeze(-1)  # [R, 1]
        zeros = torch.zeros_like(logprobs)
        # Masked positions may hold garbage (padding): zero the log-ratio there so exp() stays finite.
        log_ratio = torch.where(mask > 0, logprobs - batch.behaviour_logprobs, zeros)  # [R, T]
        fresh_log_ratio, weights, extra = log_ratio, [], {}
        if batch.old_logprobs is not None:  # recomputed pi_old: the trust region is centred on it
            old = batch.old_logprobs.detach()
            fresh_log_ratio = torch.where(mask > 0, logprobs - old, zeros)  # [R, T]
            mm_log = torch.where(fresh > 0, old - batch.behaviour_logprobs, zeros)  # [R, T] detached
            for correct in self.corrections:
                w, m = correct(mm_log, fresh)
                weights.append(w)
                extra.update(m)
        f = self.fresh(logprobs, fresh_log_ratio, adv, fresh)
        fresh_loss_t = f.loss
        for w in weights:
            fresh_loss_t = w * fresh_loss_t
        r = self.replay(logprobs, log_ratio, adv, replay)
        per_token, own_divisor = self.aggregation(mask)
        norm = normalizer if normalizer is not None else own_divisor
        fresh_loss = aggregate(fresh_loss_t, fresh * per_token, norm)
        replay_loss = aggregate(r.loss, replay * per_token, norm)
        total = fresh_loss + replay_loss
        with torch.no_grad():
            metrics = {"loss": total.detach(), "fresh_loss": fresh_loss.detach(), "replay_loss": replay_loss.detach(),
                       **_weight_metrics(f, r, fresh, replay), **extra}
        return total, metrics


def _weight_metrics(f: TokenLoss, r: TokenLoss, fresh: Tensor, replay: Tensor) -> dict[str, Tensor]:
    """clip_frac, the fresh and replayed tokens' mean/max weight and counts (and replay_clip_frac where it clips)."""
    n_fresh, n_replay = fresh.sum(), replay.sum()
    zero = torch.zeros((), dtype=r.weight.dtype, device=r.weight.device)
    clip_frac = zero if f.active is None else (f.active * fresh).sum() / n_fresh.clamp(min=1)
    metrics = {
        "clip_frac": clip_frac,
        "fresh_ratio_mean": (f.weight * fresh).sum() / n_fresh.clamp(min=1),
        # 0 where there is none; ratios are positive, so no branch on the count (which would read the device)
        "fresh_ratio_max": torch.where(fresh > 0, f.weight, zero).max() if f.weight.numel() else zero,
        "replay_weight_mean": (r.weight * replay).sum() / n_replay.clamp(min=1),
        "replay_weight_max": torch.where(replay > 0, r.weight, zero).max() if r.weight.numel() else zero,
        "fresh_tokens": n_fresh,
        "replay_tokens": n_replay,
    }
    if r.active is not None:
        metrics["replay_clip_frac"] = (r.active * replay).sum() / n_replay.clamp(min=1)
    return metrics


# ------------------------------------------------------------------------------------------------- setup

AGGREGATIONS: dict[str, Aggregation] = {"token_mean": token_mean, "constant": token_mean,
                                        "seq_mean_token_mean": seq_mean_token_mean}
"""`learner.loss.loss_agg` -> the tokens' weights (constant: the step passes the constant as the normalizer)."""


def _ppo_clip(c: PpoClipLoss) -> Surrogate:
    clipped = partial(ppo_clip, clip_low=c.clip_low, clip_high=c.clip_high)
    return clipped if c.clip_ratio_c is None else partial(dual_clip, surrogate=clipped, clip_ratio_c=c.clip_ratio_c)


def _gspo(c: GspoLoss) -> Surrogate:
    return partial(gspo, clip_low=c.clip_low, clip_high=c.clip_high)


def _cispo(c: CispoLoss) -> Surrogate:
    return partial(cispo, clip_low=c.clip_low, clip_high=c.clip_high)


def _sapo(c: SapoLoss) -> Surrogate:
    return partial(sapo, tau_pos=c.tau_pos, tau_neg=c.tau_neg)


class SurrogateKind(NamedTuple):
    """How one `learner.loss.policy_loss.kind` is built: its surrogate from its section, and the ratio that
    shaping weighs its replayed rows by."""

    build: Callable[..., Surrogate]
    ratio: Callable[[Tensor, Tensor, Tensor], Tensor]


SURROGATES = {"ppo_clip": SurrogateKind(_ppo_clip, token_ratio), "gspo": SurrogateKind(_gspo, sequence_ratio),
              "cispo": SurrogateKind(_cispo, token_ratio), "sapo": SurrogateKind(_sapo, token_ratio)}
"""`learner.loss.policy_loss.kind` -> how it is built (its section: common.config.loss.SURROGATE_KINDS)."""


def _replay(loss: LossConfig, surrogate: Surrogate) -> Surrogate:
    """`learner.loss.replay_loss`: the surrogate itself, or shaping (plain IS without `shaping_beta`); under gspo the
    shaped weight is the row's sequence ratio."""
    if loss.replay_loss == "policy_loss":
        return surrogate
    ratio = SURROGATES[loss.policy_loss.kind].ratio
    if loss.shaping_beta is None:
        return partial(importance_weighted, ratio=ratio)
    return partial(shaping, beta=loss.shaping_beta, ratio=ratio)


def _corrections(loss: LossConfig) -> tuple[Correction, ...]:
    """`learner.loss.tis_cap`, `icepop_band`, `mis`, applied in that order."""
    out: list[Correction] = []
    if loss.tis_cap is not None:
        out.append(partial(truncated_is, cap=loss.tis_cap))
    if loss.icepop_band is not None:
        out.append(partial(icepop, low=loss.icepop_band[0], high=loss.icepop_band[1]))
    if loss.mis != "none":
        out.append(partial({"truncate": mis_truncate, "mask": mis_mask}[loss.mis], cap=loss.mis_cap))
    return tuple(out)


def setup_policy_loss(loss: LossConfig, clip_fresh: bool = True) -> PolicyLoss:
    """The learner's policy loss, built once from its config. `clip_fresh` False: the variant whose fresh tokens
    are unclipped (-A r; learner.loss.clip_fresh false, or auto once mixed mode starts), which only ppo_clip has (the
    config refuses the others); replayed tokens under replay_loss=policy_loss keep the clip either way."""
    if not clip_fresh and not loss.policy_loss.unclipped_form:
        raise ValueError(f"learner.loss.policy_loss.kind={loss.policy_loss.kind} has no unclipped form (its band or "
                         "gate is the loss): set learner.loss.clip_fresh=true, or learner.loss.policy_loss.kind=ppo_clip")
    clipped = SURROGATES[loss.policy_loss.kind].build(loss.policy_loss)
    fresh = clipped if clip_fresh else importance_weighted
    return PolicyLoss(fresh, _replay(loss, clipped), _corrections(loss), AGGREGATIONS[loss.loss_agg])
