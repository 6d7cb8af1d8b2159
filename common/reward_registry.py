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
    return fn, False


def check_task_matches(reward_name: str, task_name: str | None) -> None:
    """A built-in task's verifier must not score another built-in task's questions."""
    from common.tasks import TASKS

    if task_name in TASKS and reward_name in TASKS and reward_name != task_name:
        raise ValueError(f"reward.name: {reward_name!r} cannot score questions of task {task_name!r}; "
                         f"set reward.name={task_name}")
