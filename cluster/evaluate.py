"""`exgrpo eval`: greedy and sampled accuracy (pass@1, pass@k) of a model folder on a test split.

Runs one engine in this process (vLLM when installed, else transformers — the config's
`generator.engine`), scores with the configured reward pool, prints a table and logs it to MLflow.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from actors.evaluation import EvalResult, evaluate_engine
from common.config import RunConfig

def evaluate(model_path: str, cfg: RunConfig, questions, *, samples: int = 8, temperature: float = 0.6,
             seed: int = 1234) -> EvalResult:
    """Greedy accuracy, sampled pass@1 and pass@k of `model_path` on `questions`."""
    from actors.engines import make_engine
    from common.rewards import RewardPool

    t0 = time.monotonic()
    task = cfg.data.task if cfg.data.train_path is None else None
    pool = RewardPool(cfg.reward, task)
    try:
        engine = make_engine(cfg.generator, model_path, seed=seed)
        result = evaluate_engine(engine, pool, questions, samples=samples, temperature=temperature, seed=seed,
                                 threshold=cfg.reward.correct_threshold)
    finally:
        pool.close()
    result.seconds = time.monotonic() - t0
    return result


def quiet_inprocess_vllm() -> None:
    """vLLM in this process, without its engine subprocess and INFO chatter (set before importing it)."""
    for k, v in (("VLLM_ENABLE_V1_MULTIPROCESSING", "0"), ("VLLM_LOGGING_LEVEL", "WARNING"),
                 ("TOKENIZERS_PARALLELISM", "false"), ("TRANSFORMERS_VERBOSITY", "error")):
        os.environ.setdefault(k, v)


def eval_main(args, cfg: RunConfig) -> int:
    quiet_inprocess_vllm()
    from cluster.preflight import BadInput, check_reward, load_tokenizer, model_folder_problem
    from common.data import DataError, load_questions

    model = Path(args.model).expanduser()
    problem = model_folder_problem(model, field="--model")
    if problem is not None:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    data = cfg.data
    if args.data:
        data = data.model_copy(update={"train_path": args.data, "test_path": args.data})
    elif args.task:
        data = data.model_copy(update={"task": args.task, "train_path": None})
    cfg = cfg.model_copy(update={"data": data})
    if args.task and not args.data and cfg.reward.name in ("countdown", "arithmetic"):
        cfg = cfg.model_copy(update={"reward": cfg.reward.model_copy(update={"name": args.task})})
    try:
        tok = load_tokenizer(model, field="--model")
        check_reward(cfg.reward.name, data.task if data.train_path is None else None)
        questions, report = load_questions(data, tok, "test")
    except BadInput as e:
        print(e, file=sys.stderr)
        return 2
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.limit:
        questions = questions[: args.limit]
    if not questions:
        print(f"error: no test questions ({report.summary()})", file=sys.stderr)
        return 2
    result = evaluate(str(model), cfg, questions, samples=args.samples)
    print(result.table(str(model)))
    if cfg.tracking.enabled:
        _log_eval(cfg, str(model), result)
    return 0


def _log_eval(cfg: RunConfig, model: str, r: EvalResult) -> None:
    from cluster.tracking import Tracker, default_tracking_uri

    tr = Tracker(cfg.tracking.uri or default_tracking_uri(cfg.checkpoint.runs_root), cfg.tracking.experiment)
    tr.start(f"eval {Path(model).name}", tags={"exgrpo.kind": "eval", "exgrpo.model": model})
    tr.log_params({"model": model, "samples": r.k, "temperature": r.temperature, "questions": r.questions})
    tr.log_metrics({"eval/greedy_accuracy": r.greedy_accuracy, "eval/pass_at_1": r.pass_at_1,
                    f"eval/pass_at_{r.k}": r.pass_at_k}, 0)
    tr.finish()
