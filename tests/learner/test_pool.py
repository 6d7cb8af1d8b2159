"""The learner pool on a real local Ray cluster: FSDP2 1-vs-2-rank equivalence, weight publication
through the weight-store actor, acknowledgement timeouts, checkpoint save/load/resume."""

from __future__ import annotations

import json
import re
import shutil

import numpy as np
import pytest
import ray
import torch

from common.config import LearnerConfig, ObjectStoreSyncConfig
from tests.learner import sectioned
from tests.learner.test_checkpoint_format import plant_entry, plant_file
from common.modeling import make_tiny_model_folder
from learner.checkpoint import CheckpointError
from learner.pool import LearnerPool
from learner.shape import TrainShape
from learner.weights import ObjectStoreWeightSource, WeightSyncTimeout
from bench.batches import make_batch, with_own_logprobs

NS = "exgrpo-test"
LR = 1e-3


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model_folder(tmp_path_factory.mktemp("learner-model") / "model", hidden_size=64, num_heads=2)


def make_pool(model_dir, run: str, ranks: int, dtype: str = "float32", publish_dtype: str = "float32",
              **overrides) -> LearnerPool:
    cfg = LearnerConfig(**sectioned({"num_ranks": ranks, "micro_batch_rows": 3, "mini_batches": 2, "lr": LR,
                                    "publish_timeout_s": 30, **overrides}))
    return LearnerPool(cfg, str(model_dir), TrainShape(max_new_tokens=12, dtype=dtype, publish_dtype=publish_dtype),
                       run=run, namespace=NS)


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def test_one_and_two_ranks_agree(ray_cluster, model_dir):
    """One rank, two ranks, and two ranks packing their micro-batches without padding (each rank's forward is
    one sequence; the start-up check that packed rows stay apart runs as an FSDP collective) train the same."""
    batch = make_batch(0)
    results, states = {}, {}
    for n, extra in ((1, {}), (2, {}), ("2-packed", {"padding_free": True, "micro_batch_tokens": 64})):
        pool = make_pool(model_dir, f"eq{n}", 2 if n == "2-packed" else n, **extra)
        try:
            initial = pool.state_dict()
            results[n] = pool.step(batch)
            states[n] = pool.state_dict()
        finally:
            pool.shutdown()
    assert results["2-packed"].metrics["learner/padding_free"] == 1.0 and results[2].metrics["learner/padding_free"] == 0
    # what a packed rank computes beyond its rows is only an all-masked 2-token dummy when it has run out
    assert results["2-packed"].metrics["learner/padding_frac"] < 0.05 < results[2].metrics["learner/padding_frac"]
    assert max_diff(states[1], states["2-packed"]) < 0.05 * LR
    for key in ("learner/loss", "learner/entropy_fresh", "learner/grad_norm", "learner/tokens"):
        assert results["2-packed"].metrics[key] == pytest.approx(results[1].metrics[key], rel=1e-4, abs=1e-6), key
    assert results["2-packed"].feedback.chosen == results[1].feedback.chosen
    # one learner step -> version 1 (two mini-batches, both applied), and the parameters really moved
    assert results[1].version == results[2].version == 1
    assert results[1].metrics["learner/updates"] == 2
    assert max_diff(initial, states[1]) > LR
    # Adam divides by sqrt(v): gradients that differ only by float32 summation order can move a
    # near-zero-gradient coordinate by a few percent of lr; everything else agrees far more tightly.
    assert max_diff(states[1], states[2]) < 0.05 * LR
    m1, m2 = results[1].metrics, results[2].metrics
    for key in ("learner/loss", "learner/clip_frac", "learner/entropy_fresh", "learner/entropy_replayed",
                "learner/replay_weight_mean", "learner/grad_norm", "learner/tokens", "learner/rows"):
        assert m1[key] == pytest.approx(m2[key], rel=1e-4, abs=1e-6), key
    chosen = set(results[1].feedback.chosen)  # fresh rollouts + the o* of each mixed group
    assert m1["learner/tokens"] == sum(len(r.response_ids) for g in batch.groups
                                       for r in g.rollouts + [c for c in g.candidates if c.key in chosen])
    assert m1["learner/replay_tokens"] > 0 and m1["learner/fresh_tokens"] > 0
    # feedback: every candidate of the 2 mixed groups and every trained fresh row with a key (stored by the
    # buffer) once, same entropies and choice whatever the sharding
    def measured(fb):
        return dict(zip(fb.keys + fb.fresh_keys, fb.entropies.tolist() + fb.fresh_entropies.tolist()))

    f1, f2 = measured(results[1].feedback), measured(results[2].feedback)
    cands = {c.key for g in batch.groups for c in g.candidates}
    fresh = {r.key for g in batch.groups for r in g.rollouts}
    assert len(cands) == 6 and len(results[2].feedback.keys) + len(results[2].feedback.fresh_keys) == len(f2) \
        == len(cands | fresh)
    assert f1.keys() == f2.keys() == cands | fresh
    assert set(results[1].feedback.keys) == set(results[2].feedback.keys) == cands  # candidates apart from fresh rows
    assert all(f1[k] == pytest.approx(f2[k], abs=1e-4) for k in f1)
    assert results[1].feedback.chosen == results[2].feedback.chosen and len(results[1].feedback.chosen) == 2
    assert results[1].feedback.version == 0  # the entropies were measured under version 0


