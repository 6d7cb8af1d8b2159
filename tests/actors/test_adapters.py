"""Adapter-only publications on the generator side (`actors.adapters`): the merger turns the learner's adapters into
a partial state, and each engine, given it, holds what it holds after loading the learner's merged publication; the
real generator actor tags every rollout with the adapter version that sampled it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from actors.adapters import AdapterMerger
from actors.engines import make_engine
from common.config import GeneratorConfig, LoRAConfig, TransformersEngineConfig, VllmEngineConfig
from common.messages import AdapterPublication
from common.modeling import TinyQwen2, build_char_tokenizer, save_model_folder
from learner.gather import gather_full_state, iter_flat_buckets
from learner.lora import apply_lora, init_adapters, lora_modules
from tests.actors.engine_checks import prompt_ids, teacher_forced
from tests.conftest import requires_vllm

RANK, ALPHA = 4, 8.0


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    """A tied tiny Qwen2 folder (biased q/k/v, fused by vLLM into qkv_proj) and a LoRA model of it."""
    tok = build_char_tokenizer()
    model = TinyQwen2(vocab_size=len(tok), hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, seed=5,
                      max_positions=256, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id).build()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("bias"):
                p.normal_(0, 0.5)  # zero at init: a bias the partial load dropped would go unnoticed
    return save_model_folder(model, tok, tmp_path_factory.mktemp("qwen") / "model")


def lora_version(folder, seed: int, targets: tuple[str, ...] | None = None):
    """(the LoRA model with trained-looking adapters, its merged publication, its adapter publication, the spec)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    apply_lora(model, LoRAConfig(rank=RANK, alpha=ALPHA, **({"target_modules": list(targets)} if targets else {})))
    init_adapters(model, seed, 0, 1)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("lora_B"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    merged = gather_full_state(model, 0, 1)
    adapters = [{k: v.clone() for k, v in b.items()}  # small buckets: the adapters arrive in several
                for b in iter_flat_buckets(model, 0, 1, bucket_bytes=1 << 12, adapters=True)]
    spec = AdapterPublication(scaling=ALPHA / RANK, targets=list(lora_modules(model)))
    return model, merged, adapters, spec


def test_the_adapter_publication_is_the_adapters_and_the_merge_is_the_merged_publication(qwen):
    model, merged, adapters, spec = lora_version(qwen, seed=1)
    assert len(adapters) > 1
    names = [k for b in adapters for k in b]
    assert names == [k for k in model.state_dict() if k.endswith(("lora_A", "lora_B"))]
    assert sum(v.nbytes for b in adapters for v in b.values()) == \
        sum(RANK * (m.in_features + m.out_features) * 4 for m in lora_modules(model).values())
    merger = AdapterMerger(qwen, bucket_bytes=1 << 14)
    partial = list(merger.merge(iter(adapters), spec))
    assert len(partial) > 1  # handed over in buckets
    got = {k: v for b in partial for k, v in b.items()}
    # whole attention and MLP blocks: every target's weight, merged, and the q/k/v biases beside them
    assert set(got) == {k for k in merged if ".self_attn." in k or ".mlp." in k}
    assert all(torch.allclose(got[k], merged[k], atol=1e-6) for k in got)
    with pytest.raises(ValueError, match=r"not match its targets: missing \['model.layers.0.self_attn.k_proj.lora_A"):
        list(merger.merge(iter(adapters[1:]), spec))


def test_transformers_engine_partial_load_equals_the_merged_load(qwen):
    cfg = GeneratorConfig(engine=TransformersEngineConfig(batch_rows=8), max_new_tokens=8)
    full, part = make_engine(cfg, str(qwen)), make_engine(cfg, str(qwen))
    merger = AdapterMerger(qwen)
    for version, seed in ((1, 1), (2, 2)):  # two swaps: each merged into the base, not into the previous version
        _, merged, adapters, spec = lora_version(qwen, seed)
        full.load_weights(merged, version)
        part.load_weights(merger.merge(iter(adapters), spec), version, partial=True)
        assert part.version == version
        a, b = full.model.state_dict(), part.model.state_dict()
        assert all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)
    with pytest.raises(ValueError, match="missing"):  # a whole load still wants every weight
        part.load_weights({k: v for k, v in merged.items() if "mlp" not in k}, 3)


