"""The experience policy: which built-in one the settings choose, a user's class named in the config, and the
errors that say what to change."""

from __future__ import annotations

import sys

import pytest

from buffer.core import ShardCore
from buffer.experience_policy import (ExGrpo, Grpo, PlainReplay, Su01, ZeroSignalFilter, make_experience_policy,
                                      resolve_experience_policy)
from common.config import BufferConfig
from tests.buffer.helpers import group_for, make_questions

NOW = 1000.0


@pytest.mark.parametrize("settings, kind", [
    (dict(), ExGrpo),
    (dict(retire=False), PlainReplay),
    (dict(retire_fresh="last_three_correct"), Su01),
    (dict(collect=False, replay_ratio=0), Grpo),
])
def test_the_settings_choose_one_built_in_policy(settings, kind):
    policy = make_experience_policy(BufferConfig(**settings))
    assert type(policy) is kind
    filtered = make_experience_policy(BufferConfig(drop_zero_signal=True, **settings))
    assert isinstance(filtered, ZeroSignalFilter) and type(filtered.inner) is kind and filtered.filters_zero_signal


POLICY = '''
from buffer.experience_policy import Decision, ExGrpo


class FirstOnly(ExGrpo):
    """Stores only the first correct rollout of a group."""

    def __init__(self, cfg):
        super().__init__(cfg)
        self.seen = 0

    def decide(self, group):
        self.seen += 1
        d = super().decide(group)
        return Decision(d.k, d.store[:1], d.collect, d.retire, d.solved)

    def metrics(self):
        return {"seen": float(self.seen)}

    def state(self):
        return {"seen": self.seen}

    def load_state(self, state):
        self.seen = state.get("seen", 0)
'''


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "first_only_policy.py").write_text(POLICY)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "first_only_policy"
    sys.modules.pop("first_only_policy", None)


def test_a_users_policy_decides_what_a_shard_stores_and_keeps_its_state(user_module):
    cfg = BufferConfig(group_size=4, batch_questions=4, collect_before_mixed=True,
                       experience_policy=f"{user_module}:FirstOnly")
    core = ShardCore(cfg, make_questions(4))
    items = core.lease("g", 4, now=NOW)
    core.submit([group_for(it, 3, seed=i) for i, it in enumerate(items)], now=NOW)
    assert core.store.total == 4  # one of the three correct rollouts of each group (ExGRPO would store 12)
    assert core.metrics()["policy/seen"] == 4.0
    back = ShardCore(cfg, make_questions(4))
    back.policy.load_state(core.state({})["policy"])
    assert back.policy.seen == 4


def test_a_policy_that_gives_a_full_bucket_without_retiring_is_told_what_to_do(user_module):
    core = ShardCore(BufferConfig(group_size=4, batch_questions=4, collect_before_mixed=True), make_questions(1))
    with pytest.raises(ValueError, match=r"k=4 for 'q0' without retiring it; a bucket is 1..K-1"):
        core.store.observe("q0", 4, [], collect=True)


@pytest.mark.parametrize("name, message", [
    ("no_such_policy_module:X", "buffer.experience_policy: cannot import module 'no_such_policy_module'"),
    ("first_only_policy:Missing", "buffer.experience_policy: first_only_policy has no class 'Missing'"),
    ("first_only_policy:Decision", "buffer.experience_policy: first_only_policy:Decision lacks decide, left_fresh"),
])
def test_a_name_that_is_not_a_policy_says_what_to_change(user_module, name, message):
    with pytest.raises(ValueError, match=message):
        resolve_experience_policy(name)


def test_the_start_checks_name_a_policy_that_cannot_be_built(user_module, tmp_path):
    from cluster.preflight import experience_policy_problem, user_modules
    from common.config import load_config

    (tmp_path / "broken_policy.py").write_text("from buffer.experience_policy import ExGrpo\n\n"
                                               "class Broken(ExGrpo):\n    def __init__(self, cfg):\n"
                                               "        raise RuntimeError('no thresholds given')\n")
    cfg = load_config(None, ["buffer.experience_policy=broken_policy:Broken"])
    assert experience_policy_problem(cfg.buffer) == ("buffer.experience_policy: building broken_policy:Broken(buffer "
                                                     "config) raised RuntimeError: no thresholds given; fix its __init__")
    assert user_modules(cfg) == [str((tmp_path / "broken_policy.py").resolve())]  # uploaded to every worker
    assert experience_policy_problem(BufferConfig()) == ""
    with pytest.raises(ValueError, match="experience_policy"):
        BufferConfig(experience_policy="not a class name")
