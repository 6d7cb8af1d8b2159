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
from learner.shape import TrainShape
from learner.weights import make_weight_source
from bench.batches import make_batch

NS = "exgrpo-test"
RANK, ALPHA = 3, 6.0


@pytest.mark.parametrize("sync", [ObjectStoreSyncConfig(bucket_mb=0.01),
                                  CollectiveSyncConfig(timeout_s=20, bucket_mb=0.01)],
                         ids=["object_store", "collective"])
def test_two_ranks_publish_adapters_only_and_a_generator_merges_them(ray_cluster, tiny_model_dir, sync):
    cfg = LearnerConfig(num_ranks=2, publish_timeout_s=30, weight_sync=sync, lora=LoRAConfig(rank=RANK, alpha=ALPHA),
                        batching=dict(micro_batch_rows=4), optim=dict(lr=1e-2))
    run = f"lorapub-{sync.kind}"
    pool = LearnerPool(cfg, str(tiny_model_dir), TrainShape(max_new_tokens=12), run=run, namespace=NS)
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


def test_publish_merged_still_carries_the_whole_merged_model(ray_cluster, tiny_model_dir, caplog):
    """`learner.lora.publish: merged`: the announcement says nothing of adapters and the payload is the merged state
    under the base names; `adapters` (the default) with `weight_sync.delta` is refused where the config is made."""
    import logging

    from learner.gather import Staging, gather_full_state
    from learner.pool import LearnerRank
    from learner.setup import setup_rank

    threads = torch.get_num_threads()
    anns = {}
    try:
        for publish in ("merged", "adapters"):
            cfg = LearnerConfig(publish_timeout_s=30, weight_sync=ObjectStoreSyncConfig(delta=publish == "merged"),
                                lora=LoRAConfig(rank=RANK, alpha=ALPHA, publish=publish),
                                batching=dict(micro_batch_rows=4), optim=dict(lr=1e-2))
            r = LearnerRank(cfg, str(tiny_model_dir), TrainShape(max_new_tokens=12), rank=0, run=f"lorapub-{publish}",
                            namespace=NS)
            built = setup_rank(cfg, str(tiny_model_dir), TrainShape(max_new_tokens=12), rank=0,
                               device=torch.device("cpu"))
            r.model, r.optimizer, r.trainer, r.model_config, r.staging = (built.model, built.optimizer,
                                                                          built.trainer, built.model.config, Staging())
            r.trainer.run(make_batch(0, groups=2, candidates=1))
            with caplog.at_level(logging.INFO, logger="learner.pool"):
                anns[publish] = r.publish(1).announcement
            source = make_weight_source(cfg.weight_sync, run=f"lorapub-{publish}", namespace=NS, timeout_s=20)
            got, merged = source.fetch(anns[publish]), gather_full_state(r.model, 0, 1)
            if publish == "merged":
                assert list(got) == list(merged)  # the base names, targets merged, no adapter tensor
                assert all(torch.equal(got[k], merged[k]) for k in got)
    finally:
        torch.set_num_threads(threads)
    assert anns["merged"].adapters is None and anns["adapters"].adapters is not None
    assert anns["adapters"].num_bytes < 0.15 * anns["merged"].num_bytes
    with pytest.raises(ValueError, match="learner.lora.publish=adapters sends the adapters whole"):
        LearnerConfig(weight_sync=ObjectStoreSyncConfig(delta=True), lora=LoRAConfig(rank=RANK, alpha=ALPHA))
