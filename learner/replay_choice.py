"""o*: which stored trajectory completes each mixed group, chosen under the policy the step trains.

    entropies, scores = score_candidates(model, batch, rank, shape)   # collective: one all-reduce
    batch, feedback = complete_groups(batch, scores, entropies)   # pure: the argmin per group

Every rank derives the same choice from the same sums. `StepFeedback` is what the step tells the buffer about
stored trajectories; `reasoning_metrics` measures the choice where the task checks reasoning.
The rule and the authors' score: docs/internals.md#learnerreplay_choicepy
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Protocol

import numpy as np
import torch
from torch import Tensor

from common.messages import Rollout, TrainingBatch
from learner import loss as L
from learner.batching import BatchError, MicroBatch, Row, chunk_window_spans
from learner.forward import forward_stats
from learner.shape import TrainShape

Scores = dict[tuple[int, int], float]  # (group index, candidate index) -> value


@dataclass
class StepFeedback:
    """What the step tells the buffer about stored trajectories (identical on every rank)."""

    keys: list[str] = field(default_factory=list)  # every scored candidate
    entropies: list[float] = field(default_factory=list)  # their mean token entropy under the step's policy
    chosen: list[str] = field(default_factory=list)  # the o* of each mixed group
    fresh_keys: list[str] = field(default_factory=list)  # (merged) every rank's trained fresh rows the buffer stored
    fresh_entropies: list[float] = field(default_factory=list)  # their mean token entropy, from the training forward
    fresh_logprobs: list[np.ndarray] = field(default_factory=list)  # their start-of-step log-probs [T] (or [])
    # the task's reasoning check (Rollout.valid) where known: per mixed group (o* valid, mean over its candidates),
    # and (entropy, valid) of every scored candidate
    valid_chosen: list[tuple[int, float]] = field(default_factory=list)
    valid_scored: list[tuple[float, int]] = field(default_factory=list)


def candidate_rows(batch: TrainingBatch) -> list[tuple[int, int, Row]]:
    """(group index, candidate index, row) for every candidate of a mixed group that has a choice (> 1)."""
    out = []
    for g, group in enumerate(batch.groups):
        if group.mixed and len(group.candidates) > 1:
            for c, ro in enumerate(group.candidates):
                out.append((g, c, Row(np.asarray(group.prompt_ids), np.asarray(ro.response_ids),
                                      np.asarray(ro.logprobs, dtype=np.float32), 0.0, True, ro.key, g)))
    return out


class RankBatching(Protocol):
    """How one rank cuts rows into its micro-batches and their tensors (`learner.step.TrainStep` is one)."""

    device: torch.device

    def micro_batches(self, rows: list[Row]) -> list[list[Row]]: ...  # equally many on every rank

    def collate(self, rows: list[Row]) -> MicroBatch: ...


@torch.no_grad()
def score_candidates(model: torch.nn.Module, batch: TrainingBatch, rank: RankBatching,
                     shape: TrainShape) -> tuple[Scores, Scores]:
    """Mean token entropy of every candidate with a choice, under `model`'s current weights, and the score the
    choice minimises (`batch.trajectory_score`: the same, or the authors' code's, `chunk_window_spans`).
    Collective: each rank scores the slice `rank.micro_batches` deals it (equally many micro-batches on every rank,
    a dummy's forward included), one all-reduce over the `shape.world` ranks sums them."""
    device, max_positions = rank.device, shape.max_positions
    cands = candidate_rows(batch)
    if not cands:
        return {}, {}
    for r in (c[2] for c in cands):
        if r.length > max_positions:
            raise BatchError(f"group {r.group} (question {batch.groups[r.group].question_id!r}): a stored "
                             f"candidate is {r.length} tokens, above max_position_embeddings {max_positions}")
    rows = [c[2] for c in cands]
    windowed = batch.trajectory_score == "chunk_window"
    if windowed:  # the authors' score sums prompt positions too: the head computes every position
        windows = chunk_window_spans([r.length for r in rows], [r.response_ids for r in rows],
                                     shape.max_new_tokens, shape.pad_id)
        response = [(len(r.prompt_ids) - 1, len(r.response_ids)) for r in rows]
        rows = [replace(r, prompt_ids=ids[:1], response_ids=ids[1:],  # the same tokens, all as "response"
                        behaviour_logprobs=np.zeros(len(ids) - 1, np.float32))
                for r, ids in ((r, np.concatenate([r.prompt_ids, r.response_ids])) for r in rows)]
    index = {id(r): i for i, r in enumerate(rows)}
    sums = torch.zeros(2, len(rows), dtype=torch.float32, device=device)  # [2, N] mean entropy, score
    model.eval()
    for chunk in rank.micro_batches(rows):
        if not chunk:  # this rank's dummy: the forward keeps FSDP in step, nothing to record
            forward_stats(model, rank.collate(chunk))
            continue
        mb = rank.collate(chunk)
        _, h, _ = forward_stats(model, mb)  # [R, L-1]
        mine = [index[id(r)] for r in chunk]
        where = torch.tensor(mine).to(device, non_blocking=True)  # [R]
        if windowed:
            sums[0].index_copy_(0, where, window_means(h, [response[i] for i in mine]).nan_to_num(nan=0.0))
            sums[1].index_copy_(0, where, window_means(
                h, [(s, d) for s, d in (windows[i] for i in mine)], [r.length - 1 for r in chunk]))
        else:
            sums[0].index_copy_(0, where, L.row_mean(h, mb.response_mask).nan_to_num(nan=0.0))  # empty: 0
    if shape.world > 1:
        torch.distributed.all_reduce(sums)
    ent_list, score_list = sums.tolist()
    entropies = {(g, c): h for (g, c, _), h in zip(cands, ent_list)}
    return entropies, ({(g, c): s for (g, c, _), s in zip(cands, score_list)} if windowed else entropies)


def window_means(h: Tensor, windows: list[tuple[int, int]], ends: list[int] | None = None) -> Tensor:
    """[R] each row's entropies h [R, L-1] summed over positions start <= t < end (default: start + divisor)
    and divided by the divisor (0: NaN, a mean of nothing). Windows are (start, divisor) per row."""
    t = torch.arange(h.shape[1], device=h.device)  # [L-1]
    start = torch.tensor([s for s, _ in windows]).to(h.device)  # [R]
    end = torch.tensor(ends if ends is not None else [s + d for s, d in windows]).to(h.device)  # [R]
    mask = (t[None] >= start[:, None]) & (t[None] < end[:, None])  # [R, L-1]
    total = (h.float() * mask).sum(-1)  # [R]
    div = torch.tensor([float(d) for _, d in windows], device=h.device)  # [R]
    return torch.where(div > 0, total / div.clamp(min=1.0), torch.full_like(total, float("nan")))


def complete_groups(batch: TrainingBatch, scores: Scores,
                    entropies: Scores | None = None) -> tuple[TrainingBatch, StepFeedback]:
    """Each mixed group's fresh rollouts + its chosen o*: the argmin of `scores` over its candidates
    (ties and NaN: the first, as numpy's argmin), or its only candidate. `entropies` (default: `scores`): the
    mean token entropies reported back to the buffer. Pure; the batch is not modified."""
    entropies = scores if entropies is None else entropies
    fb = StepFeedback()
    groups = []
    for g, group in enumerate(batch.groups):
        if not (group.mixed and group.candidates):
            groups.append(group)
            continue
        if len(group.candidates) == 1:
            best = 0
        else:
            best = int(np.argmin([scores[(g, c)] for c in range(len(group.candidates))]))
            for ro, h in zip(group.candidates, (entropies[(g, c)] for c in range(len(group.candidates)))):
                fb.keys.append(ro.key)
                fb.entropies.append(h)
                if ro.valid >= 0:
                    fb.valid_scored.append((h, ro.valid))
        chosen: Rollout = group.candidates[best]
        fb.chosen.append(chosen.key)
        known = [ro.valid for ro in group.candidates if ro.valid >= 0]
        if chosen.valid >= 0:
            fb.valid_chosen.append((chosen.valid, sum(known) / len(known)))
        groups.append(replace(group, rollouts=list(group.rollouts) + [chosen], candidates=[]))
    return replace(batch, groups=groups), fb


def reasoning_metrics(fb: StepFeedback) -> dict[str, float]:
    """Where the task checks reasoning (Rollout.valid): the share of mixed groups' o* with valid reasoning, the
    mean share over their candidates (what a random choice would give), and the correlation between a scored
    candidate's entropy and its validity (negative: lower entropy, more often valid). NaN where undefined."""
    nan = float("nan")
    out = {"learner/replay_valid_groups": float(len(fb.valid_chosen)),
           "learner/replay_valid_chosen": nan, "learner/replay_valid_candidates": nan, "learner/entropy_valid_corr": nan}
    if fb.valid_chosen:
        out["learner/replay_valid_chosen"] = float(np.mean([c for c, _ in fb.valid_chosen]))
        out["learner/replay_valid_candidates"] = float(np.mean([m for _, m in fb.valid_chosen]))
    if len(fb.valid_scored) >= 2:
        h, v = np.array(fb.valid_scored, dtype=np.float64).T
        if h.std() > 0 and v.std() > 0:
            out["learner/entropy_valid_corr"] = float(np.corrcoef(h, v)[0, 1])
    return out
