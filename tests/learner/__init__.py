"""Tests of the learner package."""

from __future__ import annotations

from typing import Any

from common.config.learner import LEARNER_SECTIONS


def sectioned(fields: dict[str, Any]) -> dict[str, Any]:
    """A test's learner settings, written flat for brevity (`lr`, `compile`), as LearnerConfig takes them: each
    moved field in its section (`{"optim": {"lr": ...}}`), the rest as given."""
    out: dict[str, Any] = {}
    for name, value in fields.items():
        if name in LEARNER_SECTIONS:
            out.setdefault(LEARNER_SECTIONS[name], {})[name] = value
        else:
            out[name] = value
    return out
