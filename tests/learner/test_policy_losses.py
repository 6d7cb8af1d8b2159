"""The policy losses (`learner.loss.policy_loss`) worked by hand on small batches: values and gradients, fresh
and replayed rows, both aggregations; ppo_clip within float32 reduction error of its golden numbers; each loss through
the real training step."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from common.config import LearnerConfig, LossConfig
from common.config.loss import SURROGATE_KINDS
from learner.policy_loss import SURROGATES, LossBatch, setup_policy_loss

LN = math.log


def _loss_fn(clip: bool = True, **fields):
    """The policy loss `setup_policy_loss` builds from `LossConfig(**fields)` (its unclipped variant when not
    `clip`)."""
    return setup_policy_loss(LossConfig(**fields), clip_fresh=clip)


def _run(logprobs, behaviour, adv, mask, replay, normalizer=None, clip=True, **fields):
    """(loss, d loss / d logprobs, metrics as floats) of `_loss_fn(clip, **fields)` on one batch."""
    x = torch.tensor(logprobs, dtype=torch.float32, requires_grad=True)
    batch = LossBatch(torch.tensor(behaviour), torch.tensor(adv), torch.tensor(mask), torch.tensor(replay))
    loss, m = _loss_fn(clip, **fields)(x, batch, normalizer)
    loss.backward()
    return loss.item(), x.grad, {k: float(v) for k, v in m.items()}


# Two fresh rows of two tokens, log-probs measured from a behaviour of log 0.5: row 0's ratios are 1.5 and 0.5,
# row 1's 2 and (masked) anything.
LOGP = [[LN(0.75), LN(0.25)], [LN(1.0), -7.0]]
BEH = [[LN(0.5), LN(0.5)], [LN(0.5), LN(0.5)]]
MASK = [[1.0, 1.0], [1.0, 0.0]]
FRESH = [[0.0, 0.0], [0.0, 0.0]]


def test_gspo_clips_a_row_by_its_sequence_ratio_worked_by_hand():
    # row 0: s = exp((ln 1.5 + ln 0.5) / 2) = sqrt(0.75) = 0.8660, A = +1: below the band, min(s, clip) = s:
    #   unclipped, each token -A s = -0.8660, gradient d/dlogp_t = -A s = -0.8660 (before the divisor);
    # row 1: s = 2 (its one token), A = +1: above 1 + 4e-4, clipped to -1.0004, no gradient.
    s0 = math.sqrt(0.75)
    loss, grad, m = _run(LOGP, BEH, [1.0, 1.0], MASK, FRESH, policy_loss=dict(kind="gspo", clip_low=3e-4,
                         clip_high=4e-4), loss_agg="token_mean")
    assert loss == pytest.approx((-s0 * 2 - 1.0004) / 3, rel=1e-6)  # token mean over 3 tokens
    torch.testing.assert_close(grad, torch.tensor([[-s0 / 3, -s0 / 3], [0.0, 0.0]]))
    assert m["clip_frac"] == pytest.approx(1 / 3)  # row 1's one token
    assert m["fresh_ratio_mean"] == pytest.approx((2 * s0 + 2) / 3, rel=1e-6)  # the row's sequence ratio per token
    # seq_mean_token_mean: (row 0's mean -0.8660 + row 1's -1.0004) / 2 rows; row 0's tokens weigh 1/2 each
    loss, grad, _ = _run(LOGP, BEH, [1.0, 1.0], MASK, FRESH, policy_loss=dict(kind="gspo", clip_low=3e-4,
                         clip_high=4e-4), loss_agg="seq_mean_token_mean")
    assert loss == pytest.approx((-s0 - 1.0004) / 2, rel=1e-6)
    torch.testing.assert_close(grad, torch.tensor([[-s0 / 4, -s0 / 4], [0.0, 0.0]]))


def test_gspo_token_gradient_is_the_sequence_ratios_gradient():
    """GSPO-token with a per-row token mean has GSPO's own gradient: d s_i / d theta with s_i = (pi / pi_old)^(1/|y|)
    (here with no clip in reach)."""
    torch.manual_seed(0)
    lp = (torch.randn(3, 5) * 0.1 - 2).requires_grad_(True)
    old = lp.detach() + torch.randn(3, 5) * 0.05
    mask = torch.ones(3, 5)
    mask[2, 3:] = 0
    adv = torch.tensor([1.0, -0.5, 2.0])
    loss_fn = _loss_fn(policy_loss=dict(kind="gspo", clip_low=0.9, clip_high=9.0), loss_agg="seq_mean_token_mean")
    loss, _ = loss_fn(lp, LossBatch(old, adv, mask, torch.zeros(3, 5)))
    loss.backward()
    x = lp.detach().clone().requires_grad_(True)
    s = torch.exp(((x - old) * mask).sum(-1) / mask.sum(-1))  # [R]
    (-(adv * s).mean()).backward()
    torch.testing.assert_close(lp.grad, x.grad)


def test_cispo_truncates_the_weight_and_keeps_every_tokens_gradient():
    # row 0 (A = +1): ratios 1.5 and 0.5, band [1 - 1, 1 + 0.2] = [0, 1.2]: weights 1.2 and 0.5; value -A w, gradient
    # -A w per token; row 1 (A = -1): ratio 2 -> weight 1.2, value +1.2, gradient +1.2. Token mean over 3.
    loss, grad, m = _run(LOGP, BEH, [1.0, -1.0], MASK, FRESH, policy_loss=dict(kind="cispo", clip_low=1.0,
                         clip_high=0.2), loss_agg="token_mean")
    assert loss == pytest.approx((-1.2 - 0.5 + 1.2) / 3, rel=1e-6)
    torch.testing.assert_close(grad, torch.tensor([[-1.2 / 3, -0.5 / 3], [1.2 / 3, 0.0]]))
    assert m["clip_frac"] == pytest.approx(2 / 3)  # ratios 1.5 and 2 truncated
    assert m["fresh_ratio_mean"] == pytest.approx((1.5 + 0.5 + 2) / 3, rel=1e-6)
    # ppo_clip on the same tokens: the clipped ones (1.5 with A > 0, 2 with A < 0: max(2, 1.2) is not clipped) ...
    _, ppo_grad, _ = _run(LOGP, BEH, [1.0, -1.0], MASK, FRESH, policy_loss=dict(clip_low=0.2, clip_high=0.2))
    # ... lose their gradient under PPO (token 0: clip(1.5) = 1.2 is the max for A > 0), never under CISPO
    torch.testing.assert_close(ppo_grad, torch.tensor([[0.0, -0.5 / 3], [2.0 / 3, 0.0]]))


def test_sapo_gate_worked_by_hand():
    # ratios 1 (A = +1, tau_pos 1), 2 (A = -1, tau_neg 1.05), 4 (A = +1); one token each, token mean over 3
    logp = [[LN(0.5)], [LN(1.0)], [LN(2.0)]]
    beh = [[LN(0.5)], [LN(0.5)], [LN(0.5)]]
    sig = lambda z: 1 / (1 + math.exp(-z))  # noqa: E731
    g0, g1, g2 = sig(0.0), sig(1.05 * (2 - 1)), sig(1.0 * (4 - 1))  # 0.5, 0.74077, 0.95257
    values = [-1 * g0 * 4 / 1.0, +1 * g1 * 4 / 1.05, -1 * g2 * 4 / 1.0]  # -A (4/tau) sigmoid(tau (r - 1))
    # d/dlogp of -A (4/tau) sigmoid(tau (r - 1)) = -A 4 sigmoid (1 - sigmoid) r
    grads = [-1 * 4 * g0 * (1 - g0) * 1, +1 * 4 * g1 * (1 - g1) * 2, -1 * 4 * g2 * (1 - g2) * 4]
    loss, grad, m = _run(logp, beh, [1.0, -1.0, 1.0], [[1.0]] * 3, [[0.0]] * 3, policy_loss=dict(kind="sapo",
                         tau_pos=1.0, tau_neg=1.05), loss_agg="token_mean")
    assert loss == pytest.approx(sum(values) / 3, rel=1e-6)
    torch.testing.assert_close(grad, torch.tensor([[g / 3] for g in grads]))
    assert grads[0] == pytest.approx(-1.0)  # at r = 1 the gate passes the plain policy gradient -A
    # gated (4 sigmoid (1 - sigmoid) < 1/2): only r = 4 (0.181); r = 2 keeps 0.768 of it
    assert m["clip_frac"] == pytest.approx(1 / 3)


# One fresh row (A = +1) and one replayed row (A = -1), two tokens each; the replayed row's stored log-probs give
# ratios 2 and 0.5 (sequence ratio exp((ln 2 + ln 0.5) / 2) = 1).
R_LOGP = [[LN(0.5), LN(0.5)], [LN(0.8), LN(0.1)]]
R_BEH = [[LN(0.5), LN(0.5)], [LN(0.4), LN(0.2)]]
R_MASK = [[1.0, 1.0], [1.0, 1.0]]
R_REPLAY = [[0.0, 0.0], [1.0, 1.0]]
R_ADV = [1.0, -1.0]


@pytest.mark.parametrize("loss", ["ppo_clip", "cispo", "sapo"])
def test_replayed_tokens_are_shaped_per_token_under_the_token_losses(loss):
    # replayed (A = -1): -A w / (w + 0.1) per token: 2/2.1 and 0.5/0.6; d/dlogp = -A 0.1 w / (w + 0.1)^2
    band = {"clip_low": 1.0, "clip_high": 0.2} if loss == "cispo" else {}
    _, grad, m = _run(R_LOGP, R_BEH, R_ADV, R_MASK, R_REPLAY, policy_loss=dict(kind=loss, **band),
                      loss_agg="token_mean")
    want = [0.1 * 2 / 2.1 ** 2 / 4, 0.1 * 0.5 / 0.6 ** 2 / 4]
    torch.testing.assert_close(grad[1], torch.tensor(want))
    assert m["replay_loss"] == pytest.approx((2 / 2.1 + 0.5 / 0.6) / 4, rel=1e-6)
    assert m["replay_weight_mean"] == pytest.approx(1.25) and "replay_clip_frac" not in m


def test_replayed_rows_are_shaped_by_their_sequence_ratio_under_gspo():
    # s = 1: each token -A s/(s + 0.1) = 1/1.1; d/dlogp_t = -A 0.1 s / (s + 0.1)^2 = 0.1/1.21 (per token, / 4 tokens)
    _, grad, m = _run(R_LOGP, R_BEH, R_ADV, R_MASK, R_REPLAY, policy_loss=dict(kind="gspo", clip_low=3e-4,
                      clip_high=4e-4), loss_agg="token_mean")
    torch.testing.assert_close(grad[1], torch.tensor([0.1 / 1.21 / 4] * 2))
    assert m["replay_loss"] == pytest.approx(2 / 1.1 / 4, rel=1e-6)
    assert m["replay_weight_mean"] == pytest.approx(1.0, rel=1e-6)


def test_replay_loss_policy_loss_applies_the_loss_to_replayed_rows():
    # cispo on the replayed row (A = -1): weights clip([2, 0.5], 0, 1.2) = [1.2, 0.5]: value +1.2 + 0.5, gradient the
    # same per token; one of its two tokens truncated
    _, grad, m = _run(R_LOGP, R_BEH, R_ADV, R_MASK, R_REPLAY, policy_loss=dict(kind="cispo", clip_low=1.0,
                      clip_high=0.2), loss_agg="token_mean", replay_loss="policy_loss")
    torch.testing.assert_close(grad[1], torch.tensor([1.2 / 4, 0.5 / 4]))
    assert m["replay_loss"] == pytest.approx(1.7 / 4, rel=1e-6) and m["replay_clip_frac"] == 0.5
    # ppo_clip against the stored log-probs (A = -1): ratio 2 -> max(2, 1.2) = 2 unclipped; 0.5 -> max(0.5, 0.8)
    # = 0.8 clipped (no gradient)
    _, grad, m = _run(R_LOGP, R_BEH, R_ADV, R_MASK, R_REPLAY, replay_loss="policy_loss")
    torch.testing.assert_close(grad[1], torch.tensor([2.0 / 4, 0.0]))
    assert m["replay_clip_frac"] == 0.5


def test_fresh_and_replayed_losses_add_up_under_seq_mean():
    for loss in SURROGATE_KINDS:
        _, _, m = _run(R_LOGP, R_BEH, R_ADV, R_MASK, R_REPLAY, policy_loss=loss, loss_agg="seq_mean_token_mean",
                       normalizer=2.0)
        assert m["loss"] == pytest.approx(m["fresh_loss"] + m["replay_loss"], rel=1e-6)


def test_the_bandless_losses_refuse_to_run_unclipped():
    with pytest.raises(ValueError, match="no unclipped form"):
        _run(LOGP, BEH, [1.0, 1.0], MASK, FRESH, policy_loss="sapo", clip=False)


# ppo_clip's loss, gradients and metrics before the other losses came, as numbers: commit 9314e02's
# learner/loss.py run on CPU on stored inputs (ppo_clip_golden.json's note says how they were drawn and computed,
# and why they are stored: the last bits of randn's draws depend on the CPU).
PPO_GOLDEN = json.loads(Path(__file__).with_name("ppo_clip_golden.json").read_text())
# Numbers, not bytes: another CPU (its exp, its vectorised order of a sum) rounds differently. rtol 1e-5 is the error
# of a float32 reduction of a few dozen terms with room to spare (84 to 168 float32 ULP; another machine measured a
# gradient element 6.8e-7 relative away, 4 ULP failed it). atol 1e-8 is the floor for values that are exactly 0
# (masked and clipped tokens, zero fractions): the rounding of one term of magnitude 0.1. Far below any real change
# of the loss: clip epsilon 0.2 -> 0.21 moves the defaults case by 3e-3 relative, and
# `test_the_golden_tolerance_detects_a_clip_epsilon_of_0_21` keeps it so.
PPO_TOL = {"rtol": 1e-5, "atol": 1e-8}


def _f32(v) -> torch.Tensor:
    return torch.tensor(v, dtype=torch.float32)


def _golden_run(case: dict, **change) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """(loss, d loss / d logprobs, metrics) of a golden case's loss on the stored inputs, its config fields
    overridden by `change`."""
    inp = PPO_GOLDEN["inputs"]
    lp, beh, old, adv, mask = (_f32(inp[k]) for k in ("logprobs", "behaviour", "old", "advantages", "mask"))
    replay = torch.zeros(6, 9)
    replay[inp["replay_rows"]] = 1
    fields = {**case["kwargs"], **change}  # the old policy_loss's keywords: config fields but for these three
    batch = LossBatch(beh, adv, mask, replay, old if fields.pop("old", False) else None)
    normalizer, clip = fields.pop("normalizer", None), fields.pop("clip_fresh", True)
    band = {k: fields.pop(k) for k in ("clip_low", "clip_high") if k in fields}  # ppo_clip's own section's fields
    if band:
        fields["policy_loss"] = {**fields.get("policy_loss", {}), **band}
    x = lp.clone().requires_grad_(True)
    loss, m = _loss_fn(clip, **fields)(x, batch, normalizer)
    loss.backward()
    return loss.detach(), x.grad, {k: v.detach().float() for k, v in m.items()}


def _assert_golden(case: dict, got: tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]) -> None:
    loss, grad, m = got
    assert sorted(m) == sorted(case["metrics"])  # the same metric names, exactly
    torch.testing.assert_close(loss, _f32(case["loss"]), **PPO_TOL)
    torch.testing.assert_close(grad, _f32(case["grad"]), **PPO_TOL)
    torch.testing.assert_close(m, {k: _f32(v) for k, v in case["metrics"].items()}, **PPO_TOL)


@pytest.mark.parametrize("case", PPO_GOLDEN["cases"], ids=[c["label"] for c in PPO_GOLDEN["cases"]])
def test_ppo_clip_matches_its_golden_numbers_within_float32_reduction_error(case):
    _assert_golden(case, _golden_run(case))


@pytest.mark.parametrize("label", ["defaults", "normalizer=37.0"])
def test_the_golden_tolerance_detects_a_clip_epsilon_of_0_21(label):
    """The tolerance above is no blanket: widening PPO's band from 0.2 to 0.21 on both sides (which changes which
    tokens these cases clip) fails the golden comparison."""
    case = next(c for c in PPO_GOLDEN["cases"] if c["label"] == label)
    with pytest.raises(AssertionError):
        _assert_golden(case, _golden_run(case, clip_low=0.21, clip_high=0.21))


def test_every_surrogate_kind_of_the_config_is_built_by_the_learner():
    assert list(SURROGATES) == list(SURROGATE_KINDS)


def test_config_takes_each_loss_and_refuses_what_has_no_meaning():
    for loss in SURROGATE_KINDS:
        LearnerConfig(loss=dict(policy_loss=loss, loss_agg="seq_mean_token_mean"))
    with pytest.raises(ValueError, match=r"clip_fresh=auto.*policy_loss.kind=cispo has no unclipped form.*clip_fresh=true"):
        LearnerConfig(loss=dict(policy_loss="cispo", clip_fresh="auto"))
    with pytest.raises(ValueError, match="policy_loss.kind=sapo has no unclipped form: its gate"):
        LearnerConfig(loss=dict(policy_loss="sapo", clip_fresh=False))
    LearnerConfig(loss=dict(policy_loss="ppo_clip", clip_fresh="auto"))


@pytest.mark.parametrize("loss", ["ppo_clip", "gspo", "cispo", "sapo"])
def test_each_loss_trains_through_the_real_step(tiny_model_dir, loss):
    """Two mini-batches (two updates) of fresh and replayed rows through `TrainStep` with each loss, the original
    GRPO aggregation, and the loss applied to replayed rows too: finite, updating, metrics in range."""
    from learner.batching import batch_rows
    from learner.replay_choice import complete_groups
    from learner.step import merge_rank_stats
    from bench.batches import make_batch
    from tests.learner.test_step import plain_step

    for overrides in ({}, {"loss_agg": "seq_mean_token_mean", "replay_loss": "policy_loss"}):
        model, step = plain_step(tiny_model_dir, mini_batches=2, policy_loss=loss, lr=1e-3, **overrides)
        before = {k: v.clone() for k, v in model.state_dict().items()}
        m, _ = merge_rank_stats([step.run(make_batch(0))])
        assert m["learner/updates"] == 2 and np.isfinite(m["learner/loss"]), m
        assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items())
        assert 0 <= m["learner/clip_frac"] <= 1 and m["learner/fresh_ratio_mean"] > 0
        assert m["learner/replay_tokens"] > 0 and m["learner/replay_weight_mean"] > 0
        if overrides:
            assert 0 <= m["learner/replay_clip_frac"] <= 1
            rows = batch_rows(complete_groups(make_batch(0, candidates=1), {})[0], std_normalize=False, max_positions=512)
            assert step.objective.normalizer(rows) == sum(1 for r in rows if len(r.response_ids)) > 0  # rows
        else:
            assert np.isnan(m["learner/replay_clip_frac"])


# Two fresh rows of unequal length for the aggregation: row 0 (A = +1) ratios 1.5 and 0.5, row 1 (A = -1) one token
# of ratio 1. Under seq_mean_token_mean a token of row i weighs 1 / (|y_i| x 2 rows): row 0's 1/4, row 1's 1/2
# (under token_mean every token would weigh 1/3).
AGG_LOGP = [[LN(0.75), LN(0.25)], [LN(0.5), -7.0]]


def test_gspo_by_default_aggregates_as_its_paper_worked_by_hand():
    # row 0: s = sqrt(1.5 x 0.5) = 0.866025 (in GSPO's band only below: A > 0 and s < 1, so unclipped):
    #   each token's loss -A s = -0.866025, its gradient -A s x 1/4 = -0.216506;
    # row 1: s = 1, unclipped: loss -A s = +1, gradient -A s x 1/2 = +0.5.
    # loss = (row 0's token mean -0.866025 + row 1's +1) / 2 rows = 0.066987
    assert LearnerConfig(loss=dict(policy_loss="gspo")).loss.loss_agg == "seq_mean_token_mean"
    loss, grad, m = _run(AGG_LOGP, BEH, [1.0, -1.0], MASK, FRESH, policy_loss="gspo")  # its own aggregation
    assert loss == pytest.approx(0.066987, abs=1e-6)
    torch.testing.assert_close(grad, torch.tensor([[-0.216506, -0.216506], [0.5, 0.0]]))
    assert m["clip_frac"] == 0
    # named token_mean is still possible: every token 1/3 (row 0: -0.288675, row 1: +0.333333)
    _, grad, _ = _run(AGG_LOGP, BEH, [1.0, -1.0], MASK, FRESH, policy_loss="gspo", loss_agg="token_mean")
    torch.testing.assert_close(grad, torch.tensor([[-0.288675, -0.288675], [0.333333, 0.0]]))


def test_sapo_by_default_aggregates_as_its_paper_worked_by_hand():
    # loss_t = -A (4 / tau) sigmoid(tau (r - 1)), d/dlogp_t = -A 4 sigmoid (1 - sigmoid) r.
    # row 0 (A = +1, tau 1): r = 1.5: sigmoid(0.5) = 0.622459, 4 x 0.622459 x 0.377541 = 0.940014, x 1.5 = 1.410021;
    #   r = 0.5: sigmoid(-0.5) = 0.377541, the same 0.940014, x 0.5 = 0.470007; gradients -1.410021 / 4 = -0.352505
    #   and -0.470007 / 4 = -0.117502; losses -4 x 0.622459 = -2.489837 and -4 x 0.377541 = -1.510163, mean -2.0.
    # row 1 (A = -1, tau 1.05): r = 1, sigmoid(0) = 0.5: loss +(4 / 1.05) x 0.5 = 1.904762, gradient 4 x 0.25 x 1
    #   x 1/2 = +0.5.
    # loss = (-2.0 + 1.904762) / 2 rows = -0.047619
    assert LearnerConfig(loss=dict(policy_loss="sapo")).loss.loss_agg == "seq_mean_token_mean"
    loss, grad, _ = _run(AGG_LOGP, BEH, [1.0, -1.0], MASK, FRESH, policy_loss="sapo")  # its own aggregation
    assert loss == pytest.approx(-0.047619, abs=1e-6)
    torch.testing.assert_close(grad, torch.tensor([[-0.352505, -0.117502], [0.5, 0.0]]))


def test_each_loss_has_its_own_aggregation_unless_named_and_the_config_line_says_which():
    own = {"ppo_clip": "token_mean", "gspo": "seq_mean_token_mean", "cispo": "token_mean", "sapo": "seq_mean_token_mean"}
    for loss, agg in own.items():
        cfg = LearnerConfig(loss=dict(policy_loss=loss))
        assert cfg.loss.loss_agg == agg and f"loss_agg {agg} ({loss}'s own)" in cfg.loss_scale()
    named = LearnerConfig(loss=dict(policy_loss="sapo", loss_agg="token_mean"))
    assert named.loss.loss_agg == "token_mean"
    assert "loss_agg token_mean (named; sapo's own is seq_mean_token_mean)" in named.loss_scale()
    assert "loss_agg constant (named; ppo_clip's own is token_mean)" in LearnerConfig(loss=dict(loss_agg="constant")).loss_scale()
