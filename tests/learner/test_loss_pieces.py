"""Each piece of the policy loss (`learner.loss.policy_loss`) alone, with its numbers worked out by hand in the
comments, and `setup_policy_loss` choosing the pieces from the config. The whole loss: test_loss.py,
test_policy_losses.py."""

from __future__ import annotations

import math
from functools import partial

import pytest
import torch

from common.config import LossConfig
from learner import policy_loss as P

LN = math.log


def _lp(ratios, behaviour=-1.0):
    """(logprobs requiring grad, behaviour, log_ratio) whose ratios exp(logp - behaviour) are `ratios`."""
    beh = torch.full((len(ratios), len(ratios[0])), behaviour)
    lp = (beh + torch.log(torch.tensor(ratios))).requires_grad_(True)
    return lp, beh, lp - beh


def _close(actual, expected):
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=actual.dtype), rtol=1e-5, atol=1e-6)


def test_token_and_sequence_ratio_by_hand():
    # row 0: ratios 2 and 0.5 -> s = exp((ln 2 + ln 0.5) / 2) = 1 on both tokens; row 1: one token of 4 (the second
    # is masked: its garbage 1e4 is left out of the mean) -> s = 4
    lp, _, log_ratio = _lp([[2.0, 0.5], [4.0, 1.0]])
    log_ratio = torch.where(torch.tensor([[True, True], [True, False]]), log_ratio, torch.tensor(1e4))
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    s = P.sequence_ratio(lp, log_ratio, mask)
    _close(s[:, 0], [1.0, 4.0])
    _close(s[0], [1.0, 1.0])
    # d s_t / d logp_t = s (the carrier exp(logp - sg(logp)) is 1 in value); the masked token gets none
    s.sum().backward()
    _close(lp.grad, [[1.0, 1.0], [4.0, 0.0]])
    _close(P.token_ratio(lp, torch.tensor([[LN(2.0)]]), mask), [[2.0]])


def test_ppo_clip_by_hand():
    # band [0.8, 1.2]. A = +1, r = [1.5, 0.5]: max(-1.5, -1.2) = -1.2 (clipped), max(-0.5, -0.8) = -0.5;
    # A = -1, same ratios: max(1.5, 1.2) = 1.5, max(0.5, 0.8) = 0.8 (clipped)
    lp, _, log_ratio = _lp([[1.5, 0.5], [1.5, 0.5]])
    out = P.ppo_clip(lp, log_ratio, torch.tensor([[1.0], [-1.0]]), torch.ones(2, 2), clip_low=0.2, clip_high=0.2)
    _close(out.loss, [[-1.2, -0.5], [1.5, 0.8]])
    _close(out.weight, [[1.5, 0.5], [1.5, 0.5]])
    _close(out.active, [[1.0, 0.0], [0.0, 1.0]])
    # the unclipped tokens' gradient is d(-A r)/dlogp = -A r: -0.5 and +1.5; the clipped ones get none
    out.loss.sum().backward()
    _close(lp.grad, [[0.0, -0.5], [1.5, 0.0]])


