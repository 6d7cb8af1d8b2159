"""Adapter-only publications (`learner.lora.publish: adapters`, issue 38) from 2 FSDP2 ranks on a real local Ray
cluster, through both weight-sync backends: only the adapters travel, the announcement says how to merge them, and a
generator's merge + partial engine load holds the weights the merged publication carries."""

from __future__ import annotations

import pytest
import torch

from actors.adapters import AdapterMerger
from actors.engines import make_engine
from common.config import CollectiveSyncConfig, GeneratorConfig, LearnerConfig, LoRAConfig, ObjectStoreSyncConfig, \
    TransformersEngineConfig
from learner.pool import LearnerPool
from learner.weights import make_weight_source
from tests.learner.batches import make_batch

NS = "exgrpo-test"
RANK, ALPHA = 3, 6.0


@pytest.mark.parametrize("sync", [ObjectStoreSyncConfig(delta=True, bucket_mb=0.01),  # delta: ignored for adapters
                                  CollectiveSyncConfig(timeout_s=20, bucket_mb=0.01)],
                         ids=["object_store", "collective"])
def test_two_ranks_publish_adapters_only_and_a_generator_merges_them(ray_cluster, tiny_model_dir, sync):
    cfg = LearnerConfig(num_ranks=2, micro_batch_rows=4, lr=1e-2, publish_timeout_s=30, weight_sync=sync,
                        lora=LoRAConfig(rank=RANK, alpha=ALPHA))
    run = f"lorapub-{sync.kind}"
    pool = LearnerPool(cfg, str(tiny_model_dir), run=run, namespace=NS, max_new_tokens=12)
    source = make_weight_source(sync, run=run, namespace=NS, timeout_s=20)
    engine = make_engine(GeneratorConfig(engine=TransformersEngineConfig(batch_rows=4)), str(tiny_model_dir))
    merger = AdapterMerger(tiny_model_dir)
    try:
        for _ in range(2):  # two versions: the second merged into the base again, not into the first
            pool.step(make_batch(pool.version, groups=2, candidates=1))
            ann = pool.publish()
            merged = pool.state_dict()  # the merged publication's state (float32, HF names)
            assert ann.adapters is not None and ann.adapters.scaling == ALPHA / RANK and ann.delta_bytes == 0
            assert len(ann.adapters.targets) == 7 * 2 and ann.adapters.targets[0] == "model.layers.0.self_attn.q_proj"
            got = source.fetch(ann)
            assert set(got) == {f"{t}.{p}" for t in ann.adapters.targets for p in ("lora_A", "lora_B")}
            assert got["model.layers.0.self_attn.q_proj.lora_A"].shape == (RANK, 64)  # gathered whole: 2 + 1 rows
            assert ann.num_bytes == sum(t.nbytes for t in got.values()) == \
                sum(RANK * (w.shape[0] + w.shape[1]) * 4 for t in ann.adapters.targets for w in [merged[f"{t}.weight"]])
            assert ann.num_bytes < 0.15 * sum(t.nbytes for t in merged.values())
            engine.load_weights(merger.merge(source.fetch_buckets(ann), ann.adapters), ann.version, partial=True)
            held = engine.model.state_dict()
            assert engine.version == ann.version
            assert all(torch.allclose(held[k], merged[k], atol=1e-6) for k in merged), "merge != merged publication"
            assert all(got[f"{t}.lora_B"].abs().max() > 0 for t in ann.adapters.targets)  # trained: B moved off 0
    finally:
        pool.shutdown()
