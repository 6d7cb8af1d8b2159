"""Accuracy of a loaded engine on questions: greedy, sampled pass@1 and pass@k, scored by a reward pool.

Used by the in-run evaluator actor (`actors.evaluator`) and by `exgrpo eval` (`cluster.evaluate`), which
loads the engine itself.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass

import numpy as np

from common.config import RewardConfig


@dataclass
class EvalSet:
    """One set an evaluator measures.  # driver -> evaluator actor"""

    name: str  # "" for the held-out split (metrics `eval/...`), else `eval/<name>/...`
    questions: bytes  # codec.encode_list(list[Question], Question)
    reward: RewardConfig
    samples: int
    temperature: float
    task: str | None = None  # the built-in task its questions come from (its verifier must match the reward)

GREEDY_TEMPERATURE = 0.0
"""Temperature 0 is greedy decoding in both engines (vLLM: greedy sampler; transformers: argmax)."""


@dataclass(frozen=True)
class EvalSampling:
    """How each question is answered: once greedily, and `samples` times at `temperature`, both from `seed`."""

    samples: int = 8
    temperature: float = 0.6
    seed: int = 1234


@dataclass
class EvalResult:
    questions: int
    greedy_accuracy: float
    pass_at_1: float  # mean accuracy of sampled responses (mean@k)
    pass_at_k: float  # fraction of questions with at least one correct sample
    k: int
    temperature: float
    seconds: float
    response_length_mean: float = 0.0  # tokens per sampled response
    reasoning_checked: int = 0  # correct sampled responses whose reasoning the task checked
    valid_given_correct: float = float("nan")  # share of those with valid reasoning (the task's exact check)
    pass_at_1_se: float = float("nan")  # pass@1's standard error over the sampled responses (`pass_at_1_se`)

    def table(self, model: str, name: str = "") -> str:
        rows = [("model", model), *([("set", name)] if name else []), ("questions", str(self.questions)),
                ("greedy accuracy", f"{self.greedy_accuracy:.3f}"),
                (f"pass@1 (T={self.temperature}, {self.k} samples)", f"{self.pass_at_1:.3f}"
                 + (f" (SE {self.pass_at_1_se:.3f})" if not math.isnan(self.pass_at_1_se) else "")),
                (f"pass@{self.k}", f"{self.pass_at_k:.3f}"),
                ("mean response length", f"{self.response_length_mean:.1f} tokens"),
                *([("valid reasoning | correct", f"{self.valid_given_correct:.3f} of {self.reasoning_checked}")]
                  if self.reasoning_checked else []),
                ("seconds", f"{self.seconds:.1f}")]
        w = max(len(a) for a, _ in rows)
        return "\n".join(f"{a:<{w}}  {b}" for a, b in rows)

    def metrics(self, name: str = "") -> dict[str, float]:
        """MLflow metrics under `eval/<name>/` (the held-out split, no name: `eval/`): pass_at_1 (= mean@k),
        pass_at_1_se (its standard error, `pass_at_1_se`; not with one sample), mean_at_<k>, pass_at_<k>,
        greedy_accuracy, response_length_mean, questions; where the task checks reasoning, valid_given_correct
        (share of correct sampled responses whose every reasoning step holds)."""
        p = f"eval/{name}/" if name else "eval/"
        out = {f"{p}greedy_accuracy": self.greedy_accuracy, f"{p}pass_at_1": self.pass_at_1,
               f"{p}mean_at_{self.k}": self.pass_at_1, f"{p}pass_at_{self.k}": self.pass_at_k,
               f"{p}response_length_mean": self.response_length_mean, f"{p}questions": float(self.questions)}
        if not math.isnan(self.pass_at_1_se):
            out[f"{p}pass_at_1_se"] = self.pass_at_1_se
        if self.reasoning_checked:
            out[f"{p}valid_given_correct"] = self.valid_given_correct
        return out


def evaluate_engine(engine, pool, questions, sampling: EvalSampling) -> EvalResult:
    """The measurement itself, on an engine that is already loaded (also used by the in-run evaluator). `pool`
    (`common.rewards.RewardPool`) scores: a reward of at least its `reward.correct_threshold` is correct; where
    its task (`pool.task_name`: the built-in task of the questions) checks reasoning, correct sampled responses are
    checked."""
    from actors.scoring import check_reasoning
    from common.tasks import TASKS

    samples, temperature, seed = sampling.samples, sampling.temperature, sampling.seed
    threshold, task = pool.cfg.correct_threshold, pool.task_name
    reasoning = TASKS[task].reasoning if task in TASKS else None
    t0 = time.monotonic()
    prompts = [q.prompt_ids for q in questions]
    base = engine.sampling
    try:  # one engine, two settings: engines read `sampling` at every generate() call
        engine.sampling = dataclasses.replace(base, temperature=GREEDY_TEMPERATURE)
        greedy = _score(pool, questions, engine.generate(prompts, [1] * len(prompts), seed), threshold)
        engine.sampling = dataclasses.replace(base, temperature=temperature)
        outputs = engine.generate(prompts, [samples] * len(prompts), seed)
        sampled = _score(pool, questions, outputs, threshold)
    finally:
        engine.sampling = base
    checks = [check_reasoning(reasoning, s.text, q.prompt, q.answer, q.id)[0]
              for q, outs, (ok, _) in zip(questions, outputs, sampled) for s, c in zip(outs, ok) if c] \
        if reasoning is not None else []
    checks = [c for c in checks if c is not None]
    correct = np.array([c for c, _ in sampled], dtype=np.float64)  # [Q, k]
    lengths = [n for _, ns in sampled for n in ns]
    return EvalResult(
        questions=len(questions),
        greedy_accuracy=float(np.mean([g[0][0] for g in greedy])) if questions else 0.0,
        pass_at_1=float(correct.mean()) if questions else 0.0,
        pass_at_1_se=pass_at_1_se(correct) if questions else float("nan"),
        pass_at_k=float(correct.max(axis=1).mean()) if questions else 0.0,
        k=samples, temperature=temperature, seconds=time.monotonic() - t0,
        response_length_mean=float(np.mean(lengths)) if lengths else 0.0,
        reasoning_checked=len(checks), valid_given_correct=float(np.mean(checks)) if checks else float("nan"),
    )


def pass_at_1_se(correct: np.ndarray) -> float:
    """The standard error of pass@1 (the mean of `correct`, [Q questions, k samples]) from sampling the responses,
    the questions held fixed: sqrt(sum_i s_i^2 / k) / Q, s_i^2 = k/(k-1) p_i (1-p_i) the unbiased variance of
    question i's k outcomes. This is the noise two runs evaluated on the same questions differ by; it shrinks
    as 1/sqrt(k). nan with one sample (no variance within a question to measure)."""
    q, k = correct.shape
    if k < 2:
        return float("nan")
    p = correct.mean(axis=1)  # [Q]
    return float(np.sqrt(np.sum(p * (1 - p)) / (k - 1)) / q)


def _score(pool, questions, outputs, threshold: float) -> list[tuple[list[bool], list[int]]]:
    """Per question: whether each response is correct, and its length in tokens."""
    from common.rewards import ScoreRequest

    reqs = [ScoreRequest(q.id, s.text, q.answer) for q, outs in zip(questions, outputs) for s in outs]
    results = iter(pool.score(reqs))
    return [([next(results).reward >= threshold for _ in outs], [len(s.token_ids) for s in outs]) for outs in outputs]
