"""The objective's pure functions, with the expected numbers worked out by hand in the comments."""

from __future__ import annotations

import math

import pytest
import torch

from common.config import LearnerConfig, LossConfig
from learner import loss as L
from learner.policy_loss import LossBatch, setup_policy_loss

LN = math.log

# Shared 2-row x 3-token case. Ratios r = exp(logp - behaviour):
#   row 0: A = +1.0, r = [1.5, 1.0, 0.5], mask [1, 1, 1]
#   row 1: A = -0.5, r = [1.5, 0.5, 2.0], mask [1, 1, 0]   (last token is padding)
BEHAVIOUR = torch.tensor([[-1.0, -2.0, -0.5], [-1.2, -0.3, -0.7]])
RATIOS = torch.tensor([[1.5, 1.0, 0.5], [1.5, 0.5, 2.0]])
LOGPROBS = BEHAVIOUR + torch.log(RATIOS)
ADV = torch.tensor([1.0, -0.5])
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])


def _loss(logprobs, behaviour, adv, mask, replay, old=None, normalizer=None, clip=True, **fields):
    """The policy loss `setup_policy_loss` builds from `LossConfig(**fields)` (its unclipped variant when not
    `clip`), called on one batch: (loss, metrics)."""
    loss_fn = setup_policy_loss(LossConfig(**fields), clip_fresh=clip)
    return loss_fn(logprobs, LossBatch(behaviour, adv, mask, replay, old), normalizer)


def test_group_advantages_by_hand():
    # groups {0: [1, 0]}, {1: [1, 1]}: means 0.5 and 1 -> A = [0.5, -0.5, 0, 0]
    a = L.group_advantages(torch.tensor([1.0, 0.0, 1.0, 1.0]), torch.tensor([0, 0, 7, 7]))
    assert torch.allclose(a, torch.tensor([0.5, -0.5, 0.0, 0.0]))
    # std (unbiased) of group 0 = sqrt((0.25 + 0.25) / 1) = 0.70711 -> A = +-0.5 / 0.70711 = +-0.70711;
    # group 1 has std 0 -> 0 / eps = 0
    a = L.group_advantages(torch.tensor([1.0, 0.0, 1.0, 1.0]), torch.tensor([0, 0, 7, 7]), std_normalize=True)
    assert torch.allclose(a, torch.tensor([0.70711, -0.70711, 0.0, 0.0]), atol=1e-4)
    # a single-rollout group has advantage 0
    assert L.group_advantages(torch.tensor([1.0]), torch.tensor([3])).tolist() == [0.0]


def test_fresh_ppo_clipped_by_hand():
    # eps 0.2: clip(r) row 0 = [1.2, 1.0, 0.8], row 1 = [1.2, 0.8, -]
    # row 0 (A=+1): -A r = [-1.5, -1, -0.5], -A clip = [-1.2, -1, -0.8] -> max = [-1.2, -1, -0.5]; clipped: token 0
    # row 1 (A=-.5): -A r = [0.75, 0.25],   -A clip = [0.6, 0.4]        -> max = [0.75, 0.4];     clipped: token 1
    # sum = -1.2 - 1 - 0.5 + 0.75 + 0.4 = -1.55; token mean over 5 tokens = -0.31
    loss, m = _loss(LOGPROBS, BEHAVIOUR, ADV, MASK, torch.zeros(2, 3))
    assert loss.item() == pytest.approx(-0.31, abs=1e-6)
    assert m["clip_frac"].item() == pytest.approx(2 / 5)
    assert m["fresh_ratio_mean"].item() == pytest.approx((1.5 + 1 + 0.5 + 1.5 + 0.5) / 5)
    assert m["fresh_ratio_max"].item() == pytest.approx(1.5)
    assert m["replay_tokens"].item() == 0 and m["fresh_tokens"].item() == 5
    assert m["replay_loss"].item() == 0 and m["fresh_loss"].item() == pytest.approx(-0.31, abs=1e-6)
    # Dr. GRPO: sum / constant 10 = -0.155
    loss, _ = _loss(LOGPROBS, BEHAVIOUR, ADV, MASK, torch.zeros(2, 3), normalizer=10.0)
    assert loss.item() == pytest.approx(-0.155, abs=1e-6)
    # no clipping: -A r summed = -3 + 0.75 + 0.25 = -2.0 -> mean -0.4
    loss, m = _loss(LOGPROBS, BEHAVIOUR, ADV, MASK, torch.zeros(2, 3), clip=False)
    assert loss.item() == pytest.approx(-0.4, abs=1e-6)
    assert m["clip_frac"].item() == 0
    # asymmetric clip (low 0.1, high 0.4): row 0 clip = [1.4, 1, 0.9] -> max(-1.5,-1.4)=-1.4, -1, max(-.5,-.9)=-.5
    # row 1 clip = [1.4, 0.9] -> max(.75,.7)=.75, max(.25,.45)=.45; sum = -1.4-1-.5+.75+.45 = -1.7 -> -0.34
    loss, _ = _loss(LOGPROBS, BEHAVIOUR, ADV, MASK, torch.zeros(2, 3), policy_loss=dict(clip_low=0.1, clip_high=0.4))
    assert loss.item() == pytest.approx(-0.34, abs=1e-6)


