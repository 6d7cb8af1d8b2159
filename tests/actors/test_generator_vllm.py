"""A vLLM generator actor on a local Ray cluster: clean start on published weights, streaming, parity."""

from __future__ import annotations

import numpy as np
import pytest
import ray
import torch
from transformers import AutoModelForCausalLM

from actors.generator import Generator, GeneratorSpec, actor_options
from common.config import GeneratorConfig, ObjectStoreSyncConfig, VllmEngineConfig
from common.interfaces import actor_name
from tests.actors.engine_checks import perturbed_state_dict, teacher_forced
from tests.actors.test_generator_ray import K, REWARD_CFG, make_buffer, wait_until
from tests.conftest import requires_vllm

pytestmark = [requires_vllm, pytest.mark.vllm]


def test_vllm_generator_streams_with_published_weights(ray_cluster, tiny_model_dir):
    from learner.weights import ObjectStorePublisher, ObjectStoreWeightSource

    run = "vllm"
    cfg = GeneratorConfig(engine=VllmEngineConfig(max_model_len=128, block_size=32, cpu_kv_cache_gb=0.0625),
                          max_new_tokens=8, questions_per_lease=8, num_cpus=1, idle_sleep_s=0.05)
    buffer = make_buffer(tiny_model_dir, run)
    ref = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    new = perturbed_state_dict(ref, seed=1, scale=0.3)
    ref.load_state_dict(new)
    publisher = ObjectStorePublisher(ObjectStoreSyncConfig(), run=run, namespace=None, timeout_s=60)
    publisher.publish(3, new)  # the publisher (learner rank 0) owns the weights: keep it alive

    gid = actor_name(run, "generator", 0)
    spec = GeneratorSpec(cfg, REWARD_CFG, str(tiny_model_dir), "arithmetic")
    gen = Generator.options(name=gid, **actor_options(cfg)).remote(gid, spec, buffer, ObjectStoreWeightSource(run))
    assert ray.get(gen.start.remote(), timeout=600)["version"] == 3.0
    batch = buffer.get_batch(3, timeout_s=300)
    assert batch is not None and len(batch.groups) == 8
    for g in batch.groups:
        assert len(g.rollouts) == K
        for r in g.rollouts:
            assert r.version == 3
            lp, _ = teacher_forced(ref, g.prompt_ids, r.response_ids)
            np.testing.assert_allclose(r.logprobs, lp, atol=1e-4)
    m = ray.get(gen.stop.remote(drain=True), timeout=120)
    assert m["tokens_per_s"] > 0 and m["weight_loads"] == 1
    acc = buffer.accounting()
    assert acc["outstanding"] == 0 and acc["lost"] == 0 and acc["balance"] == 0, acc
    ray.kill(gen, no_restart=True)
    buffer.shutdown()


def test_weights_published_mid_generation_land_in_flight(ray_cluster, tiny_model_dir):
    """Partial rollouts through the whole actor: a version published while samples are generating is loaded at the
    next engine step; a rollout that spans two versions has each token's log-prob from the version that sampled it
    (teacher-forced under both), records (oldest, newest) and is batched by its oldest version."""
    from learner.weights import ObjectStorePublisher, ObjectStoreWeightSource

    run = "partial"
    cfg = GeneratorConfig(engine=VllmEngineConfig(max_model_len=128, block_size=32, cpu_kv_cache_gb=0.0625),
                          max_new_tokens=48, questions_per_lease=4, max_in_flight=8, num_cpus=1, idle_sleep_s=0.05,
                          weight_poll_s=0.02, stop=[])
    buffer = make_buffer(tiny_model_dir, run, max_lag=1, batch_questions=4)
    ref = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    v3, v4 = perturbed_state_dict(ref, seed=3, scale=0.3), perturbed_state_dict(ref, seed=4, scale=0.3)
    publisher = ObjectStorePublisher(ObjectStoreSyncConfig(), run=run, namespace=None, timeout_s=60)
    publisher.publish(3, v3)
    buffer.set_version(3)
    gid = actor_name(run, "generator", 0)
    spec = GeneratorSpec(cfg, REWARD_CFG, str(tiny_model_dir), "arithmetic")
    gen = Generator.options(name=gid, **actor_options(cfg)).remote(gid, spec, buffer, ObjectStoreWeightSource(run))
    assert ray.get(gen.start.remote(), timeout=600)["version"] == 3.0
    wait_until(lambda: ray.get(gen.metrics.remote())["in_flight"] > 0, 120, "samples in flight")
    publisher.publish(4, v4)
    buffer.set_version(4)
    spanning = []
    for _ in range(40):
        batch = buffer.get_batch(4, timeout_s=60)
        assert batch is not None
        for g in batch.groups:
            for r in g.rollouts:
                assert r.version >= 3 and r.newest_version in (r.version, 4)
                if r.newest_version != r.version:
                    spanning.append((g.prompt_ids, r))
        if spanning and all(r.version == 4 for g in batch.groups for r in g.rollouts):
            break
    m = ray.get(gen.stop.remote(drain=True), timeout=120)
    assert spanning, "some rollouts were generating when version 4 landed"
    assert m["loads_in_flight"] >= 1 and m["rollouts_spanning"] >= len(spanning)
    for prompt, r in spanning:
        ref.load_state_dict(v3)
        err3 = np.abs(r.logprobs - teacher_forced(ref, prompt, r.response_ids)[0])
        ref.load_state_dict(v4)
        err4 = np.abs(r.logprobs - teacher_forced(ref, prompt, r.response_ids)[0])
        cut = int(np.argmax(err3 > 1e-4))  # the first token sampled under version 4
        assert 0 < cut and err3[:cut].max() < 1e-4 and err4[cut:].max() < 1e-4, (err3, err4)
    acc = buffer.accounting()
    assert acc["outstanding"] == 0 and acc["lost"] == 0 and acc["balance"] == 0, acc
    ray.kill(gen, no_restart=True)
    buffer.shutdown()
