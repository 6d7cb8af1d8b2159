"""The evaluator actor: held-out accuracy of published policy versions, off the training path.

    ev = Evaluator.options(name=actor_name(run, "evaluator"), **evaluator_options(eval_cfg, gen_cfg)).remote(
        eval_cfg, gen_cfg, model_path, sets, weight_source)          # sets: list[EvalSet]
    report = ray.get(ev.evaluate.remote(min_version=7))   # {"version", "seconds", "eval/pass_at_1", ...}

It owns one engine (the generators' engine settings) and one reward pool per set, loads the newest
published weights from the weight store before each evaluation (it never acknowledges: publications do
not wait for it), and measures greedy accuracy, mean@k, pass@k and the mean response length of every
set with a fixed seed, so successive reports compare policy versions and nothing else. It is stopped
with `ray.kill`; its reward workers end with it (they watch their parent, `common.reward_worker`).
"""

from __future__ import annotations

import logging
import time

import ray

from actors.evaluation import EvalSet
from common import codec
from common.config import EvalConfig, GeneratorConfig
from common.interfaces import WeightSource
from common.messages import Question

log = logging.getLogger(__name__)

MIN_VERSION_WAIT_S = 60.0
"""How long an evaluation waits for the version it was asked for to be published (a publication
normally takes well under a second; past this the newest published one is measured)."""


class EvaluatorWorker:
    """The body of the `Evaluator` actor (a plain class: it also runs in-process)."""

    def __init__(self, eval_cfg: EvalConfig, gen_cfg: GeneratorConfig, model_path: str, sets: list[EvalSet],
                 weight_source: WeightSource):
        from actors.engines import make_engine
        from common.rewards import RewardPool

        self.cfg, self.sets, self.weights = eval_cfg, sets, weight_source
        self.questions = [codec.decode_list(s.questions, Question) for s in sets]
        self.engine = make_engine(gen_cfg, model_path, seed=eval_cfg.seed)
        self.pools = [RewardPool(s.reward, s.task) for s in sets]
        self.version = 0
        self.model_path, self.merger = model_path, None

    def evaluate(self, min_version: int = 0, wait_s: float = MIN_VERSION_WAIT_S) -> dict[str, float]:
        """Load the newest published version (if newer) and measure every set. The driver asks right after a
        step, while that step's publication may still be in flight: wait up to `wait_s` for
        `min_version` to be announced, then measure the newest one there is (the report names it)."""
        from actors.evaluation import EvalSampling, evaluate_engine

        t0 = time.monotonic()
        ann = self.weights.latest()
        while (ann is None or ann.version < min_version) and time.monotonic() - t0 < wait_s:
            time.sleep(0.05)
            ann = self.weights.latest()
        if ann is None or ann.version < min_version:
            log.warning("version %d was not published within %.0fs; evaluating version %s instead", min_version,
                        wait_s, "0 (the model folder)" if ann is None else ann.version)
        if ann is not None and ann.version != self.version:
            weights = self.weights.fetch(ann)
            if ann.adapters is not None:  # LoRA adapters only: merged into the base (actors.adapters)
                if self.merger is None:
                    from actors.adapters import AdapterMerger

                    self.merger = AdapterMerger(self.model_path, who="evaluator")
                weights = self.merger.merge([weights], ann.adapters)
            self.engine.load_weights(weights, ann.version, partial=ann.adapters is not None)
            self.version = ann.version
        out = {"version": float(self.version)}
        for s, questions, pool in zip(self.sets, self.questions, self.pools):
            r = evaluate_engine(self.engine, pool, questions, EvalSampling(s.samples, s.temperature, self.cfg.seed))
            out.update(r.metrics(s.name))
        out["seconds"] = time.monotonic() - t0
        return out


def evaluator_options(eval_cfg: EvalConfig, gen_cfg: GeneratorConfig) -> dict:
    """Ray options of the evaluator: its own resources, the generators' engine environment."""
    from actors.generator import actor_options

    opts = actor_options(gen_cfg)
    opts.update(num_cpus=eval_cfg.num_cpus, num_gpus=eval_cfg.num_gpus, max_restarts=0, max_concurrency=1)
    return opts


Evaluator = ray.remote(EvaluatorWorker)
"""The Ray actor class. Use `Evaluator.options(name=..., **evaluator_options(eval_cfg, gen_cfg)).remote(...)`."""
