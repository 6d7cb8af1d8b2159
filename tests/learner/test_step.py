"""The training step's bookkeeping (rows, splits, padding) and its update rule, in-process on a plain model."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from common.config import LearnerConfig
from tests.learner import sectioned
from common.messages import Rollout, TrainGroup, TrainingBatch, float32_array, int32_array
from learner.batching import (BatchError, MicroBatching, Row, balanced_partition, batch_rows, collate,
                              chunk_window_spans, rank_micro_batches, split_mini_batches)
from learner.forward import prepare_model
from learner.replay_choice import complete_groups
from learner.shape import TrainShape
from learner.step import RankStats, TrainStep
from bench.batches import make_batch, with_own_logprobs


def rollout(ids, reward=1.0, replayed=False, key=""):
    return Rollout(response_ids=int32_array(ids), logprobs=float32_array([-1.0] * len(ids)), reward=reward,
                   correct=reward >= 1, entropy=1.0, version=0, finish_reason="stop", key=key, replayed=replayed)


def test_rows_advantages_and_errors():
    batch = TrainingBatch(groups=[TrainGroup("qa", int32_array([5, 6]), [rollout([7, 8], 1.0), rollout([9], 0.0)],
                                             mixed=False),
                                  TrainGroup("qb", int32_array([5]),
                                             [rollout([7], 1.0, True, "qb#1"), rollout([8], 1.0)], mixed=True)],
                          version=0)
    rows = batch_rows(batch, std_normalize=False, max_positions=16)
    assert [r.advantage for r in rows] == [0.5, -0.5, 0.0, 0.0]
    assert [r.replayed for r in rows] == [False, False, True, False] and rows[2].key == "qb#1"
    with pytest.raises(BatchError, match="no groups"):
        batch_rows(TrainingBatch(groups=[], version=0), std_normalize=False, max_positions=16)
    with pytest.raises(BatchError, match=r"group 0 \(question 'qa'\) rollout 0: prompt\+response is 4 tokens.*3"):
        batch_rows(batch, std_normalize=False, max_positions=3)
    batch.groups[1].rollouts[1].logprobs = float32_array([-1.0, -1.0])
    with pytest.raises(BatchError, match="group 1 .*rollout 1: 2 log-probs for 1 response tokens"):
        batch_rows(batch, std_normalize=False, max_positions=16)


def test_splits_keep_groups_and_ranks_in_step():
    rows = batch_rows(complete_groups(make_batch(0, groups=5, candidates=1), {})[0], std_normalize=False,
                      max_positions=512)
    minis = split_mini_batches(rows, 2, seed=7)
    groups = [sorted({r.group for r in m}) for m in minis]
    assert sorted(len(g) for g in groups) == [2, 3] and sorted(sum(groups, [])) == [0, 1, 2, 3, 4]
    assert all(len({r.group for r in m if r.replayed}) >= 1 for m in minis)  # groups 0, 2, 4 are mixed
    assert [[id(r) for r in m] for m in split_mini_batches(rows, 2, seed=7)] == [[id(r) for r in m] for m in minis]
    assert len(split_mini_batches(rows, 9)) == 5  # never an empty mini-batch
    mini = minis[0] if len(minis[0]) >= len(minis[1]) else minis[1]
    per_rank = [rank_micro_batches(mini, r, 2, MicroBatching(rows=4)) for r in range(2)]
    assert len(per_rank[0]) == len(per_rank[1]) == 2  # 12 rows -> 6 per rank -> 2 micro-batches each
    dealt = sorted(id(r) for mbs in per_rank for mb in mbs for r in mb)
    assert dealt == sorted(id(r) for r in mini)
    assert rank_micro_batches(mini[:1], 1, 2, MicroBatching(rows=4)) == [[]]  # nothing left: a dummy micro-batch


def test_every_mini_batch_mixes_fresh_and_replayed_groups():
    # 8 groups, every other one mixed, 2 mini-batches: before the fix mixed groups came first and the
    # in-order split gave one all-replay and one all-fresh update
    batch, _ = complete_groups(make_batch(3, groups=8, candidates=1), {})
    rows = batch_rows(batch, std_normalize=False, max_positions=512)
    for seed in range(20):
        for m in split_mini_batches(rows, 2, seed=seed):
            mixed = {r.group for r in m if r.replayed}
            assert len(mixed) == 2 and len({r.group for r in m}) == 4


def test_collate_aligns_response_tokens():
    batch = TrainingBatch(groups=[TrainGroup("q", int32_array([5, 6, 7]), [rollout([8, 9]), rollout([10], 0.0, True)],
                                             mixed=True)], version=0)
    mb = collate(batch_rows(batch, std_normalize=False, max_positions=16), pad_id=0, device=torch.device("cpu"))
    # row 0 = [5 6 7 8 9]: targets [6 7 8 9], response targets 8, 9 at target positions 2, 3
    assert mb.input_ids.tolist() == [[5, 6, 7, 8, 9], [5, 6, 7, 10, 0]]
    assert mb.response_mask.tolist() == [[0, 0, 1, 1], [0, 0, 1, 0]]
    assert mb.replay_mask.tolist() == [[0, 0, 0, 0], [0, 0, 1, 0]]
    assert mb.attention_mask.tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 1, 0]]
    assert (mb.targets * mb.response_mask.long()).tolist() == [[0, 0, 8, 9], [0, 0, 10, 0]]
    dummy = collate([], pad_id=0, device=torch.device("cpu"))
    assert dummy.response_mask.sum() == 0 and dummy.input_ids.shape == (1, 2)


def plain_step(model_dir, **overrides):
    from transformers import AutoModelForCausalLM

    cfg = LearnerConfig(**sectioned({"micro_batch_rows": 4, **overrides}))
    model = prepare_model(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.optim.lr)
    return model, TrainStep(model, opt, cfg, TrainShape(max_new_tokens=12, max_positions=512), rank=0,
                            device=torch.device("cpu"))


def test_update_skipped_when_gradient_norm_too_large(tiny_model_dir):
    model, step = plain_step(tiny_model_dir, skip_grad_norm=1e-9, mini_batches=2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    stats = step.run(make_batch(0))
    assert stats.updates == 0 and stats.skipped == 2 and len(stats.grad_norms) == 2
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())


def test_batch_without_response_tokens_changes_nothing(tiny_model_dir):
    model, step = plain_step(tiny_model_dir)
    batch = TrainingBatch(groups=[TrainGroup("q", int32_array([5, 6]), [rollout([], 1.0), rollout([], 0.0)],
                                             mixed=False)], version=0)
    stats = step.run(batch)
    assert stats.updates == 0 and stats.skipped == 1 and stats.feedback.keys == []


def test_kl_term_and_constant_normalizer(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model, step = plain_step(tiny_model_dir, kl_coef=0.5, loss_agg="constant", loss_constant=1000.0)
    step.ref_model = prepare_model(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval(),
                                   step.cfg, trainable=False)
    stats = step.run(make_batch(0))
    # the policy starts equal to the reference: KL (k3) is exactly 0 on the first and only update
    assert stats.updates == 1 and stats.sums["kl_loss"] == pytest.approx(0.0, abs=1e-7)
    assert np.isfinite(stats.sums["loss"]) and stats.sums["entropy_loss"] < 0



def test_mismatch_metrics_zero_without_mismatch_and_lag0_only(tiny_model_dir):
    from learner.step import merge_rank_stats

    model, step = plain_step(tiny_model_dir, mini_batches=2)
    m, _ = merge_rank_stats([step.run(with_own_logprobs(make_batch(0, version=0), model))])
    # behaviour = the learner's own log-probs before the update: no gap, every ratio exactly 1
    assert m["learner/logprob_diff_mean"] < 1e-5 and m["learner/logprob_diff_max"] < 1e-4
    assert m["learner/logprob_ratio_std_lag0"] < 1e-5
    # measured on the first mini-batch only: fewer tokens than the step's fresh tokens
    assert 0 < m["learner/lag0_tokens"] < m["learner/fresh_tokens"]
    assert np.isnan(m["learner/tis_weight_mean"])
    # rollouts one version old (lag 1): the gap is measured, the lag-0 spread is not
    batch = make_batch(1, version=0)
    batch.version = 1
    m, _ = merge_rank_stats([step.run(batch)])
    assert m["learner/logprob_diff_mean"] > 0.01 and m["learner/lag0_tokens"] == 0
    assert np.isnan(m["learner/logprob_ratio_std_lag0"])


def test_tis_without_mismatch_is_the_plain_update(tiny_model_dir):
    """With behaviour = the learner's start-of-step log-probs, TIS weights are 1 and the proximal ratio is
    the behaviour ratio: the update equals the plain one, in the second mini-batch too (whose start-of-step
    log-probs come from `record_old_logprobs`, not from a forward after the first update)."""
    states, metrics = [], []
    for cap in (None, 2.0):
        model, step = plain_step(tiny_model_dir, mini_batches=2, tis_cap=cap, lr=1e-2)
        stats = step.run(with_own_logprobs(make_batch(0), model))
        assert stats.updates == 2
        states.append({k: v.clone() for k, v in model.state_dict().items()})
        metrics.append(stats.sums)
    assert all(torch.allclose(states[0][k], states[1][k], atol=1e-6) for k in states[0])
    # a `mean` metric's sum is value x count: each TIS weight is 1, none truncated
    assert metrics[1]["tis_weight_mean"] == pytest.approx(metrics[1]["fresh_tokens"], rel=1e-5)
    assert metrics[1]["tis_truncated_frac"] == 0


def assert_same_step(stats: RankStats, sd: dict, want: RankStats, want_sd: dict) -> None:
    """Two steps trained the same: candidate feedback, loss sums and the weights after the updates."""
    assert stats.feedback.keys == want.feedback.keys and stats.feedback.chosen == want.feedback.chosen
    assert stats.feedback.entropies == pytest.approx(want.feedback.entropies, rel=1e-5)
    for k in ("loss", "entropy_loss", "kl_loss", "entropy_fresh", "tis_weight_mean", "gap_abs_sum"):
        assert stats.sums[k] == pytest.approx(want.sums[k], rel=1e-4, abs=1e-6), k
    for k in want_sd:
        torch.testing.assert_close(sd[k], want_sd[k], rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("overrides", [{}, {"tis_cap": 2.0}, {"kl_coef": 0.5}, {"entropy_coef": 0.1}])
def test_chunked_head_step_equals_the_full_logits_step(tiny_model_dir, overrides):
    """The default path (chunked LM head, any chunk size) trains exactly what full logits train: candidate
    scores, feedback, metrics and the weights after 2 updates. KL: a reference model on either path."""
    from transformers import AutoModelForCausalLM

    results = []
    for chunk in (0, None, 3):
        model, step = plain_step(tiny_model_dir, mini_batches=2, logits_chunk_tokens=chunk, **overrides)
        step.optimizer = torch.optim.SGD(model.parameters(), lr=1.0)  # the update is the (clipped) gradient itself
        if overrides.get("kl_coef"):
            ref = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
            ref.model.layers[0].mlp.up_proj.weight.data.mul_(1.1)  # a reference that differs: KL > 0
            step.ref_model = prepare_model(ref, step.cfg, trainable=False)
        stats = step.run(with_own_logprobs(make_batch(3, candidates=3, vocab=60), model))
        results.append((stats, {k: v.clone() for k, v in model.state_dict().items()}))
    (full, full_sd), rest = results[0], results[1:]
    assert full.updates == 2 and full.candidates_scored > 0
    for stats, sd in rest:
        assert_same_step(stats, sd, full, full_sd)
    if overrides.get("kl_coef"):
        assert full.sums["kl_loss"] > 0


def test_token_budget_packs_every_row_once_with_equal_counts_per_rank():
    """The paper's settings (2 mini-batches, 2 ranks): each mini-batch's rows are packed on every rank
    within the budget, each row exactly once, and both ranks run as many micro-batches."""
    rows = batch_rows(complete_groups(make_batch(2, groups=8, group_size=8, candidates=1, response_len=(1, 60),
                                                 prompt_len=(4, 30)), {})[0], std_normalize=False,
                      max_positions=512)
    longest = max(r.length for r in rows)
    for budget in (longest, 2 * longest + 1, 300, 10_000):
        for mini in split_mini_batches(rows, 2, seed=1):
            per_rank = [rank_micro_batches(mini, r, 2, MicroBatching(rows=64, tokens=budget)) for r in range(2)]
            assert len(per_rank[0]) == len(per_rank[1])
            dealt = [id(r) for mbs in per_rank for mb in mbs for r in mb]
            assert sorted(dealt) == sorted(id(r) for r in mini)  # every row exactly once
            for mb in (mb for mbs in per_rank for mb in mbs if mb):
                assert len(mb) * max(r.length for r in mb) <= budget or len(mb) == 1
    tight = [rank_micro_batches(rows, r, 2, MicroBatching(rows=64, tokens=longest)) for r in range(2)]
    assert all(len(mb) <= 1 or len(mb) * mb[0].length <= longest for mbs in tight for mb in mbs)
    assert len(rank_micro_batches(rows, 0, 2, MicroBatching(rows=5, tokens=10 ** 6))) == -(-len(rows) // 2 // 5)
    assert rank_micro_batches(rows[:1], 1, 2, MicroBatching(rows=4, tokens=1000)) == [[]]  # the other rank's dummy


@pytest.mark.parametrize("budget", [None, 60, 300])
def test_padding_free_packs_every_row_once_within_the_budget_of_real_tokens(budget):
    """The paper's settings (2 mini-batches, 2 ranks), packed without padding: each row exactly once, both
    ranks run as many micro-batches, and a micro-batch's real tokens stay within the budget (a longer row
    alone), in no more micro-batches than the padded packing needs."""
    rows = batch_rows(complete_groups(make_batch(2, groups=8, group_size=8, candidates=1, response_len=(1, 60),
                                                 prompt_len=(4, 30)), {})[0], std_normalize=False,
                      max_positions=512)
    budget = budget or max(r.length for r in rows)
    for mini in split_mini_batches(rows, 2, seed=1):
        per_rank = [rank_micro_batches(mini, r, 2, MicroBatching(rows=64, tokens=budget, padding_free=True))
                    for r in range(2)]
        padded = rank_micro_batches(mini, 0, 2, MicroBatching(rows=64, tokens=budget))
        assert len(per_rank[0]) == len(per_rank[1]) <= len(padded)
        dealt = [id(r) for mbs in per_rank for mb in mbs for r in mb]
        assert sorted(dealt) == sorted(id(r) for r in mini)
        for mb in (mb for mbs in per_rank for mb in mbs if mb):
            assert sum(r.length for r in mb) <= budget or len(mb) == 1
    capped = rank_micro_batches(rows, 0, 1, MicroBatching(rows=3, tokens=10 ** 6, padding_free=True))
    assert [len(mb) for mb in capped] == [3] * (len(rows) // 3) + ([len(rows) % 3] if len(rows) % 3 else [])


def test_balanced_partition_is_the_largest_differencing_method_worked_by_hand():
    """Karmarkar-Karp as verl runs it. [8, 7, 6, 5, 4] in 2 parts: the tuples ({n}, {}) are pushed shortest first
    and popped largest spread first: 8 with 7 gives ({8}, {7}) spread 1; 6 with 5 gives ({6}, {5}) spread 1; 4 with
    ({8}, {7}) (spread 1 like ({6}, {5}), but its largest subset is larger) gives ({4, 7} = 11, {8}) spread 3;
    that with ({6}, {5}): the largest with the smallest, {4, 7, 5} = 16 and {8, 6} = 14 (the optimum is 15/15: a
    heuristic). In 3 parts: ({8}, {7}, {}) spread 8 first ... ends {7, 4} = 11, {6, 5} = 11, {8}."""
    assert balanced_partition([8, 7, 6, 5, 4], 2) == [[1, 3, 4], [0, 2]]
    assert balanced_partition([8, 7, 6, 5, 4], 3) == [[1, 4], [2, 3], [0]]
    assert balanced_partition([5], 3) == [[0], [], []]  # fewer items than parts: empty ones (dummy micro-batches)
    assert balanced_partition([], 2) == [[], []]
    rng = np.random.default_rng(0)
    for _ in range(50):
        lengths = [int(n) for n in rng.integers(1, 9000, int(rng.integers(1, 40)))]
        k = int(rng.integers(1, 9))
        parts = balanced_partition(lengths, k)
        assert len(parts) == k and sorted(i for p in parts for i in p) == list(range(len(lengths)))
        sums = [sum(lengths[i] for i in p) for p in parts]
        assert sums == sorted(sums, reverse=True)
        assert sums[0] - sums[-1] <= max(lengths)  # balanced to within one item
    with pytest.raises(ValueError, match="at least one part"):
        balanced_partition([1, 2], 0)


def test_balanced_split_makes_ceil_tokens_over_budget_micro_batches_on_every_rank():
    """learner.batching.micro_batch_split=balanced (verl's dynamic batch size) at the paper's settings (2 ranks, 2
    mini-batches): each rank's count is ceil(its tokens / budget), the largest for all; every row once; the
    parts' token sums within one row of each other; never more micro-batches than first fit's."""
    rows = batch_rows(complete_groups(make_batch(2, groups=8, group_size=8, candidates=1, response_len=(1, 60),
                                                 prompt_len=(4, 30)), {})[0], std_normalize=False,
                      max_positions=512)
    for budget in (max(r.length for r in rows), 300, 10 ** 6):
        for mini in split_mini_batches(rows, 2, seed=1):
            per_rank = [rank_micro_batches(mini, r, 2, MicroBatching(rows=4, tokens=budget, padding_free=True,
                                           split="balanced")) for r in range(2)]
            ordered = sorted(mini, key=lambda r: (-r.length, r.group))
            want = max(-(-sum(r.length for r in ordered[k::2]) // budget) for k in range(2))
            assert len(per_rank[0]) == len(per_rank[1]) == max(1, want)
            assert sorted(id(r) for mbs in per_rank for mb in mbs for r in mb) == sorted(id(r) for r in mini)
            for mbs in per_rank:
                sums = [sum(r.length for r in mb) for mb in mbs]
                assert max(sums) - min(sums) <= max(r.length for r in mini)
            first_fit = rank_micro_batches(mini, 0, 2, MicroBatching(rows=10 ** 6, tokens=budget, padding_free=True))
            assert len(per_rank[0]) <= len(first_fit)
    # padded micro-batches (no packing) ignore it: first fit under the padded cost
    assert rank_micro_batches(rows, 0, 2, MicroBatching(rows=4, tokens=300, split="balanced")) == \
        rank_micro_batches(rows, 0, 2, MicroBatching(rows=4, tokens=300))


def test_balanced_split_runs_only_where_rows_are_packed_and_says_so():
    from learner.levers import resolve_levers

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    cfg, notes = resolve_levers(LearnerConfig(batching=dict(micro_batch_split="balanced", micro_batch_tokens=4096)), cpu)
    assert cfg.batching.micro_batch_split == "first_fit" and "padded micro-batches run here (auto: not CUDA" in notes[-1]
    cfg, notes = resolve_levers(LearnerConfig(batching=dict(micro_batch_split="balanced", micro_batch_tokens=4096)), cuda,
                                torch.bfloat16, flash=False, flex=True)  # CUDA packs only when asked (issue 42)
    assert cfg.batching.micro_batch_split == "first_fit" and "packing is opt-in" in notes[-1]
    cfg, notes = resolve_levers(LearnerConfig(batching=dict(micro_batch_split="balanced", micro_batch_tokens=4096),
                                              levers=dict(padding_free=True)), cuda, torch.bfloat16, flash=False, flex=True)
    assert cfg.batching.micro_batch_split == "balanced" and "balanced (verl's dynamic batch size" in notes[-1]
    for bad in ({"padding_free": True}, {"micro_batch_tokens": 4096, "padding_free": False}):  # refused up front
        with pytest.raises(ValueError, match="micro_batch_split=balanced cuts padding-free micro-batches by their "
                                             "token budget: set learner.batching.micro_batch_tokens"):
            LearnerConfig(**sectioned({"micro_batch_split": "balanced", **bad}))


def test_balanced_micro_batches_train_the_same_update_as_first_fit(tiny_model_dir):
    """With the token-mean entropy the gradient does not depend on how a mini-batch is cut (the loss is a token
    sum over it): balanced and first-fit packed micro-batches, cut differently here, give the same update (SGD,
    so that the weights show the gradient itself: AdamW's first step is about lr x its sign, which a rounding
    flips where a gradient is ~0)."""
    batch = make_batch(3, groups=4, group_size=4, candidates=1, response_len=(1, 40), prompt_len=(4, 20))
    weights, cuts = [], []
    for split in ("first_fit", "balanced"):
        model, step = plain_step(tiny_model_dir, padding_free=True, micro_batch_tokens=120, micro_batch_rows=64,
                                 micro_batch_split=split, mini_batches=2)
        step.optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
        before = {k: v.detach().clone() for k, v in model.state_dict().items()}
        rows = batch_rows(complete_groups(batch, {})[0], std_normalize=True, max_positions=512)
        cuts.append([sorted(r.length for r in mb) for mb in step.micro_batches(rows)])
        assert step.run(batch).updates == 2
        weights.append({k: v.detach() - before[k] for k, v in model.state_dict().items()})  # the two updates
    assert cuts[0] != cuts[1] and len(cuts[1]) <= len(cuts[0])
    assert max(float(w.abs().max()) for w in weights[0].values()) > 1e-3  # it trained
    for k in weights[0]:
        torch.testing.assert_close(weights[1][k], weights[0][k], rtol=1e-4, atol=1e-6)


def test_packed_layout_keeps_rows_and_response_tokens_in_order():
    batch = TrainingBatch(groups=[TrainGroup("q", int32_array([5, 6, 7]), [rollout([8, 9]), rollout([10], 0.0, True)],
                                             mixed=True)], version=0)
    mb = collate(batch_rows(batch, std_normalize=False, max_positions=16), pad_id=0, device=torch.device("cpu"),
                 packed=True)
    p = mb.packed
    assert p.input_ids.tolist() == [[5, 6, 7, 8, 9, 5, 6, 7, 10]] and mb.forward_tokens == 9
    assert p.position_ids.tolist() == [[0, 1, 2, 3, 4, 0, 1, 2, 3]]
    assert p.mask.tolist() == [[0, 0, 1, 1, 0, 0, 0, 1]]  # the boundary (9 predicts 5) is no target
    assert (p.targets * p.mask.long()).tolist() == [[0, 0, 8, 9, 0, 0, 0, 10]]
    assert mb.input_ids.shape == (2, 5) and mb.response_mask.tolist() == [[0, 0, 1, 1], [0, 0, 1, 0]]
    assert collate([], pad_id=0, device=torch.device("cpu"), packed=True).packed is None  # the dummy stays padded


@pytest.mark.parametrize("overrides", [{}, {"logits_chunk_tokens": 0, "tis_cap": 2.0}, {"kl_coef": 0.5},
                                       {"micro_batch_tokens": 60, "entropy_coef": 0.1}])
def test_padding_free_step_equals_the_padded_step(tiny_model_dir, overrides):
    """Packed without padding, a step trains what the padded step trains: candidate scores (an eval forward,
    where a KV cache would switch transformers' packed masking off), feedback, metrics, weights after 2
    updates; chunked head or full logits, TIS's recorded log-probs, a reference model's KL."""
    from transformers import AutoModelForCausalLM

    results = []
    for padding_free in (False, True):
        model, step = plain_step(tiny_model_dir, mini_batches=2, padding_free=padding_free, **overrides)
        step.optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
        if overrides.get("kl_coef"):
            ref = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
            ref.model.layers[0].mlp.up_proj.weight.data.mul_(1.1)
            step.ref_model = prepare_model(ref, step.cfg, trainable=False)
        stats = step.run(with_own_logprobs(make_batch(3, candidates=3, vocab=60), model))
        results.append((stats, {k: v.clone() for k, v in model.state_dict().items()}))
    (padded, padded_sd), (packed, packed_sd) = results
    assert packed.updates == padded.updates == 2 and packed.candidates_scored > 0
    assert packed.padding_free == 1.0 and padded.padding_free == 0.0
    assert packed.sums["row_tokens"] == packed.sums["forward_tokens"] < padded.sums["forward_tokens"]
    assert_same_step(packed, packed_sd, padded, padded_sd)


def test_a_model_that_lets_packed_rows_see_each_other_is_refused(tiny_model_dir):
    """check_packing passes the built-in Qwen2 under sdpa and eager and refuses a model whose forward drops
    position_ids (its packed rows would attend to each other), saying what to change."""
    from transformers import AutoModelForCausalLM

    from learner.forward import PackingError, check_packing

    for impl in ("sdpa", "eager"):
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32, attn_implementation=impl)
        model.train()
        assert check_packing(prepare_model(model, LearnerConfig()), torch.device("cpu")) < 1e-5
        assert model.training  # left as it was

    base = type(model)

    class DropsPositions(base):
        def forward(self, *args, position_ids=None, **kwargs):
            return super().forward(*args, **kwargs)

    blind = DropsPositions.from_pretrained(tiny_model_dir, dtype=torch.float32)
    with pytest.raises(PackingError, match="attend to each other.*learner.levers.padding_free=false"):
        check_packing(prepare_model(blind, LearnerConfig()), torch.device("cpu"))


@pytest.mark.parametrize("overrides", [{"micro_batch_tokens": 60}, {"activation_checkpointing": True}])
def test_token_budget_and_activation_checkpointing_train_the_same_update(tiny_model_dir, overrides):
    states = []
    for extra in ({}, overrides):
        model, step = plain_step(tiny_model_dir, mini_batches=2, **extra)
        step.optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
        stats = step.run(make_batch(4, candidates=2))
        assert stats.updates == 2
        states.append({k: v.clone() for k, v in model.state_dict().items()})
    for k in states[0]:
        torch.testing.assert_close(states[1][k], states[0][k], rtol=1e-4, atol=1e-6)


def test_overlong_penalty_is_dapos_soft_ramp():
    from learner.loss import overlong_penalty

    pen = overlong_penalty(torch.tensor([0, 50, 80, 81, 90, 100]), max_new_tokens=100, buffer=20)
    assert pen.tolist() == pytest.approx([0.0, 0.0, 0.0, -0.05, -0.5, -1.0])


def _overlong_batch() -> TrainingBatch:
    """One group of 4: two correct answers (one cut at 12 = max_new_tokens), two wrong (one cut)."""
    def ro(n, reward, finish):
        return Rollout(response_ids=int32_array(list(range(5, 5 + n))), logprobs=float32_array([-1.0] * n),
                       reward=reward, correct=reward >= 1, entropy=1.0, version=0, finish_reason=finish)
    return TrainingBatch(groups=[TrainGroup("q", int32_array([5, 6, 7]), [
        ro(12, 1.0, "length"), ro(4, 1.0, "stop"), ro(12, 0.0, "length"), ro(6, 0.0, "stop")], mixed=False)],
        version=0)


def test_overlong_penalty_shapes_the_advantages():
    rows = batch_rows(_overlong_batch(), std_normalize=False, max_positions=64, overlong="penalty", max_new_tokens=12,
                      overlong_buffer=4)
    # rewards 1, 1, 0, 0 with penalties -1, 0, -1, 0 -> 0, 1, -1, 0; mean 0
    assert [r.penalty for r in rows] == [-1.0, 0.0, -1.0, 0.0]
    assert [r.advantage for r in rows] == pytest.approx([0.0, 1.0, -1.0, 0.0])
    plain = batch_rows(_overlong_batch(), std_normalize=False, max_positions=64)
    assert [r.advantage for r in plain] == pytest.approx([0.5, 0.5, -0.5, -0.5]) and not any(r.penalty for r in plain)


def test_overlong_mask_leaves_truncated_rows_out_of_the_loss(tiny_model_dir):
    from learner.step import merge_rank_stats

    _, step = plain_step(tiny_model_dir, overlong="mask")
    stats = step.run(_overlong_batch())
    m, _ = merge_rank_stats([stats])
    assert m["learner/overlong_masked"] == 2 and m["learner/rows"] == 2
    assert m["learner/fresh_tokens"] == 4 + 6  # only the untruncated responses are trained
    # their advantages still come from the whole group (mean 0.5): +0.5 and -0.5
    assert m["learner/advantage_abs_mean"] == pytest.approx(0.5)
    _, step = plain_step(tiny_model_dir, overlong="penalty", overlong_buffer=4)
    m, _ = merge_rank_stats([step.run(_overlong_batch())])
    assert m["learner/overlong_masked"] == 0 and m["learner/overlong_penalty_mean"] == pytest.approx(-0.5)


@pytest.mark.parametrize("overrides, key, value", [
    ({"icepop_band": (0.5, 2.0)}, "learner/icepop_masked_frac", 0.0),
    ({"mis": "truncate"}, "learner/mis_weight_mean", 1.0),
    ({"mis": "mask"}, "learner/mis_masked_frac", 0.0),
])
def test_mismatch_corrections_without_mismatch_are_the_plain_update(tiny_model_dir, overrides, key, value):
    """Behaviour = the learner's start-of-step log-probs: IcePop keeps every token and MIS weighs every row 1,
    in the second mini-batch too (its start-of-step log-probs come from `record_old_logprobs`)."""
    from learner.step import merge_rank_stats

    states, metrics = [], []
    for extra in ({}, overrides):
        model, step = plain_step(tiny_model_dir, mini_batches=2, **extra)
        step.optimizer = torch.optim.SGD(model.parameters(), lr=1.0)  # the update is the gradient (AdamW would
        stats = step.run(with_own_logprobs(make_batch(0), model))    # magnify float32 noise of ~0 gradients)
        assert stats.updates == 2
        states.append({k: v.clone() for k, v in model.state_dict().items()})
        metrics.append(merge_rank_stats([stats])[0])
    for k in states[0]:
        torch.testing.assert_close(states[1][k], states[0][k], rtol=1e-4, atol=1e-6)
    assert metrics[1][key] == pytest.approx(value, abs=1e-5) and np.isnan(metrics[0][key])


def _sgd_state(model_dir, batch_fn, **overrides) -> tuple[dict, RankStats]:
    model, step = plain_step(model_dir, mini_batches=2, **overrides)
    step.optimizer = torch.optim.SGD(model.parameters(), lr=1.0)  # the update is the gradient itself
    stats = step.run(batch_fn(model))
    return {k: v.clone() for k, v in model.state_dict().items()}, stats


def _same(a: dict, b: dict) -> bool:
    return all(torch.allclose(a[k], b[k], rtol=1e-4, atol=1e-6) for k in a)


def test_recomputed_old_logprobs_centre_the_ratio_on_the_learner(tiny_model_dir):
    """recompute_old_logprobs: the ratio is taken against the learner's own start-of-step log-probs, so far-off
    generator log-probs train exactly what the learner's own would have (fresh groups only)."""
    far = lambda model: make_batch(0, mixed_every=0)  # noqa: E731  behaviour log-probs of another policy
    own = lambda model: with_own_logprobs(make_batch(0, mixed_every=0), model)  # noqa: E731
    recomputed, stats = _sgd_state(tiny_model_dir, far, recompute_old_logprobs=True)
    reference, _ = _sgd_state(tiny_model_dir, own)
    plain, _ = _sgd_state(tiny_model_dir, far)
    assert stats.updates == 2 and _same(recomputed, reference)
    assert not _same(plain, reference)  # without it the far-off log-probs change the update (clipping bites)


def test_clip_fresh_auto_clips_until_mixed_mode(tiny_model_dir):
    def batch(mixed: bool):
        def make(model):
            b = make_batch(0)
            b.mixed_mode = mixed
            return b
        return make

    clipped, _ = _sgd_state(tiny_model_dir, batch(False), clip_fresh=True)
    unclipped, _ = _sgd_state(tiny_model_dir, batch(False), clip_fresh=False)
    assert not _same(clipped, unclipped)  # the batch's ratios reach the clip range
    before, s0 = _sgd_state(tiny_model_dir, batch(False), clip_fresh="auto")
    after, s1 = _sgd_state(tiny_model_dir, batch(True), clip_fresh="auto")
    assert _same(before, clipped) and s0.step_metrics["clip_fresh"] == 1.0
    assert _same(after, unclipped) and s1.step_metrics["clip_fresh"] == 0.0


def test_entropy_bonus_is_a_token_mean_under_constant_aggregation(tiny_model_dir):
    """loss_agg=constant divides the policy loss by a constant; the entropy bonus stays a masked token mean
    (as the official code), not entropy_sum / constant."""
    model, step = plain_step(tiny_model_dir, loss_agg="constant", loss_constant=1000.0, entropy_coef=0.1)
    s = step.run(make_batch(0)).sums
    mean_entropy = (s["entropy_fresh"] + s["entropy_replayed"]) / (s["fresh_tokens"] + s["replay_tokens"])
    assert -s["entropy_loss"] / 0.1 == pytest.approx(mean_entropy, rel=1e-5)


def test_trained_fresh_rows_the_buffer_stored_come_back_measured(tiny_model_dir):
    """Every fresh row with a key (a correct rollout the buffer stored) reports its exact mean token entropy from
    the training forward, so the buffer can rank new trajectories against measured ones."""
    from learner.step import merge_rank_stats

    model, step = plain_step(tiny_model_dir)
    batch = make_batch(0, mixed_every=0)
    expected = {}
    with torch.no_grad():
        for g in batch.groups:
            for ro in g.rollouts:
                ids = torch.tensor([list(g.prompt_ids) + list(ro.response_ids)])  # [1, P+T]
                logits = model(input_ids=ids).logits[0, len(g.prompt_ids) - 1:-1].float()  # [T, V]
                p = torch.softmax(logits, -1)
                expected[ro.key] = float(-(p * torch.log_softmax(logits, -1)).sum(-1).mean())
    _, fb = merge_rank_stats([step.run(batch)])  # one mini-batch: the forward is at the start weights
    assert sorted(fb.fresh_keys) == sorted(expected) and not fb.chosen and not fb.keys  # (keys: candidates)
    for key, h in zip(fb.fresh_keys, fb.fresh_entropies):
        assert h == pytest.approx(expected[key], rel=1e-4), key


@pytest.mark.parametrize("entropy_agg", ["micro_batch", "token_mean"])
def test_the_official_gradient_at_its_gpu_count(tiny_model_dir, entropy_agg):
    """Issue 35 (1, 2): the official loss worked out by hand for a batch split as the official code splits it, 2 GPUs
    x 2 micro-batches of 2 rows, and our step on one rank with loss_agg=constant, loss_world_size=2 and
    entropy_agg=micro_batch give the same gradient. Official (mix_core_alg.py, loss_remove_token_mean; mix_actor.py,
    gradient_accumulation 1): each micro-batch's loss is sum(pg * mask) / C - coef * masked_mean(entropy), a GPU
    sums its micro-batches' gradients and FSDP averages over the W GPUs:

        grad = (1/W) * sum_gpus sum_micro_batches grad[ sum(pg) / C - coef * mean(H) ]

    so the policy term's divisor is C * W (65,536 in the official run, 8 times our loss_constant=8192 alone) and
    the entropy term weighs each micro-batch's mean, not one mean over the mini-batch. With equal responses (6
    tokens) and micro-batches (12 tokens) the sum of the micro-batch means does not depend on which rows share
    one, so the hand computation needs no knowledge of our row order. token_mean (one mean over the mini-batch)
    weighs the entropy 2 micro-batches per GPU times less: a different gradient."""
    import copy

    C, W, coef = 64.0, 2, 0.1
    model, step = plain_step(tiny_model_dir, loss_agg="constant", loss_constant=C, loss_world_size=W,
                             entropy_agg=entropy_agg, entropy_coef=coef, micro_batch_rows=2, grad_clip=1e9)
    batch = with_own_logprobs(make_batch(0, groups=2, group_size=4, mixed_every=0, response_len=(6, 6)), model)
    hand = copy.deepcopy(model)
    start = {k: v.detach().clone() for k, v in model.named_parameters()}
    step.optimizer = torch.optim.SGD(model.parameters(), lr=1.0)  # the update is the gradient itself
    assert step.run(batch).updates == 1
    ours = {k: start[k] - v.detach() for k, v in model.named_parameters()}

    pg_sum, ent_sum = 0.0, 0.0
    for g in batch.groups:
        rewards = [ro.reward for ro in g.rollouts]
        for ro in g.rollouts:
            adv = ro.reward - sum(rewards) / len(rewards)
            ids = torch.tensor([list(g.prompt_ids) + list(ro.response_ids)])  # [1, P+T]
            logits = hand(input_ids=ids).logits[0, len(g.prompt_ids) - 1:-1].float()  # [T, V]
            logp_all = torch.log_softmax(logits, -1)  # [T, V]
            logp = logp_all.gather(1, ids[0, len(g.prompt_ids):, None])[:, 0]  # [T]
            ratio = torch.exp(logp - torch.from_numpy(ro.logprobs))  # 1 at the start: clipping inactive
            pg_sum = pg_sum + (-adv * ratio).sum()
            ent_sum = ent_sum + (-(logp_all.exp() * logp_all).sum(-1)).sum()
    # 4 micro-batches of 2 rows x 6 tokens: sum over them of (their entropy sum / 12) = ent_sum / 12
    loss = (pg_sum / C - coef * ent_sum / 12) / W
    loss.backward()
    want = {k: p.grad for k, p in hand.named_parameters() if p.grad is not None}
    assert want.keys() <= ours.keys()
    close = all(torch.allclose(ours[k], want[k], rtol=1e-3, atol=1e-7) for k in want)
    assert close == (entropy_agg == "micro_batch")


@pytest.mark.parametrize("lora", [None, {"rank": 4, "alpha": 8.0, "dropout": 0.5}])
def test_stored_trajectories_carry_the_learners_start_of_step_logprobs(tiny_model_dir, lora):
    """Issue 35 (4): with learner.loss.store_learner_logprobs (auto: on with recompute_old_logprobs, the official
    setting) the step sends back, for every trained fresh row the buffer stored, the learner's log-probs at the start of
    the step, over two mini-batches (the first from its own forward, the second from the recomputed pi_old); through
    the wire message and the shard they replace the generator's in the stored trajectory, which a replay then
    ships (official: experience_trainer_ops.py stores the actor's recomputed old_log_probs). Issue 44 (3): with LoRA
    dropout (B set non-zero, so the dropout matters) they, and the entropies sent back, are the eval-mode forward's,
    not the dropout forward's."""
    import copy

    from buffer.core import ShardCore
    from buffer.records import record_to_rollout
    from common import codec
    from common.config import BufferConfig
    from common.messages import LearnerFeedback
    from learner.step import merge_rank_stats
    from tests.buffer.helpers import group_for, make_questions

    core = ShardCore(BufferConfig(group_size=4, batch_questions=4, collect_before_mixed=True), make_questions(8))
    items = core.lease("g", 4, now=1000.0)
    core.submit([group_for(it, 2, seed=i) for i, it in enumerate(items)], now=1000.0)  # generator log-probs -0.5
    groups = core.take(0, 4, 0)
    model, step = plain_step(tiny_model_dir, recompute_old_logprobs=True, mini_batches=2, lora=lora)
    assert step.cfg.loss.stores_learner_logprobs
    if lora:
        from learner.lora import apply_lora

        apply_lora(model, step.cfg.lora)
        torch.manual_seed(0)
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.data.normal_(0, 0.5)
        assert any(isinstance(m, torch.nn.Dropout) for m in model.modules())
    start = copy.deepcopy(model).eval()
    _, fb = merge_rank_stats([step.run(TrainingBatch(groups=groups, version=0))])
    assert len(fb.fresh_keys) == len(fb.fresh_logprobs) == 8  # 2 correct rows stored per group
    wire = LearnerFeedback(0, fb.keys, float32_array(fb.entropies), fb.chosen, fb.fresh_keys,
                           float32_array(fb.fresh_entropies), fb.fresh_logprobs)
    core.feedback(codec.decode(codec.encode(wire), LearnerFeedback))
    assert core.store.c.logprobs_from_learner == 8
    for g in groups:
        for ro in g.rollouts:
            if not ro.key:
                continue
            ids = torch.tensor([list(g.prompt_ids) + list(ro.response_ids)])  # [1, P+T]
            with torch.no_grad():
                logits = start(input_ids=ids).logits[0, len(g.prompt_ids) - 1:-1].float()  # [T, V]
            want = torch.log_softmax(logits, -1).gather(1, ids[0, len(g.prompt_ids):, None])[:, 0].numpy()  # [T]
            e = core.store.entries[g.question_id]
            [rec] = [r for r in e.recs if record_to_rollout(r, g.question_id).key == ro.key]
            stored = record_to_rollout(rec, g.question_id).logprobs
            np.testing.assert_allclose(stored, want, rtol=1e-4, atol=1e-5)
            h = torch.distributions.Categorical(logits=logits).entropy().mean().item()
            assert fb.fresh_entropies[fb.fresh_keys.index(ro.key)] == pytest.approx(h, rel=1e-4)
            assert not np.allclose(stored, ro.logprobs)  # no longer the generator's


# (response tokens, {weight: rows}, official micro-batches per GPU, ours at 1 rank without loss_world_size)
PAPER_SPLITS = [
    (400, {1 / 102_400: 512}, 2, 9),
    (800, {1 / 204_800: 512}, 2, 15),
    (1500, {1 / 192_000: 512}, 4, 26),
    (3000, {1 / 240_000: 80, 1 / 216_000: 432}, 7, 49),
    (5000, {1 / 280_000: 224, 1 / 240_000: 288}, 10, 80),
]


@pytest.mark.parametrize("response, want, per_gpu, ours", PAPER_SPLITS)
def test_the_papers_entropy_weights_are_the_official_ones_at_any_rank_count(response, want, per_gpu, ours):
    """Issue 44 (1): the paper command (docs/algorithm.md) at num_ranks 1 and 2 weighs each row's entropy as the
    official 8 GPUs do. A mini-batch is 64 questions x 8 = 512 rows; here every row is a 120-token prompt and a
    `response`-token response (length n = response + 120). Officially each GPU holds 64 rows, 64 n tokens, in
    ceil(64 n / 32768) = ceil(n / 512) micro-batches, the rows balanced over them (equal rows: counts within one);
    a row's weight is 1 / (8 x the response tokens of its micro-batch):
      400: n 520, ceil(1.016) = 2 parts of 32 rows: 1 / (8 x 32 x 400) = 1/102,400
      800: n 920, ceil(1.797) = 2 parts of 32: 1 / (8 x 32 x 800) = 1/204,800
      1500: n 1620, ceil(3.164) = 4 parts of 16: 1 / (8 x 16 x 1500) = 1/192,000
      3000: n 3120, ceil(6.094) = 7 parts, 64 = 10 + 6 x 9: 1/(8 x 10 x 3000) = 1/240,000 on 8 x 10 = 80 rows,
            1/(8 x 9 x 3000) = 1/216,000 on the other 432
      5000: n 5120, ceil(10.0) = 10 parts, 64 = 4 x 7 + 6 x 6: 1/280,000 on 8 x 28 = 224 rows, 1/240,000 on 288
    Summed over a micro-batch's tokens the weights give its mean / 8, so the total is the per-GPU count (with equal
    entropies the term is that count times it). The rule before (our own micro-batches at 1 rank, divided by 8)
    took ceil(512 n / 32768) = ceil(n / 64) = 9 / 15 / 26 / 49 / 80 micro-batches: a total of 1.125 / 1.875 / 3.25
    / 6.125 / 10 against the official 2 / 2 / 4 / 7 / 10."""
    import yaml

    from learner.batching import entropy_weights
    from learner.objective import setup_objective

    from tests.cluster.test_algorithm_doc import paper_command

    learner: dict = {}  # the paper command's learner.<section>.<field>=value settings, nested
    for key, value in (w.split("=", 1) for w in paper_command() if w.startswith("learner.")):
        *sections, name = key.split(".")[1:]
        owner = learner
        for section in sections:
            owner = owner.setdefault(section, {})
        owner[name] = yaml.safe_load(value)
    mini = [Row(np.zeros(120, np.int64), np.zeros(response, np.int64), np.zeros(response, np.float32), 0.0, False,
                f"{g}/{i}", g) for g in range(64) for i in range(8)]
    for ranks in (1, 2):
        cfg = LearnerConfig(**learner, num_ranks=ranks)
        objective = setup_objective(cfg.loss, TrainShape(max_new_tokens=response, max_positions=512, world=ranks),
                                    entropy_split=lambda rows, gpus: entropy_weights(rows, gpus, MicroBatching.of(cfg)))
        weights = objective.mini_batch(mini).entropy_weights
        got: dict[float, int] = {}
        for r in mini:
            got[weights[id(r)]] = got.get(weights[id(r)], 0) + 1
        assert got.keys() == want.keys() and all(got[w] == want[w] for w in want)
        assert sum(weights.values()) * response == pytest.approx(per_gpu)
    assert len(rank_micro_batches(mini, 0, 1, MicroBatching(cfg.batching.micro_batch_rows,
                                                          cfg.batching.micro_batch_tokens, True, "balanced"))) == ours


def test_chunk_window_spans_worked_by_hand():
    """Issue 44 (2): buffer.trajectory_score=official. 10 candidates, max_target 10, pad 0: the last chunk holds
    candidates 8 and 9 in slots 0 and 1 and dummies (all pad, m = 0) in slots 2-7; candidate i is masked with
    slot i % 8's response. Candidate 8's response has 3 non-pad tokens (a pad inside does not count), 9's 12
    (the first 10 count: m = 10, divisor 0, NaN as the official mean of nothing). With L = the row's length,
    start = max(0, L - 10 - 1 + m), divisor 10 - m:
      i = 0 (L 8, slot 0, m 3): start max(0, 8 - 11 + 3) = 0, divisor 7
      i = 1 (L 8, slot 1, m 10): start 7, divisor 0
      i = 2 (L 14, slot 2, a dummy: m 0): start 3, divisor 10
      i = 8 (L 7, m 3): start 0, divisor 7;  i = 9 (L 15, m 10): start 14, divisor 0"""
    resp = [np.full(5, 7)] * 2 + [np.full(11, 7)] * 6 + [np.array([5, 0, 5, 5]), np.full(12, 7)]
    lengths = [8, 8, 14, 14, 14, 14, 14, 14, 7, 15]
    got = chunk_window_spans(lengths, resp, max_target=10, pad_id=0)
    assert got[:3] == [(0, 7), (7, 0), (3, 10)] and got[8:] == [(0, 7), (14, 0)]
    assert got[3:8] == [(3, 10)] * 5


def test_replay_eos_appends_eos_to_truncated_replays_only_and_weighs_it_one(tiny_model_dir):
    """learner.loss.replay_eos (issue 44, the official o*): a replayed row cut at the length limit gains the EOS token,
    whose stored log-prob (NaN: it was never sampled) becomes the policy's own in the forward (weight 1); fresh
    rows, replays that ended on their own, and rows with no position left are unchanged."""
    from learner.objective import append_eos
    from learner.step import merge_rank_stats

    def row(ids, replayed, truncated, prompt=3):
        return Row(np.arange(prompt), np.asarray(ids, np.int32), np.full(len(ids), -1.0, np.float32), 1.0, replayed,
                   "k", 0, truncated=truncated)

    rows = [row([5, 6], True, True), row([5, 6], False, True), row([5, 2], True, True), row([5, 6], True, False),
            row([5, 6, 7], True, True, prompt=5)]  # eos 2; the last fills 8 positions already
    assert append_eos(rows, 2, max_positions=8) == 1
    assert rows[0].response_ids.tolist() == [5, 6, 2] and np.isnan(rows[0].behaviour_logprobs[-1])
    assert [len(r.response_ids) for r in rows[1:]] == [2, 2, 2, 3]

    from transformers import AutoModelForCausalLM

    batch = make_batch(0, candidates=1)
    for g in batch.groups:
        for ro in g.candidates:
            ro.finish_reason = "length"
    cfg = LearnerConfig(batching=dict(micro_batch_rows=4), loss=dict(replay_eos=True))
    model = prepare_model(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32), cfg)
    step = TrainStep(model, torch.optim.AdamW(model.parameters(), lr=cfg.optim.lr), cfg,
                     TrainShape(max_new_tokens=12, max_positions=512, eos_id=3), rank=0, device=torch.device("cpu"))
    m, _ = merge_rank_stats([step.run(batch)])
    mixed = sum(g.mixed for g in batch.groups)
    assert m["learner/replay_eos_appended"] == mixed == 2 and np.isfinite(m["learner/loss"])
    assert np.isfinite(m["learner/replay_weight_mean"]) and np.isfinite(m["learner/logprob_diff_mean"])
    with pytest.raises(ValueError, match="learner.loss.replay_eos: the model names no EOS token"):
        TrainStep(model, step.optimizer, cfg, TrainShape(max_new_tokens=12, max_positions=512), rank=0,
                  device=torch.device("cpu"))
