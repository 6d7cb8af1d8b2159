"""Activation checkpointing (learner.levers.activation_checkpointing): full and selective train what none trains, on one
rank, under per-layer compile and on 2 FSDP2 ranks; "auto" chooses from memory by numbers worked by hand."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from common.config import LearnerConfig, LoRAConfig
from tests.learner import sectioned
from tests.ports import rendezvous_store
from learner.batching import batch_rows, collate
from learner.activation_checkpointing import (AUTO_MODES, RESERVE, SELECTIVE_RAN_ON_GPU, USABLE, LayerCost, LayerShape,
                                   MemoryBudget, MicroBatchSize, activation_bytes, agreed_budget, apply_checkpointing,
                                   bytes_per_token, choose_checkpointing, eager_fallback_note, gpu_share,
                                   micro_batch_tokens, resolve_checkpointing, state_bytes)
from learner.forward import forward_stats, prepare_model
from learner.levers import build_optimizer
from learner.lora import apply_lora, init_adapters
from learner.replay_choice import complete_groups
from learner.shape import TrainShape
from learner.step import TrainStep
from bench.batches import make_batch

CPU = torch.device("cpu")
GIB = 2 ** 30


def test_config_takes_the_four_modes_and_the_old_booleans():
    assert LearnerConfig().levers.activation_checkpointing == "auto"
    for mode in ("auto", "full", "selective", "none"):
        assert LearnerConfig(levers=dict(activation_checkpointing=mode)).levers.activation_checkpointing == mode
    assert LearnerConfig(levers=dict(activation_checkpointing=True)).levers.activation_checkpointing == "full"
    assert LearnerConfig(levers=dict(activation_checkpointing=False)).levers.activation_checkpointing == "none"
    with pytest.raises(ValueError, match="'auto', 'full', 'selective' or 'none'"):
        LearnerConfig(levers=dict(activation_checkpointing="layer"))


def test_a_saved_config_with_the_boolean_loads_and_resumes_unchanged(tmp_path):
    """A run saved before the modes (`activation_checkpointing: true` in its YAML) loads as full, and resuming it
    with no override changes nothing."""
    from common.config import load_config, resume_config

    f = tmp_path / "run.yaml"
    f.write_text("learner:\n  levers:\n    activation_checkpointing: true\n")
    saved = load_config(f)
    assert saved.learner.levers.activation_checkpointing == "full"
    cfg, changes = resume_config(saved, [])
    assert cfg.learner.levers.activation_checkpointing == "full" and changes == {}


# ------------------------------------------------------------------------------------------------- auto, by hand

SHAPE = LayerShape(hidden=1024, kv_hidden=256, intermediate=4096, layers=10)
# Per token, in elements: none 10 x (12 x 1024 + 2 x 256 + 4 x 4096 = 29,184) + 8 x 1024 = 300,032;
# selective 10 x (5 x 1024 + 2 x 256 + 2 x 4096 = 13,824) + 8,192 = 146,432; full 10 x 1024 + 29,184 + 8,192 = 47,616.
# At 2 bytes and 16,384 tokens: none 9,831,448,576 B (9.16 GiB), selective 4,798,283,776 B (4.47 GiB),
# full 1,560,281,088 B (1.45 GiB).
# Compiled (inductor's partitioner, as measured on an H100): a layer's none keeps 6 h + 2 kv + 3 i = 18,944, so none
# 189,440 + 8,192 = 197,632 elements, 395,264 B per token, 6,476,005,376 B (6.03 GiB); full 10,240 + 18,944 + 8,192
# = 37,376 elements, 74,752 B per token, 1,224,736,768 B (1.14 GiB); selective as eager.
TOKENS = 16_384
SIZE = MicroBatchSize(TOKENS)
EAGER, COMPILED = LayerCost(SHAPE, 2), LayerCost(SHAPE, 2, compiled=True)  # bfloat16 activations


def whole(gib: float, share: float = 1.0) -> MemoryBudget:
    """A card of `gib` GiB, all of it free."""
    return MemoryBudget(free=int(gib * GIB), total=int(gib * GIB), share=share)


def test_activation_estimate_by_hand():
    assert activation_bytes("none", TOKENS, SHAPE, 2) == 9_831_448_576
    assert activation_bytes("selective", TOKENS, SHAPE, 2) == 4_798_283_776
    assert activation_bytes("full", TOKENS, SHAPE, 2) == 1_560_281_088
    assert activation_bytes("none", TOKENS, SHAPE, 4) == 2 * 9_831_448_576
    assert [bytes_per_token(m, SHAPE, 2) for m in ("none", "selective", "full")] == [600_064, 292_864, 95_232]


def test_under_compile_none_keeps_about_what_selective_does():
    assert [bytes_per_token(m, SHAPE, 2, compiled=True) for m in ("none", "selective", "full")] == [
        395_264, 292_864, 74_752]
    assert activation_bytes("none", TOKENS, SHAPE, 2, compiled=True) == 6_476_005_376
    assert activation_bytes("full", TOKENS, SHAPE, 2, compiled=True) == 1_224_736_768


def test_the_budget_is_the_free_memory_capped_at_the_ray_share():
    """80 GiB card: 70 free, the whole card given: 70; half the card given (a vLLM engine beside it): 40, though
    70 are free; 30 free of a half: 30."""
    assert MemoryBudget(free=70 * GIB, total=80 * GIB, share=1.0).bytes == 70 * GIB
    assert MemoryBudget(free=70 * GIB, total=80 * GIB, share=0.5).bytes == 40 * GIB
    assert MemoryBudget(free=30 * GIB, total=80 * GIB, share=0.5).bytes == 30 * GIB
    # learner.num_gpus: a fraction is the share; 0 (not placed by Ray) and whole GPUs are the card
    assert [gpu_share(g) for g in (0.0, 0.25, 0.5, 1.0, 2.0)] == [1.0, 0.25, 0.5, 1.0, 1.0]


def test_the_micro_batch_is_the_token_budget_or_the_rows_a_rank_trains():
    """No token budget: micro_batch_rows (64) x the longest row (256 + 8,192 = 8,448) = 540,672, but a rank that
    trains 8 rows per update has micro-batches of 8 x 8,448 = 67,584; a budget of 18,432 is the micro-batch."""
    cfg = LearnerConfig()
    assert micro_batch_tokens(cfg, 8448) == (540_672, "64 rows x 8448 tokens")
    assert micro_batch_tokens(cfg, 8448, rows=8) == (67_584, "8 rows x 8448 tokens")
    assert micro_batch_tokens(cfg, 8448, rows=100) == (540_672, "64 rows x 8448 tokens")
    budget = LearnerConfig(batching=dict(micro_batch_tokens=18_432))
    assert micro_batch_tokens(budget, 8448, rows=8) == (18_432, "learner.batching.micro_batch_tokens")


@pytest.mark.parametrize("state_gib, want, want_without_selective", [(40, "none", "none"), (64, "selective", "full"),
                                                                      (68, "full", "full"), (69.5, "full", "full")])
def test_auto_takes_the_least_recompute_that_fits(state_gib, want, want_without_selective):
    """80 GiB: 0.9 x 80 - 2 (reserve) = 70 GiB before the states. States of 40 GiB leave 30: none (9.16) fits;
    64 leave 6: selective (4.47), not none; 68 leave 2: full (1.45); 69.5 leave 0.5: nothing fits, full, and the
    note says what to lower. Auto chooses among the modes that have run on a GPU: all three since selective has
    (an H100, issue 49); without selective, 64 gives full."""
    assert USABLE * 80 * GIB - RESERVE == 70 * GIB
    choice = choose_checkpointing(whole(80), int(state_gib * GIB), SIZE, EAGER)
    assert choice.mode == want
    without = choose_checkpointing(whole(80), int(state_gib * GIB), SIZE, EAGER, modes=("none", "full"))
    assert without.mode == want_without_selective
    left = 70 - state_gib
    note = choice.note()
    assert note == (f"auto: {left:.1f} GiB left = 0.9 x 80.0 GiB budget (free 80.0, GPU share 1 of 80.0) - 2.0 "
                    f"reserve - {state_gib:.1f} weights, gradients and AdamW state, activations of {TOKENS} tokens x "
                    f"kB/token none 600.1, selective 292.9, full 95.2 = none 9.2, selective 4.5, full 1.5 GiB"
                    + (", even full may not fit: lower learner.batching.micro_batch_tokens (or micro_batch_rows), or add "
                       "learner ranks" if state_gib == 69.5 else ""))
    assert ";" not in note  # the levers' notes are joined by semicolons
    assert without.note().endswith("selective not auto's without compile (it has run on a GPU compiled only)" + (
        ", even full may not fit: lower learner.batching.micro_batch_tokens (or micro_batch_rows), or add learner ranks"
        if state_gib == 69.5 else ""))


def test_under_compile_auto_keeps_everything_where_eager_would_recompute():
    """States of 63 GiB leave 7: eager none (9.16 GiB) does not fit and auto recomputes (selective); compiled none
    (6.03 GiB) fits, and no layer runs twice."""
    assert choose_checkpointing(whole(80), 63 * GIB, SIZE, EAGER).mode == "selective"
    choice = choose_checkpointing(whole(80), 63 * GIB, SIZE, COMPILED)
    assert choice.mode == "none" and choice.note().startswith("auto, compiled: 7.0 GiB left")


def test_where_only_full_fits_auto_halves_a_token_budget_for_selective():
    """States of 66 GiB leave 4: selective at 16,384 tokens (4.47 GiB) does not fit, full (1.45) does. With a floor
    of 8,192 (a token budget), selective at 8,192 tokens (2.23 GiB) fits: auto takes it and says so. A floor above
    the half, no floor (rows, not a token budget) or selective not among the modes: full at the budget as set."""
    choice = choose_checkpointing(whole(80), 66 * GIB, MicroBatchSize(TOKENS, floor=8192), EAGER)
    assert (choice.mode, choice.tokens, choice.halved_from) == ("selective", 8192, TOKENS)
    assert "activations of 8192 tokens" in choice.note()
    assert "learner.batching.micro_batch_tokens halved from 16384 so that selective fits" in choice.note()
    for kept in (choose_checkpointing(whole(80), 66 * GIB, MicroBatchSize(TOKENS, floor=8193), EAGER),
                 choose_checkpointing(whole(80), 66 * GIB, SIZE, EAGER),
                 choose_checkpointing(whole(80), 66 * GIB, MicroBatchSize(TOKENS, floor=8192), EAGER,
                                      modes=("none", "full"))):
        assert (kept.mode, kept.tokens, kept.halved_from) == ("full", TOKENS, 0)
        assert "halved" not in kept.note()
    # where selective fits at the budget as set, nothing is halved
    assert choose_checkpointing(whole(80), 64 * GIB, MicroBatchSize(TOKENS, floor=8192), EAGER).tokens == TOKENS


def test_a_half_card_beside_an_engine_recomputes_what_the_whole_card_keeps():
    """80 GiB card, 75 free, states of 20 GiB: the whole card leaves 0.9 x 75 - 2 - 20 = 45.5 GiB and none (9.16)
    fits; half the card (40 GiB) leaves 0.9 x 40 - 2 - 20 = 14, none still fits; a quarter (20) leaves -4: full."""
    free = MemoryBudget(free=75 * GIB, total=80 * GIB, share=1.0)
    assert choose_checkpointing(free, 20 * GIB, SIZE, EAGER).mode == "none"
    half = MemoryBudget(free=75 * GIB, total=80 * GIB, share=0.5)
    assert choose_checkpointing(half, 20 * GIB, SIZE, EAGER).mode == "none"
    quarter = MemoryBudget(free=75 * GIB, total=80 * GIB, share=0.25)
    choice = choose_checkpointing(quarter, 20 * GIB, SIZE, EAGER)
    assert choice.mode == "full" and "budget (free 75.0, GPU share 0.25 of 80.0)" in choice.note()
    assert "even full may not fit" in choice.note()


def test_selective_is_auto_s_since_it_ran_on_a_gpu():
    assert SELECTIVE_RAN_ON_GPU and AUTO_MODES == ("none", "selective", "full")


def test_state_bytes_by_hand():
    """A Linear(10, 10) trained (110 float32 parameters: 4 B held + 12 B of gradient and AdamW moments each) and a
    frozen bfloat16 Linear(10, 5) (55 x 2 B), over 2 ranks: (110 x 16 + 110) / 2 = 935 B."""
    frozen = torch.nn.Linear(10, 5).to(torch.bfloat16).requires_grad_(False)
    model = torch.nn.Sequential(torch.nn.Linear(10, 10), frozen)
    assert state_bytes(model, 2) == 935


def rows_of(length: int, dtype: str = "bfloat16", world: int = 2, batch_rows: int | None = None) -> TrainShape:
    """A run's shape whose rows are `length` tokens at most (no prompt), `batch_rows` rows a batch."""
    return TrainShape(max_new_tokens=length, prompt_tokens=0, batch_rows=batch_rows, dtype=dtype, world=world)


