"""Built-in tasks: deterministic generation, disjoint splits, hand-picked verifier cases."""

from __future__ import annotations

import json

import pytest

from common.tasks import TASKS, get_task, verify_arithmetic, verify_countdown


@pytest.mark.parametrize("name", sorted(TASKS))
def test_generation_is_deterministic_unique_and_split_is_held_out(name):
    task = get_task(name)
    train, test = task.generate(3, 300, 60)
    assert (train, test) == task.generate(3, 300, 60)
    assert len(train) == 300 and len(test) == 60
    questions = [r["question"] for r in train + test]
    assert len(set(questions)) == len(questions)
    assert len({r["id"] for r in train + test}) == 360
    assert task.generate(4, 300, 60) != (train, test)
    # the test split does not depend on how many training questions are asked for
    assert task.generate(3, 50, 60)[1] == test


@pytest.mark.parametrize("name", ["arithmetic", "countdown"])  # the character-level tasks (think_arith: its own file)
def test_prompts_and_responses_are_short_and_solutions_verify(name):
    task = get_task(name)
    train, _ = task.generate(0, 200, 10)
    for row in train:
        sols = task.solutions(row["question"], row["answer"])
        assert sols and all(task.verify(s, row["answer"]) == 1.0 for s in sols)
        assert len(row["question"]) <= 12 and max(len(s) for s in sols) <= 8


def test_countdown_questions_have_several_distinct_solutions():
    task = get_task("countdown")
    train, _ = task.generate(0, 300, 10)
    assert all(len(task.solutions(r["question"], r["answer"])) >= 2 for r in train)
    assert task.solutions("3 7 8>29=", '{"target":29,"numbers":[3,7,8]}') == ["3*7+8", "7*3+8", "8+3*7", "8+7*3"]


def test_arithmetic_format():
    task = get_task("arithmetic")
    train, _ = task.generate(0, 500, 10)
    ops = {next(c for c in r["question"][1:] if c in "+-*") for r in train}
    assert ops == {"+", "-", "*"}
    assert all(r["question"].endswith("=") for r in train)


ANSWER = json.dumps({"target": 29, "numbers": [3, 7, 8]})


@pytest.mark.parametrize(
    "response, reward",
    [
        ("3*7+8", 1.0),
        ("8+7*3", 1.0),
        (" (3*7)+8 ", 1.0),
        ("((8+(3*7)))", 1.0),
        ("3*7+8\n", 1.0),
        ("3*8+7", 0.0),  # 31
        ("3*7+8+3", 0.0),  # 3 used twice (and wrong)
        ("7*7-8*3+8", 0.0),  # numbers not given
        ("29", 0.0),  # the target is not one of the numbers
        ("3*7+8=29", 0.0),  # only the expression
        ("3**7", 0.0),
        ("", 0.0),
        ("3*7+", 0.0),
        ("(3*7+8", 0.0),
        ("3*7+8)", 0.0),
        ("-3+7*8", 0.0),  # no unary minus
        ("3*7+8.0", 0.0),
        ("__import__('os')", 0.0),
        ("9**9**9**9", 0.0),
        ("(" * 5000 + "3" + ")" * 5000, 0.0),
        ("3*7+8" + " " * 100, 0.0),  # longer than any answer: refused unparsed
        ("3*7+8" * 200_000, 0.0),
        ("٣*٧+٨", 0.0),  # non-ASCII digits
    ],
)
def test_countdown_verifier(response, reward):
    assert verify_countdown(response, ANSWER) == reward


def test_countdown_numbers_are_a_multiset():
    answer = json.dumps({"target": 14, "numbers": [2, 7, 7]})
    assert verify_countdown("7+7", answer) == 1.0
    assert verify_countdown("2*7", answer) == 1.0
    assert verify_countdown("(7+7)*2-7-7", answer) == 0.0


@pytest.mark.parametrize(
    "response, answer, reward",
    [
        ("357", "357", 1.0),
        (" 357\n", "357", 1.0),
        ("-13", "-13", 1.0),
        ("0357", "357", 1.0),  # the integer value counts
        ("358", "357", 0.0),
        ("13", "-13", 0.0),
        ("357.0", "357", 0.0),
        ("3 57", "357", 0.0),
        ("", "357", 0.0),
        ("-", "0", 0.0),
        ("1" * 10_000, "1", 0.0),
        ("9**9**9**9", "1", 0.0),
        ("١٢", "12", 0.0),
    ],
)
def test_arithmetic_verifier(response, answer, reward):
    assert verify_arithmetic(response, answer) == reward


def test_unknown_task_names_the_known_ones():
    known = r"\['arithmetic', 'countdown', 'think_arith'\]"
    with pytest.raises(ValueError, match=rf"unknown task 'chess'; built-in tasks are {known}"):
        get_task("chess")


def test_the_splits_kept_in_a_cache_folder_are_the_ones_made_and_a_damaged_file_is_made_again(tmp_path):
    from common.tasks import get_task

    task = get_task("countdown")
    made = task.generate(3, 40, 10)
    assert task.generate(3, 40, 10, tmp_path) == made  # made, then kept
    (kept,) = (tmp_path / "questions").glob("countdown-3-40-10-*.json")
    assert task.generate(3, 40, 10, tmp_path) == made  # read back
    kept.write_text('[["truncated"')
    assert task.generate(3, 40, 10, tmp_path) == made  # unreadable: made again and kept again
    assert task.generate(3, 40, 10, tmp_path) == made and list((tmp_path / "questions").iterdir()) == [kept]
