"""Rewards: the registry, each built-in reward, and every failure mode of the worker pool."""

from __future__ import annotations

import json
import logging
import threading
import time

import pytest

from common.config import RewardConfig
from common.reward_registry import resolve_reward
from common.rewards import RewardPool, ScoreRequest, ScoreResult, ScoringAbandoned
from common.verifiers import exact_reward, math_reward, math_think_reward

FNS = "tests.common.reward_fns"


def _pool(name: str, **kw) -> RewardPool:
    return RewardPool(RewardConfig(name=name, **kw))


def _score(pool: RewardPool, pairs: list[tuple[str, str]]) -> list[ScoreResult]:
    return pool.score([ScoreRequest(f"q{i}", r, a) for i, (r, a) in enumerate(pairs)])


def _counts(pool: RewardPool) -> dict[str, float]:
    return {k: v for k, v in pool.stats().items() if k in ("calls", "errors", "timeouts", "worker_restarts",
                                                            "in_flight")}


def test_builtin_task_rewards_run_in_process():
    answer = json.dumps({"target": 29, "numbers": [3, 7, 8]})
    with RewardPool(RewardConfig(name="countdown"), task_name="countdown") as pool:
        res = _score(pool, [("3*7+8", answer), ("3+7+8", answer), ("9**9**9**9", answer), ("x" * 1_000_000, answer)])
        assert [r.reward for r in res] == [1.0, 0.0, 0.0, 0.0] and all(r.error is None for r in res)
        assert _counts(pool) == {"calls": 4, "errors": 0, "timeouts": 0, "worker_restarts": 0, "in_flight": 0}
        assert pool._workers == [None]  # no worker process was started
    with RewardPool(RewardConfig(name="arithmetic"), task_name="arithmetic") as pool:
        assert [r.reward for r in _score(pool, [("357", "357"), ("35", "357")])] == [1.0, 0.0]


def test_a_bad_answer_string_is_a_counted_error_not_a_crash():
    with _pool("countdown") as pool:
        (res,) = _score(pool, [("3*7+8", "not json")])
        assert res.reward == 0.0 and "raised JSONDecodeError" in res.error and pool.stats()["errors"] == 1


@pytest.mark.parametrize(
    "response, answer, reward",
    [("42", "42", 1.0), ("  Paris. ", "paris", 1.0), ("$x+1$", "x+1", 1.0), ("a  b", "a b", 1.0), ("ＡＢ", "ab", 1.0),
     ("41", "42", 0.0), ("", "42", 0.0), ("42 apples", "42", 0.0)],
)
def test_exact(response, answer, reward):
    assert exact_reward(response, answer) == reward


@pytest.mark.parametrize(
    "response, answer, reward",
    [("The answer is $\\frac{1}{2}$", "0.5", 1.0), ("so \\boxed{3}", "3", 1.0), ("$x^2+2x+1$", "(x+1)^2", 1.0),
     ("\\boxed{4}", "3", 0.0), ("no answer here", "3", 0.0)],
)
def test_math_reward_function(response, answer, reward):
    assert math_reward(response, answer) == reward


@pytest.mark.parametrize(
    "response, answer, reward",
    [("<think>2+1=3, so \\boxed{4}? no</think> \\boxed{3}", "3", 1.0),  # only the text after </think> counts
     ("<think>the answer is \\boxed{3}</think> I give up", "3", 0.0),
     ("\\boxed{3}", "3", 0.0),  # no </think>: a format failure scores 0, as in the official code
     ("<think>a</think> \\boxed{3} </think> \\boxed{5}", "3", 1.0)],  # split("</think>")[1]
)
def test_math_think_reward_is_the_official_format(response, answer, reward):
    assert math_think_reward(response, answer) == reward


