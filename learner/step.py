"""One learner step on one rank: batch -> o* selection -> rows -> mini-batches -> micro-batches -> loss -> AdamW.

Every rank receives the whole `TrainingBatch` and derives the same o* (`learner.replay_choice`), rows, advantages,
mini-batch split and loss normalizer from it, so no collective is needed for bookkeeping. `TrainStep.run` returns
`RankStats` (sums, not means) so that the pool can merge ranks exactly with `merge_rank_stats`.

Details (mini- and micro-batches, loss scaling, train/inference mismatch, waiting for the device):
docs/internals.md#learnersteppy
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from common.config import LearnerConfig
from common.messages import TrainingBatch
from learner import loss as L
from learner.batching import (MicroBatch, Row, batch_rows, collate, entropy_weights, rank_micro_batches,
                              split_mini_batches)
from learner.compile_cache import RecompileWatch
from learner.forward import forward_stats
from learner.lora import adapters_disabled
from learner.policy_loss import LossBatch, PolicyLoss, setup_policy_loss
from learner.replay_choice import Scores, StepFeedback, complete_groups, reasoning_metrics, score_candidates


def append_eos(rows: list[Row], eos_id: int, max_positions: int) -> int:
    """learner.loss.replay_eos: each replayed row cut at the length limit (and not ending in EOS) gets `eos_id`
    appended, its stored log-prob NaN (the step fills it with the policy's own: weight 1), where the model has a
    position left. Returns how many rows changed."""
    n = 0
    for r in rows:
        if r.replayed and r.truncated and (not len(r.response_ids) or r.response_ids[-1] != eos_id) \
                and r.length < max_positions:
            r.response_ids = np.append(r.response_ids, np.asarray(eos_id, r.response_ids.dtype))
            r.behaviour_logprobs = np.append(r.behaviour_logprobs, np.float32("nan"))
            n += 1
    return n


SUM_KEYS = ("loss", "pg_loss", "fresh_loss", "replay_loss", "entropy_loss", "kl_loss", "clipped_tokens",
            "fresh_ratio_sum", "replay_weight_sum", "fresh_entropy_sum", "replay_entropy_sum", "fresh_tokens",
            "replay_tokens", "rows", "abs_adv_sum", "tis_weight_sum", "tis_truncated_tokens",
            "gap_abs_sum", "gap_tokens", "gap_ratio_sum", "gap_ratio_sq_sum", "gap_lag0_tokens",
            "icepop_masked_tokens", "mis_weight_sum", "mis_masked_tokens", "icepop_tokens", "mis_tokens",
            "forward_tokens", "row_tokens", "replay_clipped_tokens", "replay_clip_tokens")
MAX_KEYS = ("fresh_ratio_max", "replay_weight_max", "gap_abs_max")


@dataclass
class _Queued:
    """One micro-batch's values waiting on the device for the step's single transfer (`RankStats.finish`)."""

    names: list[str]  # the scalars at the front of `values`, in order
    values: list[Tensor]  # 0-d tensors (then, for a micro-batch with stored fresh rows, their entropy means [R])
    rows: list[Row] = field(default_factory=list)
    forward_tokens: int = 0
    gap: bool = False  # a `loss.logprob_gap` record, not a micro-batch's metrics


@dataclass
class RankStats:
    """What one rank saw in one step, as sums (merged exactly by `merge_rank_stats`).

    During the step nothing is read back from the device: `add_micro` and `add_gap` queue each micro-batch's
    values as device tensors, and `finish` (the end of `TrainStep.run`) moves them in one transfer and adds them
    up on the host, in float64 and in the order queued (the sums of a step that read every value at once)."""

    sums: dict[str, float] = field(default_factory=lambda: {k: 0.0 for k in SUM_KEYS})
    maxes: dict[str, float] = field(default_factory=lambda: {k: 0.0 for k in MAX_KEYS})
    grad_norms: list[float] = field(default_factory=list)  # identical on every rank (one per mini-batch)
    updates: int = 0
    skipped: int = 0
    mini_batches: int = 0
    feedback: StepFeedback = field(default_factory=StepFeedback)  # the same on every rank
    candidates_scored: int = 0
    selection_s: float = 0.0
    overlong_masked: int = 0  # truncated rows left out of the loss (learner.loss.overlong=mask)
    replay_eos_appended: int = 0  # truncated replayed rows given an EOS token (learner.loss.replay_eos)
    overlong_penalty_sum: float = 0.0  # sum of the overlong penalties over the batch's rows
    overlong_rows: int = 0
    padding_free: float = 0.0  # 1 when the micro-batches ran packed without padding (learner.levers.padding_free)
    clip_fresh: float = 1.0  # 1 when this step clipped fresh tokens' ratio (learner.loss.clip_fresh; auto: unmixed)
    fresh_keys: list[str] = field(default_factory=list)  # this rank's trained fresh rows the buffer stored
    fresh_entropies: list[float] = field(default_factory=list)  # their mean token entropy, from the training forward
    fresh_logprobs: list[np.ndarray] = field(default_factory=list)  # their start-of-step log-probs [T] (store_logprobs)
    store_logprobs: bool = False  # learner.loss.store_learner_logprobs
    seconds: float = 0.0
    recompiles: int = 0  # graphs torch.compile built during this step (0 after the setup's trial: learner.trial)
    peak_memory_bytes: int = 0  # the rank's peak so far: CUDA's max allocated, else the process's peak RSS (VmHWM)
    queued: list[_Queued] = field(default_factory=list, repr=False)  # empty once `finish` ran

    def add_micro(self, metrics: dict[str, Tensor], parts: dict[str, Tensor], ent: Tensor, mb: MicroBatch,
                  start_logp: Tensor | None = None) -> None:
        """Queue one micro-batch: `policy_loss.PolicyLoss`'s metrics and the loss parts (0-d), entropies [R, L-1];
        `start_logp` [R, L-1]: log-probs at the start of the step (first mini-batch) for `store_logprobs`."""
        replay = mb.replay_mask * mb.response_mask
        fresh = mb.response_mask - replay  # [R, L-1]
        names = [*metrics, *(f"part:{k}" for k in parts), "abs_adv_sum", "fresh_entropy_sum", "replay_entropy_sum"]
        values = [*metrics.values(), *parts.values(), mb.advantages.abs().sum(), (ent * fresh).sum(),
                  (ent * replay).sum()]
        if any(r.key and not r.replayed for r in mb.rows):  # stored fresh rows: their entropy is measured here
            values.append((ent * fresh).sum(-1) / fresh.sum(-1).clamp(min=1))  # [R]
            if self.store_logprobs and start_logp is not None:  # every response token, row by row
                values.append(start_logp.reshape(-1)[mb.response_index])  # [N]
        self.queued.append(_Queued(names, values, mb.rows, mb.forward_tokens))

    def add_gap(self, gap: dict[str, Tensor]) -> None:
        """Queue one micro-batch's `loss.logprob_gap` sums (first mini-batch only: before any update)."""
        self.queued.append(_Queued(list(gap), list(gap.values()), gap=True))

    def finish(self) -> None:
        """Read every queued value back in one transfer (the step's one wait for the device) and add them up."""
        if not self.queued:
            return
        flat = torch.cat([v.detach().reshape(-1) for q in self.queued for v in q.values]).tolist()
        i = 0
        for q in self.queued:
            n = sum(v.numel() for v in q.values)
            values, i = flat[i:i + n], i + n
            m = dict(zip(q.names, values))
            if q.gap:
                self._sum_gap(m)
            else:
                self._sum_micro(m, values[len(q.names):], q)
        self.queued = []

    def _sum_micro(self, m: dict[str, float], means: list[float], q: _Queued) -> None:
        nf, nr = m["fresh_tokens"], m["replay_tokens"]
        s = self.sums
        s["pg_loss"] += m["loss"]
        s["fresh_loss"] += m["fresh_loss"]
        s["replay_loss"] += m["replay_loss"]
        for k in ("loss", "entropy_loss", "kl_loss"):
            s[k] += m[f"part:{k}"]
        s["clipped_tokens"] += m["clip_frac"] * nf
        s["fresh_ratio_sum"] += m["fresh_ratio_mean"] * nf
        s["replay_weight_sum"] += m["replay_weight_mean"] * nr
        if "replay_clip_frac" in m:  # learner.loss.replay_loss=policy_loss
            s["replay_clipped_tokens"] += m["replay_clip_frac"] * nr
            s["replay_clip_tokens"] += nr
        s["fresh_tokens"] += nf
        s["replay_tokens"] += nr
        s["rows"] += len(q.rows)
        s["forward_tokens"] += q.forward_tokens
        s["row_tokens"] += sum(r.length for r in q.rows)
        s["abs_adv_sum"] += m["abs_adv_sum"] if q.rows else 0.0
        start = iter(np.asarray(means[len(q.rows):], dtype=np.float32)) if len(means) > len(q.rows) else None
        for r, h in zip(q.rows, means):
            lp = None if start is None else np.fromiter(start, np.float32, len(r.response_ids))  # [T]
            if r.key and not r.replayed:
                self.fresh_keys.append(r.key)
                self.fresh_entropies.append(h if r.eval_entropy is None else r.eval_entropy)
                if self.store_logprobs:  # first mini-batch: its own forward; later ones: record_old_logprobs
                    self.fresh_logprobs.append(lp if lp is not None else np.asarray(r.old_logprobs, np.float32))
        s["fresh_entropy_sum"] += m["fresh_entropy_sum"]
        s["replay_entropy_sum"] += m["replay_entropy_sum"]
        self.maxes["fresh_ratio_max"] = max(self.maxes["fresh_ratio_max"], m["fresh_ratio_max"])
        self.maxes["replay_weight_max"] = max(self.maxes["replay_weight_max"], m["replay_weight_max"])
        if "icepop_masked_frac" in m:
            s["icepop_masked_tokens"] += m["icepop_masked_frac"] * nf
            s["icepop_tokens"] += nf
        if "mis_weight_mean" in m:
            s["mis_weight_sum"] += m["mis_weight_mean"] * nf
            s["mis_masked_tokens"] += m["mis_masked_frac"] * nf
            s["mis_tokens"] += nf
        if "tis_weight_mean" in m:
            s["tis_weight_sum"] += m["tis_weight_mean"] * nf
            s["tis_truncated_tokens"] += m["tis_truncated_frac"] * nf

    def _sum_gap(self, gap: dict[str, float]) -> None:
        for k in ("abs_sum", "tokens", "ratio_sum", "ratio_sq_sum", "lag0_tokens"):
            self.sums["gap_" + k] += gap[k]
        self.maxes["gap_abs_max"] = max(self.maxes["gap_abs_max"], gap["abs_max"])


def merge_rank_stats(stats: list[RankStats]) -> tuple[dict[str, float], StepFeedback]:
    """Metrics of a step from every rank's sums, plus the step's feedback (the same on every rank)."""
    s = {k: sum(st.sums[k] for st in stats) for k in SUM_KEYS}
    mx = {k: max(st.maxes[k] for st in stats) for k in MAX_KEYS}
    lead = stats[0]
    n_mini = max(lead.mini_batches, 1)
    nan = float("nan")
    tokens = s["fresh_tokens"] + s["replay_tokens"]
    seconds = max(st.seconds for st in stats)
    applied_norms = lead.grad_norms
    metrics = {
        "learner/loss": s["loss"] / n_mini,
        "learner/pg_loss": s["pg_loss"] / n_mini,
        "learner/fresh_loss": s["fresh_loss"] / n_mini,
        "learner/replay_loss": s["replay_loss"] / n_mini,
        "learner/entropy_loss": s["entropy_loss"] / n_mini,
        "learner/kl_loss": s["kl_loss"] / n_mini,
        "learner/clip_frac": s["clipped_tokens"] / s["fresh_tokens"] if s["fresh_tokens"] else nan,
        "learner/fresh_ratio_mean": s["fresh_ratio_sum"] / s["fresh_tokens"] if s["fresh_tokens"] else nan,
        "learner/fresh_ratio_max": mx["fresh_ratio_max"] if s["fresh_tokens"] else nan,
        "learner/replay_weight_mean": s["replay_weight_sum"] / s["replay_tokens"] if s["replay_tokens"] else nan,
        "learner/replay_weight_max": mx["replay_weight_max"] if s["replay_tokens"] else nan,
        "learner/entropy_fresh": s["fresh_entropy_sum"] / s["fresh_tokens"] if s["fresh_tokens"] else nan,
        "learner/entropy_replayed": s["replay_entropy_sum"] / s["replay_tokens"] if s["replay_tokens"] else nan,
        "learner/advantage_abs_mean": s["abs_adv_sum"] / s["rows"] if s["rows"] else nan,
        "learner/grad_norm": float(np.mean(applied_norms)) if applied_norms else nan,
        "learner/grad_norm_max": float(np.max(applied_norms)) if applied_norms else nan,
        "learner/tokens": tokens,
        "learner/fresh_tokens": s["fresh_tokens"],
        "learner/replay_tokens": s["replay_tokens"],
        "learner/rows": s["rows"],
        "learner/mini_batches": float(lead.mini_batches),
        "learner/updates": float(lead.updates),
        "learner/skipped_updates": float(lead.skipped),
        "learner/step_time_s": seconds,
        "learner/recompiles": float(max(st.recompiles for st in stats)),
        "learner/peak_memory_gib": max(st.peak_memory_bytes for st in stats) / 2**30,
        "learner/tokens_per_s": tokens / seconds if seconds > 0 else nan,
        "learner/candidates_scored": float(lead.candidates_scored),
        "learner/selection_s": max(st.selection_s for st in stats),
        "learner/overlong_masked": float(lead.overlong_masked),
        "learner/replay_eos_appended": float(lead.replay_eos_appended),
        "learner/clip_fresh": lead.clip_fresh,
        "learner/padding_free": lead.padding_free,
        "learner/padding_frac": 1.0 - s["row_tokens"] / s["forward_tokens"] if s["forward_tokens"] else nan,
        "learner/overlong_penalty_mean": lead.overlong_penalty_sum / lead.overlong_rows if lead.overlong_rows else 0.0,
        **_mismatch_metrics(s, mx),
    }
    metrics.update(reasoning_metrics(lead.feedback))
    # the scored candidates (the same on every rank) and each rank's trained fresh rows that the buffer stored
    fb = StepFeedback(keys=lead.feedback.keys, entropies=lead.feedback.entropies, chosen=lead.feedback.chosen,
                      fresh_keys=[k for st in stats for k in st.fresh_keys],
                      fresh_entropies=[h for st in stats for h in st.fresh_entropies],
                      fresh_logprobs=[lp for st in stats for lp in st.fresh_logprobs])
    return metrics, fb


def _mismatch_metrics(s: dict[str, float], mx: dict[str, float]) -> dict[str, float]:
    """Train/inference mismatch on the fresh tokens of the step's first mini-batch (weights not yet
    updated): |logp_learner - logp_behaviour| mean and max over all of them; the spread (population
    std) of exp(logp_learner - logp_behaviour) over those sampled by these very weights (lag 0),
    which is 0 without numerical mismatch. TIS weight statistics over all fresh tokens (NaN without TIS)."""
    nan = float("nan")
    n, n0 = s["gap_tokens"], s["gap_lag0_tokens"]
    var = s["gap_ratio_sq_sum"] / n0 - (s["gap_ratio_sum"] / n0) ** 2 if n0 else nan
    has_tis = s["tis_weight_sum"] > 0 and s["fresh_tokens"] > 0
    return {
        "learner/logprob_diff_mean": s["gap_abs_sum"] / n if n else nan,
        "learner/logprob_diff_max": mx["gap_abs_max"] if n else nan,
        "learner/logprob_ratio_std_lag0": math.sqrt(max(var, 0.0)) if n0 else nan,
        "learner/lag0_tokens": n0,
        "learner/tis_weight_mean": s["tis_weight_sum"] / s["fresh_tokens"] if has_tis else nan,
        "learner/tis_truncated_frac": s["tis_truncated_tokens"] / s["fresh_tokens"] if has_tis else nan,
        "learner/icepop_masked_frac": s["icepop_masked_tokens"] / s["icepop_tokens"] if s["icepop_tokens"] else nan,
        "learner/mis_weight_mean": s["mis_weight_sum"] / s["mis_tokens"] if s["mis_tokens"] else nan,
        "learner/mis_masked_frac": s["mis_masked_tokens"] / s["mis_tokens"] if s["mis_tokens"] else nan,
        # replayed tokens whose policy loss clipped or gated them (learner.loss.replay_loss=policy_loss; NaN under
        # shaping)
        "learner/replay_clip_frac": (s["replay_clipped_tokens"] / s["replay_clip_tokens"] if s["replay_clip_tokens"]
                                     else nan),
    }


class TrainStep:
    """The training step of one rank: owns nothing but references to the model and optimizer.

    `model` is the (FSDP-sharded) causal LM, `ref_model` an optional frozen reference for the KL term (under
    LoRA none: the reference is `model` with its adapters disabled, see `reference_logprobs`).
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, cfg: LearnerConfig, *,
                 rank: int, world: int, device: torch.device, pad_id: int, max_positions: int,
                 max_new_tokens: int, ref_model: torch.nn.Module | None = None, eos_id: int | None = None):
        self.model, self.optimizer, self.cfg = model, optimizer, cfg
        self.rank, self.world, self.device = rank, world, device
        self.pad_id, self.max_positions, self.max_new_tokens = pad_id, max_positions, max_new_tokens
        self.eos_id = eos_id  # learner.loss.replay_eos
        if cfg.loss.replay_eos and eos_id is None:
            raise ValueError("learner.loss.replay_eos: the model names no EOS token (eos_token_id in its config.json "
                             "or generation_config.json); set learner.loss.replay_eos=false")
        self.ref_model = ref_model
        # the policy loss, built once: clipped, and unclipped where learner.loss.clip_fresh may turn the clip off
        clips = (True, False) if cfg.loss.clip_fresh == "auto" else (cfg.loss.clip_fresh,)
        self.policy_losses: dict[bool, PolicyLoss] = {c: setup_policy_loss(cfg.loss, clip_fresh=c) for c in clips}

    def run(self, batch: TrainingBatch) -> RankStats:
        t0 = time.perf_counter()
        watch = RecompileWatch()
        cfg = self.cfg
        stats = RankStats(padding_free=float(cfg.levers.packs_padding_free),
                          store_logprobs=cfg.loss.stores_learner_logprobs)
        entropies, scores = self.score_candidates(batch, stats)
        batch, stats.feedback = complete_groups(batch, scores, entropies)
        rows = batch_rows(batch, std_normalize=cfg.loss.std_normalize, max_positions=self.max_positions,
                          overlong=cfg.loss.overlong, max_new_tokens=self.max_new_tokens,
                          overlong_buffer=cfg.loss.overlong_buffer or max(1, self.max_new_tokens // 5))
        if cfg.loss.replay_eos:
            stats.replay_eos_appended = append_eos(rows, self.eos_id, self.max_positions)
        stats.overlong_penalty_sum = sum(r.penalty for r in rows)
        stats.overlong_rows = len(rows)
        if cfg.loss.overlong == "mask":  # after the advantages: a truncated row still counts in its group's mean
            stats.overlong_masked = sum(r.truncated for r in rows)
            rows = [r for r in rows if not r.truncated]
        minis = split_mini_batches(rows, cfg.batching.mini_batches, seed=cfg.seed * 1_000_003 + batch.version)
        if self._eval_stored:  # LoRA dropout: what the buffer stores comes from the eval-mode forward
            self.record_old_logprobs(minis, entropies=True)
        elif cfg.loss.needs_old_logprobs:
            self.record_old_logprobs(minis[1:])  # the first mini-batch's forward is itself at the start weights
        # clip_fresh auto: clipped until the buffer's mixed mode starts (the authors' schedule)
        clip = (not batch.mixed_mode) if cfg.loss.clip_fresh == "auto" else cfg.loss.clip_fresh
        stats.clip_fresh = float(clip)
        self.model.train()
        for i, mini in enumerate(minis):
            stats.mini_batches += 1
            normalizer = self._normalizer(mini)
            if normalizer == 0:  # no response tokens at all: nothing to learn from this mini-batch
                stats.skipped += 1
                continue
            tokens = float(sum(len(r.response_ids) for r in mini))
            weights = self._entropy_weights(mini)
            for chunk in self._micro_batches(mini):
                self._micro_step(self._collate(chunk), normalizer, stats, first=i == 0,
                                 clip=clip, tokens=tokens, ent_weights=weights)
            self._optimizer_step(stats)
        stats.finish()  # the step's metrics in one transfer, after the last update was queued
        stats.recompiles = watch.done(f"the step of policy version {batch.version}", self.rank)
        stats.seconds = time.perf_counter() - t0
        return stats

    def score_candidates(self, batch: TrainingBatch, stats: RankStats) -> tuple[Scores, Scores]:
        """`replay_choice.score_candidates` under this rank's weights and micro-batching; `stats` counts it."""
        t0 = time.perf_counter()
        entropies, scores = score_candidates(self.model, batch, self._micro_batches, self._collate,
                                             device=self.device, world=self.world, max_positions=self.max_positions,
                                             max_new_tokens=self.max_new_tokens, pad_id=self.pad_id)
        if entropies:
            stats.candidates_scored = len(entropies)
            stats.selection_s = time.perf_counter() - t0
        return entropies, scores

    @property
    def _eval_stored(self) -> bool:
        """Whether the log-probs and entropies the buffer stores come from `record_old_logprobs`'s eval-mode forward
        rather than the training forward: with LoRA dropout, which that forward applies."""
        return self.cfg.lora is not None and self.cfg.lora.dropout > 0

    @torch.no_grad()
    def record_old_logprobs(self, minis: list[list[Row]], entropies: bool = False) -> None:
        """Set `Row.old_logprobs` of this rank's rows of `minis` under the current weights (for TIS), and with
        `entropies` `Row.eval_entropy` (the mean over the response). Eval mode: no dropout.
        Collective (FSDP forwards): the same micro-batches as training, so every rank runs as many."""
        self.model.eval()
        done: list[tuple[list[Row], Tensor]] = []
        for mini in minis:
            for chunk in self._micro_batches(mini):
                mb = self._collate(chunk)
                lp, h, _ = forward_stats(self.model, mb)  # [R, L-1]
                if chunk:
                    done.append((chunk, lp))
                    if entropies:
                        for r, x in zip(chunk, L.row_mean(h, mb.response_mask).nan_to_num(nan=0.0).tolist()):
                            r.eval_entropy = x
        if not done:
            return
        flat = torch.cat([lp.reshape(-1) for _, lp in done]).cpu().numpy()  # one transfer for all of them
        o = 0
        for chunk, lp in done:
            lp_host = flat[o:o + lp.numel()].reshape(lp.shape)  # [R, L-1]
            o += lp.numel()
            for i, r in enumerate(chunk):
                p, t = len(r.prompt_ids), len(r.response_ids)
                r.old_logprobs = lp_host[i, p - 1:p - 1 + t].copy()  # [T]

    def _micro_batches(self, rows: list[Row]) -> list[list[Row]]:
        bt = self.cfg.batching
        return rank_micro_batches(rows, self.rank, self.world, bt.micro_batch_rows, bt.micro_batch_tokens,
                                  self.cfg.levers.packs_padding_free, bt.micro_batch_split)

    def _collate(self, rows: list[Row]) -> MicroBatch:
        return collate(rows, self.pad_id, self.device, packed=self.cfg.levers.packs_padding_free and bool(rows))

    def _entropy_weights(self, mini: list[Row]) -> dict[int, float] | None:
        """entropy_agg=micro_batch: each row's entropy weight (by id), from the mini-batch split over
        loss_world_size GPUs as the authors' run splits it (else over our ranks, as we split it)."""
        if self.cfg.loss.entropy_agg != "micro_batch":
            return None
        cfg = self.cfg
        bt = cfg.batching
        w = entropy_weights(mini, cfg.loss.loss_world_size or self.world, bt.micro_batch_rows, bt.micro_batch_tokens,
                            cfg.levers.packs_padding_free, bt.micro_batch_split)
        return {id(r): x for r, x in zip(mini, w)}

    def _normalizer(self, mini: list[Row]) -> float:
        tokens = sum(len(r.response_ids) for r in mini)
        if tokens == 0:
            return 0.0
        loss = self.cfg.loss
        if loss.loss_agg == "seq_mean_token_mean":  # rows with a response token: each row's token mean counts once
            return float(sum(1 for r in mini if len(r.response_ids)))
        if loss.loss_agg == "constant":
            return float(loss.loss_constant or len(mini) * self.max_new_tokens) * (loss.loss_world_size or 1)
        return float(tokens)

    def _micro_step(self, mb: MicroBatch, normalizer: float, stats: RankStats, first: bool = False,
                    clip: bool = True, tokens: float | None = None,
                    ent_weights: dict[int, float] | None = None) -> None:
        """Forward, loss, backward of one micro-batch. `first`: part of the step's first mini-batch (no
        update yet), where the fresh tokens' train/inference gap is measured, and where the forward itself
        gives TIS its start-of-step log-probs (later mini-batches use `record_old_logprobs`). `clip`: clip
        fresh tokens' ratio. `tokens`: response tokens of the whole mini-batch, the entropy bonus's divisor (a
        masked token mean under either loss_agg; None: `normalizer`). `ent_weights` (`learner.loss.entropy_agg=
        micro_batch`): each row's weight by id (`batching.entropy_weights`): each micro-batch's (as the authors' run
        splits it) masked token mean / loss_world_size, summed over the rows of every rank, whichever micro-batch
        computes them."""
        cfg = self.cfg
        ref_logp = self.reference_logprobs(mb)  # before the policy's forward: a no-grad forward of its own
        logp, ent, anchor = forward_stats(self.model, mb)  # [R, L-1] each
        if cfg.loss.replay_eos:  # an appended EOS has no stored log-prob (NaN): its weight is 1, the policy's own
            mb.behaviour_logprobs = torch.where(torch.isnan(mb.behaviour_logprobs), logp.detach(),
                                                mb.behaviour_logprobs)
        fresh = mb.response_mask * (1.0 - mb.replay_mask)  # [R, L-1]
        if first:
            stats.add_gap(L.logprob_gap(logp, mb.behaviour_logprobs, fresh, mb.lag0_mask))
        old = None
        if cfg.loss.needs_old_logprobs:
            old = mb.old_logprobs if (mb.rows and not first) else logp.detach()
            if old is None:
                raise RuntimeError("learner.loss.recompute_old_logprobs/tis_cap/icepop_band/mis: a later mini-batch "
                                   "has no start-of-step log-probs (record_old_logprobs must run before the first "
                                   "update)")
        pg, metrics = self.policy_losses[clip](
            logp, LossBatch(mb.behaviour_logprobs, mb.advantages, mb.response_mask, mb.replay_mask, old), normalizer)
        if ent_weights is not None:  # each row's tokens weighted by its micro-batch in the authors' run (a dummy: 0)
            w = torch.tensor([ent_weights[id(r)] for r in mb.rows] or [0.0], dtype=torch.float32)  # [R]
            ent_term = L.entropy_bonus(ent, mb.response_mask * w.to(self.device, non_blocking=True)[:, None],
                                       cfg.loss.entropy_coef, 1.0)
        else:
            ent_term = L.entropy_bonus(ent, mb.response_mask, cfg.loss.entropy_coef, tokens if tokens else normalizer)
        kl_term = torch.zeros((), device=self.device)
        if ref_logp is not None:  # a token mean under seq_mean_token_mean (whose normalizer counts rows)
            kl_term = L.kl_penalty(logp, ref_logp, mb.response_mask, cfg.loss.kl_coef,
                                   tokens if cfg.loss.loss_agg == "seq_mean_token_mean" else normalizer)
        total = pg + ent_term + kl_term
        # 0 * anchor keeps every parameter in the graph: a rank whose micro-batch is an all-masked dummy
        # (fewer rows than ranks) still runs the backward that FSDP's gradient collectives wait for.
        ((total + 0.0 * anchor) * self.world).backward()
        parts = {"loss": total.detach(), "entropy_loss": ent_term.detach(), "kl_loss": kl_term.detach()}
        stats.add_micro(metrics, parts, ent.detach(), mb,
                        start_logp=logp.detach() if first and not self._eval_stored else None)

    @torch.no_grad()
    def reference_logprobs(self, mb: MicroBatch) -> Tensor | None:
        """The KL reference's log-probs [R, L-1] of `mb` (None: no KL term, or a dummy micro-batch).

        `ref_model` when one was given (a separate frozen copy); under LoRA (`learner.lora`) the reference is the
        trained model itself with its adapters disabled (`learner.lora.adapters_disabled`): its frozen base. That
        forward is collective under FSDP, so a rank's dummy micro-batch runs it too. It runs before the policy's
        forward, so FSDP2 sees whole forwards in order and activation checkpointing's recomputation in the
        backward runs with the adapters on."""
        if self.cfg.loss.kl_coef <= 0:
            return None
        if self.ref_model is not None:
            return forward_stats(self.ref_model, mb)[0] if mb.rows else None
        if self.cfg.lora is None:
            return None
        with adapters_disabled(self.model):
            logp, _, _ = forward_stats(self.model, mb)
        return logp if mb.rows else None

    def _optimizer_step(self, stats: RankStats) -> None:
        """Clip and apply the accumulated gradient, or skip it (non-finite or above `skip_grad_norm`). Reading the
        norm to decide is the step's one wait for the device per mini-batch (not per micro-batch): a skipped
        update must not touch AdamW's moments or step count, which a device-side mask could not promise."""
        params = [p for p in self.model.parameters() if p.grad is not None]
        norm = torch.nn.utils.get_total_norm([p.grad for p in params])
        norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
        stats.grad_norms.append(norm)
        if not math.isfinite(norm) or norm > self.cfg.optim.skip_grad_norm:
            stats.skipped += 1
        else:
            coef = min(1.0, self.cfg.optim.grad_clip / (norm + 1e-6))
            if coef < 1.0:
                torch._foreach_mul_([p.grad for p in params], coef)  # one launch per group, not per tensor
            self.optimizer.step()
            stats.updates += 1
        self.optimizer.zero_grad(set_to_none=True)
