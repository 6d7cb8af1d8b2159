"""The lever trial: every device lever a learner rank has on is tried at setup, before the first step, and one
that fails is switched off for the run instead of stopping it.

    off = try_levers(levers, trainer)   # {lever: the error it raised}; the levers left on passed
    # levers: a `Levers` of `learner.setup` (switch one off or on again over the built model)

A trial is what a step does with nothing applied to the weights; all ranks agree on its outcome, and the random
number generators are forked around it. Under per-layer compile it is also the warm-up. Drills:
`EXGRPO_LEVER_FAULTS=compile,padding_free,fused_optimizer` (any subset) makes those levers fail their trial.
Why, what a trial runs, the fallback order: docs/internals.md#learnertrialpy
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Protocol

import numpy as np
import torch

from common.config import LearnerConfig
from common.text import one_line
from learner.batching import Row
from learner.forward import forward_stats

log = logging.getLogger(__name__)

FAULTS_ENV = "EXGRPO_LEVER_FAULTS"
MICRO_BATCH_LEVERS = ("padding_free", "compile")  # switched off in this order when the micro-batch fails
LEVERS = MICRO_BATCH_LEVERS + ("fused_optimizer",)


class InjectedLeverFault(RuntimeError):
    """A lever failing its trial because `EXGRPO_LEVER_FAULTS` names it (a drill, not a bug)."""


class LeverError(RuntimeError):
    """The trial micro-batch failed with every lever off: the learner cannot run here (not a lever's failure)."""


class Levers(Protocol):
    """What the trial needs from the rank it tries: the levers' state and how to switch one."""

    cfg: LearnerConfig  # the levers as they are now (resolved: true/false)

    def set(self, lever: str, on: bool) -> None: ...


def is_on(cfg: LearnerConfig, lever: str) -> bool:
    return cfg.levers.packs_padding_free if lever == "padding_free" else getattr(cfg.levers, lever) is True


def switch_off(cfg: LearnerConfig, off: dict[str, str]) -> LearnerConfig:
    """`cfg` with each lever named in `off` set to false: a resumed or restarted run keeps the decisions its first
    start made (and does not pay a failing compile again)."""
    update = {k: False for k in off if k in LEVERS}
    return cfg.with_levers(**update) if update else cfg


def injected_faults() -> set[str]:
    """The levers `EXGRPO_LEVER_FAULTS` makes fail; refuses a name that is not a lever."""
    names = {n.strip() for n in os.environ.get(FAULTS_ENV, "").split(",") if n.strip()}
    unknown = names - set(LEVERS)
    if unknown:
        raise ValueError(f"{FAULTS_ENV}={os.environ[FAULTS_ENV]!r}: {sorted(unknown)} is not a lever; "
                         f"name some of {', '.join(LEVERS)}")
    return names


def trial_rows(vocab: int) -> tuple[list[list[Row]], list[list[Row]]]:
    """(the trained micro-batches: 2 rows of different lengths, then 1 row; the eval forwards: 3 rows of other
    lengths, then 1 row). One row is its own case for a compiler (a size of 1 broadcasts): a run meets it with one
    long response, the packed layout and a rank's dummy, so the trial runs it before the first step. Token ids are
    drawn from a fixed generator (not the run's), away from the ids special tokens usually take."""
    g = np.random.default_rng(12345)
    lo, hi = min(3, vocab - 1), max(min(vocab, 1000), min(3, vocab - 1) + 1)

    def row(prompt: int, response: int, i: int) -> Row:
        return Row(g.integers(lo, hi, prompt), g.integers(lo, hi, response), np.zeros(response, np.float32),
                   1.0 if i % 2 else -1.0, False, f"trial-{i}", i)

    return ([[row(5, 19, 0), row(7, 9, 1)], [row(6, 11, 2)]],
            [[row(4, 6, 0), row(6, 13, 1), row(3, 4, 2)], [row(8, 21, 3)]])


def attempt_micro_batch(trainer, faults: set[str]) -> str | None:
    """The trial micro-batches under the trainer's levers (see the module doc): what a step runs, in a step's
    order, so that the graphs they compile are the ones the first step uses; None when they ran, else the error
    in one line. Nothing reaches the weights: the gradients are dropped."""
    cfg, model = trainer.cfg, trainer.model
    train_batches, eval_batches = trial_rows(int(model.config.vocab_size))
    was_training = model.training
    try:
        model.eval()
        with torch.no_grad():  # candidate scoring and old log-probs: eval mode, no grad
            for rows in eval_batches:
                forward_stats(model, trainer.collate(rows))
        model.train()
        for rows in train_batches:
            mb = trainer.collate(rows)
            trainer.reference_logprobs(mb)
            logp, ent, anchor = forward_stats(model, mb)  # [R, L-1] each
            (logp.sum() + ent.sum() + 0.0 * anchor).backward()
        for lever in MICRO_BATCH_LEVERS:  # after the collectives, so that ranks drilled apart stay in step
            if lever in faults and is_on(cfg, lever):
                raise InjectedLeverFault(f"{lever}: made to fail by {FAULTS_ENV}")
        return None
    except Exception as e:  # noqa: BLE001 -- any failure of a lever's kernel; the caller decides and says so
        return _one_line(e)
    finally:
        trainer.optimizer.zero_grad(set_to_none=True)
        model.train(was_training)


def attempt_optimizer(optimizer: torch.optim.Optimizer, faults: set[str], fused: bool) -> str | None:
    """One optimizer step over zeroed gradients with lr and weight decay 0 (AdamW then moves no weight), its state
    cleared after; None when it ran, else the error in one line."""
    saved = [(g["lr"], g["weight_decay"]) for g in optimizer.param_groups]
    try:
        if fused and "fused_optimizer" in faults:
            raise InjectedLeverFault(f"fused_optimizer: made to fail by {FAULTS_ENV}")
        for group in optimizer.param_groups:
            group["lr"], group["weight_decay"] = 0.0, 0.0
            for p in group["params"]:
                p.grad = torch.zeros_like(p)
        optimizer.step()
        return None
    except Exception as e:  # noqa: BLE001 -- the kernel's refusal, whatever its type
        return _one_line(e)
    finally:
        for group, (lr, wd) in zip(optimizer.param_groups, saved):
            group["lr"], group["weight_decay"] = lr, wd
        optimizer.state.clear()
        optimizer.zero_grad(set_to_none=True)


def agree(error: str | None, trainer) -> str | None:
    """The attempt's outcome for every rank: a failure on any rank fails it everywhere (one all-reduce)."""
    if trainer.world <= 1:
        return error
    ok = torch.tensor([0.0 if error else 1.0], device=trainer.device)
    torch.distributed.all_reduce(ok, op=torch.distributed.ReduceOp.MIN)
    if error is None and ok.item() < 1.0:
        return "failed on another rank (its log has the error)"
    return error


def try_levers(levers: Levers, trainer, rebuild_optimizer: Callable[[], None]) -> dict[str, str]:
    """Try the levers `levers.cfg` has on; switch off those that fail (see the module doc). Collective under FSDP.
    Returns {lever: error} of the levers switched off. `rebuild_optimizer()`: replaces the trainer's optimizer
    after `levers.set("fused_optimizer", False)`."""
    faults = injected_faults()
    off: dict[str, str] = {}
    in_play = [lv for lv in MICRO_BATCH_LEVERS if is_on(levers.cfg, lv)]
    with torch.random.fork_rng(devices=[trainer.device] if trainer.device.type == "cuda" else []):
        if in_play:
            first = agree(attempt_micro_batch(trainer, faults), trainer)
            if first is not None:
                off = _search(levers, trainer, in_play, first, faults)
        if levers.cfg.levers.fused_optimizer is True:
            error = agree(attempt_optimizer(trainer.optimizer, faults, fused=True), trainer)
            if error is not None:
                levers.set("fused_optimizer", False)
                rebuild_optimizer()
                off["fused_optimizer"] = error
    for lever, error in off.items():
        if trainer.rank == 0:
            log.warning("learner.%s failed its trial at setup and is off for this run (the run trains on without "
                        "it; a resume keeps it off): %s", lever, error)
    return off


def _search(levers: Levers, trainer, in_play: list[str], error: str, faults: set[str]) -> dict[str, str]:
    """The levers to switch off after the trial failed with all of `in_play` on: the first one alone whose
    removal lets the trial pass (newest first), else all of them; LeverError when even that fails."""
    for lever in in_play:
        levers.set(lever, False)
        if agree(attempt_micro_batch(trainer, faults), trainer) is None:
            return {lever: error}
        levers.set(lever, True)
    for lever in in_play:
        levers.set(lever, False)
    last = agree(attempt_micro_batch(trainer, faults), trainer)
    if last is not None:
        raise LeverError(f"the learner's trial micro-batch fails with every lever off ({last}); with "
                         f"{', '.join(in_play)} on it failed with: {error}")
    return {lever: error for lever in in_play}


def _one_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {one_line(str(e), 400, placeholder='...')}"
