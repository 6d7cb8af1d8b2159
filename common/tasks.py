"""Built-in tasks: questions generated deterministically from a seed, with a held-out test split.

- `arithmetic`: prompt `"12+345="`, response `"357"`.
- `countdown` (the default): prompt `"3 7 8>29="`, response an expression such as `"3*7+8"`.
- `think_arith`: prompt `"What is (7+3)*4-2*5?"`, response in the authors' ExGRPO format
  `"<think>10*4-2*5=40-2*5=40-10=30</think>\\boxed{30}"` (a chat model; the task closer to real use).

A question goes to the test split by a keyed hash of its text, so the split is disjoint from the training split
and does not change with `n_train`. Verifiers never `eval`. Details: docs/internals.md#commontaskspy
"""

from __future__ import annotations

import hashlib
import itertools
import json
import random
import re
from collections import Counter
from functools import lru_cache
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from common.disk import atomic_write_text

TEST_SHARE = 8
"""About one generated question in TEST_SHARE goes to the held-out split."""

MAX_RESPONSE_CHARS = 64
"""Built-in verifiers score longer responses 0 without parsing them."""

MAX_EXPRESSION_TOKENS = 128
"""`_parse` refuses longer expressions (the tasks' own have at most 11 tokens): a model's answer of any length then
makes a tree of bounded depth (the tree walks recurse) and values of bounded size."""


@dataclass(frozen=True)
class Task:
    """A built-in task.

    `generate(seed, n_train, n_test)` returns rows `{"id", "question", "answer"}` for the two splits;
    `verify(response_text, answer)` returns a reward in [0, 1]; `solutions(question, answer)` lists
    correct responses (used to train the built-in model; at least one per question).
    """

    name: str
    make_question: Callable[[random.Random], tuple[str, str] | None]
    verify: Callable[[str, str], float]
    solutions: Callable[[str, str], list[str]]
    rewards: tuple[str, ...]
    """Built-in reward names that can score this task's answers (the first is its default)."""
    chat: bool = False
    """Its built-in model is a chat model: a BPE tokenizer with a chat template, trained on prompts the
    template renders (runs need data.use_chat_template=true). Otherwise: the character tokenizer, plain prompts."""
    max_attempts_per_question: int = 50
    reasoning: Callable[[str, str, str], bool | None] | None = None
    """`reasoning(response_text, prompt, answer)`: whether a response's reasoning is valid (checked exactly;
    None when it cannot be told); None for a task without such a check."""

    def generate(self, seed: int, n_train: int, n_test: int, cache_dir: str | Path | None = None
                 ) -> tuple[list[dict], list[dict]]:
        """Deterministic in `seed`; the two splits are disjoint and each holds unique questions. `cache_dir`: the
        splits are kept there (a JSON file named by the task, the arguments and this module's source), so that a
        run's start reads them instead of searching again (countdown: 0.75 s on 2 CPU cores)."""
        if cache_dir is None:
            return self._generate(seed, n_train, n_test)
        path = Path(cache_dir).expanduser() / "questions" / f"{self.name}-{seed}-{n_train}-{n_test}-{_source_digest()}.json"
        try:
            train, test = json.loads(path.read_text())
            return train, test
        except (OSError, ValueError):  # absent or unreadable: made again, and kept when the disk lets us
            pass
        train, test = self._generate(seed, n_train, n_test)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_text(path, json.dumps([train, test]))
        except OSError:
            pass
        return train, test

    def _generate(self, seed: int, n_train: int, n_test: int) -> tuple[list[dict], list[dict]]:
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


@lru_cache(maxsize=1)
def _source_digest() -> str:
    """This module's source, in the name of each cached split: a change of the generators makes them again."""
    return hashlib.blake2b(Path(__file__).read_bytes(), digest_size=6).hexdigest()


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