def test_math_reward_survives_adversarial_answers_in_its_workers():
    pairs = [
        ("$\\frac{1}{2}$", "1/2"),
        ("9**9**9**9", "1"),
        ("$9^{9^{9^{9}}}$", "1"),
        ("x" * 1_000_000, "1"),
        ("\\frac{" * 3000 + "1" + "}{2}" * 3000, "1"),
        ("\\sqrt{" * 5000 + "2" + "}" * 5000, "2"),
        ("\\boxed{7}", "7"),
    ]
    with _pool("math", timeout_s=2.0, num_workers=2) as pool:  # a stalled worker would never return here
        res = _score(pool, pairs)
        stats = pool.stats()
    assert res[0].reward == 1.0 and res[-1].reward == 1.0
    assert all(r.reward == 0.0 for r in res[1:-1])
    assert stats["calls"] == 7 and stats["errors"] == stats["timeouts"] <= 5


def test_user_function_bad_returns_score_zero_with_errors(caplog):
    cases = {
        "good": (1.0, None), "raises": (0.0, "raised RuntimeError: broken on 'x'"),
        "nan": (0.0, "returned nan, outside [0, 1]"), "out_of_range": (0.0, "returned 1.5, outside [0, 1]"),
        "negative": (0.0, "returned -0.1, outside [0, 1]"), "string": (0.0, "returned a str, not a number"),
        "none": (0.0, "returned a NoneType, not a number"), "boolean": (1.0, None), "numpy_float": (0.25, None),
        "huge_int": (0.0, "returned a number that does not fit a float"),
    }
    for fn, (reward, error) in cases.items():
        with _pool(f"{FNS}:{fn}") as pool, caplog.at_level(logging.WARNING, logger="common.rewards"):
            caplog.clear()
            (res,) = pool.score([ScoreRequest("question-7", "x", "x")])
            assert (res.reward, res.error) == (reward, error), fn
            assert pool.stats()["errors"] == (error is not None)
            if error:
                assert "question-7" in caplog.text and error in caplog.text


def test_hanging_call_times_out_and_its_worker_is_replaced():
    with _pool(f"{FNS}:hangs", timeout_s=1.0) as pool:
        first_pid = None
        res = _score(pool, [("a", ""), ("hang", ""), ("b", ""), ("hang", ""), ("c", "")])
        assert [r.reward for r in res] == [1.0, 0.0, 1.0, 0.0, 1.0]
        assert res[1].error == "timed out after 1 s"
        assert _counts(pool) == {"calls": 5, "errors": 2, "timeouts": 2, "worker_restarts": 2, "in_flight": 0}
        # the two timed-out calls took at least their timeout each; three of five were quick
        stats = pool.stats()
        assert stats["call_max_s"] >= 1.0 and stats["call_p50_s"] < 1.0 and stats["oldest_s"] == 0
        first_pid = pool._workers[0].proc.pid
        assert [r.reward for r in _score(pool, [("d", "")])] == [1.0]
        assert pool._workers[0].proc.pid == first_pid  # a healthy worker is reused across batches


def test_stats_are_live_during_a_hanging_batch_and_abandon_ends_it(caplog):
    """While a batch of hanging calls runs (each past its 2 s timeout in turn, so the batch would take
    ~16 s), another thread sees the calls in flight, the oldest call's age and the timeouts so far;
    `abandon()` then ends the batch at once (ScoringAbandoned) and kills the worker. Driven by what the
    pool reports, not by the clock: the abandon comes after the second timeout is seen."""
    pool = _pool(f"{FNS}:hangs", timeout_s=2.0)
    out: dict = {}

    def run():
        try:
            _score(pool, [("hang", "")] * 8)
        except ScoringAbandoned as e:
            out["abandoned"] = e

    with caplog.at_level(logging.WARNING, logger="common.rewards"):
        t = threading.Thread(target=run)
        t.start()
        seen = []
        while t.is_alive() and pool.stats()["timeouts"] < 2:
            seen.append(pool.stats())
            time.sleep(0.05)
        live = pool.stats()
        pool.abandon()
        t.join(60)
    assert not t.is_alive(), "abandon() did not end the running batch"
    assert live["timeouts"] == 2 and live["in_flight"] == 6 and live["calls"] == 0  # calls count finished batches
    assert any(s["in_flight"] == 8 and s["oldest_s"] > 0 for s in seen)
    assert out["abandoned"].scored == 2 and out["abandoned"].total == 8
    assert pool._workers == [None]  # killed, not left inside the hanging call
    with pytest.raises(ScoringAbandoned):  # for good
        _score(pool, [("a", "")])
    first = [r.message for r in caplog.records if "timed out" in r.message]
    assert len(first) == 1 and "reward.timeout_s=2 s" in first[0] and "response 'hang'" in first[0], first
    pool.close()


