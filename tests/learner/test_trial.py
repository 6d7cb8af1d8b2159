"""The lever trial (learner.trial): a lever that fails at setup is switched off and the rank trains on.

Failures are real where a CPU has one (a torch.compile backend that breaks; flex_attention's missing CPU backward)
and injected with EXGRPO_LEVER_FAULTS otherwise, as the drill of a whole run does (tests/cluster/test_train_e2e.py).
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from common.config import LearnerConfig
from tests.learner import sectioned
from tests.ports import rendezvous_store
from learner.compile_cache import compiled_graphs
from learner.setup import setup_rank
from learner.shape import TrainShape
from learner.step import merge_rank_stats
from learner.trial import FAULTS_ENV, LEVERS, LeverError, injected_faults, switch_off, try_levers
from bench.batches import make_batch

CPU = torch.device("cpu")
ALL_ON = dict(compile=True, compile_backend="aot_eager", padding_free=True, fused_optimizer=True)


def _setup(model_dir, **overrides):
    cfg = LearnerConfig(**sectioned({"micro_batch_rows": 4, "mini_batches": 2, "lr": 1e-3, **overrides}))
    return setup_rank(cfg, str(model_dir), TrainShape(max_new_tokens=40), rank=0, device=CPU)


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
    assert cfg.levers.compile is ("compile" not in faults)
    assert cfg.levers.packs_padding_free is ("padding_free" not in faults)
    assert cfg.levers.fused_optimizer is ("fused_optimizer" not in faults)
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
    assert _compiled_layers(built.model) == 0 and built.trainer.cfg.levers.compile is False
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
    assert cfg.levers.compile and cfg.levers.packs_padding_free and cfg.levers.fused_optimizer
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
    """flex_attention chosen by the user has no backward on a CPU: with packing (the lever on) switched off it still
    fails, so the error is the attention's, raised with both attempts' errors (not hidden behind a lever). Without
    compile on: a compile of flex_attention took ~55 s of this test on 2 cores and adds nothing to what it asserts
    (a compile that breaks is test_a_compile_that_breaks_is_off_and_the_trial_moved_no_weight)."""
    monkeypatch.delenv(FAULTS_ENV, raising=False)
    with pytest.raises(LeverError, match="every lever off.*FlexAttention does not support backward"):
        _setup(tiny_model_dir, padding_free=True, attn_implementation="flex_attention")


def test_switch_off_and_the_fault_names_are_checked(monkeypatch):
    cfg = LearnerConfig(levers=dict(compile=True, padding_free="auto", fused_optimizer="auto"))
    kept = switch_off(cfg, {"compile": "InductorError: ...", "padding_free": "x"})
    assert kept.levers.compile is False and kept.levers.padding_free is False and kept.levers.fused_optimizer == "auto"
    assert switch_off(cfg, {}) is cfg
    monkeypatch.setenv(FAULTS_ENV, "compile, flash")
    with pytest.raises(ValueError, match=r"\['flash'\] is not a lever; name some of padding_free, compile"):
        injected_faults()


# ------------------------------------------------------------------------------------------------- compile once

def _mixed_steps(*trainers):
    """Three steps of new lengths on each trainer, the second cut into 1-row micro-batches (one long response, a
    rank's dummy): (each step's stats per trainer)."""
    out = []
    for v, rows in enumerate((4, 1, 3)):
        batch = make_batch(30 + v, candidates=2, response_len=(1, 5 + 11 * v), version=v)
        stats = []
        for t in trainers:
            t.cfg = t.cfg.model_copy(update={"batching": t.cfg.batching.model_copy(update={"micro_batch_rows": rows})})
            stats.append(t.run(batch))
        out.append(stats)
    return out


@pytest.mark.parametrize("mode", ["none", "full"])
def test_the_trial_compiles_the_graphs_every_step_uses(tiny_model_dir, monkeypatch, mode):
    """Per-layer compile (aot_eager: AOT autograd's graphs without kernels): the setup's trial builds 4 graphs
    (with gradients and without, for several rows and for 1 row: a size of 1 is dynamo's own case), and three steps
    of new lengths, one of them all 1-row micro-batches, build none: learner/recompiles is 0 at every step. Bit for
    bit what eager trains."""
    monkeypatch.delenv(FAULTS_ENV, raising=False)
    torch._dynamo.reset()
    built = _setup(tiny_model_dir, compile=True, compile_backend="aot_eager", activation_checkpointing=mode)
    assert built.trial_graphs == 4
    graphs = compiled_graphs()
    eager = _setup(tiny_model_dir, activation_checkpointing=mode)
    for got, want in _mixed_steps(built.trainer, eager.trainer):
        assert got.recompiles == 0 and merge_rank_stats([got])[0]["learner/recompiles"] == 0
        assert got.updates == want.updates == 2 and got.sums["loss"] == want.sums["loss"]
    assert compiled_graphs() == graphs
    want = eager.model.state_dict()
    for k, v in built.model.state_dict().items():
        assert torch.equal(v, want[k]), k


def test_a_recompile_after_the_trial_is_counted_and_names_its_guard(tiny_model_dir, monkeypatch, caplog):
    """A step under autocast (a global state the trial's graphs were not built for) compiles new graphs: the step
    counts them (learner/recompiles) and logs one line naming the guard that failed; the next step is clean."""
    monkeypatch.delenv(FAULTS_ENV, raising=False)
    torch._dynamo.reset()
    built = _setup(tiny_model_dir, compile=True, compile_backend="aot_eager")
    with caplog.at_level(logging.WARNING, logger="learner.compile_cache"):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            stats = built.trainer.run(make_batch(3, candidates=2))
    assert stats.recompiles > 0 and merge_rank_stats([stats])[0]["learner/recompiles"] == stats.recompiles
    lines = [r.getMessage() for r in caplog.records if "compiled during" in r.getMessage()]
    assert len(lines) == 1 and "guard failed: " in lines[0] and "autocast" in lines[0].lower(), lines
    assert "the step of policy version 0" in lines[0]
    assert built.trainer.run(make_batch(4, candidates=2)).recompiles == 0


ONE_FSDP_RANK = textwrap.dedent("""
    import json, os, sys, torch
    import torch.distributed as dist
    sys.path.insert(0, os.getcwd())
    from common.config import LearnerConfig
    from learner.compile_cache import compiled_graphs
    from learner.setup import setup_rank
    from learner.shape import TrainShape
    from bench.batches import make_batch

    model_dir = sys.argv[1]
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # one rank: no port
    torch.set_num_threads(1)
    cfg = LearnerConfig(batching=dict(micro_batch_rows=4, mini_batches=2), optim=dict(lr=1e-3),
                        levers=dict(compile=True, compile_backend="aot_eager", activation_checkpointing="full"))
    built = setup_rank(cfg, model_dir, TrainShape(max_new_tokens=40, dtype="bfloat16"), rank=0,
                       device=torch.device("cpu"))
    after_trial, recompiles = compiled_graphs(), []
    for v, rows in enumerate((4, 1, 3)):
        cfg = built.trainer.cfg
        built.trainer.cfg = cfg.model_copy(update={"batching": cfg.batching.model_copy(update={"micro_batch_rows": rows})})
        batch = make_batch(30 + v, candidates=2, response_len=(1, 5 + 11 * v), version=v)
        recompiles.append(built.trainer.run(batch).recompiles)
    print("RESULT", json.dumps({"trial": built.trial_graphs, "steps": compiled_graphs() - after_trial,
                                "recompiles": recompiles}))
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)
""")


def test_under_fsdp2_full_checkpointing_reuses_the_forwards_graph(tiny_model_dir):
    """One FSDP2 rank (bf16: sharded, FSDP2's hooks on every layer), full checkpointing, per-layer compile
    (aot_eager): FSDP2's post-backward hook hands the forward a view and the recompute a plain tensor, and
    transformers' input-grad hook split the no-grad forward; with both handled the trial builds 2 graphs for
    several rows (it built 4 for them) and 2 for one row, and steps of new lengths with 1-row micro-batches build
    none."""
    import json

    env = {k: v for k, v in os.environ.items() if k != FAULTS_ENV} | {"OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", ONE_FSDP_RANK, str(tiny_model_dir)], cwd=os.getcwd(),
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    got = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("RESULT"))[7:])
    assert got == {"trial": 4, "steps": 0, "recompiles": [0, 0, 0]}


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
    from learner.shape import TrainShape
    from bench.batches import make_batch

    rank, port, model_dir = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    if rank == 1:  # only rank 1's packing breaks
        os.environ["EXGRPO_LEVER_FAULTS"] = "padding_free"
    dist.init_process_group("gloo", store=dist.TCPStore("127.0.0.1", int(port), is_master=False), rank=rank,
                            world_size=2)
    torch.set_num_threads(1)
    cfg = LearnerConfig(batching=dict(micro_batch_rows=4, mini_batches=2), optim=dict(lr=1e-3),
                        levers=dict(padding_free=True, fused_optimizer=True))
    built = setup_rank(cfg, model_dir, TrainShape(max_new_tokens=40, world=2), rank=rank,
                       device=torch.device("cpu"))
    stats = built.trainer.run(make_batch(0, groups=2, candidates=1))
    print("RESULT", json.dumps({"off": built.levers_off, "fused": built.trainer.cfg.levers.fused_optimizer,
                                "packs": built.trainer.cfg.levers.packs_padding_free, "updates": stats.updates}))
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)
""")


def test_two_ranks_agree_when_only_one_fails(tiny_model_dir):
    """2 FSDP2 ranks over gloo, packing breaking on rank 1 only: both switch packing off (rank 0 says the failure
    was another rank's), keep fused AdamW, and train the same step."""
    import json

    store = rendezvous_store()  # held until the ranks are done
    port = store.port
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
