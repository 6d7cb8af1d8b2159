"""The `eval` section and its evaluation sets."""

from __future__ import annotations

import re
from pathlib import Path

from pydantic import Field, field_validator

from common.config.base import Section
from common.config.reward import RewardConfig


class EvalSetConfig(Section):
    """One named evaluation set (`eval.sets.<name>`): a JSONL/Parquet file with its own reward and sampling."""

    path: str = Field(min_length=1)
    """JSONL or Parquet file; rows are read with the data.*_field names, like data.test_path."""
    reward: str | None = None
    """Reward function of this set (a registry name or package.module:function); None: the run's reward.name."""
    samples: int | None = Field(None, ge=1, le=1024)
    """Samples per question (mean@k, pass@k); None: eval.samples."""
    temperature: float | None = Field(None, gt=0, le=10)
    """Sampling temperature; None: eval.temperature."""
    questions: int | None = Field(None, ge=1, le=1_000_000)
    """Evaluate the first this many questions; None: all of them."""

    @field_validator("path")
    @classmethod
    def _exists(cls, v: str) -> str:
        if not Path(v).expanduser().is_file():
            raise ValueError(f"{v} is not a file")
        return v

    @field_validator("reward")
    @classmethod
    def _reward_name(cls, v: str | None) -> str | None:
        return None if v is None else RewardConfig(name=v).name  # the same check as reward.name


class EvalConfig(Section):
    """Held-out evaluation during training, by an evaluator actor off the training path."""

    every_steps: int = Field(0, ge=0, le=10_000_000)
    """Evaluate the newest published policy every this many learner steps (0: no in-run evaluation).
    The learner and generators never wait for it; a request while one runs is skipped and counted."""
    questions: int = Field(64, ge=1, le=1_000_000)
    """Held-out questions evaluated (the first ones of the test split: the built-in task's, or data.test_path)."""
    samples: int = Field(4, ge=1, le=1024)
    """Sampled responses per question for pass@1 (mean accuracy) and pass@k."""
    temperature: float = Field(0.6, gt=0, le=10)
    """Sampling temperature of the pass@k samples (the paper evaluates at 0.6); greedy accuracy is measured too."""
    final: bool = True
    """With every_steps > 0, also evaluate the final policy at the end of the run (waits for it)."""
    timeout_s: float = Field(900.0, gt=0, le=86_400)
    """The final evaluation (and the evaluator's start) fails loudly after this long."""
    num_cpus: float = Field(0.0, ge=0)
    """CPUs reserved for the evaluator actor (0: it shares the generators' and learner's)."""
    num_gpus: float = Field(0.0, ge=0)
    """GPUs reserved for the evaluator actor."""
    seed: int = Field(1234, ge=0, le=2**32 - 1)  # numpy and vLLM take 32-bit seeds
    """Sampling seed (the same questions and seed at every evaluation, so curves compare versions)."""
    sets: dict[str, EvalSetConfig] = Field(default_factory=dict)
    """Named evaluation sets (`eval.sets.aime.path=aime.jsonl`), each with its own reward, samples and temperature,
    evaluated in the run and by `exgrpo eval` instead of the held-out split; metrics `eval/<name>/mean_at_k`,
    `pass_at_k`, `greedy_accuracy`, `response_length_mean`."""

    @field_validator("sets")
    @classmethod
    def _set_names(cls, v: dict[str, EvalSetConfig]) -> dict[str, EvalSetConfig]:
        bad = [k for k in v if not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", k)]
        if bad:
            raise ValueError(f"eval.sets: names {bad} must be 1-64 letters, digits, '_', '.' or '-' (they name "
                             "MLflow metrics eval/<name>/...)")
        return v
