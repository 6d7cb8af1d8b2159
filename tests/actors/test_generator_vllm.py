"""A vLLM generator actor on a local Ray cluster: clean start on published weights, streaming, parity."""

from __future__ import annotations

import numpy as np
import pytest
import ray
import torch
from transformers import AutoModelForCausalLM

from actors.generator import Generator, actor_options
from common.config import GeneratorConfig, ObjectStoreSyncConfig, VllmEngineConfig
from common.interfaces import actor_name
from tests.actors.engine_checks import perturbed_state_dict, teacher_forced
from tests.actors.test_generator_ray import K, REWARD_CFG, make_buffer
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
    gen = Generator.options(name=gid, **actor_options(cfg)).remote(
        gid, cfg, REWARD_CFG, str(tiny_model_dir), buffer, ObjectStoreWeightSource(run), "arithmetic")
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
