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
from learner.batching import (MicroBatch, MicroBatching, Row, collate, entropy_weights, rank_micro_batches,
                              split_mini_batches)
from learner.compile_cache import RecompileWatch
from learner.forward import forward_stats
from learner.lora import adapters_disabled
from learner.objective import METRICS, Objective, Reduce, Terms, setup_objective
from learner.replay_choice import Scores, StepFeedback, complete_groups, reasoning_metrics, score_candidates
from learner.shape import TrainShape


STEP_SUMS = ("forward_tokens", "row_tokens", "gap_abs_sum", "gap_tokens", "gap_ratio_sum", "gap_ratio_sq_sum",
             "gap_lag0_tokens")
"""The step's own sums besides the objective's metrics: forward positions (padding included) and rows' tokens, and
the train/inference gap of the first mini-batch's fresh tokens (`L.logprob_gap`)."""


@dataclass
class _Queued:
    """One micro-batch's values waiting on the device for the step's single transfer (`RankStats.finish`)."""

    names: list[str]  # the scalars at the front of `values`, in order
    values: list[Tensor]  # 0-d tensors (then, for a micro-batch with stored fresh rows, their entropy means [R])
    host: dict[str, float] = field(default_factory=dict)  # metrics known on the host
    rows: list[Row] = field(default_factory=list)
    forward_tokens: int = 0
    gap: bool = False  # a `logprob_gap` record, not a micro-batch's metrics


