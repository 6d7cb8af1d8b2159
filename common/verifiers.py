"""Verifiers: reward functions `fn(response_text, answer) -> float in [0, 1]` that are not a task's own.

A leaf module (nothing of the project imported): the built-in tasks (`common.tasks`) use `math_reward`,
the registry (`common.reward_registry`) names them all.
"""

from __future__ import annotations

import unicodedata
from collections.abc import Callable

RewardFn = Callable[[str, str], float]


def exact_reward(response: str, answer: str) -> float:
    """1.0 when the normalised response equals the normalised answer."""
    return 1.0 if normalize_text(response) == normalize_text(answer) else 0.0


def normalize_text(text: str) -> str:
    """NFKC, case-folded, whitespace collapsed, surrounding `$` and one trailing period removed."""
    t = " ".join(unicodedata.normalize("NFKC", text).casefold().split())
    t = t.strip("$").strip()
    return t[:-1].rstrip() if t.endswith(".") else t


def math_reward(response: str, answer: str) -> float:
    """math-verify: 1.0 when the response's final answer is mathematically equal to the reference."""
    from math_verify import parse, verify

    gold = parse(answer) or parse(f"${answer}$")
    pred = parse(response)
    if not gold or not pred:
        return 0.0
    return 1.0 if verify(gold, pred) else 0.0


def math_think_reward(response: str, answer: str) -> float:
    """The ExGRPO authors' math reward: the answer must follow `</think>`; the reasoning is not graded."""
    if "</think>" not in response:
        return 0.0
    return math_reward(response.split("</think>")[1], answer)


def synthetic_reward(response: str, answer: str) -> float:
    """SIMULATION ONLY (`generator.engine.kind: synthetic`): 1 for the engine's `correct` text, in constant time."""
    return float(response == "correct")
