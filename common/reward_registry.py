"""The reward registry: which names exist, and the function behind a name.

- `countdown`, `arithmetic`: the built-in tasks' verifiers (`common.tasks`);
- `exact`, `math`, `math_think`: `common.verifiers`;
- `package.module:function`: any importable user function.

Read by the configuration (names, to validate `reward.name`), the reward pool and its worker processes
(`resolve_reward`) and the start-up checks; it imports only the tasks and the verifiers.
"""

from __future__ import annotations

import importlib

from common.verifiers import RewardFn, exact_reward, math_reward, math_think_reward, synthetic_reward

BUILTIN_NAMES = ("countdown", "arithmetic", "exact", "math", "math_think")
SIMULATION_NAMES = ("synthetic",)
"""Rewards of the simulation engine only: accepted by RewardConfig, never offered to users, refused by `exgrpo train`."""


def _builtin() -> dict[str, tuple[RewardFn, bool]]:
    """name -> (function, runs in-process)."""
    from common.tasks import verify_arithmetic, verify_countdown

    return {
        "countdown": (verify_countdown, True),
        "arithmetic": (verify_arithmetic, True),
        "exact": (exact_reward, True),
        "math": (math_reward, False),
        "math_think": (math_think_reward, False),
        "synthetic": (synthetic_reward, True),
    }


def resolve_reward(name: str) -> tuple[RewardFn, bool]:
    """(function, runs in-process) for a registry name or `package.module:function`.

    Raises ValueError that says what to change for an unknown name, a module that does not import,
    or an attribute that is missing or not callable.
    """
    builtin = _builtin()
    if name in builtin:
        return builtin[name]
    module_name, sep, attr = name.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"reward.name: unknown reward {name!r}; use one of {sorted(builtin)} "
                         "or a user function written package.module:function")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"reward.name: cannot import module {module_name!r} ({e}); "
                         "check the spelling and that it is on PYTHONPATH") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"reward.name: {module_name} has no callable {attr!r}")
    _check_signature(name, fn)
    return fn, False


def _check_signature(name: str, fn: RewardFn) -> None:
    """A reward is called fn(response, answer): `os:system`, which takes one argument, is refused here rather
    than as an error on every rollout."""
    import inspect

    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin without a signature: the calls will tell
        return
    try:
        sig.bind("response", "answer")
    except TypeError:
        raise ValueError(f"reward.name: {name} takes {sig}, not (response, answer); a reward is a function "
                         "fn(response: str, answer: str) -> float") from None


def check_task_matches(reward_name: str, task_name: str | None) -> None:
    """A built-in task's verifier must not score another built-in task's questions."""
    from common.tasks import TASKS

    if task_name in TASKS and reward_name in TASKS and reward_name != task_name:
        raise ValueError(f"reward.name: {reward_name!r} cannot score questions of task {task_name!r}; "
                         f"set reward.name={task_name}")


def _countdown_answer(answer: str) -> bool:
    from common.tasks import _parse_answer

    try:
        _parse_answer(answer)
    except (ValueError, TypeError, KeyError):  # JSONDecodeError is a ValueError
        return False
    return True


def _whole_number(answer: str) -> bool:
    from common.tasks import _is_int

    return bool(answer.strip()) and _is_int(answer.strip())


ANSWER_FORMATS = {
    "countdown": ('JSON text such as {"target": 24, "numbers": [3, 5, 8]}', _countdown_answer),
    "arithmetic": ("a whole number such as 42", _whole_number),
}
"""The reference answers a built-in task's verifier reads (the other rewards read any text): a verifier given
answers it cannot parse scores every rollout 0 or raises, and a run would train on nothing."""


def unreadable_answers(reward_name: str, answers: list[str], source: str) -> str | None:
    """Why `reward_name` cannot score questions whose reference answers are `answers` (the first rows of
    `source`), when it can read none of them; None when it reads one, or reads any text."""
    if reward_name not in ANSWER_FORMATS or not answers:
        return None
    form, reads = ANSWER_FORMATS[reward_name]
    if any(reads(a) for a in answers):
        return None
    shown = ", ".join(repr(a[:40]) for a in answers[:3])
    return (f"reward.name: {reward_name} cannot read the reference answers of {source} (its first rows have "
            f"{shown}; {reward_name} expects {form}); set reward.name to the reward for your data: math "
            "(math-verify), math_think (math-verify after </think>), exact, or your own package.module:function")
