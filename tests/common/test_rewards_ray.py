"""The reward pool inside a Ray actor (its workers are fresh interpreters, not forks of the actor)."""

from __future__ import annotations


def test_reward_pool_inside_a_ray_actor(ray_cluster):
    ray = ray_cluster

    @ray.remote(num_cpus=0)
    class Scorer:
        def __init__(self):
            from common.config import RewardConfig
            from common.rewards import RewardPool

            self.pool = RewardPool(RewardConfig(name="tests.common.reward_fns:hangs", timeout_s=1.0, num_workers=2))

        def score(self, texts):
            from common.rewards import ScoreRequest

            return [(r.reward, r.error) for r in self.pool.score([ScoreRequest(t, t, "") for t in texts])], \
                self.pool.stats()

    scorer = Scorer.remote()
    results, stats = ray.get(scorer.score.remote(["a", "hang", "b", "c"]), timeout=120)
    assert [r for r, _ in results] == [1.0, 0.0, 1.0, 1.0]
    assert stats["timeouts"] == 1 and stats["calls"] == 4
