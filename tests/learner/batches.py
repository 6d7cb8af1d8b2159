"""Hand-built TrainingBatch messages for learner tests and the benchmark (no buffer involved)."""

from __future__ import annotations

import numpy as np

from common.messages import Rollout, TrainGroup, TrainingBatch, float32_array, int32_array


def make_batch(seed: int, *, groups: int = 4, group_size: int = 4, prompt_len: tuple[int, int] = (4, 10),
               response_len: tuple[int, int] = (1, 12), vocab: int = 99, mixed_every: int = 2,
               version: int = 0) -> TrainingBatch:
    """`groups` groups of `group_size` rollouts with 0/1 rewards (never all equal), random tokens and
    behaviour log-probs near -log(vocab); every `mixed_every`-th group is mixed (its first rollout replayed).
    Every rollout carries a key `q{g}#{i}` so the learner returns entropy feedback for it."""
    rng = np.random.default_rng(seed)
    out = []
    for g in range(groups):
        prompt = int32_array(rng.integers(4, vocab, rng.integers(*prompt_len, endpoint=True)))  # [P]
        mixed = mixed_every > 0 and g % mixed_every == 0
        rewards = rng.permutation([1.0] + [0.0] + list(rng.integers(0, 2, group_size - 2).astype(float)))
        rollouts = []
        for i in range(group_size):
            t = int(rng.integers(*response_len, endpoint=True))
            ids = int32_array(rng.integers(4, vocab, t))  # [T]
            lps = float32_array(-np.log(vocab) + rng.normal(0, 0.1, t))  # [T]
            replayed = mixed and i == 0
            rollouts.append(Rollout(response_ids=ids, logprobs=lps, reward=1.0 if replayed else float(rewards[i]),
                                    correct=bool(rewards[i] >= 1.0), entropy=4.0, version=version,
                                    finish_reason="stop", key=f"q{g}#{i:016x}", replayed=replayed))
        out.append(TrainGroup(question_id=f"q{g}", prompt_ids=prompt, rollouts=rollouts, mixed=mixed))
    return TrainingBatch(groups=out, version=version)