def test_gspo_clips_a_row_whole_by_hand():
    # row 0 (A = +1): ratios 2 and 0.5 -> s = 1, in the band [0.8, 1.2]: loss -1 per token; row 1 (A = +1): one
    # token of 4 -> s = 4, clipped to 1.2: loss -1.2, active
    lp, _, log_ratio = _lp([[2.0, 0.5], [4.0, 1.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    out = P.gspo(lp, log_ratio * mask, torch.tensor([[1.0], [1.0]]), mask, clip_low=0.2, clip_high=0.2)
    _close(out.loss[0], [-1.0, -1.0])
    _close(out.loss[1, :1], [-1.2])
    _close(out.active * mask, [[0.0, 0.0], [1.0, 0.0]])


def test_cispo_by_hand():
    # A = +1, band [1 - 1, 1 + 0.2] = [0, 1.2]: r = [1.5, 0.5] -> w = [1.2, 0.5]; loss -A w = [-1.2, -0.5], the
    # gradient -A w per token (no token loses it), active where w != r: the first
    lp, _, log_ratio = _lp([[1.5, 0.5]])
    out = P.cispo(lp, log_ratio, torch.tensor([[1.0]]), torch.ones(1, 2), clip_low=1.0, clip_high=0.2)
    _close(out.loss, [[-1.2, -0.5]])
    _close(out.active, [[1.0, 0.0]])
    out.loss.sum().backward()
    _close(lp.grad, [[-1.2, -0.5]])


def test_sapo_by_hand():
    # row 0: A = +1, tau_pos 1, r = 1: sigmoid(0) = 0.5, loss -(4 / 1) 0.5 = -2, gradient -A 4 (0.5)(0.5) 1 = -1,
    #   factor 4 sigmoid (1 - sigmoid) = 1: not active.
    # row 1: A = -1, tau_neg 1.05, r = 3: sigmoid(1.05 x 2) = 0.890903, loss +(4 / 1.05) 0.890903 = 3.393917;
    #   factor 4 x 0.890903 x 0.109097 = 0.388779 < 1/2: active; gradient -A x 0.388779 x 3 = 1.166336
    lp, _, log_ratio = _lp([[1.0], [3.0]])
    out = P.sapo(lp, log_ratio, torch.tensor([[1.0], [-1.0]]), torch.ones(2, 1), tau_pos=1.0, tau_neg=1.05)
    _close(out.loss, [[-2.0], [3.393917]])
    _close(out.active, [[0.0], [1.0]])
    out.loss.sum().backward()
    _close(lp.grad, [[-1.0], [1.166336]])


def test_dual_clip_bounds_only_negative_advantages_by_hand():
    # c = 3, band [0.8, 1.2]. row 0 (A = -1): r = 4: PPO's max(4, 1.2) = 4 -> min(4, -A c = 3) = 3 (active, no
    # gradient); r = 1.1: 1.1 in the band, untouched. row 1 (A = +1): r = 4: max(-4, -1.2) = -1.2 (PPO's clip;
    # no second bound for A > 0)
    lp, _, log_ratio = _lp([[4.0, 1.1], [4.0, 1.0]])
    out = P.dual_clip(lp, log_ratio, torch.tensor([[-1.0], [1.0]]), torch.ones(2, 2),
                      surrogate=partial(P.ppo_clip, clip_low=0.2, clip_high=0.2), clip_ratio_c=3.0)
    _close(out.loss, [[3.0, 1.1], [-1.2, -1.0]])
    _close(out.active, [[1.0, 0.0], [1.0, 0.0]])
    out.loss.sum().backward()
    _close(lp.grad, [[0.0, 1.1], [0.0, -1.0]])


def test_shaping_and_plain_importance_sampling_by_hand():
    # A = +1, w = [1.5, 1], beta 0.1: -w / (w + 0.1) = [-1.5 / 1.6, -1 / 1.1] = [-0.9375, -0.909091];
    # d/dlogp = -A beta w / (w + beta)^2 = [-0.1 x 1.5 / 2.56, -0.1 / 1.21] = [-0.058594, -0.082645]; no clip
    lp, _, log_ratio = _lp([[1.5, 1.0]])
    out = P.shaping(lp, log_ratio, torch.tensor([[1.0]]), torch.ones(1, 2), beta=0.1)
    _close(out.loss, [[-0.9375, -0.909091]])
    assert out.active is None
    out.loss.sum().backward()
    _close(lp.grad, [[-0.058594, -0.082645]])
    # plain IS: -A w = [-1.5, -1], gradient -A w
    lp, _, log_ratio = _lp([[1.5, 1.0]])
    out = P.importance_weighted(lp, log_ratio, torch.tensor([[1.0]]), torch.ones(1, 2))
    _close(out.loss, [[-1.5, -1.0]])
    out.loss.sum().backward()
    _close(lp.grad, [[-1.5, -1.0]])
    # shaped by the row's sequence ratio (gspo): ratios 2 and 0.5 -> s = 1, each token -1 / 1.1 = -0.909091
    lp, _, log_ratio = _lp([[2.0, 0.5]])
    out = P.shaping(lp, log_ratio, torch.tensor([[1.0]]), torch.ones(1, 2), beta=0.1, ratio=P.sequence_ratio)
    _close(out.loss, [[-0.909091, -0.909091]])


# mismatch m = exp(old - behaviour): row 0 [1.5, 0.5], row 1 [4, 1]; every token fresh
MM_LOG = torch.log(torch.tensor([[1.5, 0.5], [4.0, 1.0]]))
FRESH = torch.ones(2, 2)


def test_truncated_importance_sampling_by_hand():
    # cap 2: c = [[1.5, 0.5], [2, 1]]; mean (1.5 + 0.5 + 2 + 1) / 4 = 1.25; one of 4 truncated
    c, m = P.truncated_is(MM_LOG, FRESH, cap=2.0)
    _close(c, [[1.5, 0.5], [2.0, 1.0]])
    _close(m["tis_weight_mean"], 1.25)
    _close(m["tis_truncated_frac"], 0.25)


def test_icepop_by_hand():
    # band [0.6, 2]: 0.5 and 4 fall outside -> keep [[1, 0], [0, 1]]; 2 of 4 masked
    keep, m = P.icepop(MM_LOG, FRESH, low=0.6, high=2.0)
    _close(keep, [[1.0, 0.0], [0.0, 1.0]])
    _close(m["icepop_masked_frac"], 0.5)


def test_sequence_level_mis_by_hand():
    # rho row 0 = 1.5 x 0.5 = 0.75, row 1 = 4 x 1 = 4. truncate, cap 2: weights 0.75 and 2 (one per row);
    # token-weighted mean (0.75 x 2 + 2 x 2) / 4 = 1.375, none masked
    w, m = P.mis_truncate(MM_LOG, FRESH, cap=2.0)
    _close(w, [[0.75], [2.0]])
    _close(m["mis_weight_mean"], 1.375)
    _close(m["mis_masked_frac"], 0.0)
    # mask, band [1/2, 2]: row 0 (0.75) kept, row 1 (4) out: weights 1 and 0, mean 0.5, half the tokens masked
    w, m = P.mis_mask(MM_LOG, FRESH, cap=2.0)
    _close(w, [[1.0], [0.0]])
    _close(m["mis_weight_mean"], 0.5)
    _close(m["mis_masked_frac"], 0.5)


def test_aggregations_by_hand():
    # rows of 3, 1 and 0 tokens. token_mean: each token 1, divisor 4 tokens. seq_mean_token_mean: row 0's tokens
    # 1/3 each, row 1's 1; divisor 2 (the rows with a token)
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    w, n = P.token_mean(mask)
    _close(w, mask.tolist())
    _close(n, 4.0)
    w, n = P.seq_mean_token_mean(mask)
    _close(w, [[1 / 3, 1 / 3, 1 / 3], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    _close(n, 2.0)


def test_the_whole_loss_composes_the_pieces_by_hand():
    # row 0 fresh (A = +1), ratios to the behaviour [1.5, 0.5]; row 1 replayed (A = -1), ratios [1, 1]. The
    # learner's start-of-step log-probs `old` equal logp: the fresh ratio, centred on them, is 1 (-A r = -1 each),
    # and the mismatch exp(old - behaviour) = [1.5, 0.5] gives TIS weights (cap 2) [1.5, 0.5]: [-1.5, -0.5].
    # The replayed row is shaped against the behaviour: -A w / (w + 0.1) = 1 / 1.1 per token, untouched by TIS.
    # Token mean over 4: fresh -2 / 4 = -0.5, replay (2 / 1.1) / 4 = 0.454545
    lp, beh, _ = _lp([[1.5, 0.5], [1.0, 1.0]])
    loss_fn = P.PolicyLoss(fresh=partial(P.ppo_clip, clip_low=0.2, clip_high=0.2),
                           replay=partial(P.shaping, beta=0.1),
                           corrections=(partial(P.truncated_is, cap=2.0),))
    batch = P.LossBatch(beh, torch.tensor([1.0, -1.0]), torch.ones(2, 2), torch.tensor([[0.0, 0.0], [1.0, 1.0]]),
                        lp.detach())
    loss, m = loss_fn(lp, batch)
    _close(m["fresh_loss"], -2.0 / 4)
    _close(m["replay_loss"], 2 / 1.1 / 4)
    _close(loss.detach(), -2.0 / 4 + 2 / 1.1 / 4)
    _close(m["tis_weight_mean"], 1.0)  # (1.5 + 0.5) / 2 fresh tokens
    # TIS has nothing to correct with without the start-of-step log-probs
    with pytest.raises(ValueError, match="old_logprobs"):
        loss_fn(lp, P.LossBatch(beh, batch.advantages, batch.response_mask, batch.replay_mask))
    # without TIS and old log-probs the fresh ratio is the behaviour's [1.5, 0.5]: PPO's [-1.2, -0.5], / 4
    no_tis = P.PolicyLoss(fresh=loss_fn.fresh, replay=loss_fn.replay)
    _, m = no_tis(lp, P.LossBatch(beh, batch.advantages, batch.response_mask, batch.replay_mask))
    _close(m["fresh_loss"], (-1.2 - 0.5) / 4)


def test_setup_chooses_the_pieces_once_from_the_config():
    fn = P.setup_policy_loss(LossConfig())  # ppo_clip, shaping, token_mean: the paper's loss
    assert fn.fresh.func is P.ppo_clip and fn.fresh.keywords == {"clip_low": 0.2, "clip_high": 0.2}
    assert fn.replay.func is P.shaping and fn.replay.keywords == {"beta": 0.1, "ratio": P.token_ratio}
    assert fn.corrections == () and fn.aggregation is P.token_mean
    assert P.setup_policy_loss(LossConfig(clip_fresh="auto"), clip_fresh=False).fresh is P.importance_weighted
    fn = P.setup_policy_loss(LossConfig(policy_loss=dict(clip_ratio_c=3.0), clip_fresh="auto"))
    assert fn.fresh.func is P.dual_clip and fn.fresh.keywords["clip_ratio_c"] == 3.0
    assert fn.fresh.keywords["surrogate"].func is P.ppo_clip
    # unclipped fresh tokens have no second bound either; replayed ones under replay_loss=policy_loss keep both
    fn = P.setup_policy_loss(LossConfig(policy_loss=dict(clip_ratio_c=3.0), clip_fresh="auto", replay_loss="policy_loss"), False)
    assert fn.fresh is P.importance_weighted and fn.replay.func is P.dual_clip
    fn = P.setup_policy_loss(LossConfig(policy_loss="gspo", shaping_beta=None))
    assert fn.fresh.func is P.gspo and fn.fresh.keywords == {"clip_low": 3e-4, "clip_high": 4e-4}
    assert fn.replay.func is P.importance_weighted and fn.replay.keywords == {"ratio": P.sequence_ratio}
    assert fn.aggregation is P.seq_mean_token_mean  # gspo's own
    fn = P.setup_policy_loss(LossConfig(policy_loss="cispo", replay_loss="policy_loss"))
    assert fn.fresh.func is P.cispo and fn.replay is fn.fresh
    fn = P.setup_policy_loss(LossConfig(policy_loss=dict(kind="sapo", tau_neg=1.2), loss_agg="constant"))
    assert fn.fresh.keywords == {"tau_pos": 1.0, "tau_neg": 1.2} and fn.aggregation is P.token_mean
    fn = P.setup_policy_loss(LossConfig(tis_cap=3.0, icepop_band=(0.5, 2.0), mis="mask", mis_cap=4.0))
    assert [(c.func, c.keywords) for c in fn.corrections] == [
        (P.truncated_is, {"cap": 3.0}), (P.icepop, {"low": 0.5, "high": 2.0}), (P.mis_mask, {"cap": 4.0})]
    with pytest.raises(ValueError, match="policy_loss.kind=gspo has no unclipped form.*set learner.loss.clip_fresh=true"):
        P.setup_policy_loss(LossConfig(policy_loss="gspo"), clip_fresh=False)