@dataclass
class RankStats:
    """What one rank saw in one step, as sums (merged exactly by `merge_rank_stats`).

    The objective's metrics reduce as `reductions` (its `Objective.metrics`) declares: `sums[k]` holds the sum of
    a `sum`/`per_update`/`total` metric, and of value x count of a `mean` one, `counts[k]` the count a `mean`,
    `total` or `max` metric divides by (summed over the micro-batches that emitted it), `maxes[k]` the largest, and
    `step_metrics[k]` a `step` one. During the step nothing is read back from the device: `add_micro` and `add_gap`
    queue each micro-batch's values as device tensors, and `finish` (the end of `TrainStep.run`) moves them in one
    transfer and adds them up on the host, in float64 and in the order queued."""

    reductions: dict[str, Reduce] = field(default_factory=lambda: METRICS)
    sums: dict[str, float] = field(default_factory=dict)
    counts: dict[str, float] = field(default_factory=dict)
    maxes: dict[str, float] = field(default_factory=dict)
    step_metrics: dict[str, float] = field(default_factory=dict)
    grad_norms: list[float] = field(default_factory=list)  # identical on every rank (one per mini-batch)
    updates: int = 0
    skipped: int = 0
    mini_batches: int = 0
    feedback: StepFeedback = field(default_factory=StepFeedback)  # the same on every rank
    candidates_scored: int = 0
    selection_s: float = 0.0
    padding_free: float = 0.0  # 1 when the micro-batches ran packed without padding (learner.levers.padding_free)
    fresh_keys: list[str] = field(default_factory=list)  # this rank's trained fresh rows the buffer stored
    fresh_entropies: list[float] = field(default_factory=list)  # their mean token entropy, from the training forward
    fresh_logprobs: list[np.ndarray] = field(default_factory=list)  # their start-of-step log-probs [T] (store_logprobs)
    store_logprobs: bool = False  # the objective stores the learner's start-of-step log-probs
    seconds: float = 0.0
    recompiles: int = 0  # graphs torch.compile built during this step (0 after the setup's trial: learner.trial)
    peak_memory_bytes: int = 0  # the rank's peak so far: CUDA's max allocated, else the process's peak RSS (VmHWM)
    queued: list[_Queued] = field(default_factory=list, repr=False)  # empty once `finish` ran

    def __post_init__(self) -> None:
        for k, r in self.reductions.items():
            if r.how in ("sum", "per_update", "mean", "total"):
                self.sums.setdefault(k, 0.0)
            if r.how in ("mean", "total", "max"):
                self.counts.setdefault(k, 0.0)
            if r.how == "max":
                self.maxes.setdefault(k, 0.0)
        for k in STEP_SUMS:
            self.sums.setdefault(k, 0.0)
        self.maxes.setdefault("gap_abs_max", 0.0)

    def add_micro(self, metrics: dict[str, Tensor | float], ent: Tensor, mb: MicroBatch,
                  start_logp: Tensor | None = None) -> None:
        """Queue one micro-batch: the objective's metrics (0-d tensors or host floats), entropies [R, L-1];
        `start_logp` [R, L-1]: log-probs at the start of the step (first mini-batch) for `store_logprobs`."""
        names = [k for k, v in metrics.items() if isinstance(v, Tensor)]
        values = [metrics[k] for k in names]
        if any(r.key and not r.replayed for r in mb.rows):  # stored fresh rows: their entropy is measured here
            fresh = mb.response_mask - mb.replay_mask * mb.response_mask  # [R, L-1]
            values.append((ent * fresh).sum(-1) / fresh.sum(-1).clamp(min=1))  # [R]
            if self.store_logprobs and start_logp is not None:  # every response token, row by row
                values.append(start_logp.reshape(-1)[mb.response_index])  # [N]
        host = {k: float(v) for k, v in metrics.items() if not isinstance(v, Tensor)}
        self.queued.append(_Queued(names, values, host, mb.rows, mb.forward_tokens))

    def add_gap(self, gap: dict[str, Tensor]) -> None:
        """Queue one micro-batch's `L.logprob_gap` sums (first mini-batch only: before any update)."""
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
                self._sum_micro({**m, **q.host}, values[len(q.names):], q)
        self.queued = []

    def _sum_micro(self, m: dict[str, float], means: list[float], q: _Queued) -> None:
        for k, r in self.reductions.items():
            if k not in m:
                continue
            if r.how == "mean":
                self.sums[k] += m[k] * m[r.over]
            elif r.how in ("sum", "per_update", "total"):
                self.sums[k] += m[k]
            elif r.how == "max":
                self.maxes[k] = max(self.maxes[k], m[k])
            if r.over is not None:
                self.counts[k] += m[r.over]
        self.sums["forward_tokens"] += q.forward_tokens
        self.sums["row_tokens"] += sum(r.length for r in q.rows)
        start = iter(np.asarray(means[len(q.rows):], dtype=np.float32)) if len(means) > len(q.rows) else None
        for r, h in zip(q.rows, means):
            lp = None if start is None else np.fromiter(start, np.float32, len(r.response_ids))  # [T]
            if r.key and not r.replayed:
                self.fresh_keys.append(r.key)
                self.fresh_entropies.append(h if r.eval_entropy is None else r.eval_entropy)
                if self.store_logprobs:  # first mini-batch: its own forward; later ones: record_old_logprobs
                    self.fresh_logprobs.append(lp if lp is not None else np.asarray(r.old_logprobs, np.float32))

    def _sum_gap(self, gap: dict[str, float]) -> None:
        for k in ("abs_sum", "tokens", "ratio_sum", "ratio_sq_sum", "lag0_tokens"):
            self.sums["gap_" + k] += gap[k]
        self.maxes["gap_abs_max"] = max(self.maxes["gap_abs_max"], gap["abs_max"])


def _reduced(how: Reduce, total: float, count: float, largest: float, n_mini: int) -> float:
    """One objective metric of the whole step from its rank-summed `total`, `count` and `largest`."""
    nan = float("nan")
    match how.how:
        case "sum":
            return total
        case "per_update":
            return total / n_mini
        case "mean" | "total":
            return total / count if count else nan
        case "max":
            return largest if count else nan
    raise AssertionError(how)


