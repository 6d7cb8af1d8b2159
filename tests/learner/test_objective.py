"""The objective built once from `learner.loss` (`learner.objective`): its choices worked by hand on small rows, the
metrics it declares, and the step's generic reduction of them (`learner.step.RankStats`, `merge_rank_stats`)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from common.config import LossConfig
from common.messages import TrainingBatch
from learner.batching import Row, collate
from learner.objective import METRICS, Reduce, Terms, setup_objective
from learner.shape import TrainShape
from learner.step import RankStats, merge_rank_stats

SHAPE = TrainShape(max_new_tokens=10, max_positions=64, eos_id=2)


def row(n: int, replayed: bool = False, adv: float = 1.0, key: str = "") -> Row:
    return Row(np.arange(1, 4), np.full(n, 5), np.full(n, -1.0, np.float32), adv, replayed, key, 0)


def objective(**fields):
    return setup_objective(LossConfig(**fields), SHAPE)


def test_the_normalizer_is_chosen_once_from_loss_agg_worked_by_hand():
    mini = [row(3), row(0), row(5)]  # 8 response tokens, 2 rows with any, 3 rows
    assert objective(loss_agg="token_mean").mini_batch(mini).normalizer == 8
    assert objective(loss_agg="seq_mean_token_mean").mini_batch(mini).normalizer == 2
    # constant: loss_constant, else rows x max_new_tokens = 3 x 10, times loss_world_size
    assert objective(loss_agg="constant", loss_constant=100.0).mini_batch(mini).normalizer == 100
    assert objective(loss_agg="constant", loss_world_size=8).mini_batch(mini).normalizer == 240
    assert objective().mini_batch(mini).tokens == 8
    assert objective().mini_batch([row(0)]) is None  # nothing to learn from


def test_the_clip_schedule_reads_the_batchs_phase():
    fresh, mixed = TrainingBatch([], 0), TrainingBatch([], 0, mixed_mode=True)
    auto = objective(clip_fresh="auto")
    assert auto.clips(fresh) and not auto.clips(mixed) and set(auto.policy_losses) == {True, False}
    mixed.stats["mixed_mode"] = 0.0  # a metric, never read
    assert not auto.clips(mixed)
    assert objective().clips(mixed) and not objective(clip_fresh=False).clips(fresh)


def test_kl_and_old_logprobs_are_decided_at_setup():
    calls = []
    ref = lambda mb: calls.append(mb) or torch.zeros(1)  # noqa: E731
    off = setup_objective(LossConfig(), SHAPE, reference=ref)
    assert off.reference_logprobs(None) is None and not calls  # kl_coef 0: the reference never runs
    on = setup_objective(LossConfig(kl_coef=0.5), SHAPE, reference=ref)
    assert on.reference_logprobs("mb") is not None and calls == ["mb"]
    assert not objective().needs_old_logprobs and objective(tis_cap=2.0).needs_old_logprobs
    assert objective(recompute_old_logprobs=True).stores_learner_logprobs
    with pytest.raises(ValueError, match="replay_eos: the model names no EOS token"):
        setup_objective(LossConfig(replay_eos=True), TrainShape(max_new_tokens=10, max_positions=64))
    with pytest.raises(ValueError, match="entropy_agg=micro_batch needs"):
        objective(entropy_agg="micro_batch")


def _micro(rows: list[Row], logp: float) -> tuple[torch.Tensor, torch.Tensor, object]:
    mb = collate(rows, pad_id=0, device=torch.device("cpu"))
    lp = torch.where(mb.response_mask > 0, torch.full_like(mb.response_mask, logp), torch.zeros_like(mb.response_mask))
    return lp, mb.response_mask * 0.5, mb  # every response token's entropy 0.5


@pytest.mark.parametrize("fields", [{}, {"tis_cap": 2.0}, {"icepop_band": (0.5, 2.0), "mis": "mask"},
                                    {"replay_loss": "policy_loss"}, {"kl_coef": 0.1}])
def test_every_metric_the_objective_emits_is_declared(fields):
    obj = setup_objective(LossConfig(**fields), SHAPE, reference=lambda mb: torch.zeros_like(mb.response_mask))
    lp, ent, mb = _micro([row(2), row(3, replayed=True)], -1.0)
    mb.old_logprobs = lp
    _, m = obj(lp, ent, mb, Terms(5.0, 5.0), obj.reference_logprobs(mb))
    assert set(m) <= set(obj.metrics)
    assert all(r.over is None or obj.metrics[r.over].how == "sum" for r in obj.metrics.values())


def test_the_step_reduces_the_declared_metrics_worked_by_hand():
    """Two micro-batches on one rank and one on another, one mini-batch. Micro-batch a: 2 fresh tokens at ratio
    exp(0) = 1, 3 replayed; b: 4 fresh tokens; c (rank 2): 1 fresh token. Every entropy 0.5, every |A| 1.
    clip_frac is a mean over fresh tokens: (0 x 2 + 0 x 4 + 0 x 1) / 7; entropy_fresh a total over them: 0.5 x 7 / 7;
    advantage_abs_mean over rows: 4 rows of |A| 1; fresh_ratio_max 1; replay_weight_max 1 (3 tokens at exp(0))."""
    obj = objective()
    ranks = []
    for micro in ([[row(2), row(3, replayed=True)], [row(4)]], [[row(1)]]):
        st = RankStats(obj.metrics)
        st.mini_batches = 1
        for rows in micro:
            lp, ent, mb = _micro(rows, -1.0)
            _, m = obj(lp, ent, mb, Terms(7.0, 10.0), None)
            st.add_micro(m, ent, mb)
        st.finish()
        ranks.append(st)
    assert ranks[0].sums["fresh_tokens"] == 6 and ranks[0].counts["entropy_fresh"] == 6
    got, _ = merge_rank_stats(ranks)
    assert got["learner/fresh_tokens"] == 7 and got["learner/replay_tokens"] == 3 and got["learner/rows"] == 4
    assert got["learner/clip_frac"] == 0 and got["learner/fresh_ratio_mean"] == pytest.approx(1.0)
    assert got["learner/entropy_fresh"] == pytest.approx(0.5) and got["learner/entropy_replayed"] == pytest.approx(0.5)
    assert got["learner/advantage_abs_mean"] == pytest.approx(1.0)
    assert got["learner/fresh_ratio_max"] == pytest.approx(1.0)
    assert got["learner/replay_weight_max"] == pytest.approx(1.0)
    # entropy_loss per update: -0.001 x (0.5 x 10 tokens) / 10 over the three micro-batches' 10 tokens
    assert got["learner/entropy_loss"] == pytest.approx(-0.001 * 0.5)
    assert math.isnan(got["learner/tis_weight_mean"]) and math.isnan(got["learner/replay_clip_frac"])
    assert got["learner/tokens"] == 10


def test_a_reduction_is_one_of_the_kinds_the_step_knows():
    assert {r.how for r in METRICS.values()} <= {"sum", "per_update", "mean", "total", "max", "step"}
    assert Reduce("mean", "fresh_tokens").over == "fresh_tokens"
