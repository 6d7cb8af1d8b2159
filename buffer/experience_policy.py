"""The experience policy: what a finished group does to the experience pool, when mixed mode starts, and what a lease
draws. One object per shard (and one in the client, for the switch), built once by `make_experience_policy`.

    policy = make_experience_policy(cfg)            # from the buffer.* settings, or buffer.experience_policy=mod:Class
    d = policy.decide(FinishedGroup(...))           # Decision: its bucket, what to store, retire, or None (GRPO)
    policy.left_fresh(store.retired)                # questions never issued fresh again

The built-in rules, one class each, beside the question sampler and trajectory selector (buffer/sampling.py):

| class | settings that choose it | what a finished group does |
|---|---|---|
| `Grpo` | `buffer.collect=false` | nothing: no experience is kept |
| `ExGrpo` | the defaults | sets its question's bucket (k of K); stores its correct rollouts while 0 < k < `store_below` and mixed mode is on; retires the question at k > `retire_above` (k = K) |
| `PlainReplay` | `buffer.retire=false` | as ExGrpo, but a solved question (k = K) stays, marked solved (the advantage sampler skips it) |
| `Su01` | `buffer.retire_fresh=last_three_correct` | as ExGrpo; a question leaves the fresh stream when its last three fresh rollouts were all correct |
| `ZeroSignalFilter(p)` | `buffer.drop_zero_signal=true` | as `p`; a group whose rewards are all equal is kept out of training (DAPO's filter) |

A user's rule is a class named in the config, `buffer.experience_policy=package.module:Class`, built as `Class(cfg)`;
subclass `ExGrpo` and override `decide` (docs/algorithm.md, "Your own experience policy").
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from buffer.batch_plan import MixedSwitch
from common.config import BufferConfig
from common.messages import Rollout


@dataclass(frozen=True, slots=True)
class FinishedGroup:
    """One checked group as the policy sees it, before anything changes the store."""

    question_id: str
    fresh: tuple[Rollout, ...]  # the rollouts generated for it (K, or K - 1 beside o*)
    replayed: bool  # a mixed group: one stored correct trajectory (o*) completes it to K
    group_size: int  # K
    mixed_mode: bool  # the run-wide switch is on

    @property
    def fresh_correct(self) -> int:
        return sum(1 for r in self.fresh if r.correct)


@dataclass(frozen=True, slots=True)
class Decision:
    """What one finished group does to its question's experience. `k` is the correct count its bucket takes (0: the
    bucket is left as it is); `store` the indices of `fresh` rollouts offered to the store; `collect` whether the store
    may add trajectories (and new questions) now; `retire` deletes the question's experience and stores none again;
    `solved` marks a kept question as solved (all correct) until a group of it misses again."""

    k: int
    store: tuple[int, ...] = ()
    collect: bool = False
    retire: bool = False
    solved: bool = False


@runtime_checkable
class ExperiencePolicy(Protocol):
    """What the shard and the client ask of an experience policy. Subclass `ExGrpo` rather than writing all of it."""

    filters_zero_signal: bool  # a group whose rewards are all equal is kept out of training
    replay_takes_fresh_slot: bool  # each new replay consumes one fresh question unused (buffer.fresh_draw=per_step)

    def decide(self, group: FinishedGroup) -> Decision | None:
        """The group's effect on the pool; None: the pool is not touched (no experience is managed)."""

    def left_fresh(self, retired: set[str]) -> set[str]:
        """The questions never issued fresh again, given those retired from the pool."""

    def mixed_switch(self) -> MixedSwitch:
        """The delayed start: a new switch that decides, once per batch, when mixed mode starts for the run."""

    def state(self) -> dict:
        """The policy's own state as msgpack-ready plain data (in every shard snapshot)."""

    def load_state(self, state: dict) -> None: ...

    def metrics(self) -> dict[str, float]:
        """Counters of its own, logged as buffer/policy/<name> (summed over shards)."""


class Grpo:
    """No experience: plain on-policy GRPO with the same components (`buffer.collect=false`)."""

    filters_zero_signal = False

    def __init__(self, cfg: BufferConfig):
        self.cfg = cfg
        self.replay_takes_fresh_slot = cfg.fresh_draw == "per_step"

    def decide(self, group: FinishedGroup) -> Decision | None:
        return None

    def left_fresh(self, retired: set[str]) -> set[str]:
        return retired

    def mixed_switch(self) -> MixedSwitch:
        return MixedSwitch(self.cfg.switch_groups, self.cfg.mixed_switch_accuracy)

    def state(self) -> dict:
        return {}

    def load_state(self, state: dict) -> None:
        pass

    def metrics(self) -> dict[str, float]:
        return {}


