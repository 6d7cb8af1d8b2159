"""The `think_arith` task and its chat model's pieces: reasoning paths, the BPE tokenizer and chat template,
chat prompts through `load_questions`, math_think scoring of the `<think> … </think>` format, and the
per-task config defaults."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from common.config import TASK_DEFAULTS, ConfigError, DataConfig, load_config, resume_config, yaml_value
from common.data import load_questions
from common.modeling import CHAT_TEMPLATE, train_bpe_tokenizer
from common.verifiers import math_think_reward
from common.tasks import _read_chain, get_task, think_arith_paths, think_arith_response, verify_think_arith

TASK = get_task("think_arith")


@pytest.fixture(scope="module")
def rows():
    train, test = TASK.generate(0, 600, 100)
    return train, test


@pytest.fixture(scope="module")
def tok(rows, tmp_path_factory):
    """The tokenizer as the built-in model builds it, saved and loaded back as a Hugging Face tokenizer."""
    train, _ = rows
    texts = [t for r in train for t in [r["question"], *TASK.solutions(r["question"], r["answer"])]]
    folder = tmp_path_factory.mktemp("bpe")
    train_bpe_tokenizer(texts).save_pretrained(folder)
    return AutoTokenizer.from_pretrained(folder)


# ------------------------------------------------------------------------------------------- task


def _value(expression: str) -> int:
    assert set(expression) <= set("0123456789+-*()"), expression
    return eval(expression)  # our own generated arithmetic, checked to hold nothing else


def test_every_reasoning_path_is_correct_and_every_question_has_two(rows):
    train, test = rows
    for row in train + test:
        expression = row["question"].removeprefix("What is ").removesuffix("?")
        paths = think_arith_paths(_read_chain(expression))
        assert len(paths) >= 2 and len({tuple(p) for p in paths}) == len(paths), row
        for path in paths:
            assert path[-1] == row["answer"] and _value(expression) == int(row["answer"])
            assert all(_value(step) == int(row["answer"]) for step in path), path  # each rewrite keeps the value
            assert all(abs(int(n)) <= 99 for step in path for n in step.replace("(", " ").replace(")", " ")
                       .replace("+", " ").replace("*", " ").replace("-", " ").split()), path
        solutions = TASK.solutions(row["question"], row["answer"])
        assert len(solutions) == len(paths) and all(TASK.verify(s, row["answer"]) == 1.0 for s in solutions)
    for row in train[:100]:  # the reward itself (math-verify, milliseconds a call) on a sample
        assert math_think_reward(TASK.solutions(row["question"], row["answer"])[-1], row["answer"]) == 1.0


def test_paths_worked_by_hand():
    # two independent products: either first
    assert think_arith_paths(_read_chain("2*3+4*5")) == [["2*3+20", "6+20", "26"], ["6+4*5", "6+20", "26"]]
    # 9-(2+3) may not become 7+3 (a subtracted number is never added to the next one), nor 9-2+3 -> 9-5
    assert think_arith_paths(_read_chain("9-2+3")) == [["7+3", "10"]]
    assert think_arith_paths(_read_chain("(9-5)*2")) == [["4*2", "8"]]
    # 1+9-2: (1+9)-2 or 1+(9-2); a product's factor is never added first: 2*3+4 -> never 2*7
    assert think_arith_paths(_read_chain("1+9-2")) == [["1+7", "8"], ["10-2", "8"]]
    assert think_arith_paths(_read_chain("2*3+4")) == [["6+4", "10"]]
    # only the leading number may go negative
    assert think_arith_paths(_read_chain("2-9+3")) == [["-7+3", "-4"]]
    assert think_arith_paths(_read_chain("8-(2-5)")) == []


def test_question_format_mixes_tiers_and_parentheses(rows):
    train, _ = rows
    ops = [sum(r["question"].count(c) for c in "+-*") for r in train]
    assert set(ops) == {2, 3} and ops.count(3) > ops.count(2)  # three numbers (easier tier) or four
    assert 0.05 < sum("(" in r["question"] for r in train) / len(train) < 0.5
    assert all(r["question"].startswith("What is ") and r["question"].endswith("?") for r in train)
    assert any(int(r["answer"]) < 0 for r in train)


# -------------------------------------------------------------------------------------- scoring


@pytest.mark.parametrize("response, reward", [
    ("<think>6+4*5=6+20=26</think>\\boxed{26}", 1.0),
    ("<think>6+4*5=6+20=26</think>26", 1.0),
    ("<think>6+4*5=6+20=26</think> \\boxed{26} ", 1.0),
    ("<think>6+4*5=6+20=25</think>\\boxed{26}", 1.0),  # the reasoning is not graded, as in the official code
    ("<think>6+4*5=6+20=26</think>\\boxed{25}", 0.0),
    ("<think>6+4*5=6+20=26\\boxed{26}", 0.0),  # no </think>: no answer
    ("\\boxed{26}", 0.0),
    ("<think>26</think>", 0.0),
    ("<think>2</think>\\boxed{2", 0.0),
])
def test_math_think_scores_the_model_format(response, reward):
    assert math_think_reward(response, "26") == reward
    assert verify_think_arith(response, "26") == reward


def test_negative_answers_are_scored():
    assert math_think_reward(think_arith_response(["-7+3", "-4"], "-4"), "-4") == 1.0
    assert math_think_reward(think_arith_response(["-7+3", "4"], "4"), "-4") == 0.0


# ------------------------------------------------------------------------------------ tokenizer


def test_bpe_tokenizer_round_trips_and_keeps_think_tokens_whole(tok, rows):
    train, _ = rows
    for row in train[:50]:
        for text in [row["question"], *TASK.solutions(row["question"], row["answer"])]:
            ids = tok.encode(text, add_special_tokens=False)
            assert tok.decode(ids) == text
            assert tok.decode(ids + [tok.eos_token_id], skip_special_tokens=True) == text
    odd = "héllo wörld ∑ 日本 \t\n{}"
    assert tok.decode(tok.encode(odd, add_special_tokens=False)) == odd  # byte-level: any text
    response = TASK.solutions(train[0]["question"], train[0]["answer"])[0]
    pieces = tok.convert_ids_to_tokens(tok.encode(response, add_special_tokens=False))
    assert pieces[0] == "<think>" and "</think>" in pieces
    assert all(len(p) == 1 for p in pieces if p.isdigit())  # digits one per token
    assert len(pieces) < 0.6 * len(response)  # merges: shorter than characters
    assert len(tok) <= 320 and (tok.bos_token, tok.eos_token, tok.pad_token) == ("<s>", "</s>", "<pad>")


def test_chat_template(tok):
    user = [{"role": "user", "content": "What is 2*3+4*5?"}]
    assert tok.chat_template == CHAT_TEMPLATE
    assert tok.apply_chat_template(user, tokenize=False, add_generation_prompt=True) == \
        "<s><|user|>What is 2*3+4*5?<|assistant|>"
    assert tok.apply_chat_template(user, tokenize=False) == "<s><|user|>What is 2*3+4*5?"
    turn = user + [{"role": "assistant", "content": "<think>26</think>\\boxed{26}"}]
    assert tok.apply_chat_template(turn, tokenize=False) == \
        "<s><|user|>What is 2*3+4*5?<|assistant|><think>26</think>\\boxed{26}</s>"
    with pytest.raises(Exception, match="only user and assistant turns, got system"):
        tok.apply_chat_template([{"role": "system", "content": "x"}] + user, tokenize=False)


def test_load_questions_renders_the_chat_template(tok):
    cfg = load_config(None, ["data.task=think_arith", "data.num_train=40", "data.num_test=10"]).data
    assert cfg.use_chat_template
    qs, report = load_questions(cfg, tok, "train")
    assert len(qs) == 40 and report.skipped == 0 and qs[0].task == "think_arith"
    q = qs[0]
    assert q.prompt.startswith("<s><|user|>What is ") and q.prompt.endswith("?<|assistant|>")
    ids = q.prompt_ids.tolist()
    assert ids[:2] == [tok.bos_token_id, tok.convert_tokens_to_ids("<|user|>")]
    assert ids[-1] == tok.convert_tokens_to_ids("<|assistant|>") and ids.count(tok.bos_token_id) == 1
    assert tok.decode(ids) == q.prompt
    test, _ = load_questions(cfg, tok, "test")
    assert len(test) == 10 and not {x.id for x in qs} & {x.id for x in test}


# --------------------------------------------------------------------------------------- config


def test_the_task_sets_its_defaults_and_explicit_values_win():
    cfg = load_config(None, ["data.task=think_arith"])
    assert (cfg.reward.name, cfg.data.use_chat_template, cfg.generator.max_new_tokens) == ("math_think", True, 40)
    assert (cfg.model.toy.hidden_size, cfg.model.toy.num_heads, cfg.model.toy.target_mean_accuracy) == (64, 2, 0.15)
    cfg = load_config(None, ["data.task=think_arith", "reward.name=math", "generator.max_new_tokens=64"])
    assert (cfg.reward.name, cfg.generator.max_new_tokens) == ("math", 64)
    assert load_config(None, ["data.task=arithmetic"]).reward.name == "arithmetic"
    default = load_config()  # countdown: nothing changes
    assert (default.reward.name, default.data.use_chat_template, default.generator.max_new_tokens) == \
        ("countdown", False, 24)
    # a task beside a file would be ignored: refused with why and what to set instead (issue 45)
    with pytest.raises(ConfigError, match="data.task: think_arith is not used when data.train_path is set"):
        load_config(None, ["data.task=think_arith", "data.train_path=q.jsonl", "reward.name=math"])


def test_the_documented_defaults_are_the_applied_ones():
    doc = " ".join(DataConfig.model_fields["task"].description.split())
    for key, value in TASK_DEFAULTS["think_arith"].items():
        assert key.startswith("model.toy.") or f"{key}={yaml_value(value)}" in doc, key


def test_a_resumed_run_keeps_an_explicit_value_equal_to_the_field_default():
    saved = load_config(None, ["data.task=think_arith", "generator.max_new_tokens=24"])
    cfg, changes = resume_config(saved, ["total_steps=80"])
    assert cfg.generator.max_new_tokens == 24 and changes == {"total_steps": (60, 80)}


@pytest.mark.parametrize("overrides, expected", [
    (["data.task=think_arith", "reward.name=countdown"],
     "reward.name: countdown cannot score the think_arith task; set reward.name=math_think (or math)"),
    (["data.task=think_arith", "reward.name=exact"], "reward.name: exact cannot score the think_arith task"),
    (["data.task=countdown", "reward.name=math_think"], "reward.name: math_think cannot score the countdown task"),
    (["data.task=think_arith", "data.use_chat_template=false"],
     "data.use_chat_template: the built-in think_arith model is a chat model"),
    (["data.use_chat_template=true"], "data.use_chat_template: the built-in countdown model has a character tokenizer"),
    (["data.task=think_arith", "model.toy.hidden_size=96"], "hidden_size / num_heads = 96/2"),
])
def test_mixed_up_settings_are_refused(overrides, expected):
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    assert any(expected in line for line in e.value.lines), e.value.lines


def test_own_models_may_use_any_encoding():
    cfg = load_config(None, ["data.task=think_arith", "data.use_chat_template=false", "model.path=/m"])
    assert not cfg.data.use_chat_template and DataConfig(task="think_arith").task == "think_arith"


def test_the_reasoning_check_accepts_every_path_and_refuses_a_false_step():
    from common.tasks import TASKS, think_arith_reasoning_valid as valid

    task = TASKS["think_arith"]
    assert task.reasoning is valid and TASKS["countdown"].reasoning is None
    train, _ = task.generate(0, 40, 0)
    for row in train:  # every reasoning path the task knows is valid, in the chat-rendered prompt too
        for sol in task.solutions(row["question"], row["answer"]):
            assert valid(sol, f"<|user|>{row['question']}<|assistant|>", row["answer"]), sol
    q = "What is 24+4*6?"
    assert valid("<think>24+24=48</think>\\boxed{48}", q, "48")
    assert not valid("<think>24+4*6=24+16=48</think>\\boxed{48}", q, "48")  # right answer, a false step
    assert not valid("<think>48</think>\\boxed{48}", q, "48")  # no reasoning at all
    assert not valid("<think>24+24=4 8</think>\\boxed{48}", q, "48") and not valid("<think>x=48</think>", q, "48")
    assert valid("<think>-7+3=-4</think>\\boxed{-4}", "What is 2-9+3?", "-4")  # a leading negative number
    assert valid("\\boxed{48}", q, "48") is None and valid("<think>1=1</think>", "no question", "1") is None


LONG_REASONING = "1+1" + "+1-1" * 3000  # 12,003 characters, 6,001 operators: one recursion level each, unbounded


def test_the_reasoning_check_refuses_an_answer_of_any_length_or_nesting():
    from common.tasks import MAX_EXPRESSION_TOKENS, think_arith_reasoning_valid as valid, verify_countdown

    q = "What is 1+1?"
    assert valid("<think>1+1=2</think>\\boxed{2}", q, "2")
    assert valid(f"<think>{LONG_REASONING}=2</think>\\boxed{{2}}", q, "2") is False  # true, but no think_arith step
    assert MAX_EXPRESSION_TOKENS == 128  # 3 + 4 * 31 = 127 tokens are read; 131 are refused
    assert valid(f"<think>1+1{'+1-1' * 31}=2</think>\\boxed{{2}}", q, "2")
    assert valid(f"<think>1+1{'+1-1' * 32}=2</think>\\boxed{{2}}", q, "2") is False
    assert valid(f"<think>{'(' * 5000}1+1{')' * 5000}=2</think>\\boxed{{2}}", q, "2") is False  # depth
    assert valid(f"<think>1{' ' * 100_000}+1=2</think>\\boxed{{2}}", q, "2") is False
    assert valid(f"<think>{'9*' * 20_000}9=2</think>", q, "2") is False  # no 20,000-digit product computed
    answer = '{"target":29,"numbers":[3,7,8]}'
    assert verify_countdown(LONG_REASONING, answer) == 0.0 and verify_countdown("3*7+8", answer) == 1.0


def test_a_long_correct_answer_goes_through_a_generators_scoring_as_data():
    """The generator's path: math_think in a reward worker process, then the reasoning check in the scorer thread
    (actors.scoring.scored_groups); the 12,000-character reasoning used to raise RecursionError there, which crashed
    the generator, and again on the same question after its restart."""
    import numpy as np

    from actors.engines.base import GenSample
    from actors.generator_stats import GeneratorStats
    from actors.scoring import Correctness, Group, scored_groups
    from common.config import RewardConfig
    from common.messages import Question, WorkItem
    from common.rewards import RewardPool, ScoreRequest

    question = Question("q-long", "What is 1+1?", "2", np.zeros(1, np.int32), task="think_arith")
    texts = [f"<think>{LONG_REASONING}=2</think>\\boxed{{2}}", "<think>1+1=2</think>\\boxed{2}"]
    samples = [GenSample(np.zeros(3, np.int32), np.zeros(3, np.float32), 0.5, "stop", t, ((0, 0),)) for t in texts]
    group = Group(WorkItem("lease-1", question, 2, deadline=0.0, shard=0), samples, left=0)
    stats = GeneratorStats()
    with RewardPool(RewardConfig(name="math_think"), task_name="think_arith") as pool:
        scores = pool.score([ScoreRequest(question.id, t, question.answer) for t in texts])
        assert pool._workers[0] is not None  # scored in a worker process, as a generator's math_think is
    assert [s.reward for s in scores] == [1.0, 1.0]
    (scored,) = scored_groups([group], scores, "g0", Correctness(1.0, TASK.reasoning), known_version=0, stats=stats)
    assert [r.valid for r in scored.rollouts] == [0, 1]  # the long one: refused as invalid, not a crash
    assert (stats.reasoning_checked, stats.reasoning_valid, stats.reasoning_errors) == (2, 1, 0)


def test_a_reasoning_check_that_raises_is_counted_not_a_crash(caplog):
    import logging

    import numpy as np

    from actors.engines.base import GenSample
    from actors.generator_stats import GeneratorStats
    from actors.scoring import Correctness, Group, scored_groups
    from common.messages import Question, WorkItem
    from common.rewards import ScoreResult

    def recursing_check(text: str, prompt: str, answer: str) -> bool:
        raise RecursionError("maximum recursion depth exceeded")

    question = Question("q-7", "What is 1+1?", "2", np.zeros(1, np.int32))
    sample = GenSample(np.zeros(3, np.int32), np.zeros(3, np.float32), 0.5, "stop", "x" * 12_000, ((0, 0),))
    group = Group(WorkItem("lease-1", question, 1, deadline=0.0, shard=0), [sample], left=0)
    stats = GeneratorStats()
    with caplog.at_level(logging.WARNING, logger="actors.generator"):
        (scored,) = scored_groups([group], [ScoreResult(1.0)], "g0", Correctness(1.0, recursing_check), 0, stats)
    assert scored.rollouts[0].valid == -1 and scored.rollouts[0].reward == 1.0  # not checked; the reward stands
    assert (stats.reasoning_checked, stats.reasoning_errors) == (0, 1)
    assert "q-7" in caplog.text and "RecursionError" in caplog.text
    assert stats.as_metrics(running=True, version=0, in_flight=0, rewards=None)["reasoning_errors"] == 1.0
