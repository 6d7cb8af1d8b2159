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


def test_a_reward_module_from_the_run_folder_reaches_the_workers_through_py_modules(ray_cluster, tmp_path,
                                                                                     monkeypatch):
    """Issue 51, section 3 of docs/own-task.md: `my_rewards.py` in the folder a run starts from is on no worker's
    path (as on another node of a cluster). `cluster.preflight.user_modules` names it, and a driver that gives it to
    Ray as the job's `py_modules` (as `cluster.runtime.start_ray` does) gets an actor that scores with it in its
    reward worker processes (fresh interpreters, whose PYTHONPATH is the actor's sys.path). The driver is a second
    process joining this module's cluster from another folder (Ray takes local py_modules only at the job level)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from cluster.preflight import user_modules
    from common.config import load_config

    folder, elsewhere = tmp_path / "project", tmp_path / "elsewhere"
    folder.mkdir()
    elsewhere.mkdir()
    module = folder / "my_rewards_py_modules.py"
    module.write_text("def score(response, answer):\n    return 1.0 if response == answer else 0.0\n")
    monkeypatch.syspath_prepend(str(folder))  # the driver finds it (as `exgrpo` does in the folder it runs in)
    cfg = load_config(None, ["reward.name=my_rewards_py_modules:score"])
    assert user_modules(cfg) == [str(module.resolve())]

    driver = f"""
from cluster.auth import use_token_auth_when_connecting
address = {ray_cluster.get_runtime_context().gcs_address!r}
use_token_auth_when_connecting(address)
import ray
ray.init(address=address, namespace="py-modules-test", log_to_driver=False, runtime_env={{"py_modules": {user_modules(cfg)!r}}})

@ray.remote(num_cpus=0)
class Scorer:
    def score(self, pairs):
        from common.config import RewardConfig
        from common.rewards import RewardPool, ScoreRequest

        with RewardPool(RewardConfig(name="my_rewards_py_modules:score", num_workers=1)) as pool:
            return [r.reward for r in pool.score([ScoreRequest(str(i), r, a) for i, (r, a) in enumerate(pairs)])]

print("scores", ray.get(Scorer.remote().score.remote([("7", "7"), ("6", "7")]), timeout=120))
"""
    root = Path(__file__).resolve().parents[2]
    p = subprocess.run([sys.executable, "-c", driver], cwd=elsewhere, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": str(root)})
    assert "scores [1.0, 0.0]" in p.stdout, p.stdout + p.stderr
