"""Messages that cross process boundaries. Each is defined once here, with its direction.

All are plain dataclasses; `common.codec` turns them into versioned msgpack payloads (token ids as int32,
log-probs as float32 numpy arrays: compact typed bytes).

    dataset --Question--> buffer shard --WorkItem--> generator --ScoredGroup(Rollout...)--> buffer shard
    buffer shard --TrainingBatch(TrainGroup...)--> learner --LearnerFeedback--> buffer shard
    learner --WeightsAnnouncement--> weight store --> generators

Policy version: the number of learner steps applied to the policy (one step adds exactly 1); every "version",
"lag" and `buffer.max_lag` counts in this unit. Details: docs/internals.md#commonmessagespy
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated

import numpy as np

SCHEMA_VERSION = 5
"""Bumped whenever a message's fields change; payloads of another version are refused."""

Int32Array = Annotated[np.ndarray, np.int32]
Float32Array = Annotated[np.ndarray, np.float32]


def int32_array(values) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(values, dtype=np.int32).reshape(-1))


def float32_array(values) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(values, dtype=np.float32).reshape(-1))


@dataclass(slots=True)
class Question:
    """A question with a verifiable answer.  # dataset -> buffer -> generator"""

    id: str
    prompt: str  # text given to the model (chat template already applied when configured)
    answer: str  # reference answer, passed to the reward function
    prompt_ids: Int32Array  # [P] prompt token ids
    task: str = ""  # task or dataset name, for the reward registry and metrics


@dataclass(slots=True)
class ReplayRef:
    """Where a replay work item came from.  # buffer -> generator

    The generator samples K-1 fresh rollouts; the stored trajectory o* that completes the group is
    chosen later, by the learner, among the question's stored candidates (see `TrainGroup`)."""

    probability: float  # chance of this question in one draw of the question sampler (0 for a re-issue)
    candidates: int  # stored correct trajectories of the question when the item was issued
    reissue: bool = False  # a replay item issued again after its lease ended or its group went stale


@dataclass(slots=True)
class WorkItem:
    """A lease: generate `num_samples` rollouts of `question` before `deadline`.  # buffer -> generator"""

    lease_id: str
    question: Question
    num_samples: int  # K for fresh questions, K-1 for replay questions
    deadline: float  # unix time after which the lease is expired and the question issued again
    shard: int  # shard that issued the lease (where the group must go back)
    replay: ReplayRef | None = None
    version: int = 0  # the buffer's policy version when it leased this (a generator behind it loads weights first)
    min_weights: int = 0  # the oldest weights whose rollouts stay trainable a batch later: version + 1 - max(max_lag, 1)
    # (a generator on older weights holds the item until they load; with max_lag >= 2 it may start on version - 1)


@dataclass(slots=True)
class Rollout:
    """One sampled response, scored.  # generator -> buffer (inside ScoredGroup) -> learner"""

    response_ids: Int32Array  # [T] sampled token ids (EOS included when it was sampled)
    logprobs: Float32Array  # [T] behaviour-policy log-prob of each sampled token
    reward: float  # in [0, 1]
    correct: bool  # reward >= correct_threshold
    entropy: float  # mean token entropy (generator's estimate, or learner's refreshed value)
    version: int  # oldest policy version that sampled a token of it (the staleness rule uses this one)
    finish_reason: str  # "stop" | "length" | "abort"
    key: str = ""  # trajectory key, set by the buffer for stored/replayed trajectories
    replayed: bool = False  # True for the stored trajectory of a mixed group
    newest_version: int = -1  # newest policy version that sampled a token (> version: a partial rollout); -1: version
    valid: int = -1  # the task's reasoning check of a correct response: 1 valid, 0 invalid, -1 not checked / unknown

    def __post_init__(self) -> None:
        if self.newest_version < 0:
            self.newest_version = self.version


@dataclass(slots=True)
class ScoredGroup:
    """The rollouts of one lease.  # generator -> buffer"""

    lease_id: str
    question_id: str
    rollouts: list[Rollout]
    generator_id: str
    reward_errors: int = 0  # reward calls that raised, hung or returned a bad value (scored 0)


