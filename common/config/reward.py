"""The `reward` section."""

from __future__ import annotations

import difflib

from pydantic import Field, field_validator

from common.config.base import Section


class RewardConfig(Section):
    """How rollouts are scored."""

    name: str = Field("countdown", min_length=1)
    """`countdown`, `arithmetic`, `math` (math-verify), `math_think` (math-verify on the text after `</think>`, 0
    without it: the authors' ExGRPO format), `exact`, or a user function `package.module:function`."""
    timeout_s: float = Field(5.0, gt=0, le=3600)
    """Per-call timeout; a call that exceeds it scores 0 and is counted as an error."""
    max_response_chars: int = Field(20_000, ge=1)
    """Responses longer than this are truncated before scoring (the tail, where answers live, is kept)."""
    num_workers: int = Field(1, ge=1, le=256)
    """Worker processes scoring in parallel inside each generator."""
    correct_threshold: float = Field(1.0, ge=0, le=1)
    """A rollout is correct when its reward is at least this."""
    worker_memory_mb: int = Field(4096, ge=0, le=1_000_000)
    """Address-space limit of each reward worker process (0: none); a memory bomb fails inside the worker."""
    worker_start_timeout_s: float = Field(60.0, gt=0, le=3600)
    """A reward worker that has not imported its function within this is reported and its items score 0."""
    max_error_fraction: float | None = Field(None, gt=0, le=1)
    """Stop the run (exit 1, after a checkpoint) when more than this share of the rollouts of the last 10 learner
    steps were reward errors (raised, hung past `timeout_s`, bad value: each scored 0) instead of training on
    zeros. None: warn when more than half were, and go on."""
    stop_after_error_steps: int = Field(3, ge=0, le=1000)
    """Stop the run (exit 1, after a checkpoint) when every rollout of its first this many learner steps (counted
    from each start, a resume's too) was a reward error: a reward function that fails on every call (raises, returns
    no number, or does not import in the generators) would otherwise train on zeros. 0: never stop for it.
    `max_error_fraction` is the knob for partial failures."""

    @field_validator("name")
    @classmethod
    def _known_reward(cls, v: str) -> str:
        """A registry name, or the form of a user function (importing it is checked when a run starts)."""
        from common.reward_registry import BUILTIN_NAMES, SIMULATION_NAMES

        module, sep, attr = v.partition(":")
        user_fn = sep and attr.isidentifier() and all(p.isidentifier() for p in module.split("."))
        if v in BUILTIN_NAMES or v in SIMULATION_NAMES or user_fn:
            return v
        close = difflib.get_close_matches(v, BUILTIN_NAMES, n=1)
        raise ValueError(f"unknown reward {v!r}; {f'did you mean {close[0]}? ' if close else ''}use one of "
                         f"{', '.join(BUILTIN_NAMES)}, or a user function written package.module:function")
