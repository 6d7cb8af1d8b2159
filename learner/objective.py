"""The whole objective of one learner step, chosen once from `learner.loss` and then called with rows and tensors.

    objective = setup_objective(cfg.loss, shape, reference=..., entropy_split=...)   # at setup
    rows, once = objective.rows(batch)           # advantages, overlong handling, replay EOS (the same on every rank)
    clip = objective.clips(batch)                # the clip schedule: PPO's clip on fresh tokens in this batch?
    terms = objective.mini_batch(mini, clip=clip, first=...)   # its divisors, entropy weights; None: no token
    ref = objective.reference_logprobs(mb)       # the KL reference's forward (before the policy's), or None
    loss, metrics = objective(logp, ent, mb, terms, ref)   # [R, L-1] tensors -> 0-d loss

The step (`learner.step.TrainStep`) reads none of `learner.loss`: it calls these and reduces `metrics` as
`Objective.metrics` declares (`Reduce`). The pieces are `learner.policy_loss` (the surrogate and its corrections)
and the pure terms of `learner.loss`; the parts that need the model (the KL reference's forward, the micro-batch
split of another rank count) are handles given at construction. Rules: docs/algorithm.md
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Literal

import numpy as np
import torch
from torch import Tensor

from common.messages import TrainingBatch
from learner import loss as L
from learner.batching import MicroBatch, Row, batch_rows
from learner.policy_loss import CORRECTION_METRICS, LossBatch, PolicyLoss, setup_policy_loss
from learner.shape import TrainShape

if TYPE_CHECKING:
    from common.config import LossConfig


@dataclass(frozen=True)
class Reduce:
    """How one metric the objective emits per micro-batch becomes the step's `learner/<name>`: over micro-batches and
    ranks, `sum` adds it up, `per_update` too and divides by the step's mini-batches, `mean` weighs the value (a mean
    over the count metric `over`) by that count, `total` adds it up (a sum over `over`) and divides by `over`'s sum,
    `max` keeps the largest; `mean`, `total` and `max` are NaN where the micro-batches that emitted them counted
    nothing. `step`: a value of the whole step, the same on every rank (the first rank's is reported)."""

    how: Literal["sum", "per_update", "mean", "total", "max", "step"]
    over: str | None = None


METRICS: dict[str, Reduce] = {
    "loss": Reduce("per_update"),  # policy loss + entropy term + KL term, the loss the backward takes
    "pg_loss": Reduce("per_update"),
    "entropy_loss": Reduce("per_update"),
    "kl_loss": Reduce("per_update"),
    "entropy_fresh": Reduce("total", "fresh_tokens"),  # mean token entropy of fresh and of replayed tokens
    "entropy_replayed": Reduce("total", "replay_tokens"),
    "advantage_abs_mean": Reduce("total", "rows"),
    "rows": Reduce("sum"),
    # what `learner.policy_loss.PolicyLoss` emits ("loss" there is pg_loss here); the corrections' only with them
    "fresh_loss": Reduce("per_update"),
    "replay_loss": Reduce("per_update"),
    "clip_frac": Reduce("mean", "fresh_tokens"),
    "fresh_ratio_mean": Reduce("mean", "fresh_tokens"),
    "fresh_ratio_max": Reduce("max", "fresh_tokens"),
    "replay_weight_mean": Reduce("mean", "replay_tokens"),
    "replay_weight_max": Reduce("max", "replay_tokens"),
    "fresh_tokens": Reduce("sum"),
    "replay_tokens": Reduce("sum"),
    "replay_clip_frac": Reduce("mean", "replay_tokens"),  # replay_loss=policy_loss
    **{name: Reduce("mean", "fresh_tokens") for name in CORRECTION_METRICS},  # tis_cap, icepop_band, mis
    "overlong_masked": Reduce("step"),  # truncated rows left out of the loss (overlong=mask)
    "replay_eos_appended": Reduce("step"),  # truncated replayed rows given an EOS token (replay_eos)
    "overlong_penalty_mean": Reduce("step"),  # the mean overlong penalty over the batch's rows (overlong=penalty)
    "clip_fresh": Reduce("step"),  # 1 when this step clipped fresh tokens' ratio (the clip schedule)
}
"""Every metric an `Objective` reports, and how it reduces; one it does not emit in a step is NaN (or 0: a sum)."""


def append_eos(rows: list[Row], eos_id: int, max_positions: int) -> int:
    """replay_eos: each replayed row cut at the length limit (and not ending in EOS) gets `eos_id` appended, its
    stored log-prob NaN (the objective fills it with the policy's own: weight 1), where the model has a position
    left. Returns how many rows changed."""
    n = 0
    for r in rows:
        if r.replayed and r.truncated and (not len(r.response_ids) or r.response_ids[-1] != eos_id) \
                and r.length < max_positions:
            r.response_ids = np.append(r.response_ids, np.asarray(eos_id, r.response_ids.dtype))
            r.behaviour_logprobs = np.append(r.behaviour_logprobs, np.float32("nan"))
            n += 1
    return n


# ------------------------------------------------------------------------------------------- normalizers

def token_count(mini: list[Row]) -> float:
    """token_mean: the mini-batch's response tokens."""
    return float(sum(len(r.response_ids) for r in mini))


def rows_with_tokens(mini: list[Row]) -> float:
    """seq_mean_token_mean: the rows with a response token (each row's token mean counts once)."""
    return float(sum(1 for r in mini if len(r.response_ids)))


def constant(mini: list[Row], *, divisor: float | None, max_new_tokens: int, scale: int) -> float:
    """constant (Dr. GRPO): `divisor` (loss_constant; None: the rows x max_new_tokens), times `scale`
    (loss_world_size)."""
    return float(divisor or len(mini) * max_new_tokens) * scale


@dataclass(frozen=True)
class Terms:
    """What the objective fixes for one mini-batch (objective -> its micro-batches): the policy loss's `normalizer`,
    its response `tokens` (the entropy and KL terms' token mean), the entropy weight of each row by id
    (micro_batch), whether fresh tokens' ratio is clipped (`clip`: the step's clip schedule), and whether it is the
    step's first mini-batch (`first`: no update yet, so its own forward is pi_old)."""

    normalizer: float
    tokens: float
    entropy_weights: dict[int, float] | None = None
    clip: bool = True
    first: bool = False


# ------------------------------------------------------------------------------------------- the objective

Reference = Callable[[MicroBatch], Tensor | None]
"""The KL reference's log-probs [R, L-1] of a micro-batch (None: none, or a dummy micro-batch); a collective forward."""
EntropySplit = Callable[[list[Row], int], list[float]]
"""(mini-batch rows, GPUs) -> each row's entropy weight as `learner.batching.entropy_weights` splits them."""


@dataclass(frozen=True)
class Objective:
    """The objective with every option of `learner.loss` bound (see the module doc). Built by `setup_objective`."""

    policy_losses: dict[bool, PolicyLoss]  # by clip: the clipped form, and the unclipped where the schedule uses it
    clip_schedule: Callable[[TrainingBatch], bool]
    normalizer: Callable[[list[Row]], float]
    entropy_coef: float
    entropy_split: Callable[[list[Row]], list[float]] | None  # entropy_agg=micro_batch: the rows' weights
    kl_coef: float
    reference: Reference | None  # None: no KL term
    kl_token_mean: bool  # the KL term divides by the mini-batch's tokens (seq_mean_token_mean), else the normalizer
    rows_of: Callable[[TrainingBatch], list[Row]]  # batch_rows with the advantages' and overlong penalty's options
    drop_truncated: bool  # overlong=mask
    eos_id: int | None  # replay_eos: the token appended (None: off)
    max_positions: int
    needs_old_logprobs: bool  # pi_old recomputed: the step records every later mini-batch's start-of-step log-probs
    stores_learner_logprobs: bool  # the buffer stores the learner's start-of-step log-probs of fresh rows
    metrics: dict[str, Reduce]

    def rows(self, batch: TrainingBatch) -> tuple[list[Row], dict[str, float]]:
        """The rows to train with their advantages (a truncated row still counts in its group's mean under
        overlong=mask, then leaves), and the step's `step` metrics of them."""
        rows = self.rows_of(batch)
        once = {"replay_eos_appended": 0.0, "overlong_masked": 0.0,
                "overlong_penalty_mean": sum(r.penalty for r in rows) / len(rows) if rows else 0.0}
        if self.eos_id is not None:
            once["replay_eos_appended"] = float(append_eos(rows, self.eos_id, self.max_positions))
        if self.drop_truncated:
            once["overlong_masked"] = float(sum(r.truncated for r in rows))
            rows = [r for r in rows if not r.truncated]
        return rows, once

    def clips(self, batch: TrainingBatch) -> bool:
        """Whether this batch's fresh tokens take PPO's clip (clip_fresh; auto: until the buffer's mixed mode)."""
        return self.clip_schedule(batch)

    def mini_batch(self, mini: list[Row], *, clip: bool = True, first: bool = False) -> Terms | None:
        """A mini-batch's terms (`clip`: `clips(batch)`; `first`: the step's first mini-batch); None when it has no
        response token (nothing to learn from it)."""
        tokens = token_count(mini)
        if tokens == 0:
            return None
        weights = None
        if self.entropy_split is not None:
            weights = {id(r): x for r, x in zip(mini, self.entropy_split(mini))}
        return Terms(self.normalizer(mini), tokens, weights, clip, first)

    def reference_logprobs(self, mb: MicroBatch) -> Tensor | None:
        """The KL reference's log-probs [R, L-1] of `mb`, or None (no KL term). Call it before the policy's forward,
        on every rank (a collective forward under FSDP, dummy micro-batches included)."""
        return None if self.reference is None else self.reference(mb)

    def __call__(self, logp: Tensor, ent: Tensor, mb: MicroBatch, terms: Terms,
                 ref_logp: Tensor | None) -> tuple[Tensor, dict[str, Tensor | float]]:
        """The loss of one micro-batch (0-d) and its metrics (0-d tensors, detached, or host floats). logp, ent
        [R, L-1]: the policy's forward; `terms`: its mini-batch's (`mini_batch`); `ref_logp`: the KL reference's
        (`reference_logprobs`)."""
        behaviour = mb.behaviour_logprobs
        if self.eos_id is not None:  # an appended EOS has no stored log-prob (NaN): its weight is 1, the policy's own
            behaviour = torch.where(torch.isnan(behaviour), logp.detach(), behaviour)
        old = None
        if self.needs_old_logprobs:
            old = mb.old_logprobs if (mb.rows and not terms.first) else logp.detach()
            if old is None:
                raise RuntimeError("learner.loss.recompute_old_logprobs/tis_cap/icepop_band/mis: a later mini-batch "
                                   "has no start-of-step log-probs (record_old_logprobs must run before the first "
                                   "update)")
        pg, pm = self.policy_losses[terms.clip](
            logp, LossBatch(behaviour, mb.advantages, mb.response_mask, mb.replay_mask, old), terms.normalizer)
        ent_term = self._entropy(ent, mb, terms)
        kl_term = torch.zeros((), device=logp.device)
        if ref_logp is not None:
            kl_term = L.kl_penalty(logp, ref_logp, mb.response_mask, self.kl_coef,
                                   terms.tokens if self.kl_token_mean else terms.normalizer)
        total = pg + ent_term + kl_term
        replay = mb.replay_mask * mb.response_mask
        fresh = mb.response_mask - replay  # [R, L-1]
        h = ent.detach()
        metrics: dict[str, Tensor | float] = {
            **{k: v for k, v in pm.items() if k != "loss"}, "pg_loss": pm["loss"],
            "loss": total.detach(), "entropy_loss": ent_term.detach(), "kl_loss": kl_term.detach(),
            "entropy_fresh": (h * fresh).sum(), "entropy_replayed": (h * replay).sum(),
            "advantage_abs_mean": mb.advantages.abs().sum(), "rows": float(len(mb.rows))}
        return total, metrics

    def _entropy(self, ent: Tensor, mb: MicroBatch, terms: Terms) -> Tensor:
        """The entropy bonus: a token mean over the mini-batch, or (micro_batch) each row's tokens weighted by its
        micro-batch in the split that `entropy_split` reproduces (a dummy micro-batch: weight 0)."""
        if terms.entropy_weights is None:
            return L.entropy_bonus(ent, mb.response_mask, self.entropy_coef, terms.tokens)
        w = torch.tensor([terms.entropy_weights[id(r)] for r in mb.rows] or [0.0], dtype=torch.float32)  # [R]
        return L.entropy_bonus(ent, mb.response_mask * w.to(ent.device, non_blocking=True)[:, None],
                               self.entropy_coef, 1.0)


# ------------------------------------------------------------------------------------------------- setup

def _normalizer(loss: LossConfig, shape: TrainShape) -> Callable[[list[Row]], float]:
    """`learner.loss.loss_agg`: the policy loss's divisor of a mini-batch."""
    match loss.loss_agg:
        case "token_mean":
            return token_count
        case "seq_mean_token_mean":
            return rows_with_tokens
        case "constant":
            return partial(constant, divisor=loss.loss_constant, max_new_tokens=shape.max_new_tokens,
                           scale=loss.loss_world_size or 1)
    raise AssertionError(loss.loss_agg)  # resolved when the config loads


def _clip_schedule(loss: LossConfig) -> Callable[[TrainingBatch], bool]:
    """`learner.loss.clip_fresh`: always, never, or (auto) until the batch was composed in mixed mode."""
    if loss.clip_fresh == "auto":
        return lambda batch: not batch.mixed_mode
    return lambda batch, clip=bool(loss.clip_fresh): clip


def setup_objective(loss: LossConfig, shape: TrainShape, *, reference: Reference | None = None,
                    entropy_split: EntropySplit | None = None) -> Objective:
    """The objective of `learner.loss`, built once. `reference`: the KL reference's forward (kept only when
    kl_coef > 0); `entropy_split`: the micro-batch split entropy_agg=micro_batch weighs rows by (needed then)."""
    if shape.max_positions is None:
        raise ValueError("the objective needs the model's positions: TrainShape.with_model(model)")
    if loss.replay_eos and shape.eos_id is None:
        raise ValueError("learner.loss.replay_eos: the model names no EOS token (eos_token_id in its config.json "
                         "or generation_config.json); set learner.loss.replay_eos=false")
    split = None
    if loss.entropy_agg == "micro_batch":
        if entropy_split is None:
            raise ValueError("learner.loss.entropy_agg=micro_batch needs the learner's micro-batch split")
        gpus = loss.loss_world_size or shape.world
        split = lambda mini: entropy_split(mini, gpus)  # noqa: E731
    clips = (True, False) if loss.clip_fresh == "auto" else (bool(loss.clip_fresh),)
    return Objective(
        policy_losses={c: setup_policy_loss(loss, clip_fresh=c) for c in clips},
        clip_schedule=_clip_schedule(loss),
        normalizer=_normalizer(loss, shape),
        entropy_coef=loss.entropy_coef,
        entropy_split=split,
        kl_coef=loss.kl_coef,
        reference=reference if loss.kl_coef > 0 else None,
        kl_token_mean=loss.loss_agg == "seq_mean_token_mean",
        rows_of=partial(batch_rows, std_normalize=loss.std_normalize, max_positions=shape.max_positions,
                        overlong=loss.overlong, max_new_tokens=shape.max_new_tokens,
                        overlong_buffer=loss.overlong_buffer or max(1, shape.max_new_tokens // 5)),
        drop_truncated=loss.overlong == "mask",
        eos_id=shape.eos_id if loss.replay_eos else None,
        max_positions=shape.max_positions,
        needs_old_logprobs=loss.needs_old_logprobs,
        stores_learner_logprobs=loss.stores_learner_logprobs,
        metrics=METRICS,
    )
