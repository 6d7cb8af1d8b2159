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
    module = import_user_module(module_name)
    _check_not_shadowed(name, module)
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"reward.name: {module_name} has no callable {attr!r}")
    _check_signature(name, fn)
    _check_returns_a_value(name, fn)
    return fn, False


def import_user_module(module_name: str, field: str = "reward.name"):
    """A user's module (a reward's, an experience policy's: `field` names the setting). ValueError with one line when
    its import fails: not found (the spelling, the path), found but failing (its file, line and error: a syntax error, an exception, a missing dependency of
    its own), or exiting at import (`sys.exit(3)` would otherwise end the command with code 3, which means a
    stall)."""
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name is not None and (module_name == e.name or module_name.startswith(e.name + ".")):
            raise ValueError(f"{field}: cannot import module {module_name!r} ({e}); check the spelling, and "
                             "start the run from the folder that holds it or put that folder on PYTHONPATH") from None
        raise ValueError(f"{field}: module {module_name!r} was found, but its import failed on {e.name!r} "
                         f"({_where(e, module_name)}: {e}); install {e.name} where the run starts and on every "
                         "node of the run") from None
    except SyntaxError as e:
        raise ValueError(f"{field}: module {module_name!r} does not compile ({e.filename} line {e.lineno}: "
                         f"{type(e).__name__}: {e.msg}); fix the module") from None
    except SystemExit as e:
        raise ValueError(f"{field}: module {module_name!r} called sys.exit({e.code!r}) while being imported "
                         f"({_where(e, module_name)}); a module must not exit at import: move that code under "
                         "`if __name__ == \"__main__\":`") from None
    except Exception as e:  # anything the module's own code raises at import: say where, not a traceback
        raise ValueError(f"{field}: importing module {module_name!r} raised {type(e).__name__}: {e} "
                         f"({_where(e, module_name)}); fix the module") from None


def _check_not_shadowed(name: str, module) -> None:
    """A module of the current folder (`json.py`) named like a standard-library or installed one: the import
    found that one first (`cluster.cli` puts the current folder after the installed packages), so the reward
    would be that module's attribute, or missing. ValueError naming the file imported and the one meant."""
    import os
    import sys
    from pathlib import Path

    module_name, _, attr = name.partition(":")
    top = module_name.split(".")[0]
    mine = next((c for c in (Path(os.getcwd()) / f"{top}.py", Path(os.getcwd()) / top) if c.exists()), None)
    found = sys.modules.get(top, module)
    imported = getattr(found, "__file__", None) or next(iter(getattr(found, "__path__", None) or []), None)
    if mine is None or (imported is not None and Path(imported).resolve().is_relative_to(mine.resolve())):
        return
    imported = imported or "built into Python"
    whose = "the standard library's" if top in sys.stdlib_module_names else "an installed package's"
    raise ValueError(f"reward.name: {module_name} imported {whose} {top} ({imported}), not your {mine}: a module named "
                     f"like a standard-library or installed one is found after it; rename your module (e.g. "
                     f"my_{top}{mine.suffix}) and set reward.name=my_{top}{module_name[len(top):]}:{attr}")


def _where(e: BaseException, module_name: str) -> str:
    """`file line N` of the deepest frame of `e`'s traceback in the user's module (else the deepest frame)."""
    import traceback

    frames = traceback.extract_tb(e.__traceback__)
    top = module_name.split(".")[0]
    own = [f for f in frames if f"/{top}/" in f.filename or f.filename.endswith(f"/{top}.py")]
    frame = (own or frames or [None])[-1]
    return "no traceback" if frame is None else f"{frame.filename} line {frame.lineno}"


def _check_returns_a_value(name: str, fn: RewardFn) -> None:
    """`async def` and generator functions return a coroutine or a generator, not a float: every call would be
    scored as an error, so they are refused here."""
    import inspect

    call = getattr(fn, "__call__", None) if not inspect.isroutine(fn) else None
    for what, test in (("an async def function: its calls return coroutines", inspect.iscoroutinefunction),
                       ("an async generator: its calls return async generators", inspect.isasyncgenfunction),
                       ("a generator function (it yields): its calls return generators", inspect.isgeneratorfunction)):
        if test(fn) or (call is not None and test(call)):
            raise ValueError(f"reward.name: {name} is {what}, not a float; a reward is a plain function "
                             "fn(response: str, answer: str) -> float that returns its score")


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