def test_resolve_decides_auto_from_the_model_and_the_micro_batch(tiny_model_dir):
    """Off CUDA "auto" is none and a set mode stays; on CUDA (the budget given, so this runs anywhere) the
    micro-batch is `micro_batch_tokens`, or `micro_batch_rows` (or the rows a rank trains) x `max_length` without
    it, against the model's own shape and state, with bytes per token as `compile` runs the layers."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    cfg = LearnerConfig(batching=dict(micro_batch_rows=4), levers=dict(compile=False))
    got, note = resolve_checkpointing(cfg, model, CPU, rows_of(100, dtype="float32", world=1))
    assert got.levers.activation_checkpointing == "none" and note == "activation checkpointing none (auto: not CUDA)"
    got, note = resolve_checkpointing(cfg.with_levers(activation_checkpointing="selective"), model,
                                      torch.device("cuda"), rows_of(100, world=1))
    assert got.levers.activation_checkpointing == "selective" and note == "activation checkpointing selective (set)"

    shape, state = LayerShape.of(model.config), state_bytes(model, 2)
    assert shape == LayerShape(hidden=64, kv_hidden=64, intermediate=192, layers=2)
    selective = activation_bytes("selective", 400, shape, 2)  # 4 rows x 100
    memory = int((RESERVE + state + selective) / USABLE) + 1  # selective just fits, eager none does not
    budget = MemoryBudget(free=memory, total=memory, share=1.0)
    cuda = torch.device("cuda")
    got, note = resolve_checkpointing(cfg, model, cuda, rows_of(100), budget=budget)
    assert got.levers.activation_checkpointing == "full"  # eager none does not fit; eager selective is not auto's
    assert "selective not auto's without compile" in note
    assert "activations of 400 tokens (4 rows x 100 tokens)" in note and "GPU share 1 of" in note
    # the rows one rank trains per update: 2 of them, 200 tokens, none fits
    got, note = resolve_checkpointing(cfg, model, cuda, rows_of(100, batch_rows=4), budget=budget)
    assert got.levers.activation_checkpointing == "none" and "activations of 200 tokens (2 rows x 100 tokens)" in note
    tokens = cfg.model_copy(update={"batching": cfg.batching.model_copy(update={"micro_batch_tokens": 100})})  # a quarter of the tokens: none fits
    got, note = resolve_checkpointing(tokens, model, cuda, rows_of(100), budget=budget)
    assert got.levers.activation_checkpointing == "none" and "activations of 100 tokens (learner.batching.micro_batch_tokens)" in note
    # per-layer compile under inductor: a budget where compiled none just fits, eager none does not
    compiled = cfg.with_levers(compile=True)
    memory = int((RESERVE + state + activation_bytes("none", 400, shape, 2, compiled=True)) / USABLE) + 1
    budget = MemoryBudget(free=memory, total=memory, share=1.0)
    got, note = resolve_checkpointing(compiled, model, cuda, rows_of(100), budget=budget)
    assert got.levers.activation_checkpointing == "none" and note.startswith("activation checkpointing none (auto, compiled:")
    eager_backend = compiled.with_levers(compile_backend="aot_eager")  # no partitioner: eager's bytes
    got, _ = resolve_checkpointing(eager_backend, model, cuda, rows_of(100), budget=budget)
    assert got.levers.activation_checkpointing == "full"
    # a token budget of 20,000 where selective fits only at half of it: auto halves it, the cfg carries the half
    memory = int((RESERVE + state + activation_bytes("selective", 10_000, shape, 2)) / USABLE) + 1
    budget = MemoryBudget(free=memory, total=memory, share=1.0)
    tokens = compiled.model_copy(update={"batching": compiled.batching.model_copy(update={"micro_batch_tokens": 20_000})})
    got, note = resolve_checkpointing(tokens, model, cuda, rows_of(100), budget=budget)
    assert (got.levers.activation_checkpointing, got.batching.micro_batch_tokens) == ("selective", 10_000)
    assert "learner.batching.micro_batch_tokens halved from 20000 so that selective fits" in note
    # not below the longest row: a 12,000-token row keeps the budget and recomputes
    got, note = resolve_checkpointing(tokens, model, cuda, rows_of(12_000), budget=budget)
    assert (got.levers.activation_checkpointing, got.batching.micro_batch_tokens) == ("full", 20_000) and "halved" not in note


def _saved_outside_checkpoints(model, mb) -> int:
    """Bytes autograd saves for the backward of `mb` outside any checkpoint (every saved tensor that is not a
    parameter, once per storage; a checkpoint keeps its own and hides them from these hooks)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = {}

    def keep(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        forward_stats(model, mb)
    return sum(saved.values())


def test_the_estimate_counts_what_autograd_keeps_in_the_tiny_model(tiny_model_dir):
    """bfloat16: without checkpointing, what autograd saves for a micro-batch is within 20% below the estimate for
    none (an estimate that errs high, so that auto errs towards checkpointing); with full or selective, the layers'
    activations leave autograd's own saved tensors (under a sixth of none's stay: the embeddings' and the head's)."""
    from transformers import AutoModelForCausalLM

    saved = {}
    for mode in ("none", "full", "selective"):
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16)
        model = prepare_model(model, LearnerConfig(levers=dict(activation_checkpointing=mode))).train()
        mb = collate(_rows(1), 0, CPU)
        saved[mode] = _saved_outside_checkpoints(model, mb)
    estimate = activation_bytes("none", mb.input_ids.numel(), LayerShape.of(model.config), 2)
    assert 0.8 * estimate <= saved["none"] <= estimate
    assert saved["full"] < saved["none"] / 6 and saved["selective"] < saved["none"] / 6, saved