def merge_rank_stats(stats: list[RankStats]) -> tuple[dict[str, float], StepFeedback]:
    """Metrics of a step from every rank's sums, plus the step's feedback (the same on every rank)."""
    lead = stats[0]
    s = {k: sum(st.sums[k] for st in stats) for k in lead.sums}
    c = {k: sum(st.counts[k] for st in stats) for k in lead.counts}
    mx = {k: max(st.maxes[k] for st in stats) for k in lead.maxes}
    n_mini = max(lead.mini_batches, 1)
    nan = float("nan")
    seconds = max(st.seconds for st in stats)
    applied_norms = lead.grad_norms
    metrics = {f"learner/{k}": (lead.step_metrics.get(k, nan) if r.how == "step"
                                else _reduced(r, s.get(k, 0.0), c.get(k, 0.0), mx.get(k, 0.0), n_mini))
               for k, r in lead.reductions.items()}
    tokens = metrics.get("learner/fresh_tokens", 0.0) + metrics.get("learner/replay_tokens", 0.0)
    metrics.update({
        "learner/grad_norm": float(np.mean(applied_norms)) if applied_norms else nan,
        "learner/grad_norm_max": float(np.max(applied_norms)) if applied_norms else nan,
        "learner/tokens": tokens,
        "learner/mini_batches": float(lead.mini_batches),
        "learner/updates": float(lead.updates),
        "learner/skipped_updates": float(lead.skipped),
        "learner/step_time_s": seconds,
        "learner/recompiles": float(max(st.recompiles for st in stats)),
        "learner/peak_memory_gib": max(st.peak_memory_bytes for st in stats) / 2**30,
        "learner/tokens_per_s": tokens / seconds if seconds > 0 else nan,
        "learner/candidates_scored": float(lead.candidates_scored),
        "learner/selection_s": max(st.selection_s for st in stats),
        "learner/padding_free": lead.padding_free,
        "learner/padding_frac": 1.0 - s["row_tokens"] / s["forward_tokens"] if s["forward_tokens"] else nan,
        **_gap_metrics(s, mx),
    })
    metrics.update(reasoning_metrics(lead.feedback))
    # the scored candidates (the same on every rank) and each rank's trained fresh rows that the buffer stored
    fb = StepFeedback(keys=lead.feedback.keys, entropies=lead.feedback.entropies, chosen=lead.feedback.chosen,
                      fresh_keys=[k for st in stats for k in st.fresh_keys],
                      fresh_entropies=[h for st in stats for h in st.fresh_entropies],
                      fresh_logprobs=[lp for st in stats for lp in st.fresh_logprobs])
    return metrics, fb


def _gap_metrics(s: dict[str, float], mx: dict[str, float]) -> dict[str, float]:
    """Train/inference mismatch on the fresh tokens of the step's first mini-batch (weights not yet
    updated): |logp_learner - logp_behaviour| mean and max over all of them; the spread (population
    std) of exp(logp_learner - logp_behaviour) over those sampled by these very weights (lag 0),
    which is 0 without numerical mismatch."""
    nan = float("nan")
    n, n0 = s["gap_tokens"], s["gap_lag0_tokens"]
    var = s["gap_ratio_sq_sum"] / n0 - (s["gap_ratio_sum"] / n0) ** 2 if n0 else nan
    return {
        "learner/logprob_diff_mean": s["gap_abs_sum"] / n if n else nan,
        "learner/logprob_diff_max": mx["gap_abs_max"] if n else nan,
        "learner/logprob_ratio_std_lag0": math.sqrt(max(var, 0.0)) if n0 else nan,
        "learner/lag0_tokens": n0,
    }


