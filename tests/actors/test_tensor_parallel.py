"""Tensor-parallel generators, placed: each reserves a placement group of `tensor_parallel_size` one-GPU bundles
on one node, waits (pending, reported) while the cluster cannot hold it, and gives it back when removed.

GPUs are declared as Ray resources on this CPU machine, and the engine is the synthetic one: vLLM's own tensor
parallelism inside the group (`distributed_executor_backend="ray"`) needs real GPUs and has not run yet."""

from __future__ import annotations

import shutil
import tempfile

import pytest
import ray
import torch
from ray.util.placement_group import placement_group_table

from actors.generator import GeneratorSpec
from actors.pool import GeneratorPool
from common.config import GeneratorConfig, ObjectStoreSyncConfig, RewardConfig, SyntheticEngineConfig
from tests.actors.test_generator_ray import make_buffer, wait_until
from tests.conftest import ray_auth_of_this_process


@pytest.fixture(scope="module")
def gpu_cluster():
    """A private local Ray cluster that declares 3 GPUs (none exists: placement only)."""
    tmp = tempfile.mkdtemp(prefix="exgrpo-ray-", dir="/tmp")
    with ray_auth_of_this_process():
        ray.init(address="local", num_cpus=4, num_gpus=3, _temp_dir=tmp, include_dashboard=False,
                 namespace="exgrpo-test", log_to_driver=False,
                 runtime_env={"env_vars": {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}})
    try:
        yield ray
    finally:
        ray.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)


def _groups() -> dict[str, dict]:
    return {v["name"]: v for v in placement_group_table().values() if v["name"].endswith("-tp")}


def test_each_generator_holds_its_gpus_in_one_placement_group(gpu_cluster, tiny_model_dir):
    from learner.weights import ObjectStorePublisher, ObjectStoreWeightSource

    run = "tp"
    buffer = make_buffer(tiny_model_dir, run)
    cfg = GeneratorConfig(engine=SyntheticEngineConfig(tokens_per_s=400, length_median=8), max_new_tokens=16,
                          num_cpus=0.5, num_gpus=1, tensor_parallel_size=2, questions_per_lease=2, idle_sleep_s=0.05,
                          stop_timeout_s=60)
    ObjectStorePublisher(ObjectStoreSyncConfig(), run=run, namespace=None, timeout_s=30).publish(0, {"w": torch.zeros(2)})
    spec = GeneratorSpec(cfg, RewardConfig(name="synthetic"), str(tiny_model_dir), "arithmetic")
    pool = GeneratorPool(spec, buffer, ObjectStoreWeightSource(run), run=run)
    try:
        pool.scale_to(1)  # 2 of the 3 GPUs, on one node
        (name, pg), = _groups().items()
        assert pg["state"] == "CREATED" and pg["strategy"] == "STRICT_PACK"
        assert sorted(b.get("GPU", 0) for b in pg["bundles"].values()) == [1.0, 1.0]
        gen = pool.actors[0]
        assert ray.get(gen.__ray_call__.remote(lambda self: ray.get_runtime_context().get_placement_group_id())) \
            == pg["placement_group_id"]
        assert buffer.get_batch(0, timeout_s=60) is not None  # it generates
        pool.scale_to(2, wait=False)  # a second one needs 2 more GPUs; 1 is free: pending, and said so
        wait_until(lambda: (pool.poll(), pool.status()["pending"])[1], 60, "the second generator pending")
        assert "each needs 0.5 CPU; 2 GPU" in pool.describe() and "1 GPU free" in pool.describe()
        pool.scale_to(1)  # removed while pending: its placement group is given back
        assert [g["state"] for g in _groups().values()].count("CREATED") == 1
        assert ray.available_resources().get("GPU", 0) == 1.0
    finally:
        pool.shutdown()
        buffer.shutdown()
    assert all(g["state"] == "REMOVED" for g in _groups().values())
    wait_until(lambda: ray.available_resources().get("GPU", 0) == 3.0, 30, "every GPU given back")
