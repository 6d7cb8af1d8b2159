"""In-run evaluation: the driver's side of the evaluator actor (`actors.evaluator`).

    ev = InRunEval.create(cfg, model_path, run=name, namespace=ns)   # None when eval.every_steps == 0
    ev.after_step(step)          # every eval.every_steps steps: ask for version `step`, never wait
    for step, metrics in ev.poll(): tracker.log_metrics(metrics, step)
    ev.final(version)            # at the end: the final policy, waited for (bounded)

Reports are logged at the learner step whose policy version was evaluated (version = steps, see
`common.messages`), so `eval/*` curves line up with `train/*` ones even though an evaluation
finishes a few steps after it was asked for. A request while one runs is skipped and counted
(`eval/skipped`); a failed evaluation is logged and counted (`eval/errors`) and never stops training.
"""

from __future__ import annotations

import logging
from pathlib import Path

import ray

from common.config import RunConfig

log = logging.getLogger("exgrpo")


class InRunEval:
    def __init__(self, cfg: RunConfig, actor, num_questions: int):
        self.cfg, self.actor, self.num_questions = cfg.eval, actor, num_questions
        self.in_flight = None
        self.skipped = 0
        self.errors = 0
        self.last: dict[str, float] = {}
        self.last_version = -1

    @classmethod
    def create(cls, cfg: RunConfig, model_path: Path, *, run: str, namespace: str | None) -> InRunEval | None:
        if not cfg.eval.every_steps:
            return None
        from actors.evaluation import EvalSet
        from actors.evaluator import Evaluator, evaluator_options
        from cluster.evaluate import eval_sets
        from common import codec
        from common.interfaces import actor_name
        from common.messages import Question
        from common.tokenizer import auto_tokenizer
        from learner.weights import ObjectStoreWeightSource

        sets = eval_sets(cfg, auto_tokenizer(model_path))
        actor = Evaluator.options(name=actor_name(run, "evaluator"), namespace=namespace,
                                  **evaluator_options(cfg.eval, cfg.generator)).remote(
            cfg.eval, cfg.generator, str(model_path),
            [EvalSet(s.name, codec.encode_list(s.questions, Question), s.reward, s.samples, s.temperature, s.task)
             for s in sets], ObjectStoreWeightSource(run, namespace))
        for s in sets:
            log.info("in-run evaluation every %d steps on %s: %d questions (%d samples, T=%.1f, reward %s)",
                     cfg.eval.every_steps, f"eval set {s.name}" if s.name else "the held-out split",
                     len(s.questions), s.samples, s.temperature, s.reward.name)
        return cls(cfg, actor, sum(len(s.questions) for s in sets))

    def after_step(self, step: int) -> None:
        """Ask for an evaluation of the newest published version every `every_steps` steps."""
        if step % self.cfg.every_steps:
            return
        if self.in_flight is not None:
            self.skipped += 1
            return
        self.in_flight = self.actor.evaluate.remote(min_version=step)

    def poll(self, wait_s: float = 0.0) -> list[tuple[int, dict[str, float]]]:
        """Finished reports as (step, metrics); never blocks beyond `wait_s`."""
        if self.in_flight is None:
            return []
        ready, _ = ray.wait([self.in_flight], timeout=wait_s)
        if not ready:
            return []
        ref, self.in_flight = self.in_flight, None
        try:
            report = ray.get(ref)
        except ray.exceptions.RayError as e:
            self.errors += 1
            log.error("in-run evaluation failed (%d so far; training goes on): %s", self.errors,
                      str(e).splitlines()[0][:300] if str(e) else type(e).__name__)
            return []
        step = self.last_version = int(report.pop("version"))
        report["eval/seconds"] = report.pop("seconds")
        self.last = report
        return [(step, {**self.last, **self._counters()})]

    def _counters(self) -> dict[str, float]:
        return {"eval/skipped": float(self.skipped), "eval/errors": float(self.errors)}

    def final(self, version: int) -> list[tuple[int, dict[str, float]]]:
        """Wait for the evaluation in flight, then evaluate the final policy `version` unless that one
        was just measured (bounded by eval.timeout_s)."""
        out = self.poll(wait_s=self.cfg.timeout_s) if self.in_flight is not None else []
        if not self.cfg.final or self.last_version == version:
            return out
        self.in_flight = self.actor.evaluate.remote(min_version=version)
        got = self.poll(wait_s=self.cfg.timeout_s)
        if self.in_flight is not None:  # the run's training and checkpoints are unaffected: say so, count it
            ray.cancel(self.in_flight, force=True)
            self.in_flight = None
            self.errors += 1
            log.error("the final evaluation did not finish within eval.timeout_s=%.0fs; it is left out",
                      self.cfg.timeout_s)
        return out + got

    def shutdown(self) -> None:
        ray.kill(self.actor, no_restart=True)
