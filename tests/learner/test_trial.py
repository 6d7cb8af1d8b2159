"""The lever trial (learner.trial): a lever that fails at setup is switched off and the rank trains on.

Failures are real where a CPU has one (a torch.compile backend that breaks; flex_attention's missing CPU backward)
and injected with EXGRPO_LEVER_FAULTS otherwise, as the drill of a whole run does (tests/cluster/test_train_e2e.py).
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import textwrap

import pytest
import torch

from common.config import LearnerConfig
from learner.setup import setup_rank
from learner.trial import FAULTS_ENV, LEVERS, LeverError, injected_faults, switch_off, try_levers
from tests.learner.batches import make_batch

CPU = torch.device("cpu")
ALL_ON = dict(compile=True, compile_backend="aot_eager", padding_free=True, fused_optimizer=True)


def _setup(model_dir, **overrides):
    cfg = LearnerConfig(**{"micro_batch_rows": 4, "mini_batches": 2, "lr": 1e-3, **overrides})
    return setup_rank(cfg, str(model_dir), rank=0, world=1, device=CPU, dtype=torch.float32, max_new_tokens=40)


def _compiled_layers(model) -> int:
    return sum("forward" in vars(layer) for layer in model.model.layers)


@pytest.mark.parametrize("faults", [["compile"], ["padding_free"], ["fused_optimizer"], list(LEVERS)])
def test_a_lever_that_fails_its_trial_is_off_and_the_rank_trains_on(tiny_model_dir, monkeypatch, caplog, faults):
    monkeypatch.setenv(FAULTS_ENV, ",".join(faults))
    with caplog.at_level(logging.WARNING, logger="learner.trial"):
        built = _setup(tiny_model_dir, **ALL_ON)
    assert sorted(built.levers_off) == sorted(faults)
    assert all(FAULTS_ENV in err for err in built.levers_off.values())
    cfg = built.trainer.cfg
    assert cfg.compile is ("compile" not in faults)
    assert cfg.packs_padding_free is ("padding_free" not in faults)
    assert cfg.fused_optimizer is ("fused_optimizer" not in faults)
    assert _compiled_layers(built.model) == (0 if "compile" in faults else len(built.model.model.layers))
    assert built.trainer.optimizer.defaults["fused"] is (None if "fused_optimizer" in faults else True)
    assert built.optimizer is built.trainer.optimizer
    warned = [r.getMessage() for r in caplog.records if "failed its trial" in r.getMessage()]
    assert len(warned) == len(faults) and all(any(f"learner.{f} " in w for w in warned) for f in faults)
    stats = built.trainer.run(make_batch(3, candidates=2))
    assert stats.updates == 2


def test_a_compile_that_breaks_is_off_and_the_trial_moved_no_weight(tiny_model_dir, monkeypatch):
    """A real failure: a torch.compile backend that raises at the first compile (as inductor did on the H100). The
    trial's micro-batch, eval forwards and no-op optimizer step leave every weight bit for bit as loaded, and AdamW
    with no state (the first real step starts it)."""
    from transformers import AutoModelForCausalLM

    def broken(gm, example_inputs):
        raise RuntimeError("LoweringException: this backend cannot lower anything")

    from torch._dynamo.backends.registry import _COMPILER_FNS, register_backend

    if "broken_for_test" not in _COMPILER_FNS:
        register_backend(broken, name="broken_for_test")
    monkeypatch.delenv(FAULTS_ENV, raising=False)
    built = _setup(tiny_model_dir, compile=True, compile_backend="broken_for_test", fused_optimizer=True)
    assert list(built.levers_off) == ["compile"]
    assert "cannot lower anything" in built.levers_off["compile"]
    assert _compiled_layers(built.model) == 0 and built.trainer.cfg.compile is False
    assert built.trainer.optimizer.defaults["fused"] is True  # its own trial passed
    assert not built.optimizer.state
    loaded = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).state_dict()
    for k, v in built.model.state_dict().items():
        assert torch.equal(v, loaded[k]), k
    assert built.trainer.run(make_batch(4, candidates=2)).updates == 2


def test_levers_that_pass_stay_on_and_the_trial_draws_nothing_from_the_run(tiny_model_dir, monkeypatch):
    """All levers pass: nothing is switched off, and the run's random numbers are the ones it would draw without a
    trial (the generators are forked around it)."""
    monkeypatch.delenv(FAULTS_ENV, raising=False)
    built = _setup(tiny_model_dir, **ALL_ON)
    assert built.levers_off == {}
    cfg = built.trainer.cfg
    assert cfg.compile and cfg.packs_padding_free and cfg.fused_optimizer
    torch.manual_seed(7)
    off = try_levers(_Levers(cfg), built.trainer, lambda: None)
    after_trial = torch.rand(4)
    torch.manual_seed(7)
    assert off == {} and torch.equal(after_trial, torch.rand(4))


def test_no_lever_on_means_no_trial(tiny_model_dir, monkeypatch):
    """The CPU's defaults (no lever on) run no trial: an injected fault of every lever changes nothing."""
    monkeypatch.setenv(FAULTS_ENV, ",".join(LEVERS))
    built = _setup(tiny_model_dir)
    assert built.levers_off == {}