def countdown_solutions(question: str, answer: str) -> list[str]:
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
    """Expression -> tree of ("num", n) / (op, left, right); raises _ParseError, also for more than
    MAX_EXPRESSION_TOKENS tokens. Grammar: expr := term (("+"|"-") term)*; term := atom ("*" atom)*;
    atom := NUMBER | "(" expr ")"."""
    if len(text) > 4 * MAX_EXPRESSION_TOKENS:  # refused before tokenising (a token and a space are at most 4 chars)
        raise _ParseError("expression too long")
    toks = _tokens(text)
    if len(toks) > MAX_EXPRESSION_TOKENS:
        raise _ParseError("expression too long")
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


# -------------------------------------------------------------------------------------- think_arith

THINK_ARITH_MAX_VALUE = 99
"""Every number written on a reasoning path (operands, intermediate and final values) is at most this."""
THINK_ARITH_THREE_OPERAND_SHARE = 0.3
"""Share of questions with three numbers (the easier tier); the rest have four."""
THINK_ARITH_PAREN_SHARE = 0.5
"""Share of generated expressions that get one pair of parentheses (kept only where they change the order)."""


def _think_arith_question(rng: random.Random) -> tuple[str, str] | None:
    """Three or four numbers 1-9 joined by + - *, with one pair of parentheses half the time; kept only
    when the expression has at least two reasoning paths (see think_arith_paths)."""
    n = 3 if rng.random() < THINK_ARITH_THREE_OPERAND_SHARE else 4
    nums = [rng.randint(1, 9) for _ in range(n)]
    chain: list = [nums[0]]
    for x in nums[1:]:
        chain += [rng.choice("+-*"), x]
    if rng.random() < THINK_ARITH_PAREN_SHARE:
        lo = rng.randrange(n - 1)
        hi = rng.randrange(lo + 2, n + 1)  # numbers lo..hi-1 go in parentheses: at least two, not all
        inner = chain[2 * lo: 2 * hi - 1]
        before = chain[2 * lo - 1] if lo else None
        after = chain[2 * hi - 1] if hi < n else None
        if hi - lo == n or "*" not in (before, after) and before != "-" or set(inner[1::2]) == {"*"}:
            return None  # parentheses that would change nothing
        chain = chain[: 2 * lo] + [inner] + chain[2 * hi - 1:]
    paths = think_arith_paths(chain)
    if len(paths) < 2:
        return None
    return f"What is {_render(chain)}?", paths[0][-1]


def think_arith_paths(chain: list) -> list[list[str]]:
    """Every reasoning path of an expression (sorted): the expressions written after each legal reduction,
    ending with the value. A chain is `[operand, op, operand, ...]`; an operand is an int or a
    parenthesised chain.

    A reduction replaces two adjacent numbers `a op b` of a chain by their value where that keeps the
    value of the whole: always for `*`; for `+` and `-` when neither number is a factor of a product and
    `a` is not subtracted (`x-a+b` is not `x-(a+b)`). A parenthesised group down to one number loses its
    parentheses. Written numbers stay within THINK_ARITH_MAX_VALUE and non-negative, except the leading
    number of the whole expression (`2-9+3` -> `-7+3` -> `-4`)."""
    out: set[tuple[str, ...]] = set()

    def walk(state: list, written: tuple[str, ...]) -> None:
        nexts = list(_reductions(state, top=True))
        if not nexts and len(state) == 1 and written:
            out.add(written)
        for s in nexts:
            walk(s, written + (_render(s),))

    walk(chain, ())
    return sorted(list(p) for p in out)


def _reductions(chain: list, top: bool):
    """The chains one legal reduction away from `chain` (see think_arith_paths)."""
    for i in range(0, len(chain), 2):
        if isinstance(chain[i], list):
            for inner in _reductions(chain[i], top=False):
                yield chain[:i] + [inner[0] if len(inner) == 1 else inner] + chain[i + 1:]
    for i in range(2, len(chain), 2):
        a, op, b = chain[i - 2], chain[i - 1], chain[i]
        if isinstance(a, list) or isinstance(b, list):
            continue
        before = chain[i - 3] if i >= 3 else None
        after = chain[i + 1] if i + 1 < len(chain) else None
        if op != "*" and ("*" in (before, after) or before == "-"):
            continue
        v = _OPS[op](a, b)
        if abs(v) > THINK_ARITH_MAX_VALUE or (v < 0 and not (top and i == 2)):
            continue
        yield chain[: i - 2] + [v] + chain[i + 1:]


