"""o* (learner.replay_choice): candidates scored under the current weights, the argmin completing each mixed group,
and the validity metrics of the choice."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from learner.batching import chunk_window_spans
from learner.replay_choice import complete_groups
from learner.step import RankStats
from bench.batches import make_batch
from tests.learner.test_step import plain_step


def test_complete_groups_takes_the_argmin_and_reports_every_candidate():
    batch = make_batch(1, groups=2, candidates=3)  # group 0 mixed with 3 candidates, group 1 fresh
    keys = [c.key for c in batch.groups[0].candidates]
    done, fb = complete_groups(batch, {(0, 0): 0.9, (0, 1): 0.2, (0, 2): 0.2})
    assert done.groups[0].rollouts[-1].key == keys[1] and done.groups[0].rollouts[-1].replayed  # ties: the first
    assert len(done.groups[0].rollouts) == 4 and done.groups[0].candidates == []
    assert done.groups[1] is batch.groups[1] and len(batch.groups[0].rollouts) == 3  # input untouched
    assert fb.keys == keys and fb.entropies == [0.9, 0.2, 0.2] and fb.chosen == [keys[1]]
    one = make_batch(1, groups=2, candidates=1)
    done, fb = complete_groups(one, {})  # a single candidate (random selector): nothing to score
    assert fb.keys == [] and fb.chosen == [one.groups[0].candidates[0].key]


def test_selection_uses_entropy_under_the_current_weights(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model, step = plain_step(tiny_model_dir)
    batch = make_batch(5, groups=4, candidates=4, vocab=60)
    stats = RankStats()
    scores, chosen_by = step.score_candidates(batch, stats)
    assert stats.candidates_scored == 8 and len(scores) == 8 and chosen_by == scores  # mean_entropy: the same
    ref = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    for (g, c), h in scores.items():
        grp, cand = batch.groups[g], batch.groups[g].candidates[c]
        ids = torch.tensor([list(grp.prompt_ids) + list(cand.response_ids)])
        with torch.no_grad():
            logits = ref(input_ids=ids).logits[0, len(grp.prompt_ids) - 1:-1]  # predicts each response token
        direct = torch.distributions.Categorical(logits=logits).entropy().mean().item()
        assert h == pytest.approx(direct, rel=1e-4), (g, c)
    stats = step.run(batch)
    for g in (0, 2):
        ents = [scores[(g, c)] for c in range(4)]
        best = batch.groups[g].candidates[ents.index(min(ents))].key
        assert best in stats.feedback.chosen
    assert sorted(stats.feedback.keys) == sorted(c.key for g in (0, 2) for c in batch.groups[g].candidates)


def test_reasoning_metrics_of_the_chosen_trajectories():
    """o* validity against its candidates' mean, and the entropy-validity correlation of scored candidates."""
    import dataclasses

    from learner.replay_choice import reasoning_metrics

    batch = make_batch(0, groups=4, mixed_every=2, candidates=3)  # groups 0 and 2 are mixed
    for g in batch.groups:
        g.candidates = [dataclasses.replace(c, valid=v) for c, v in zip(g.candidates, (1, 0, 0))]
    scores = {(g, c): h for g in (0, 2) for c, h in enumerate((0.1, 0.5, 0.9))}  # the valid one is lowest
    _, fb = complete_groups(batch, scores)
    m = reasoning_metrics(fb)
    assert m["learner/replay_valid_groups"] == 2 and m["learner/replay_valid_chosen"] == 1.0
    assert m["learner/replay_valid_candidates"] == pytest.approx(1 / 3)
    assert m["learner/entropy_valid_corr"] < -0.8
    assert np.isnan(reasoning_metrics(type(fb)())["learner/replay_valid_chosen"])  # nothing checked: NaN


def test_official_trajectory_score_is_the_official_computation(tiny_model_dir):
    """Issue 44 (2): with trajectory_score=official the learner picks the argmin of the official score (the
    windows of `chunk_window_spans`), computed directly from the model's entropies over prompt + response, and
    still reports the mean response entropy to the buffer. 3 mixed groups x 4 candidates = 12: the last chunk is
    candidates 8-11."""
    from transformers import AutoModelForCausalLM

    model, step = plain_step(tiny_model_dir)
    batch = make_batch(5, groups=6, candidates=4, vocab=60, prompt_len=(4, 10), response_len=(1, 12))
    batch.trajectory_score = "chunk_window"
    stats = RankStats()
    entropies, scores = step.score_candidates(batch, stats)
    ref = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    order = [(g, c) for g in (0, 2, 4) for c in range(4)]
    cands = [(batch.groups[g].prompt_ids, batch.groups[g].candidates[c].response_ids) for g, c in order]
    windows = chunk_window_spans([len(p) + len(r) for p, r in cands], [r for _, r in cands], 12, 0)
    for (g, c), (p, r), (start, div) in zip(order, cands, windows):
        ids = torch.tensor([list(p) + list(r)])  # [1, L]
        with torch.no_grad():
            h = torch.distributions.Categorical(logits=ref(input_ids=ids).logits[0, :-1]).entropy()  # [L-1]
        assert entropies[(g, c)] == pytest.approx(h[len(p) - 1:].mean().item(), rel=1e-4)
        if div == 0:
            assert np.isnan(scores[(g, c)])
        else:
            assert scores[(g, c)] == pytest.approx(h[start:].sum().item() / div, rel=1e-4)
    assert any(d for _, d in windows) and any(s > 0 for s, _ in windows)  # the window cuts into some prompts
    done, fb = complete_groups(batch, scores, entropies)
    for g in (0, 2, 4):
        assert fb.chosen[(0, 2, 4).index(g)] == batch.groups[g].candidates[
            int(np.argmin([scores[(g, c)] for c in range(4)]))].key
    assert fb.entropies == [entropies[k] for k in order]