def test_hung_worker_process_is_gone():
    pool = _pool(f"{FNS}:hangs", timeout_s=0.5)
    _score(pool, [("a", "")])
    proc = pool._workers[0].proc
    _score(pool, [("hang", "")])
    assert proc.poll() is not None  # killed and reaped
    pool.close()
    pool.close()  # idempotent


def test_crashing_worker_is_replaced_and_the_rest_scored():
    with _pool(f"{FNS}:crashes") as pool:
        res = _score(pool, [("a", ""), ("crash", ""), ("b", "")])
        assert [r.reward for r in res] == [1.0, 0.0, 1.0]
        assert res[1].error == "reward worker died (exit code 3)"
        assert pool.stats()["worker_restarts"] == 1


def test_printing_function_does_not_corrupt_the_protocol():
    with _pool(f"{FNS}:prints") as pool:
        assert [r.reward for r in _score(pool, [("a", "")] * 3)] == [1.0, 1.0, 1.0]


def test_memory_bomb_fails_inside_the_worker():
    with _pool(f"{FNS}:memory_bomb", worker_memory_mb=1024) as pool:
        (res,) = _score(pool, [("a", "")])
        assert res.reward == 0.0 and "MemoryError" in res.error


def test_long_responses_are_cut_to_their_tail():
    with _pool(f"{FNS}:tail_check", max_response_chars=100) as pool:
        res = _score(pool, [("x" * 1_000_000 + "END", ""), ("END" + "x" * 1000, "")])
        assert [r.reward for r in res] == [1.0, 0.0]


def test_batches_are_split_over_workers_and_order_is_kept():
    with _pool(f"{FNS}:as_fraction", num_workers=3) as pool:
        res = _score(pool, [(str(i), "") for i in range(50)])
        assert [r.reward for r in res] == [i / 100 for i in range(50)]
        assert sum(w is not None for w in pool._workers) == 3
        assert pool.score([]) == []


def test_bad_reward_names_fail_at_construction_with_what_to_change():
    with pytest.raises(ValueError, match=r"unknown reward 'bogus'; use one of countdown, arithmetic, exact, "
                                         r"math, math_think, or a user function written package.module:function"):
        _pool("bogus")
    with pytest.raises(ValueError, match="cannot import module 'no_such_module_xyz'"):
        _pool("no_such_module_xyz:f")
    with pytest.raises(ValueError, match="has no callable 'missing'"):
        _pool(f"{FNS}:missing")
    with pytest.raises(ValueError, match="has no callable 'not_callable'"):
        _pool(f"{FNS}:not_callable")
    with pytest.raises(ValueError, match="'countdown' cannot score questions of task 'arithmetic'"):
        RewardPool(RewardConfig(name="countdown"), task_name="arithmetic")
    assert resolve_reward(f"{FNS}:good")[1] is False and resolve_reward("exact")[1] is True