class TrainStep:
    """The training step of one rank: owns nothing but references to the model and optimizer, and the objective
    (`learner.objective`, built once from the config's loss section), whose options it never reads.

    `model` is the (FSDP-sharded) causal LM, `ref_model` an optional frozen reference for the KL term (under
    LoRA none: the reference is `model` with its adapters disabled, see `reference_logprobs`). `shape`: the run's
    lengths, rank count and the model's tokens (`TrainShape.with_model`).
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, cfg: LearnerConfig,
                 shape: TrainShape, *, rank: int, device: torch.device, ref_model: torch.nn.Module | None = None):
        self.model, self.optimizer, self.cfg, self.shape = model, optimizer, cfg, shape
        self.rank, self.world, self.device = rank, shape.world, device
        self.ref_model = ref_model
        self.objective: Objective = setup_objective(cfg.loss, shape, reference=self._reference_forward,
                                                    entropy_split=self._entropy_split)

    def run(self, batch: TrainingBatch) -> RankStats:
        t0 = time.perf_counter()
        watch = RecompileWatch()
        objective = self.objective
        stats = RankStats(objective.metrics, padding_free=float(self.cfg.levers.packs_padding_free),
                          store_logprobs=objective.stores_learner_logprobs)
        entropies, scores = self.score_candidates(batch, stats)
        batch, stats.feedback = complete_groups(batch, scores, entropies)
        rows, stats.step_metrics = objective.rows(batch)
        minis = split_mini_batches(rows, self.cfg.batching.mini_batches, seed=self.cfg.seed * 1_000_003 + batch.version)
        if self._eval_stored:  # LoRA dropout: what the buffer stores comes from the eval-mode forward
            self.record_old_logprobs(minis, entropies=True)
        elif objective.needs_old_logprobs:
            self.record_old_logprobs(minis[1:])  # the first mini-batch's forward is itself at the start weights
        clip = objective.clips(batch)
        stats.step_metrics["clip_fresh"] = float(clip)
        self.model.train()
        for i, mini in enumerate(minis):
            stats.mini_batches += 1
            terms = objective.mini_batch(mini, clip=clip, first=i == 0)
            if terms is None:  # no response tokens at all: nothing to learn from this mini-batch
                stats.skipped += 1
                continue
            for chunk in self.micro_batches(mini):
                self._micro_step(self.collate(chunk), terms, stats)
            self._optimizer_step(stats)
        stats.finish()  # the step's metrics in one transfer, after the last update was queued
        stats.recompiles = watch.done(f"the step of policy version {batch.version}", self.rank)
        stats.seconds = time.perf_counter() - t0
        return stats

    def score_candidates(self, batch: TrainingBatch, stats: RankStats) -> tuple[Scores, Scores]:
        """`replay_choice.score_candidates` under this rank's weights and micro-batching; `stats` counts it."""
        t0 = time.perf_counter()
        entropies, scores = score_candidates(self.model, batch, self, self.shape)
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
            for chunk in self.micro_batches(mini):
                mb = self.collate(chunk)
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

    def micro_batches(self, rows: list[Row]) -> list[list[Row]]:
        """This rank's micro-batches of `rows` under the step's micro-batching (read per call: the setup's lever
        trial may change it); equally many on every rank."""
        return rank_micro_batches(rows, self.rank, self.world, MicroBatching.of(self.cfg))

    def collate(self, rows: list[Row]) -> MicroBatch:
        """The tensors of one micro-batch on this rank's device (packed where the micro-batches run padding-free)."""
        return collate(rows, self.shape.pad_id, self.device,
                       packed=self.cfg.levers.packs_padding_free and bool(rows))

    def _entropy_split(self, mini: list[Row], gpus: int) -> list[float]:
        """The objective's entropy_agg=micro_batch handle: each row's weight when the mini-batch is split over `gpus`
        GPUs under this step's batching (read per call: the setup's lever trial may change it)."""
        return entropy_weights(mini, gpus, MicroBatching.of(self.cfg))

    def _micro_step(self, mb: MicroBatch, terms: Terms, stats: RankStats) -> None:
        """Forward, objective, backward of one micro-batch. In the step's first mini-batch (`terms.first`: no
        update yet) the fresh tokens' train/inference gap is measured, and its forward is itself at the
        start-of-step weights."""
        ref_logp = self.objective.reference_logprobs(mb)  # before the policy's forward: a no-grad forward of its own
        logp, ent, anchor = forward_stats(self.model, mb)  # [R, L-1] each
        if terms.first:
            fresh = mb.response_mask * (1.0 - mb.replay_mask)  # [R, L-1]
            stats.add_gap(L.logprob_gap(logp, mb.behaviour_logprobs, fresh, mb.lag0_mask))
        total, metrics = self.objective(logp, ent, mb, terms, ref_logp)
        # 0 * anchor keeps every parameter in the graph: a rank whose micro-batch is an all-masked dummy
        # (fewer rows than ranks) still runs the backward that FSDP's gradient collectives wait for.
        ((total + 0.0 * anchor) * self.world).backward()
        start = logp.detach() if terms.first and not self._eval_stored else None
        stats.add_micro(metrics, ent.detach(), mb, start_logp=start)

    def reference_logprobs(self, mb: MicroBatch) -> Tensor | None:
        """The KL reference's log-probs [R, L-1] of `mb` as the objective takes them (None: no KL term, or a dummy
        micro-batch)."""
        return self.objective.reference_logprobs(mb)

    @torch.no_grad()
    def _reference_forward(self, mb: MicroBatch) -> Tensor | None:
        """The objective's KL reference handle: `ref_model` when one was given (a separate frozen copy); under LoRA
        (`learner.lora`) the trained model itself with its adapters disabled (`learner.lora.adapters_disabled`): its
        frozen base. That forward is collective under FSDP, so a rank's dummy micro-batch runs it too. It runs
        before the policy's forward, so FSDP2 sees whole forwards in order and activation checkpointing's
        recomputation in the backward runs with the adapters on."""
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