def test_replayed_policy_shaping_by_hand():
    # row 0 replayed (A=+1, w = [1.5, 1, 0.5]), beta 0.1: -w/(w+0.1) = [-1.5/1.6, -1/1.1, -0.5/0.6]
    #   = [-0.9375, -0.909091, -0.833333], sum -2.679924 (no clipping)
    # row 1 fresh as above: [0.75, 0.4], sum 1.15
    # total -1.529924 / 5 tokens = -0.305985
    replay = torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])
    loss, m = _loss(LOGPROBS, BEHAVIOUR, ADV, MASK, replay, shaping_beta=0.1)
    assert loss.item() == pytest.approx(-1.529924 / 5, abs=1e-6)
    assert m["replay_loss"].item() == pytest.approx(-2.679924 / 5, abs=1e-6)
    assert m["fresh_loss"].item() == pytest.approx(1.15 / 5, abs=1e-6)
    assert m["replay_weight_mean"].item() == pytest.approx(1.0) and m["replay_weight_max"].item() == pytest.approx(1.5)
    assert m["clip_frac"].item() == pytest.approx(1 / 2)  # fresh tokens only: row 1 token 1
    # ablation: no shaping -> -A w = [-1.5, -1, -0.5], sum -3; total (-3 + 1.15)/5 = -0.37
    loss, _ = _loss(LOGPROBS, BEHAVIOUR, ADV, MASK, replay, shaping_beta=None)
    assert loss.item() == pytest.approx(-0.37, abs=1e-6)
    # a large ratio is not clipped for replayed tokens: w = 10 -> -10/10.1 (bounded by shaping, not by a clip)
    lp = BEHAVIOUR.clone()
    lp[0, 0] += LN(10.0)
    _, m = _loss(lp, BEHAVIOUR, ADV, MASK, replay)
    assert m["replay_weight_max"].item() == pytest.approx(10.0, rel=1e-5)


def textbook(logprobs, behaviour, adv, mask, replay, eps=0.2, beta=0.1):
    """Token by token, straight from the formulas (no vectorisation), token mean."""
    total, n = 0.0, 0
    for i in range(logprobs.shape[0]):
        for t in range(logprobs.shape[1]):
            if mask[i, t] == 0:
                continue
            r = torch.exp(logprobs[i, t] - behaviour[i, t])
            if replay[i, t]:
                total = total - adv[i] * r / (r + beta)
            else:
                total = total + torch.maximum(-adv[i] * r, -adv[i] * torch.clamp(r, 1 - eps, 1 + eps))
            n += 1
    return total / n