# ------------------------------------------------------------------------------------------------- same update

def _rows(seed: int):
    return batch_rows(complete_groups(make_batch(seed, groups=2, candidates=1), {})[0], std_normalize=False,
                      max_positions=512)


def _step(model_dir, **overrides):
    from transformers import AutoModelForCausalLM

    cfg = LearnerConfig(**sectioned({"micro_batch_rows": 4, "mini_batches": 2, "lr": 1e-3, **overrides}))
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if cfg.lora is not None:  # as learner.setup does: adapters before the head, checkpointing and compile
        apply_lora(model, cfg.lora)
        init_adapters(model, cfg.seed, 0, 1)
    model = prepare_model(model, cfg)
    opt, _ = build_optimizer((p for p in model.parameters() if p.requires_grad), cfg)
    return model, TrainStep(model, opt, cfg, TrainShape(max_new_tokens=40, max_positions=512), rank=0,
                            device=CPU)


def _weights(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_checkpointed_forward_gives_the_same_values_and_gradients(tiny_model_dir, mode):
    """One uneven micro-batch, float32: log-probs, entropies and every parameter's gradient equal none's."""
    out = {}
    for m in ("none", mode):
        model, _ = _step(tiny_model_dir, activation_checkpointing=m)
        model.train()
        mb = collate(_rows(2), 0, CPU)
        logp, ent, _ = forward_stats(model, mb)
        on = mb.response_mask > 0
        weight = torch.linspace(-1, 1, int(on.sum()))  # [N]
        ((logp[on] * weight).sum() + 0.1 * (ent[on] * weight).sum()).backward()
        out[m] = (logp.detach(), ent.detach(), {n: p.grad.clone() for n, p in model.named_parameters()})
    torch.testing.assert_close(out[mode][0], out["none"][0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out[mode][1], out["none"][1], rtol=1e-6, atol=1e-6)
    for name, g in out["none"][2].items():
        torch.testing.assert_close(out[mode][2][name], g, rtol=1e-5, atol=1e-7, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("overrides", [{}, {"lora": LoRAConfig(rank=4, alpha=8.0), "kl_coef": 0.1}],
                         ids=["plain", "lora-kl"])
@pytest.mark.parametrize("mode", ["full", "selective"])
def test_checkpointing_trains_the_same_update_as_none(tiny_model_dir, mode, overrides):
    """Two steps of two AdamW updates: the same weights as without checkpointing (with LoRA, the KL reference is
    the same layers under no_grad, where nothing is checkpointed)."""
    states, losses = [], []
    for m in ("none", mode):
        model, step = _step(tiny_model_dir, activation_checkpointing=m, **overrides)
        for v in range(2):
            stats = step.run(make_batch(4 + v, candidates=2, version=v))
            assert stats.updates == 2
            losses.append(stats.sums["loss"])
        states.append(_weights(model))
    assert losses[2:] == pytest.approx(losses[:2], rel=1e-5, abs=1e-7)
    for k in states[0]:
        torch.testing.assert_close(states[1][k], states[0][k], rtol=1e-5, atol=1e-7)


def test_full_leaves_the_embeddings_output_alone_and_trains_the_same_gradients(tiny_model_dir):
    """Full checkpointing without transformers' input-grad hook (it split a compiled no-grad forward in two: issue
    49): no hook is left on the embeddings, and the log-probs, entropies and every gradient equal those with the
    hook (non-reentrant checkpointing does not need it), bit for bit."""
    out = []
    for hook in (True, False):
        model, _ = _step(tiny_model_dir, activation_checkpointing="full")
        assert not getattr(model, "_require_grads_hooks", None)
        if hook:  # the path before issue 49: gradient_checkpointing_enable's own hook
            model.enable_input_require_grads()
        model.train()
        mb = collate(_rows(2), 0, CPU)
        logp, ent, _ = forward_stats(model, mb)
        on = mb.response_mask > 0
        weight = torch.linspace(-1, 1, int(on.sum()))  # [N]
        ((logp[on] * weight).sum() + 0.1 * (ent[on] * weight).sum()).backward()
        out.append((logp.detach(), ent.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    assert torch.equal(out[0][0], out[1][0]) and torch.equal(out[0][1], out[1][1])
    for name, g in out[0][2].items():
        assert torch.equal(out[1][2][name], g), name


def test_auto_left_unresolved_checkpoints_nothing(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    forwards = [layer.forward for layer in model.model.layers]
    assert apply_checkpointing(model, "auto") == 0 and apply_checkpointing(model, "none") == 0
    assert [layer.forward for layer in model.model.layers] == forwards
    assert not any(getattr(layer, "gradient_checkpointing", False) for layer in model.model.layers)


def test_selective_under_per_layer_compile_trains_what_eager_trains(tiny_model_dir):
    """Selective checkpointing inside the compiled layers (aot_eager: AOT autograd as inductor, no kernels): the
    same update as eager without checkpointing over steps of new lengths, no graph break, and no recompile after
    the first step."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    _, eager_step = _step(tiny_model_dir, activation_checkpointing="none")
    compiled, compiled_step = _step(tiny_model_dir, activation_checkpointing="selective", compile=True,
                                    compile_backend="aot_eager")
    graphs = []
    for v in range(3):
        batch = make_batch(10 + v, candidates=2, response_len=(1, 6 + 9 * v), version=v)
        want, got = eager_step.run(batch), compiled_step.run(batch)
        assert got.sums["loss"] == pytest.approx(want.sums["loss"], rel=1e-5, abs=1e-7)
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[0] > 0 and graphs[-1] == graphs[0], f"graphs after each step: {graphs}"
    assert not counters["graph_break"], dict(counters["graph_break"])
    eager_sd = _weights(eager_step.model)
    for k, v in _weights(compiled).items():
        torch.testing.assert_close(v, eager_sd[k], rtol=1e-5, atol=1e-7)


TWO_RANKS = textwrap.dedent("""
    import os, sys, torch
    import torch.distributed as dist
    sys.path.insert(0, os.getcwd())
    from common.config import LearnerConfig
    from learner.activation_checkpointing import MemoryBudget, agreed_budget
    from learner.setup import setup_rank
    from learner.shape import TrainShape
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from bench.batches import make_batch

    rank, port, model_dir, out = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
    dist.init_process_group("gloo", store=dist.TCPStore("127.0.0.1", int(port), is_master=False), rank=rank,
                            world_size=2)
    torch.set_num_threads(1)
    got = {}
    # rank 0 has 30 of 40 GiB free, rank 1 all 40 (GiB as 2**30 B): both budget rank 0's 30
    own = MemoryBudget(free=(30 + 10 * rank) * 2**30, total=40 * 2**30, share=1.0)
    agreed = agreed_budget(own, torch.device("cpu"))
    got["agreed"] = [agreed.free, agreed.total, agreed.share]
    for mode in ("none", "full", "selective"):
        cfg = LearnerConfig(batching=dict(micro_batch_rows=2, mini_batches=2), optim=dict(lr=1e-3),
                            levers=dict(activation_checkpointing=mode))
        built = setup_rank(cfg, model_dir, TrainShape(max_new_tokens=40, world=2), rank=rank,
                           device=torch.device("cpu"))
        stats = built.trainer.run(make_batch(4, candidates=2))
        full = get_model_state_dict(built.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        got[mode] = {"loss": stats.sums["loss"], "updates": stats.updates, "weights": full}
    if rank == 1:
        torch.save(got["agreed"], out + ".rank1")
    dist.barrier()
    if rank == 0:
        torch.save(got, out)
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)
""")


def test_two_fsdp_ranks_train_the_same_update_with_each_mode(tiny_model_dir, tmp_path):
    """2 FSDP2 ranks over gloo, each layer sharded on its own: full and selective checkpointing (the recompute
    runs inside the layer's backward, while its parameters are gathered) train the weights none trains. Auto's
    budget is the smallest of the ranks' (`agreed_budget`), so both choose alike."""
    store = rendezvous_store()  # held until the ranks are done
    port = store.port
    out = tmp_path / "rank0.pt"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-c", TWO_RANKS, str(r), str(port), str(tiny_model_dir), str(out)],
                              cwd=os.getcwd(), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(2)]
    logs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], logs
    got = torch.load(out)
    gib = 2 ** 30
    assert [got["agreed"], torch.load(str(out) + ".rank1")] == [[30 * gib, 40 * gib, 1.0]] * 2
    assert agreed_budget(MemoryBudget(free=1, total=2, share=1.0), torch.device("cpu")).free == 1  # no group: as is
    want = got["none"]
    assert want["updates"] == 2
    for mode in ("full", "selective"):
        assert got[mode]["updates"] == 2
        assert got[mode]["loss"] == pytest.approx(want["loss"], rel=1e-5, abs=1e-7)
        for k, v in want["weights"].items():
            torch.testing.assert_close(got[mode]["weights"][k], v, rtol=1e-5, atol=1e-7)


def test_a_compile_that_fails_after_auto_chose_from_compiled_bytes_warns_in_one_line():
    """The mode stays (the layers are checkpointed and sharded by then); the WARNING says what to set. Full, a set
    mode, an eager choice or a compile that passed its trial: nothing to say."""
    compiled = "activation checkpointing none (auto, compiled: 7.0 GiB left = ...)"
    failed = {"compile": "InductorError: ..."}
    line = eager_fallback_note("none", compiled, failed)
    assert line.startswith("learner.levers.compile failed its trial after activation checkpointing auto chose none")
    assert "set learner.levers.activation_checkpointing=full" in line and "\n" not in line
    assert "eager selective" in eager_fallback_note("selective", compiled.replace("none", "selective", 1), failed)
    assert eager_fallback_note("full", compiled, failed) is None
    assert eager_fallback_note("none", "activation checkpointing none (set)", failed) is None
    assert eager_fallback_note("none", "activation checkpointing none (auto: not CUDA)", failed) is None
    assert eager_fallback_note("none", compiled, {"padding_free": "..."}) is None
