"""Builders of real messages for buffer tests (no mocks)."""

from __future__ import annotations

from common.messages import Question, Rollout, ScoredGroup, WorkItem, float32_array, int32_array


def make_questions(n: int, prefix: str = "q") -> list[Question]:
    return [Question(id=f"{prefix}{i}", prompt=f"p{i}", answer=str(i), prompt_ids=int32_array([i, i + 1, 7])) for i in range(n)]


def rollout(tokens, reward: float, version: int = 0, entropy: float = 1.0) -> Rollout:
    ids = int32_array(tokens)
    return Rollout(response_ids=ids, logprobs=float32_array([-0.5] * len(ids)), reward=reward,
                   correct=reward >= 1.0, entropy=entropy, version=version, finish_reason="stop")


def group_for(item: WorkItem, n_correct: int, version: int = 0, seed: int = 0, entropies=None) -> ScoredGroup:
    """A scored group for a work item: the first n_correct rollouts correct, distinct token ids."""
    rs = []
    for j in range(item.num_samples):
        ent = entropies[j] if entropies is not None else 1.0 + j
        rs.append(rollout([seed, j, len(item.question.id)], 1.0 if j < n_correct else 0.0, version, ent))
    return ScoredGroup(lease_id=item.lease_id, question_id=item.question.id, rollouts=rs, generator_id="g0")
