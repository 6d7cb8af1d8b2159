"""Messages that cross process boundaries. Each is defined once here, with its direction.

All are plain dataclasses; `common.codec` turns them into versioned msgpack payloads. Token ids are
int32 numpy arrays and log-probs float32 numpy arrays, so they travel as compact typed bytes.

    dataset --Question--> buffer shard --WorkItem--> generator
    generator --ScoredGroup(Rollout...)--> buffer shard
    buffer shard --TrainingBatch(TrainGroup...)--> learner
    learner --LearnerFeedback--> buffer shard
    learner --WeightsAnnouncement--> weight store --> generators
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated

import numpy as np

SCHEMA_VERSION = 1
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
    """The stored trajectory a replay work item will be joined with.  # buffer -> generator -> buffer"""

    key: str  # trajectory key inside the shard
    entropy: float  # its entropy estimate when chosen (for metrics)
    version: int  # policy version that produced it


@dataclass(slots=True)
class WorkItem:
    """A lease: generate `num_samples` rollouts of `question` before `deadline`.  # buffer -> generator"""

    lease_id: str
    question: Question
    num_samples: int  # K for fresh questions, K-1 for replay questions
    deadline: float  # unix time after which the lease is expired and the question issued again
    shard: int  # shard that issued the lease (where the group must go back)
    replay: ReplayRef | None = None


@dataclass(slots=True)
class Rollout:
    """One sampled response, scored.  # generator -> buffer (inside ScoredGroup) -> learner"""

    response_ids: Int32Array  # [T] sampled token ids (EOS included when it was sampled)
    logprobs: Float32Array  # [T] behaviour-policy log-prob of each sampled token
    reward: float  # in [0, 1]
    correct: bool  # reward >= correct_threshold
    entropy: float  # mean token entropy (generator's estimate, or learner's refreshed value)
    version: int  # policy version that generated it
    finish_reason: str  # "stop" | "length" | "abort"
    key: str = ""  # trajectory key, set by the buffer for stored/replayed trajectories
    replayed: bool = False  # True for the stored trajectory of a mixed group


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
    """A group ready for training: K rollouts of one question (mixed groups hold one replayed).  # buffer -> learner"""

    question_id: str
    prompt_ids: Int32Array  # [P]
    rollouts: list[Rollout]
    mixed: bool  # one rollout is a replayed stored trajectory
    lease_id: str = ""


@dataclass(slots=True)
class TrainingBatch:
    """B groups sampled with a fixed fresh/mixed ratio.  # buffer -> learner"""

    groups: list[TrainGroup]
    version: int  # learner policy version the batch was requested for
    stats: dict[str, float] = field(default_factory=dict)  # buffer-side metrics of this batch


@dataclass(slots=True)
class WeightsAnnouncement:
    """A published policy version.  # learner -> weight store -> generators"""

    version: int
    location: str  # backend-specific: "object_store" or "nccl:<group>" or a folder path
    num_bytes: int
    created_at: float  # unix time of publication
    checksum: str = ""  # optional content hash of the safetensors payload


@dataclass(slots=True)
class LearnerFeedback:
    """Entropy of trained trajectories under the policy that trained on them.  # learner -> buffer"""

    version: int
    keys: list[str]
    entropies: Float32Array  # [len(keys)]


MESSAGE_TYPES: tuple[type, ...] = (
    Question,
    ReplayRef,
    WorkItem,
    Rollout,
    ScoredGroup,
    TrainGroup,
    TrainingBatch,
    WeightsAnnouncement,
    LearnerFeedback,
)