def test_ranks_not_set_up_in_time_are_named_and_stopped(ray_cluster, model_dir):
    """The start is bounded: past learner.start_timeout_s the error names the ranks, and they are killed."""
    import time

    with pytest.raises(RuntimeError, match=r"learner rank\(s\) \[0, 1\] were not set up within "
                                           r"learner.start_timeout_s=0s"):
        make_pool(model_dir, "slowstart", 2, start_timeout_s=0.001)
    deadline = time.monotonic() + 300  # ray.kill is asynchronous; a fast machine leaves the loop at once
    while time.monotonic() < deadline and any(a["name"].startswith("slowstart/learner")
                                              for a in ray.util.list_named_actors(all_namespaces=True)):
        time.sleep(0.2)
    assert not [a for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith("slowstart/learner")]


def test_two_ranks_with_fewer_rows_than_ranks_and_all_updates_skipped(ray_cluster, model_dir):
    """A rank whose micro-batch is empty still joins every collective; a step whose updates are all
    skipped still ends the step (version + 1), so a synchronous run never stalls on it."""
    cfg = LearnerConfig(num_ranks=2, publish_timeout_s=30, batching=dict(micro_batch_rows=8, mini_batches=1),
                        optim=dict(lr=LR))
    pool = LearnerPool(cfg, str(model_dir), TrainShape(max_new_tokens=12), run="fewrows", namespace=NS)
    try:
        # 17 rows, 8-row micro-batches: rank 0 gets 8 + 1 rows, rank 1 gets 8 + an empty dummy
        r = pool.step(make_batch(4, groups=1, group_size=17, mixed_every=0))
        assert r.version == 1 and r.metrics["learner/rows"] == 17 and r.metrics["learner/updates"] == 1
        one = pool.step(make_batch(5, groups=1, group_size=2, mixed_every=0, response_len=(1, 1)))
        assert one.version == 2 and one.metrics["learner/rows"] == 2
        # a mixed group with one fresh rollout and 3 candidates: 3 candidates to score on 2 ranks
        mixed = pool.step(make_batch(6, groups=1, group_size=2, mixed_every=1, candidates=3))
        assert mixed.version == 3 and len(mixed.feedback.keys) == 3 and len(mixed.feedback.fresh_keys) == 1
        assert len(mixed.feedback.chosen) == 1
        before = pool.state_dict()

        def both(self):  # each rank: the bucketed gather, then torch's per-parameter full state dict
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

            return self.full_state_dict(), get_model_state_dict(
                self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

        (ours, ref), (ours1, _) = ray.get([rk.__ray_call__.remote(both) for rk in pool.ranks])
        assert ours.keys() == ref.keys() and ours1 == {}
        assert all(torch.equal(ours[k], ref[k]) and ours[k].dtype == ref[k].dtype for k in ref)
        ray.get([rk.__ray_call__.remote(lambda self: setattr(self.trainer.cfg.optim, "skip_grad_norm", 1e-12))
                 for rk in pool.ranks])
        skipped = pool.step(make_batch(7))
        assert skipped.version == 4 and skipped.metrics["learner/updates"] == 0
        assert skipped.metrics["learner/skipped_updates"] == 1
        assert max_diff(before, pool.state_dict()) == 0.0
    finally:
        pool.shutdown()


def test_publish_fetch_ack_and_timeout(ray_cluster, model_dir):
    pool = make_pool(model_dir, "pub", 2)
    source = ObjectStoreWeightSource("pub", NS)
    try:
        assert source.latest() is None
        pool.step(make_batch(1))
        pending = pool.publish_async()  # returns at once; the gather runs on the ranks
        ann = pending.result()
        assert ann.version == pool.version == 1 and ann.location == "object_store" and ann.num_bytes > 0
        assert pool.publish_async() is pending  # same version: not gathered twice

        @ray.remote(num_cpus=0)
        def generator(src: ObjectStoreWeightSource, model_path: str, gid: str):
            """What a generator does: newest announcement -> fetch -> load into transformers -> ack."""
            from transformers import AutoModelForCausalLM

            a = src.latest()
            model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
            model.load_state_dict(src.fetch(a), strict=True)
            src.ack(gid, a.version)
            return a.version, {k: v.clone() for k, v in model.state_dict().items()}

        source.register("gen-a")
        source.register("gen-b")
        version, loaded = ray.get(generator.remote(source, str(model_dir), "gen-a"))
        assert version == 1
        assert max_diff(loaded, pool.state_dict()) == 0.0
        # gen-b never acknowledges: the wait fails loudly, naming the version and gen-b (not gen-a)
        with pytest.raises(WeightSyncTimeout, match=r"version 1 .*\['gen-b'\]"):
            pool.wait_for_acks(timeout_s=1.0)
        source.unregister("gen-b")  # a removed generator is no longer waited for
        pool.wait_for_acks(timeout_s=5.0)

        # a late generator gets the newest version; an old version is dropped after keep_versions
        pool.step(make_batch(2))
        pool.publish()
        pool.step(make_batch(3))
        newest = pool.publish()
        late = ObjectStoreWeightSource("pub", NS)
        assert late.latest().version == newest.version == 3
        with pytest.raises(KeyError, match="version 1 is no longer"):
            late.fetch(ann)
    finally:
        pool.shutdown()


@pytest.mark.parametrize("ranks", [1, 2])
def test_checkpoint_resume_equals_uninterrupted(ray_cluster, model_dir, tmp_path, ranks):
    b0, b1 = make_batch(10), make_batch(11)
    ckpt = tmp_path / "ckpt"
    pool = make_pool(model_dir, f"ck{ranks}", ranks)
    try:
        pool.step(b0)
        assert pool.save_checkpoint(ckpt) == ckpt
        r_uninterrupted = pool.step(b1)
        uninterrupted = pool.state_dict()
    finally:
        pool.shutdown()
    assert sorted(p.name for p in ckpt.iterdir()) == ["meta.json", "model", "optimizer", "rng"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp folder left behind

    resumed = make_pool(model_dir, f"ck{ranks}r", ranks)
    try:
        resumed.load_checkpoint(ckpt)
        assert resumed.version == 1 and resumed.steps == 1
        r_resumed = resumed.step(b1)
        assert max_diff(resumed.state_dict(), uninterrupted) < 1e-6
        assert r_resumed.metrics["learner/loss"] == pytest.approx(r_uninterrupted.metrics["learner/loss"], abs=1e-7)
        assert r_resumed.version == r_uninterrupted.version == 2
    finally:
        resumed.shutdown()

    # the model folder is a normal Hugging Face folder
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf = AutoModelForCausalLM.from_pretrained(ckpt / "model", dtype=torch.float32)
    assert AutoTokenizer.from_pretrained(ckpt / "model").eos_token == "</s>"
    assert any(not torch.equal(v, torch.zeros_like(v)) for v in hf.state_dict().values())


def test_bad_checkpoints_fail_clearly(ray_cluster, model_dir, tmp_path):
    pool = make_pool(model_dir, "bad", 1)
    try:
        with pytest.raises(CheckpointError, match="does not exist"):
            pool.load_checkpoint(tmp_path / "nowhere")
        good = pool.save_checkpoint(tmp_path / "good")
        partial = tmp_path / "partial"
        shutil.copytree(good, partial)
        (partial / "meta.json").unlink()
        with pytest.raises(CheckpointError, match="meta.json is missing"):
            pool.load_checkpoint(partial)
        corrupt = tmp_path / "corrupt"
        shutil.copytree(good, corrupt)
        weights = corrupt / "model" / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[:1000])
        with pytest.raises(CheckpointError, match="unreadable"):
            pool.load_checkpoint(corrupt)
        # a payload planted in any file a resume reads is refused naming it, and never runs
        marker = tmp_path / "MARKER"
        for n, (name, plant) in enumerate(PLANTS.items()):
            planted = tmp_path / f"planted{n}"
            shutil.copytree(good, planted)
            file = plant(planted, marker)
            if name == "model/config.json":  # not read on resume (the ranks build the run's model)
                pool.load_checkpoint(planted)
            else:
                with pytest.raises(CheckpointError, match=re.escape(str(file)) + r".*(refused|corrupt|unreadable)"):
                    pool.load_checkpoint(planted)
            assert not marker.exists(), name
        pool.load_checkpoint(good)  # the ranks refused together, before any collective: still in step
        pool.save_checkpoint(tmp_path / "good")  # overwriting a checkpoint replaces it whole
        assert pool.version == 0 and (tmp_path / "good" / "meta.json").is_file()
    finally:
        pool.shutdown()


def _plant_whole(rel: str):
    def plant(ckpt, marker):
        plant_file(ckpt / rel, marker)
        return ckpt / rel
    return plant


PLANTS = {**{rel: _plant_whole(rel) for rel in ("optimizer/.metadata", "meta.json", "rng/rank0.json",
                                                "model/model.safetensors", "model/config.json")},
          "optimizer plain entry": lambda ckpt, marker: plant_entry(ckpt / "optimizer", marker, tensor=False),
          "optimizer tensor entry": lambda ckpt, marker: plant_entry(ckpt / "optimizer", marker, tensor=True)}
"""Every file of a learner checkpoint a resume reads, each with a payload planted (`plant_file`, `plant_entry`):
name -> plant(ckpt, marker) returning the planted file."""


def test_bfloat16_two_ranks_train_and_resume_exactly(ray_cluster, model_dir, tmp_path):
    """model.dtype=bfloat16 on CPU over gloo: FSDP2 computes in bfloat16 on float32 master weights; the
    train/inference gap to float32 behaviour log-probs is measured; publications carry the engines' bfloat16
    (the master weights rounded once, half the bytes); the checkpoint's model folder is bfloat16 and resuming
    restores the float32 master weights bit for bit."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from learner import checkpoint as ck

    fp32 = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    b0, b1 = with_own_logprobs(make_batch(20), fp32), make_batch(21, version=1)
    ckpt = tmp_path / "ckpt"
    pool = make_pool(model_dir, "bf16", 2, dtype="bfloat16", publish_dtype="bfloat16")
    source = ObjectStoreWeightSource("bf16", NS)
    try:
        initial = pool.state_dict()
        r0 = pool.step(b0)
        m = r0.metrics
        assert r0.version == 1 and m["learner/updates"] == 2 and np.isfinite(m["learner/loss"])
        # behaviour = a float32 forward of the same weights: the gap is bfloat16 rounding, small but not 0
        assert 1e-4 < m["learner/logprob_diff_mean"] < 0.05 and m["learner/logprob_ratio_std_lag0"] > 1e-4
        saved = pool.state_dict()
        assert {v.dtype for v in saved.values()} == {torch.float32}  # master weights
        # updates of lr 1e-3 are far below bfloat16's resolution of weights ~0.02-1: float32 masters keep them
        assert max_diff(initial, saved) > LR / 2
        ann = pool.publish()
        published = source.fetch(ann)
        assert {v.dtype for v in published.values()} == {torch.bfloat16}
        assert all(torch.equal(published[k], saved[k].to(torch.bfloat16)) for k in saved)
        assert ann.num_bytes < sum(v.numel() * 4 for v in saved.values()) * 0.6
        pool.save_checkpoint(ckpt)
        uninterrupted = pool.step(b1)
        after = pool.state_dict()
    finally:
        pool.shutdown()
    assert ck.has_master_weights(ckpt)
    assert json.loads((ckpt / "model" / "config.json").read_text())["dtype"] == "bfloat16"
    with safe_open(str(ckpt / "model" / "model.safetensors"), "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}

    resumed = make_pool(model_dir, "bf16r", 2, dtype="bfloat16")
    try:
        planted, marker = tmp_path / "planted", tmp_path / "MARKER"  # masters on 2 ranks: both refuse, neither hangs
        shutil.copytree(ckpt, planted)
        file = PLANTS["optimizer tensor entry"](planted, marker)
        with pytest.raises(CheckpointError, match=re.escape(str(file)) + r".*posix\.system.*refused"):
            resumed.load_checkpoint(planted)
        assert not marker.exists()
        resumed.load_checkpoint(ckpt)
        assert max_diff(resumed.state_dict(), saved) == 0.0  # exact, not the bfloat16 folder's rounding
        again = resumed.step(b1)
        assert max_diff(resumed.state_dict(), after) == 0.0
        assert again.metrics["learner/loss"] == uninterrupted.metrics["learner/loss"]
    finally:
        resumed.shutdown()


def test_streamed_publication_is_an_object_per_bucket_and_equals_the_full_state(ray_cluster, model_dir):
    """2 ranks, 50 KB buckets: rank 0 puts each gathered bucket as its own object while the gather goes on;
    a generator's fetch merges them back into exactly the master weights, in state-dict order."""
    pool = make_pool(model_dir, "stream", 2, weight_sync=ObjectStoreSyncConfig(bucket_mb=0.05))
    source = ObjectStoreWeightSource("stream", NS)
    try:
        pool.step(make_batch(30))
        ann = pool.publish()
        refs = ray.get(pool.store.get.remote(ann.version))
        full = pool.state_dict()
        got = source.fetch(ann)
        assert len(refs) >= 4, len(refs)
        assert list(got) == list(full) and all(torch.equal(got[k], full[k]) for k in full)
        assert ann.num_bytes == sum(v.numel() * v.element_size() for v in full.values())
        sizes = [sum(arr.nbytes for _, arr in ray.get(r).values()) for r in refs]
        assert max(sizes) <= 0.05 * (1 << 20) + max(v.numel() * v.element_size() for v in full.values())
    finally:
        pool.shutdown()


@pytest.mark.parametrize("tied", [False, True])
def test_sharded_ranks_load_exactly_the_model_folder(ray_cluster, tmp_path, model_dir, tied):
    """2 ranks build the model without weights and read only their own rows of each tensor (learner.loading):
    the gathered state equals the folder's weights bit for bit, tied embeddings (one tensor, two names) too."""
    from safetensors.torch import load_file

    from common.modeling import TinyQwen2, build_char_tokenizer, save_model_folder

    folder = model_dir
    if tied:
        tok = build_char_tokenizer()
        folder = save_model_folder(TinyQwen2(vocab_size=300, hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1,
                                             seed=3, max_positions=256).build(), tok, tmp_path / "qwen2")
    pool = make_pool(folder, f"load{int(tied)}", 2)
    try:
        loaded = pool.state_dict()
    finally:
        pool.shutdown()
    on_disk = load_file(str(folder / "model.safetensors"))
    assert on_disk.keys() <= loaded.keys()
    for k, v in on_disk.items():
        assert torch.equal(loaded[k], v.float()), k
