"""Hand-built TrainingBatch messages for the benchmarks and the learner tests (no buffer involved)."""

from __future__ import annotations

import numpy as np

from common.messages import Rollout, TrainGroup, TrainingBatch, float32_array, int32_array


def make_batch(seed: int, *, groups: int = 4, group_size: int = 4, prompt_len: tuple[int, int] = (4, 10),
               response_len: tuple[int, int] = (1, 12), vocab: int = 99, mixed_every: int = 2,
               candidates: int = 3, version: int = 0) -> TrainingBatch:
    """`groups` groups with 0/1 rewards (never all equal), random tokens and behaviour log-probs near
    -log(vocab). Every `mixed_every`-th group is mixed: `group_size - 1` fresh rollouts and `candidates`
    stored correct ones (replayed, keyed `q{g}#...`) for the learner to choose o* from."""
    rng = np.random.default_rng(seed)
    out = []

    def rollout(replayed: bool, reward: float, key: str) -> Rollout:
        t = int(rng.integers(*response_len, endpoint=True))
        ids = int32_array(rng.integers(4, vocab, t))  # [T]
        lps = float32_array(-np.log(vocab) + rng.normal(0, 0.1, t))  # [T]
        return Rollout(response_ids=ids, logprobs=lps, reward=reward, correct=reward >= 1.0, entropy=4.0,
                       version=version, finish_reason="stop", key=key, replayed=replayed)

    for g in range(groups):
        prompt = int32_array(rng.integers(4, vocab, rng.integers(*prompt_len, endpoint=True)))  # [P]
        mixed = mixed_every > 0 and g % mixed_every == 0
        rewards = rng.permutation([1.0] + [0.0] + list(rng.integers(0, 2, group_size - 2).astype(float)))
        n_fresh = group_size - 1 if mixed else group_size
        fresh = [rollout(False, float(rewards[i]), f"q{g}#{i:016x}") for i in range(n_fresh)]
        cands = [rollout(True, 1.0, f"q{g}#{100 + c:016x}") for c in range(candidates)] if mixed else []
        out.append(TrainGroup(question_id=f"q{g}", prompt_ids=prompt, rollouts=fresh, mixed=mixed, candidates=cands))
    return TrainingBatch(groups=out, version=version)


def with_own_logprobs(batch: TrainingBatch, model) -> TrainingBatch:
    """`batch` with every fresh rollout's behaviour log-probs replaced by `model`'s (float32 math on the
    model's logits): what a generator running exactly this model would have recorded."""
    import torch

    for g in batch.groups:
        for ro in g.rollouts:
            ids = torch.tensor([list(g.prompt_ids) + list(ro.response_ids)])  # [1, P+T]
            with torch.no_grad():
                logits = model(input_ids=ids).logits[0, len(g.prompt_ids) - 1:-1].float()  # [T, V]
            lp = torch.log_softmax(logits, -1).gather(1, ids[0, len(g.prompt_ids):, None])[:, 0]  # [T]
            ro.logprobs = float32_array(lp.numpy())
    return batch