def _render(chain: list) -> str:
    return "".join(f"({_render(x)})" if isinstance(x, list) else str(x) for x in chain)


def _read_chain(text: str) -> list:
    """The chain of an expression written by `_render` (numbers, + - *, parentheses)."""
    stack: list[list] = [[]]
    for tok in _tokens(text):
        if tok == "(":
            stack.append([])
        elif tok == ")":
            group = stack.pop()
            stack[-1].append(group)
        else:
            stack[-1].append(int(tok) if tok.isdigit() else tok)
    return stack[0]


def think_arith_response(path: list[str], answer: str) -> str:
    """The authors' format: the reasoning in `<think>...</think>`, then the boxed answer."""
    return f"<think>{'='.join(path)}</think>\\boxed{{{answer}}}"


def think_arith_solutions(question: str, answer: str) -> list[str]:
    """One response per reasoning path of the question's expression."""
    expression = question.removeprefix("What is ").removesuffix("?")
    return [think_arith_response(p, answer) for p in think_arith_paths(_read_chain(expression))]


@lru_cache(maxsize=65_536)
def _math_after_think(tail: str, answer: str) -> float:
    from common.verifiers import math_reward  # at call time: math-verify imports sympy

    return math_reward(tail, answer)


def verify_think_arith(response: str, answer: str) -> float:
    """The `math_think` reward (math-verify on the text after `</think>`, 0 without it), memoised on that
    text: a model's sampled answers repeat, and math-verify takes milliseconds per call."""
    if not isinstance(response, str) or "</think>" not in response:
        return 0.0
    return _math_after_think(response.split("</think>")[1], answer)


_THINK_ARITH_QUESTION = re.compile(r"What is ([0-9+\-*() ]+)\?")


def think_arith_reasoning_valid(response: str, prompt: str, answer: str) -> bool | None:
    """Whether every step of a think_arith response's reasoning is true: the text inside <think>...</think> is
    a chain `E1=E2=...=En` of at least one equation, every Ei evaluates to the question's value and En is that
    value (`24+4*6=24+16=48` reaches 48 through a false step: invalid). None when the prompt holds no
    think_arith question or the response has no reasoning block."""
    m = _THINK_ARITH_QUESTION.search(prompt or "")
    if m is None or not isinstance(response, str) or "<think>" not in response or "</think>" not in response:
        return None
    try:
        value = _evaluate(_parse(m.group(1)))
    except _ParseError:
        return None
    parts = response.split("<think>", 1)[1].split("</think>", 1)[0].split("=")
    if len(parts) < 2 or parts[-1].strip() != str(value) or str(value) != answer.strip():
        return False
    for part in parts:
        text = part.strip()
        try:
            if _evaluate(_parse("0" + text if text.startswith("-") else text)) != value:
                return False
        except _ParseError:
            return False
    return True


# ----------------------------------------------------------------------------------------- registry

TASKS: dict[str, Task] = {
    "arithmetic": Task("arithmetic", _arithmetic_question, verify_arithmetic, lambda question, answer: [answer],
                       rewards=("arithmetic", "exact", "math")),
    "countdown": Task("countdown", _countdown_question, verify_countdown, countdown_solutions,
                      rewards=("countdown",)),
    "think_arith": Task("think_arith", _think_arith_question, verify_think_arith, think_arith_solutions,
                        rewards=("math_think", "math"), chat=True, reasoning=think_arith_reasoning_valid),
}


def get_task(name: str) -> Task:
    """The built-in task called `name`; raises ValueError naming the known tasks otherwise."""
    try:
        return TASKS[name]
    except KeyError:
        raise ValueError(f"unknown task {name!r}; built-in tasks are {sorted(TASKS)}") from None