def test_gradients_match_textbook_autograd():
    replay = torch.tensor([[0.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
    lp1 = LOGPROBS.clone().requires_grad_(True)
    lp2 = LOGPROBS.clone().requires_grad_(True)
    loss, _ = _loss(lp1, BEHAVIOUR, ADV, MASK, replay)
    loss.backward()
    textbook(lp2, BEHAVIOUR, ADV, MASK, replay).backward()
    assert torch.allclose(lp1.grad, lp2.grad, atol=1e-7)
    # by hand: row 0 token 0 is clipped (A>0, r=1.5 > 1.2) -> zero gradient; token 1: d(-A r)/dlogp = -r = -1, /5
    assert lp1.grad[0, 0].item() == 0.0
    assert lp1.grad[0, 1].item() == pytest.approx(-1.0 / 5)
    # replayed row 1 token 0: d/dlogp [-A w/(w+b)] = -A b w/(w+b)^2 = 0.5*0.1*1.5/1.6^2 = 0.029297, /5
    assert lp1.grad[1, 0].item() == pytest.approx(0.5 * 0.1 * 1.5 / 1.6**2 / 5, rel=1e-5)
    # masked token: exactly zero
    assert lp1.grad[1, 2].item() == 0.0


def test_masked_tokens_contribute_nothing():
    replay = torch.tensor([[0.0, 1.0, 0.0], [1.0, 0.0, 1.0]])
    base, mb = _loss(LOGPROBS, BEHAVIOUR, ADV, MASK, replay)
    garbage_lp, garbage_b = LOGPROBS.clone(), BEHAVIOUR.clone()
    garbage_lp[1, 2], garbage_b[1, 2] = 1e4, -1e4  # exp(2e4) would be inf if it were used
    lp = garbage_lp.clone().requires_grad_(True)
    loss, m = _loss(lp, garbage_b, ADV, MASK, replay)
    loss.backward()
    assert torch.isfinite(loss) and loss.item() == pytest.approx(base.item())
    assert {k: v.item() for k, v in m.items()} == pytest.approx({k: v.item() for k, v in mb.items()})
    assert lp.grad[1, 2].item() == 0.0 and torch.isfinite(lp.grad).all()


def test_token_entropy_and_logprobs_by_hand():
    # vocab 2: logits [0, 0] -> H = ln 2 = 0.693147; [ln 3, 0] -> p = [.75, .25],
    # H = -(.75 ln .75 + .25 ln .25) = 0.562335; [30, 0] -> H ~ 0 (3.1e-12)
    logits = torch.tensor([[[0.0, 0.0], [LN(3), 0.0], [30.0, 0.0]],
                           [[LN(3), 0.0], [0.0, 0.0], [0.0, 0.0]]])  # [2, 3, 2]
    h = L.token_entropy(logits)
    expected = torch.tensor([[0.693147, 0.562335, 0.0], [0.562335, 0.693147, 0.693147]])
    assert torch.allclose(h, expected, atol=1e-5)
    assert torch.allclose(L.token_entropy(logits, chunk_size=1), h)  # chunking changes nothing
    assert torch.allclose(L.token_entropy(logits.bfloat16(), chunk_size=2), h, atol=2e-2)
    assert h.dtype == torch.float32
    # log p(target 0) under [ln 3, 0] = ln .75 = -0.287682; under [0, 0] = ln .5 = -0.693147
    lp = L.token_logprobs(logits, torch.tensor([[0, 0, 1], [0, 1, 0]]), chunk_size=4)
    assert lp[0, 1].item() == pytest.approx(-0.287682, abs=1e-6)
    assert lp[0, 0].item() == pytest.approx(-0.693147, abs=1e-6)
    assert lp[0, 2].item() == pytest.approx(-30.0, abs=1e-5)
    # per-row mean over MASK: row 0 = (0.693147 + 0.562335 + 0) / 3 = 0.418494; row 1 = (0.562335+0.693147)/2
    rm = L.row_mean(h, MASK)
    assert rm.tolist() == pytest.approx([0.418494, 0.627741], abs=1e-5)
    assert math.isnan(L.row_mean(h, torch.zeros(2, 3))[0].item())  # a row without tokens has no mean


def test_entropy_bonus_and_kl_terms_by_hand():
    # entropy bonus: -coef * token mean of H over MASK = -0.001 * (0.693147+0.562335+0+0.562335+0.693147)/5
    #   = -0.001 * 0.502193 = -0.000502193
    h = torch.tensor([[0.693147, 0.562335, 0.0], [0.562335, 0.693147, 99.0]])
    assert L.entropy_bonus(h, MASK, 0.001).item() == pytest.approx(-0.000502193, abs=1e-9)
    assert L.entropy_bonus(h, MASK, 0.001, normalizer=10.0).item() == pytest.approx(-0.000251096, abs=1e-9)
    # KL k3 with d = ref - logp: d = ln2 -> 2 - .693147 - 1 = .306853; d = 0 -> 0; d = -ln2 -> .5 + .693147 - 1
    #   = .193147. Row 0 d = [ln2, 0, -ln2], row 1 d = [0, ln2, (masked)]; sum = .306853*2 + .193147 = .806853
    #   coef 0.1, mean over 5 tokens: 0.1 * .806853 / 5 = 0.0161371
    logp = torch.zeros(2, 3)
    ref = torch.tensor([[LN(2), 0.0, -LN(2)], [0.0, LN(2), 50.0]])
    assert L.kl_penalty(logp, ref, MASK, 0.1).item() == pytest.approx(0.0161371, abs=1e-6)
    # gradient of k3 wrt logp: d/dlogp (e^d - d - 1) = -(e^d - 1): at d = ln2 -> -1, times 0.1 / 5
    lp = logp.clone().requires_grad_(True)
    L.kl_penalty(lp, ref, MASK, 0.1).backward()
    assert lp.grad[0, 0].item() == pytest.approx(-0.1 / 5, abs=1e-7) and lp.grad[1, 2].item() == 0.0


def test_entropy_gradient_matches_direct_formula():
    logits = torch.randn(2, 3, 5, generator=torch.Generator().manual_seed(0))
    a = logits.clone().requires_grad_(True)
    b = logits.clone().requires_grad_(True)
    L.entropy_bonus(L.token_entropy(a, chunk_size=2), MASK, 0.5).backward()
    p = torch.softmax(b, -1)
    h = -(p * torch.log(p)).sum(-1)
    (-0.5 * (h * MASK).sum() / MASK.sum()).backward()
    assert torch.allclose(a.grad, b.grad, atol=1e-6)
    assert torch.all(a.grad[1, 2] == 0)


def test_truncated_importance_sampling_by_hand():
    # The learner's log-probs at the start of the step sit between behaviour and now:
    #   raw TIS weight exp(old - behaviour) = [[1.5, 1, 0.5], [4, 1, (masked)]] -> cap 2: c = [[1.5, 1, .5], [2, 1]]
    #   proximal ratio r = exp(logp - old) = RATIOS / raw = [[1, 1, 1], [0.375, 0.5]]
    # row 0 (A=+1): -A r = [-1, -1, -1], clip(r, .8, 1.2) = r -> max = [-1, -1, -1]; times c = [-1.5, -1, -0.5]
    # row 1 (A=-.5): -A r = [0.1875, 0.25], -A clip = [0.4, 0.4] (both clipped) -> max = [0.4, 0.4];
    #   times c = [0.8, 0.4]
    # sum = -3 + 1.2 = -1.8; token mean over 5 = -0.36
    raw = torch.tensor([[1.5, 1.0, 0.5], [4.0, 1.0, 1.0]])
    old = BEHAVIOUR + torch.log(raw)
    lp = LOGPROBS.clone().requires_grad_(True)
    loss, m = _loss(lp, BEHAVIOUR, ADV, MASK, torch.zeros(2, 3), old=old, tis_cap=2.0)
    assert loss.item() == pytest.approx(-0.36, abs=1e-6)
    assert m["clip_frac"].item() == pytest.approx(2 / 5)
    assert m["fresh_ratio_mean"].item() == pytest.approx((1 + 1 + 1 + 0.375 + 0.5) / 5)  # the proximal ratio
    assert m["tis_weight_mean"].item() == pytest.approx((1.5 + 1 + 0.5 + 2 + 1) / 5)  # = 1.2
    assert m["tis_truncated_frac"].item() == pytest.approx(1 / 5)  # row 1 token 0 (4 -> 2)
    # gradient: row 0 token 0 unclipped: d(c * -A r)/dlogp = -A c r = -1.5, /5 = -0.3; the weight is constant
    # row 1 token 0 is clipped (r = .375 < .8 with A < 0): zero gradient
    loss.backward()
    assert lp.grad[0, 0].item() == pytest.approx(-0.3, abs=1e-6)
    assert lp.grad[1, 0].item() == 0.0
    # no mismatch (old == behaviour): c = 1 and the loss is the plain clipped one, -0.31
    loss, m = _loss(LOGPROBS, BEHAVIOUR, ADV, MASK, torch.zeros(2, 3), old=BEHAVIOUR, tis_cap=2.0)
    assert loss.item() == pytest.approx(-0.31, abs=1e-6) and m["tis_weight_mean"].item() == pytest.approx(1.0)
    # replayed tokens are untouched by TIS: row 0 replayed gives the shaping loss -2.679924 as before
    replay = torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])
    _, m = _loss(LOGPROBS, BEHAVIOUR, ADV, MASK, replay, old=old, tis_cap=2.0)
    assert m["replay_loss"].item() == pytest.approx(-2.679924 / 5, abs=1e-6)
    assert m["fresh_loss"].item() == pytest.approx(1.2 / 5, abs=1e-6)
    with pytest.raises(ValueError, match="old_logprobs"):
        _loss(LOGPROBS, BEHAVIOUR, ADV, MASK, torch.zeros(2, 3), tis_cap=2.0)


def test_logprob_gap_by_hand():
    # d = ln RATIOS: row 0 [ln 1.5, 0, ln .5], row 1 [ln 1.5, ln .5, (masked)]
    # sum |d| = 2 ln 1.5 + 2 ln 2 = 0.810930 + 1.386294 = 2.197225; max |d| = ln 2 = 0.693147; 5 tokens
    # lag 0 = row 0 only: exp(d) = [1.5, 1, .5] -> sum 3, sum of squares 2.25 + 1 + .25 = 3.5, 3 tokens
    #   (mean 1, std sqrt(3.5/3 - 1) = 0.408248)
    g = L.logprob_gap(LOGPROBS, BEHAVIOUR, MASK, torch.tensor([[1.0], [0.0]]).expand(2, 3))
    assert g["abs_sum"].item() == pytest.approx(2.197225, abs=1e-5)
    assert g["abs_max"].item() == pytest.approx(0.693147, abs=1e-6)
    assert g["tokens"].item() == 5 and g["lag0_tokens"].item() == 3
    assert g["ratio_sum"].item() == pytest.approx(3.0, abs=1e-6)
    assert g["ratio_sq_sum"].item() == pytest.approx(3.5, abs=1e-6)


def test_icepop_and_sequence_level_mis_by_hand():
    # As in the TIS case: mismatch m = exp(old - behaviour) = [[1.5, 1, 0.5], [4, 1, (masked)]], proximal
    # ratio r = [[1, 1, 1], [0.375, 0.5]], per-token PPO loss row 0 (A=+1) [-1, -1, -1], row 1 (A=-.5) [0.4, 0.4].
    raw = torch.tensor([[1.5, 1.0, 0.5], [4.0, 1.0, 1.0]])
    old = BEHAVIOUR + torch.log(raw)
    fresh_only = torch.zeros(2, 3)
    # IcePop band [0.6, 2]: row 0 token 2 (0.5) and row 1 token 0 (4) are masked -> -1 - 1 + 0.4 = -1.6, /5
    loss, m = _loss(LOGPROBS, BEHAVIOUR, ADV, MASK, fresh_only, old=old, icepop_band=(0.6, 2.0))
    assert loss.item() == pytest.approx(-0.32, abs=1e-6) and m["icepop_masked_frac"].item() == pytest.approx(2 / 5)
    # MIS truncate, cap 2: rho row 0 = 1.5 * 1 * 0.5 = 0.75, row 1 = 4 * 1 = 4 -> weights 0.75 and 2:
    # 0.75 * -3 + 2 * 0.8 = -0.65, /5; token-weighted mean weight (0.75 * 3 + 2 * 2) / 5 = 1.25
    loss, m = _loss(LOGPROBS, BEHAVIOUR, ADV, MASK, fresh_only, old=old, mis="truncate", mis_cap=2.0)
    assert loss.item() == pytest.approx(-0.13, abs=1e-6)
    assert m["mis_weight_mean"].item() == pytest.approx(1.25) and m["mis_masked_frac"].item() == 0.0
    # MIS mask, band [1/2, 2]: row 0 (0.75) stays, row 1 (4) is out -> -3 / 5; 2 of 5 fresh tokens masked
    loss, m = _loss(LOGPROBS, BEHAVIOUR, ADV, MASK, fresh_only, old=old, mis="mask", mis_cap=2.0)
    assert loss.item() == pytest.approx(-0.6, abs=1e-6) and m["mis_masked_frac"].item() == pytest.approx(2 / 5)
    # the weights carry no gradient: row 1 masked -> its tokens get none; row 0 token 1 gets -A r / 5 = -0.2
    lp = LOGPROBS.clone().requires_grad_(True)
    _loss(lp, BEHAVIOUR, ADV, MASK, fresh_only, old=old, mis="mask", mis_cap=2.0)[0].backward()
    assert lp.grad[1].abs().sum().item() == 0.0 and lp.grad[0, 1].item() == pytest.approx(-0.2, abs=1e-6)
    # without mismatch every correction is the identity: the plain clipped loss -0.31
    for kw in ({"icepop_band": (0.5, 2.0)}, {"mis": "truncate"}, {"mis": "mask"}):
        loss, _ = _loss(LOGPROBS, BEHAVIOUR, ADV, MASK, fresh_only, old=BEHAVIOUR, **kw)
        assert loss.item() == pytest.approx(-0.31, abs=1e-6), kw
    with pytest.raises(ValueError, match="old_logprobs"):
        _loss(LOGPROBS, BEHAVIOUR, ADV, MASK, fresh_only, mis="mask")


def test_dual_clip_bounds_negative_advantages_by_hand():
    # verl's dual-clip, c = 3, eps 0.2. row 0: A = -1, r = [4, 1.1, 0.5]; row 1: A = +1, r = [4] (+ 2 padding).
    # row 0: r = 4: -A r = 4, -A clip(r) = 1.2, max 4; A < 0: min(4, -A c = 3) = 3 (constant: no gradient, active)
    #        r = 1.1: 1.1 in the band: loss 1.1, gradient -A r = 1.1
    #        r = 0.5: max(0.5, -A 0.8 = 0.8) = 0.8 (clipped: no gradient, active)
    # row 1: r = 4: max(-4, -1.2) = -1.2 (clipped, no gradient); A > 0: no second bound
    # sum = 3 + 1.1 + 0.8 - 1.2 = 3.7 over 4 tokens = 0.925; gradient / 4 tokens: row 0 [0, 0.275, 0]; active 3 of 4
    beh = torch.full((2, 3), -2.0)
    ratios = torch.tensor([[4.0, 1.1, 0.5], [4.0, 1.0, 1.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    adv = torch.tensor([-1.0, 1.0])
    x = (beh + torch.log(ratios)).requires_grad_(True)
    loss, m = _loss(x, beh, adv, mask, torch.zeros(2, 3), policy_loss=dict(clip_ratio_c=3.0))
    loss.backward()
    assert loss.item() == pytest.approx(0.925, abs=1e-6)
    torch.testing.assert_close(x.grad, torch.tensor([[0.0, 0.275, 0.0], [0.0, 0.0, 0.0]]))
    assert m["clip_frac"].item() == pytest.approx(3 / 4)
    # without it (the default, as the official ExGRPO loss): row 0's r = 4 token keeps -A r = 4 and its gradient
    # 4 / 4 = 1: sum 4.7 / 4 = 1.175
    x.grad = None
    loss, m = _loss(x, beh, adv, mask, torch.zeros(2, 3))
    loss.backward()
    assert loss.item() == pytest.approx(1.175, abs=1e-6)
    torch.testing.assert_close(x.grad, torch.tensor([[1.0, 0.275, 0.0], [0.0, 0.0, 0.0]]))
    assert m["clip_frac"].item() == pytest.approx(2 / 4)
    # the same rows replayed under replay_loss=policy_loss take the same bound
    loss, m = _loss(x, beh, adv, mask, torch.ones(2, 3), policy_loss=dict(clip_ratio_c=3.0), replay_loss="policy_loss")
    assert loss.item() == pytest.approx(0.925, abs=1e-6) and m["replay_clip_frac"].item() == pytest.approx(3 / 4)
    # unclipped fresh tokens (learner.loss.clip_fresh off) have no second bound either: -A r summed = 4 + 1.1 + 0.5 - 4
    loss, _ = _loss(x, beh, adv, mask, torch.zeros(2, 3), policy_loss=dict(clip_ratio_c=3.0), clip=False)
    assert loss.item() == pytest.approx(1.6 / 4, abs=1e-6)
    with pytest.raises(ValueError, match="clip_ratio_c"):  # a field of ppo_clip's section only
        LearnerConfig(loss=dict(policy_loss=dict(kind="gspo", clip_ratio_c=3.0)))


def test_dual_clip_config_is_ppo_clips_only():
    from common.config import LearnerConfig
    from common.config import ConfigError, load_config
    assert LearnerConfig().loss.policy_loss.clip_ratio_c is None  # off by default: the official loss has no dual-clip
    dual = dict(policy_loss=dict(clip_ratio_c=3.0), clip_fresh="auto")
    assert "dual-clip 3 for A < 0" in LearnerConfig(loss=dual).loss_scale()
    with pytest.raises(ConfigError, match="clip_ratio_c is a field of kind ppo_clip, not of sapo: set "
                                          "learner.loss.policy_loss.kind=ppo_clip"):
        load_config(None, ["learner.loss.policy_loss=sapo", "learner.loss.policy_loss.clip_ratio_c=3"])
    with pytest.raises(ValueError, match="clip_fresh=false never clips"):
        LearnerConfig(loss=dict(policy_loss=dict(clip_ratio_c=3.0), clip_fresh=False))
    with pytest.raises(ValueError, match="greater than 1"):
        LearnerConfig(loss=dict(policy_loss=dict(clip_ratio_c=0.5)))