def test_a_failure_with_every_lever_off_is_not_a_levers_and_is_raised(tiny_model_dir, monkeypatch):
    """flex_attention chosen by the user has no backward on a CPU: packing and compile off, it still fails, so the
    error is the attention's, raised with both attempts' errors (not hidden behind a lever)."""
    monkeypatch.delenv(FAULTS_ENV, raising=False)
    with pytest.raises(LeverError, match="every lever off.*FlexAttention does not support backward"):
        _setup(tiny_model_dir, padding_free=True, attn_implementation="flex_attention", compile=True,
               compile_backend="aot_eager")


def test_switch_off_and_the_fault_names_are_checked(monkeypatch):
    cfg = LearnerConfig(compile=True, padding_free="auto", fused_optimizer="auto")
    kept = switch_off(cfg, {"compile": "InductorError: ...", "padding_free": "x"})
    assert kept.compile is False and kept.padding_free is False and kept.fused_optimizer == "auto"
    assert switch_off(cfg, {}) is cfg
    monkeypatch.setenv(FAULTS_ENV, "compile, flash")
    with pytest.raises(ValueError, match=r"\['flash'\] is not a lever; name some of padding_free, compile"):
        injected_faults()


class _Levers:
    def __init__(self, cfg):
        self.cfg = cfg

    def set(self, lever, on):
        raise AssertionError("no lever should be switched")


TWO_RANKS = textwrap.dedent("""
    import json, os, sys, torch
    import torch.distributed as dist
    sys.path.insert(0, os.getcwd())
    from common.config import LearnerConfig
    from learner.setup import setup_rank
    from tests.learner.batches import make_batch

    rank, port, model_dir = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    if rank == 1:  # only rank 1's packing breaks
        os.environ["EXGRPO_LEVER_FAULTS"] = "padding_free"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    torch.set_num_threads(1)
    cfg = LearnerConfig(micro_batch_rows=4, mini_batches=2, lr=1e-3, padding_free=True, fused_optimizer=True)
    built = setup_rank(cfg, model_dir, rank=rank, world=2, device=torch.device("cpu"), dtype=torch.float32,
                       max_new_tokens=40)
    stats = built.trainer.run(make_batch(0, groups=2, candidates=1))
    print("RESULT", json.dumps({"off": built.levers_off, "fused": built.trainer.cfg.fused_optimizer,
                                "packs": built.trainer.cfg.packs_padding_free, "updates": stats.updates}))
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)
""")


def test_two_ranks_agree_when_only_one_fails(tiny_model_dir):
    """2 FSDP2 ranks over gloo, packing breaking on rank 1 only: both switch packing off (rank 0 says the failure
    was another rank's), keep fused AdamW, and train the same step."""
    import json

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k != FAULTS_ENV} | {"OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-c", TWO_RANKS, str(r), str(port), str(tiny_model_dir)],
                              cwd=os.getcwd(), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(2)]
    logs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], logs
    got = [json.loads(next(line for line in log.splitlines() if line.startswith("RESULT"))[7:]) for log in logs]
    assert [sorted(g["off"]) for g in got] == [["padding_free"], ["padding_free"]]
    assert "another rank" in got[0]["off"]["padding_free"] and FAULTS_ENV in got[1]["off"]["padding_free"]
    assert all(g["fused"] is True and g["packs"] is False and g["updates"] == 2 for g in got)