def test_a_reward_module_named_like_a_standard_library_one_names_the_file_imported(tmp_path, monkeypatch):
    """`json.py` in the current folder with reward.name=json:f: the standard library's json is imported (the
    current folder comes after it on sys.path), which has no `f`; the message names that file and the fix."""
    (tmp_path / "json.py").write_text("def f(response, answer):\n    return 1.0\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("sys.path", [*__import__("sys").path, str(tmp_path)])  # after the installed, as `exgrpo` does
    with pytest.raises(ValueError) as e:
        resolve_reward("json:f")
    assert str(e.value) == (f"reward.name: json imported the standard library's json ({json.__file__}), not your "
                            f"{tmp_path / 'json.py'}: a module named like a standard-library or installed one is found "
                            "after it; rename your module (e.g. my_json.py) and set reward.name=my_json:f")
    (tmp_path / "json.py").rename(tmp_path / "my_json.py")  # as the message says
    assert resolve_reward("my_json:f")[0]("x", "y") == 1.0
    monkeypatch.delitem(__import__("sys").modules, "my_json")


@pytest.mark.parametrize("source, says", [
    ("def score(response, answer):\n    return 1.0 if response == answer else 0.0\n)\n",
     ["does not compile (", ".py line 3: SyntaxError: ", "fix the module"]),
    ("X = 1\nraise RuntimeError('no config file here')\n",
     ["raised RuntimeError: no config file here (", ".py line 2)", "fix the module"]),
    ("import sys\nsys.exit(3)\n",
     ["called sys.exit(3) while being imported (", ".py line 2)", "must not exit at import",
      'if __name__ == "__main__":']),
    ("import no_such_dependency_xyz\n",
     ["was found, but its import failed on 'no_such_dependency_xyz' (", ".py line 1: No module named "
      "'no_such_dependency_xyz')", "install no_such_dependency_xyz where the run starts"]),
    ("async def score(response, answer):\n    return 1.0\n",
     [":score is an async def function: its calls return coroutines, not a float", "fn(response: str, answer: str) "
      "-> float"]),
    ("def score(response, answer):\n    yield 1.0\n",
     [":score is a generator function (it yields): its calls return generators, not a float"]),
])
def test_a_reward_module_that_fails_at_import_or_returns_no_float_is_one_line(tmp_path, monkeypatch, source, says):
    """Issue 51: a traceback (or, for sys.exit(3), a silent exit with the code that means a stall) became one line
    with the module's file, line and error; async and generator rewards are refused before any rollout."""
    import uuid

    name = f"user_reward_{uuid.uuid4().hex[:8]}"  # a fresh module name: nothing cached in sys.modules
    (tmp_path / f"{name}.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ValueError) as e:
        resolve_reward(f"{name}:score")
    text = str(e.value)
    assert text.startswith("reward.name: ") and "\n" not in text, text
    assert all(s in text for s in says), text
    if any(".py line" in s for s in says):  # the failing line of the user's own file
        assert f"{tmp_path / name}.py line" in text, text


def test_a_missing_module_is_told_to_check_the_spelling_and_the_folder():
    with pytest.raises(ValueError, match=r"cannot import module 'no_such_module_xyz' \(No module named "
                                         r"'no_such_module_xyz'\); check the spelling, and start the run from the "
                                         r"folder that holds it or put that folder on PYTHONPATH"):
        resolve_reward("no_such_module_xyz:f")


@pytest.mark.parametrize("fn, response, error", [
    ("recurses", "1+1" + "+1-1" * 3000, "raised RecursionError: maximum recursion depth exceeded"),
    ("exits", "exit", "raised SystemExit: 0"),
    ("broken_message", "x", "raised ValueError: bad ? surrogate"),
])
def test_an_answer_that_breaks_a_function_is_a_counted_zero_and_its_worker_goes_on(fn, response, error):
    with _pool(f"{FNS}:{fn}") as pool:
        res = _score(pool, [("a", ""), (response, ""), ("b", "")])
        pid = pool._workers[0].proc.pid
        assert [r.reward for r in res] == [1.0, 0.0, 1.0] and res[1].error == error
        assert _counts(pool) == {"calls": 3, "errors": 1, "timeouts": 0, "worker_restarts": 0, "in_flight": 0}
        assert [r.reward for r in _score(pool, [("c", "")])] == [1.0] and pool._workers[0].proc.pid == pid