@requires_vllm
@pytest.mark.vllm
def test_vllm_engine_partial_load_equals_the_merged_load(qwen, capfd):
    """vLLM fuses q/k/v (with biases) into qkv_proj and gate/up into gate_up_proj; a partial state of whole blocks
    loads them all, the embedding, norms and head stay the folder's, and a second adapter replaces the first. With
    q and v alone as targets k still comes (from the base): vLLM rebuilds a fused layer from what it is given, so a
    partial state of the targets' weights alone loses k (measured: 0.2 nats off)."""
    engine = make_engine(GeneratorConfig(engine=VllmEngineConfig(max_model_len=256, block_size=32,
                                                                 cpu_kv_cache_gb=0.0625), max_new_tokens=8), str(qwen))
    tok = build_char_tokenizer()
    prompts = [prompt_ids(tok, "12+34="), prompt_ids(tok, "what is 5*5? ")]

    def sample():
        return [s for o in engine.generate(prompts, [3, 3], seed=7) for s in o]

    merger = AdapterMerger(qwen)
    base_state = lora_version(qwen, 0, ("q_proj",))[1]  # B = 0: the base
    try:
        base = sample()
        for version, seed, targets in ((1, 1, None), (3, 2, None), (5, 3, ("q_proj", "v_proj"))):
            model, merged, adapters, spec = lora_version(qwen, seed, targets)
            engine.load_weights(base_state, version - 1)  # the base where a run's targets differ: here, the last one
            capfd.readouterr()
            engine.load_weights(merger.merge(iter(adapters), spec), version, partial=True)
            assert engine.version == version
            said = capfd.readouterr()
            assert "Failed to load weights" not in said.out + said.err  # vLLM's per-layer warnings: silenced
            got = sample()
            engine.load_weights(merged, version + 1)
            want = sample()
            assert [s.token_ids.tolist() for s in got] == [s.token_ids.tolist() for s in want]
            assert max(np.abs(g.logprobs - w.logprobs).max() for g, w in zip(got, want)) < 1e-5
            errs = [np.abs(s.logprobs - teacher_forced(model, p, s.token_ids)[0]).max()
                    for p, s in zip([prompts[0]] * 3 + [prompts[1]] * 3, got)]
            assert max(errs) < 2e-3, errs
        assert [s.token_ids.tolist() for s in base] != [s.token_ids.tolist() for s in got]
        assert merger.blocks.keys() == {f"model.layers.{i}.{b}" for i in (0, 1) for b in ("self_attn", "mlp")}
    finally:
        del engine.llm


def test_a_generator_on_ray_tags_rollouts_with_the_adapter_version_that_sampled_them(ray_cluster, tiny_model_dir):
    """The real generator actor (transformers engine) fed adapter-only publications through the object store: it
    merges each into the folder's base, and every rollout's version and log-probs are those of the adapter that
    sampled it, across a swap."""
    import ray
    from transformers import AutoModelForCausalLM

    from actors.generator import Generator, GeneratorSpec, actor_options
    from common.config import ObjectStoreSyncConfig
    from common.interfaces import actor_name
    from learner.weights import ObjectStorePublisher, ObjectStoreWeightSource
    from tests.actors.engine_checks import check_rollout_logprobs
    from tests.actors.test_generator_ray import GEN_CFG, REWARD_CFG, make_buffer, wait_until

    run = "loraswap"
    buffer = make_buffer(tiny_model_dir, run)
    publisher = ObjectStorePublisher(ObjectStoreSyncConfig(), run=run, namespace=None, timeout_s=30)
    models = {}

    def publish(version: int) -> None:
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
        apply_lora(model, LoRAConfig(rank=RANK, alpha=ALPHA))
        init_adapters(model, version, 0, 1)
        g = torch.Generator().manual_seed(version)
        with torch.no_grad():
            for n, p in model.named_parameters():
                if n.endswith("lora_B"):
                    p.copy_(torch.randn(p.shape, generator=g) * 0.1)
        models[version] = model
        spec = AdapterPublication(scaling=ALPHA / RANK, targets=list(lora_modules(model)))
        ann = publisher.publish(version, iter_flat_buckets(model, 0, 1, bucket_bytes=1 << 14, adapters=True),
                                adapters=spec)
        assert ann.adapters == spec and ann.num_bytes == sum(RANK * (m.in_features + m.out_features) * 4
                                                             for m in lora_modules(model).values())

    publish(1)
    gid = actor_name(run, "generator", 0)
    spec = GeneratorSpec(GEN_CFG, REWARD_CFG, str(tiny_model_dir), "arithmetic")
    gen = Generator.options(name=gid, **actor_options(GEN_CFG)).remote(gid, spec, buffer, ObjectStoreWeightSource(run))
    try:
        assert ray.get(gen.start.remote(), timeout=300)["version"] == 1.0
        batch = buffer.get_batch(1, timeout_s=120)
        assert batch is not None and {r.version for g in batch.groups for r in g.rollouts} == {1}
        for g in batch.groups[:2]:
            for r in g.rollouts:
                check_rollout_logprobs(models, g.prompt_ids, r)
        buffer.set_version(2)
        publish(2)

        def version2_batch():
            b = buffer.get_batch(2, timeout_s=30)
            return b if b is not None and any(r.newest_version == 2 for g in b.groups for r in g.rollouts) else None

        batch = wait_until(version2_batch, 120, "rollouts sampled by adapter version 2")
        checked = 0
        for g in batch.groups:
            for r in g.rollouts:
                check_rollout_logprobs(models, g.prompt_ids, r)
                checked += r.newest_version == 2
        assert checked > 0
        assert ray.get(gen.metrics.remote())["weight_loads"] >= 2
        ray.get(gen.stop.remote(drain=True), timeout=120)
    finally:
        ray.kill(gen, no_restart=True)
        buffer.shutdown()