class ExGrpo(Grpo):
    """ExGRPO's experience management: a question's latest group sets its bucket (k correct of K, o* counting as one
    unless `buffer.k_fresh_only`); its correct rollouts are stored while 0 < k < `buffer.store_below` and mixed mode
    is on (or from the start with `buffer.collect_before_mixed`); more than `buffer.retire_above` correct (k = K by
    default) retires the question, which also leaves the fresh stream."""

    def __init__(self, cfg: BufferConfig):
        super().__init__(cfg)
        self.store_below = cfg.store_below or cfg.group_size
        self.retire_at = cfg.group_size if cfg.retire_above is None else cfg.retire_above + 1

    def correct(self, group: FinishedGroup) -> int:
        """k: the group's correct rollouts, o* counting as one unless only fresh ones count."""
        return group.fresh_correct + (1 if group.replayed and not self.cfg.k_fresh_only else 0)

    def collecting(self, group: FinishedGroup) -> bool:
        return group.mixed_mode or self.cfg.collect_before_mixed

    def decide(self, group: FinishedGroup) -> Decision | None:
        k = self.correct(group)
        store = () if k >= self.store_below else tuple(i for i, r in enumerate(group.fresh) if r.correct)
        return Decision(k, store, self.collecting(group), retire=k >= self.retire_at)


class PlainReplay(ExGrpo):
    """Replay without retirement (`buffer.retire=false`): a solved question keeps its trajectories and stays in the
    fresh stream; its all-correct group stores nothing and leaves the bucket as it is, marked solved."""

    def decide(self, group: FinishedGroup) -> Decision | None:
        if self.correct(group) >= group.group_size:
            return Decision(0, (), self.collecting(group), solved=True)
        return super().decide(group)


class Su01(ExGrpo):
    """SU-01's fresh-stream exit (`buffer.retire_fresh=last_three_correct`): retirement empties the pool only; a
    question leaves the fresh stream once its last three tracked rollouts (the fresh ones of its groups, in order)
    were all correct."""

    def __init__(self, cfg: BufferConfig):
        super().__init__(cfg)
        self.fresh_out: set[str] = set()
        self.tracked: dict[str, list[bool]] = {}

    def decide(self, group: FinishedGroup) -> Decision | None:
        last = (self.tracked.get(group.question_id, []) + [r.correct for r in group.fresh])[-3:]
        self.tracked[group.question_id] = last
        if len(last) == 3 and all(last):
            self.fresh_out.add(group.question_id)
        return super().decide(group)

    def left_fresh(self, retired: set[str]) -> set[str]:
        return self.fresh_out

    def state(self) -> dict:
        return {"fresh_out": sorted(self.fresh_out), "tracked": {q: list(v) for q, v in self.tracked.items()}}

    def load_state(self, state: dict) -> None:
        self.fresh_out = set(state.get("fresh_out", ()))
        self.tracked = {q: [bool(x) for x in v] for q, v in state.get("tracked", {}).items()}


@dataclass(slots=True)
class ZeroSignalFilter:
    """DAPO's filter around another policy (`buffer.drop_zero_signal=true`): a group whose rewards are all equal has
    no advantage and is kept out of training; its effect on the pool is the inner policy's."""

    inner: ExperiencePolicy
    filters_zero_signal: bool = field(default=True, init=False)

    @property
    def replay_takes_fresh_slot(self) -> bool:
        return self.inner.replay_takes_fresh_slot

    def decide(self, group: FinishedGroup) -> Decision | None:
        return self.inner.decide(group)

    def left_fresh(self, retired: set[str]) -> set[str]:
        return self.inner.left_fresh(retired)

    def mixed_switch(self) -> MixedSwitch:
        return self.inner.mixed_switch()

    def state(self) -> dict:
        return self.inner.state()

    def load_state(self, state: dict) -> None:
        self.inner.load_state(state)

    def metrics(self) -> dict[str, float]:
        return self.inner.metrics()


def make_experience_policy(cfg: BufferConfig) -> ExperiencePolicy:
    """The policy `cfg` names: `buffer.experience_policy` (a user's class), else the built-in one its settings
    choose (the module docstring's table)."""
    if cfg.experience_policy:
        policy = resolve_experience_policy(cfg.experience_policy)(cfg)
    elif not cfg.collect:
        policy = Grpo(cfg)
    elif not cfg.retire:
        policy = PlainReplay(cfg)
    elif cfg.retire_fresh == "last_three_correct":
        policy = Su01(cfg)
    else:
        policy = ExGrpo(cfg)
    return ZeroSignalFilter(policy) if cfg.drop_zero_signal else policy


def resolve_experience_policy(name: str) -> type:
    """The class `package.module:Class` names; ValueError that says what to change when it does not import or is not
    an experience policy."""
    from common.reward_registry import import_user_module

    module_name, sep, attr = name.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"buffer.experience_policy: {name!r} is not package.module:Class; name your class so, e.g. "
                         "my_policy:ShortestCorrect")
    cls = getattr(import_user_module(module_name, "buffer.experience_policy"), attr, None)
    if not isinstance(cls, type):
        raise ValueError(f"buffer.experience_policy: {module_name} has no class {attr!r}")
    missing = [m for m in ("decide", "left_fresh", "mixed_switch", "state", "load_state", "metrics",
                           "filters_zero_signal") if not hasattr(cls, m)]
    if missing:
        raise ValueError(f"buffer.experience_policy: {name} lacks {', '.join(missing)}; subclass "
                         "buffer.experience_policy.ExGrpo and override decide")
    return cls