@dataclass(slots=True)
class TrainGroup:
    """A group ready for training.  # buffer -> learner

    Fresh group: K fresh rollouts. Mixed group: K-1 fresh rollouts plus `candidates`, the question's
    stored correct trajectories (replayed=True, keyed); the learner completes the group with one of
    them (the lowest mean token entropy under the policy it trains, or the only one shipped)."""

    question_id: str
    prompt_ids: Int32Array  # [P]
    rollouts: list[Rollout]  # the fresh rollouts
    mixed: bool  # completed by one replayed stored trajectory from `candidates`
    lease_id: str = ""
    candidates: list[Rollout] = field(default_factory=list)  # mixed groups only; at least one


@dataclass(slots=True)
class TrainingBatch:
    """B groups sampled with a fixed fresh/mixed ratio.  # buffer -> learner"""

    groups: list[TrainGroup]
    version: int  # learner policy version the batch was requested for
    stats: dict[str, float] = field(default_factory=dict)  # buffer-side metrics of this batch (logged; the learner reads none)
    trajectory_score: str = "mean_entropy"  # buffer.trajectory_score: how the learner ranks a group's candidates
    mixed_mode: bool = False  # composed in mixed mode (the run-wide switch on): learner.loss.clip_fresh=auto reads it


@dataclass(slots=True)
class AdapterPublication:
    """What an adapter-only publication (`learner.lora.publish: adapters`) carries besides its tensors: each
    target's `<target>.lora_A` [r, in] and `<target>.lora_B` [out, r]; a generator loads W + scaling B A as the
    target's `<target>.weight`, W being the base model's (its model folder: the base is frozen).
    # learner -> weight store -> generators (inside WeightsAnnouncement)"""

    scaling: float  # alpha / rank
    targets: list[str]  # the adapted Linear modules' full names (e.g. "model.layers.0.self_attn.q_proj")


@dataclass(slots=True)
class WeightsAnnouncement:
    """A published policy version.  # learner -> weight store -> generators"""

    version: int
    location: str  # backend-specific: "object_store" or "nccl:<group>" or a folder path
    num_bytes: int
    created_at: float  # unix time of publication
    checksum: str = ""  # optional content hash of the safetensors payload
    delta_bytes: int = 0  # > 0: a delta from version - 1 was published too, of this many payload bytes
    adapters: AdapterPublication | None = None  # set: the payload is LoRA adapters only, merged by each generator
    secret: str = field(default="", repr=False)
    """collective: the run's channel secret (`learner.collective.handshake`); travels only in Ray calls, never shown."""


@dataclass(slots=True)
class PublishReport:
    """One publication as learner rank 0 saw it.  # learner rank 0 -> driver (a Ray return value, not msgpack)"""

    announcement: WeightsAnnouncement
    blocking_s: float  # seconds rank 0 spent in `LearnerRank.publish`: the learner's next step waits this long
    gather_s: float  # of which waiting for the gather's buckets (the rest: the backend taking them)


@dataclass(slots=True)
class LearnerFeedback:
    """Mean token entropy of stored trajectories under the policy of `version`, and which were
    replayed.  # learner -> buffer"""

    version: int  # the policy version the entropies were measured under (the batch's version)
    keys: list[str]  # the candidates the learner scored for the mixed groups' o*
    entropies: Float32Array  # [len(keys)] exact full-vocabulary mean token entropy (temperature 1)
    chosen: list[str] = field(default_factory=list)  # keys trained as o* of a mixed group (counts one replay each)
    fresh_keys: list[str] = field(default_factory=list)  # the stored fresh correct rollouts the step trained
    fresh_entropies: Float32Array = field(default_factory=lambda: np.zeros(0, np.float32))  # [len(fresh_keys)]
    # per fresh key, the learner's start-of-step log-probs of its response tokens ([T] each), which the buffer
    # stores in place of the generator's (learner.loss.store_learner_logprobs); [] when not stored
    fresh_logprobs: list[Float32Array] = field(default_factory=list)


MESSAGE_TYPES: tuple[type, ...] = (
    Question,
    ReplayRef,
    WorkItem,
    Rollout,
    ScoredGroup,
    TrainGroup,
    TrainingBatch,
    AdapterPublication,
    WeightsAnnouncement,
    LearnerFeedback,
)
