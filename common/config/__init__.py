"""Run configuration: one pydantic section per component under a root `RunConfig`.

Every field carries a docstring (shown by `exgrpo config --explain` and in docs/configuration.md),
a default that runs the built-in task on one CPU machine, and bounds. Each component receives only
its own section (`cfg.buffer`, `cfg.learner`, ...), never the root.

Loading: `load_config(path_or_None, ["buffer.group_size=8", ...])`. Errors are collected into a
`ConfigError` whose `lines` are short "field: problem" strings; the CLI prints them and exits 2.

One module per section (`model`, `data`, `reward`, `generator`, `buffer`, `learner` with `learner_sections` and `loss`,
`cluster`, `eval`, `tracking`), the root and its cross-section rules (`run`), and loading/resuming/writing
(`loading`). Import from `common.config`; the names below are its public surface.
"""

from __future__ import annotations

from common.config.base import Section
from common.config.buffer import BufferConfig
from common.config.cluster import AutoscaleConfig, ClusterConfig
from common.config.data import TASK_DEFAULTS, DataConfig
from common.config.eval import EvalConfig, EvalSetConfig
from common.config.generator import (AutoEngineConfig, EngineConfig, GeneratorConfig, SyntheticEngineConfig,
                                     TransformersEngineConfig, VllmEngineConfig)
from common.config.learner import (CollectiveSyncConfig, LearnerConfig, LoRAConfig, ObjectStoreSyncConfig,
                                   WeightSyncConfig)
from common.config.learner_sections import BatchingConfig, LeversConfig, OptimConfig
from common.config.loss import LossConfig
from common.config.loading import (RESUMABLE_FIELDS, ConfigError, apply_overrides, flatten, load_config,
                                   load_saved_config, restore_secrets, resume_config, to_yaml, yaml_value)
from common.config.model import ModelConfig, ToyModelConfig
from common.config.reward import RewardConfig
from common.config.run import RUN_NAME, RunConfig
from common.config.tracking import CheckpointConfig, TrackingConfig

__all__ = [
    "AutoEngineConfig", "AutoscaleConfig", "BatchingConfig", "BufferConfig", "CheckpointConfig", "ClusterConfig",
    "CollectiveSyncConfig", "ConfigError", "DataConfig", "EngineConfig", "EvalConfig", "EvalSetConfig",
    "GeneratorConfig", "LearnerConfig", "LeversConfig", "LoRAConfig", "LossConfig", "ModelConfig",
    "ObjectStoreSyncConfig", "OptimConfig", "RESUMABLE_FIELDS", "RUN_NAME", "RewardConfig", "RunConfig", "Section",
    "SyntheticEngineConfig", "TASK_DEFAULTS", "ToyModelConfig", "TrackingConfig", "TransformersEngineConfig",
    "VllmEngineConfig", "WeightSyncConfig", "apply_overrides", "flatten", "load_config", "load_saved_config",
    "restore_secrets", "resume_config", "to_yaml", "yaml_value",
]
