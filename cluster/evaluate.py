"""`exgrpo eval`: greedy and sampled accuracy (pass@1, pass@k) of a model folder on a test split.

Runs one engine in this process (vLLM when installed, else transformers — the config's
`generator.engine`), scores with the configured reward pool, prints a table and logs it to MLflow.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from actors.evaluation import EvalResult, EvalSampling, evaluate_engine
from common.config import RewardConfig, RunConfig

_RUN_TASK = object()


def evaluate(model_path: str, cfg: RunConfig, questions, sampling: EvalSampling = EvalSampling(), *,
             task: str | None | object = _RUN_TASK) -> EvalResult:
    """Greedy accuracy, sampled pass@1 and pass@k of `model_path` on `questions` (answered as `sampling` says),
    scored by cfg.reward; `task`: the built-in task the questions come from (default: the run's; None: a file)."""
    from actors.engines import make_engine
    from common.rewards import RewardPool

    t0 = time.monotonic()
    if task is _RUN_TASK:
        task = cfg.data.task if cfg.data.train_path is None else None
    pool = RewardPool(cfg.reward, task)
    try:
        engine = make_engine(cfg.generator, model_path, seed=sampling.seed)
        result = evaluate_engine(engine, pool, questions, sampling)
    finally:
        pool.close()
    result.seconds = time.monotonic() - t0
    return result


@dataclass
class SetSpec:
    """An evaluation set, loaded: `name` "" is the held-out split."""

    name: str
    questions: list
    reward: RewardConfig
    samples: int
    temperature: float
    task: str | None


def eval_sets(cfg: RunConfig, tokenizer, *, limit: int | None = None) -> list[SetSpec]:
    """`eval.sets` loaded (each file with the data.* field names and prompt settings, its own reward, samples,
    temperature), or, without sets, the held-out split (its first eval.questions, or `limit`). ValueError
    (what to change) for a set with no usable question."""
    from common.data import load_questions

    if not cfg.eval.sets:
        questions, report = load_questions(cfg.data, tokenizer, "test")
        questions = questions[: limit or cfg.eval.questions]
        if not questions:
            raise ValueError(f"eval: no usable held-out questions ({report.summary()}); set data.test_path, "
                             "eval.sets, or eval.every_steps=0")
        return [SetSpec("", questions, cfg.reward, cfg.eval.samples, cfg.eval.temperature,
                        cfg.data.task if cfg.data.train_path is None else None)]
    out = []
    for name, st in cfg.eval.sets.items():
        data = cfg.data.model_copy(update={"train_path": st.path, "test_path": st.path})
        questions, report = load_questions(data, tokenizer, "test")
        questions = questions[: limit or st.questions or len(questions)]
        if not questions:
            raise ValueError(f"eval.sets.{name}: no usable questions in {st.path} ({report.summary()}; "
                             f"{'; '.join(report.problems[:3])})")
        reward = cfg.reward.model_copy(update={"name": st.reward}) if st.reward else cfg.reward
        out.append(SetSpec(name, questions, reward, st.samples or cfg.eval.samples,
                           st.temperature or cfg.eval.temperature, None))
    return out


def quiet_inprocess_vllm() -> None:
    """vLLM in this process, without its engine subprocess and INFO chatter (set before importing it)."""
    for k, v in (("VLLM_ENABLE_V1_MULTIPROCESSING", "0"), ("VLLM_LOGGING_LEVEL", "WARNING"),
                 ("TOKENIZERS_PARALLELISM", "false"), ("TRANSFORMERS_VERBOSITY", "error")):
        os.environ.setdefault(k, v)


def eval_overrides(data: str | None, task: str | None, overrides: list[str]) -> list[str]:
    """The overrides `exgrpo eval --data/--task` stands for, so the config is validated and checked against the data
    evaluated: `--data F` makes F the data (after the user's overrides: it wins); `--task T` alone is the built-in
    task; `--task T --data F` reads F in T's format (T's reward and chat setting, before the user's overrides)."""
    from common.config.base import yaml_value
    from common.config.data import TASK_DEFAULTS

    if data is not None:
        path = "'" + data.replace("'", "''") + "'"  # YAML-quoted: a path is text whatever it looks like
        form = [f"{k}={yaml_value(v)}" for k, v in TASK_DEFAULTS.get(task, {}).items()
                if k.startswith(("reward.", "data."))]
        return [*form, *overrides, f"data.train_path={path}", f"data.test_path={path}", "data.task=null"]
    if task is not None:  # through the config, so the task's defaults (reward, chat) apply
        return [*overrides, f"data.task={task}", "data.train_path=null", "data.test_path=null"]
    return overrides


def eval_main(args, cfg: RunConfig) -> int:
    quiet_inprocess_vllm()
    from cluster.preflight import BadInput, eval_problems, fit_lengths, load_tokenizer, model_folder_problem
    from common.data import DataError

    model = Path(args.model).expanduser()
    problem = model_folder_problem(model, field="--model")
    if problem is not None:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update={"path": str(model)})})
    if args.task and not args.data and cfg.reward.name in ("countdown", "arithmetic"):
        cfg = cfg.model_copy(update={"reward": cfg.reward.model_copy(update={"name": args.task})})
    use_sets = bool(cfg.eval.sets) and not (args.data or args.task)
    try:  # the start checks `exgrpo train` makes of the same data, reward and model
        problems = eval_problems(cfg, model, use_sets, "--data" if args.data else None)
        if problems:
            raise BadInput("invalid configuration:", *problems)
        cfg = fit_lengths(cfg, model)
        tok = load_tokenizer(model, field="--model")
        if use_sets:  # the config's eval.sets, each with its reward, samples and temperature
            sets = eval_sets(cfg, tok, limit=args.limit)
        else:
            sets = eval_sets(cfg.model_copy(update={"eval": cfg.eval.model_copy(update={"sets": {}})}), tok,
                             limit=args.limit or 10**9)
    except BadInput as e:
        print(e, file=sys.stderr)
        return 2
    except (DataError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    results = []
    for st in sets:
        run_cfg = cfg.model_copy(update={"reward": st.reward})
        # eval.samples / eval.temperature (or the set's own), as the in-run evaluator: offline and in-run pass@k compare
        result = evaluate(str(model), run_cfg, st.questions,
                          EvalSampling(samples=args.samples or st.samples, temperature=st.temperature), task=st.task)
        print(result.table(str(model), st.name))
        results.append((st.name, result))
    if cfg.tracking.enabled:
        _log_eval(cfg, str(model), results)
    return 0


def _log_eval(cfg: RunConfig, model: str, results: list[tuple[str, EvalResult]]) -> None:
    from cluster.tracking import Tracker, default_tracking_uri

    tr = Tracker(cfg.tracking.uri or default_tracking_uri(cfg.checkpoint.runs_root), cfg.tracking.experiment)
    tr.start(f"eval {Path(model).name}", tags={"exgrpo.kind": "eval", "exgrpo.model": model})
    tr.log_params({"model": model, **{f"{name or 'heldout'}.{k}": v for name, r in results
                                      for k, v in (("samples", r.k), ("temperature", r.temperature),
                                                   ("questions", r.questions))}})
    tr.log_metrics({k: v for name, r in results for k, v in r.metrics(name).items()}, 0)
    tr.finish()
