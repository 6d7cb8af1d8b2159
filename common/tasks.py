"""Built-in tasks: questions generated deterministically from a seed, with a held-out test split.

Both tasks keep prompts and responses short because the built-in tokenizer is character-level (one
character = one token) and CPU generation is slow:

- `arithmetic`: prompt `"12+345="`, response `"357"`. Operands have 1-3 digits; +, - and x (written
  `*`, second factor one digit). Every question has exactly one correct answer.
- `countdown` (the default): prompt `"3 7 8>29="` (a quarter of the questions give two numbers:
  the easy tier), response an expression such as `"3*7+8"` that reaches the target using each given
  number at most once with `+ - *` (and parentheses).
  Every question has at least two distinct correct responses (`3*7+8`, `8+7*3`, ...), so choosing the
  lowest-entropy correct trajectory is meaningful. The answer string is JSON
  (`{"target":29,"numbers":[3,7,8]}`) so the verifier needs nothing but the answer.

Split: every generated question goes to the test split when a keyed hash of its text falls in the
lowest `1/TEST_SHARE` of the hash range, so the test split is disjoint from the training split and
does not change when `n_train` changes. Verifiers never `eval`: countdown responses are parsed by
a small recursive-descent parser, and the numbers used are checked before anything is computed, which
bounds the work to a handful of small-integer operations (so verifiers may run in-process).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import random
from collections import Counter
from functools import lru_cache
from collections.abc import Callable
from dataclasses import dataclass

TEST_SHARE = 8
"""About one generated question in TEST_SHARE goes to the held-out split."""

MAX_RESPONSE_CHARS = 64
"""Built-in verifiers score longer responses 0 without parsing them."""


@dataclass(frozen=True)
class Task:
    """A built-in task.

    `generate(seed, n_train, n_test)` returns rows `{"id", "question", "answer"}` for the two splits;
    `verify(response_text, answer)` returns a reward in [0, 1]; `solutions(answer)` lists correct
    responses (used to train the built-in model; at least one per question).
    """

    name: str
    make_question: Callable[[random.Random], tuple[str, str] | None]
    verify: Callable[[str, str], float]
    solutions: Callable[[str], list[str]]
    max_attempts_per_question: int = 50

    def generate(self, seed: int, n_train: int, n_test: int) -> tuple[list[dict], list[dict]]:
        """Deterministic in `seed`; the two splits are disjoint and each holds unique questions."""
        rng = random.Random(f"{self.name}:{seed}")
        train: list[dict] = []
        test: list[dict] = []
        seen: set[str] = set()
        attempts = 0
        budget = self.max_attempts_per_question * (n_train + n_test) + 1000
        while len(train) < n_train or len(test) < n_test:
            attempts += 1
            if attempts > budget:
                raise ValueError(
                    f"task {self.name}: only {len(train)} train / {len(test)} test unique questions found for "
                    f"n_train={n_train}, n_test={n_test}; lower data.num_train / data.num_test"
                )
            made = self.make_question(rng)
            if made is None or made[0] in seen:
                continue
            question, answer = made
            seen.add(question)
            row = {"id": f"{self.name}-{_digest(question, 6)}", "question": question, "answer": answer}
            split = test if _is_test(question, seed) else train
            limit = n_test if split is test else n_train
            if len(split) < limit:
                split.append(row)
        return train, test


def _digest(text: str, nbytes: int) -> str:
    return hashlib.blake2b(text.encode(), digest_size=nbytes).hexdigest()


def _is_test(question: str, seed: int) -> bool:
    h = hashlib.blake2b(question.encode(), digest_size=8, key=f"split{seed}".encode()).digest()
    return int.from_bytes(h, "little") % TEST_SHARE == 0


def _clean(response: str) -> str | None:
    """The response without surrounding whitespace, or None when it is too long to be an answer."""
    if not isinstance(response, str) or len(response) > MAX_RESPONSE_CHARS:
        return None
    return response.strip()


# --------------------------------------------------------------------------------------- arithmetic

_OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


def _arithmetic_question(rng: random.Random) -> tuple[str, str]:
    """+ and - of 1-3 digit numbers; x of a 1-3 digit number by a 1 digit one (full 3x3-digit products
    are out of reach of the built-in model, which would leave a whole third of the task never solved)."""
    op = rng.choice("+-*")
    a = rng.randint(0, 10 ** rng.randint(1, 3) - 1)
    b = rng.randint(0, 10 ** (1 if op == "*" else rng.randint(1, 3)) - 1)
    return f"{a}{op}{b}=", str(_OPS[op](a, b))


def verify_arithmetic(response: str, answer: str) -> float:
    """1.0 when the response is exactly the integer answer (surrounding whitespace ignored), else 0.0."""
    text = _clean(response)
    if not text or not _is_int(text):
        return 0.0
    return 1.0 if int(text) == int(answer) else 0.0


def _is_int(text: str) -> bool:
    digits = text[1:] if text[0] == "-" else text
    return 0 < len(digits) <= 32 and digits.isascii() and digits.isdigit()


# ---------------------------------------------------------------------------------------- countdown

COUNTDOWN_NUMBERS = 3
COUNTDOWN_TWO_NUMBER_SHARE = 0.25
COUNTDOWN_MAX_NUMBER = 9
COUNTDOWN_TARGETS = range(10, 100)


def _countdown_question(rng: random.Random) -> tuple[str, str] | None:
    """Two (one question in four: the easy tier) or three numbers 1-9 and a two-digit target reachable
    in at least two distinct ways."""
    count = 2 if rng.random() < COUNTDOWN_TWO_NUMBER_SHARE else COUNTDOWN_NUMBERS
    numbers = [rng.randint(1, COUNTDOWN_MAX_NUMBER) for _ in range(count)]
    by_value = _expressions_by_value(tuple(numbers))
    reachable = [t for t in COUNTDOWN_TARGETS if len(by_value.get(t, ())) >= 2]
    if not reachable:
        return None
    target = rng.choice(reachable)
    answer = json.dumps({"target": target, "numbers": numbers}, separators=(",", ":"))
    return f"{' '.join(map(str, numbers))}>{target}=", answer


@lru_cache(maxsize=4096)
def _expressions_by_value(numbers: tuple[int, ...]) -> dict[int, tuple[str, ...]]:
    """Every parenthesis-free expression over 2..n of the numbers (each used at most once), by value."""
    out: dict[int, set[str]] = {}  # cached: the returned dict must not be mutated
    for size in range(2, len(numbers) + 1):
        for picked in itertools.permutations(range(len(numbers)), size):
            for ops in itertools.product("+-*", repeat=size - 1):
                text = str(numbers[picked[0]]) + "".join(o + str(numbers[i]) for o, i in zip(ops, picked[1:]))
                out.setdefault(_evaluate(_parse(text)), set()).add(text)
    return {v: tuple(sorted(s)) for v, s in out.items()}


def _parse_answer(answer: str) -> tuple[int, list[int]]:
    data = json.loads(answer)
    return int(data["target"]), [int(x) for x in data["numbers"]]


def countdown_solutions(answer: str) -> list[str]:
    """All parenthesis-free correct responses (sorted)."""
    target, numbers = _parse_answer(answer)
    return list(_expressions_by_value(tuple(numbers)).get(target, ()))


class _ParseError(ValueError):
    pass


def _tokens(text: str) -> list[str]:
    out: list[str] = []
    i = 0
    while i < len(text):
        c = text[i]
        if c.isspace():
            i += 1
        elif c in "+-*()":
            out.append(c)
            i += 1
        elif c.isascii() and c.isdigit():
            j = i
            while j < len(text) and text[j].isascii() and text[j].isdigit():
                j += 1
            if j - i > 3:
                raise _ParseError("number too long")
            out.append(text[i:j])
            i = j
        else:
            raise _ParseError(f"unexpected character {c!r}")
    return out


def _parse(text: str) -> tuple:
    """Expression -> tree of ("num", n) / (op, left, right); raises _ParseError. Grammar:
    expr := term (("+"|"-") term)*; term := atom ("*" atom)*; atom := NUMBER | "(" expr ")"."""
    toks = _tokens(text)
    tree, pos = _parse_expr(toks, 0, 0)
    if pos != len(toks):
        raise _ParseError("trailing input")
    return tree


def _parse_expr(toks: list[str], pos: int, depth: int) -> tuple[tuple, int]:
    left, pos = _parse_term(toks, pos, depth)
    while pos < len(toks) and toks[pos] in "+-":
        op = toks[pos]
        right, pos = _parse_term(toks, pos + 1, depth)
        left = (op, left, right)
    return left, pos


def _parse_term(toks: list[str], pos: int, depth: int) -> tuple[tuple, int]:
    left, pos = _parse_atom(toks, pos, depth)
    while pos < len(toks) and toks[pos] == "*":
        right, pos = _parse_atom(toks, pos + 1, depth)
        left = ("*", left, right)
    return left, pos


def _parse_atom(toks: list[str], pos: int, depth: int) -> tuple[tuple, int]:
    if pos >= len(toks):
        raise _ParseError("unexpected end")
    if toks[pos] == "(":
        if depth >= 8:
            raise _ParseError("too deeply nested")
        inner, pos = _parse_expr(toks, pos + 1, depth + 1)
        if pos >= len(toks) or toks[pos] != ")":
            raise _ParseError("missing )")
        return inner, pos + 1
    if toks[pos].isdigit():
        return ("num", int(toks[pos])), pos + 1
    raise _ParseError(f"unexpected {toks[pos]!r}")


def _numbers_used(tree: tuple) -> list[int]:
    if tree[0] == "num":
        return [tree[1]]
    return _numbers_used(tree[1]) + _numbers_used(tree[2])


def _evaluate(tree: tuple) -> int:
    if tree[0] == "num":
        return tree[1]
    return _OPS[tree[0]](_evaluate(tree[1]), _evaluate(tree[2]))


def verify_countdown(response: str, answer: str) -> float:
    """1.0 when the response is an expression (+ - * and parentheses) over the given numbers, each used
    at most once, whose value is the target; else 0.0. Numbers are checked before evaluation, so at
    most three one-digit numbers are ever combined."""
    text = _clean(response)
    if not text:
        return 0.0
    target, numbers = _parse_answer(answer)
    try:
        tree = _parse(text)
    except _ParseError:
        return 0.0
    if Counter(_numbers_used(tree)) - Counter(numbers):
        return 0.0
    return 1.0 if _evaluate(tree) == target else 0.0


# ----------------------------------------------------------------------------------------- registry

TASKS: dict[str, Task] = {
    "arithmetic": Task("arithmetic", _arithmetic_question, verify_arithmetic, lambda answer: [answer]),
    "countdown": Task("countdown", _countdown_question, verify_countdown, countdown_solutions),
}


def get_task(name: str) -> Task:
    """The built-in task called `name`; raises ValueError naming the known tasks otherwise."""
    try:
        return TASKS[name]
    except KeyError:
        raise ValueError(f"unknown task {name!r}; built-in tasks are {sorted(TASKS)}") from None
