"""The CUDA publication path of learner/gather.py: buckets gathered on the device, cast to bfloat16, copied on a
side stream into pinned host buffers that alternate (two slots), handed out while the next bucket is gathered.
Every published tensor equals the model's own, cast once; a bucket is valid until the next one is asked for."""

from __future__ import annotations

import pytest
import torch

from learner.gather import Staging, gather_full_state, iter_full_state
from tests.gpu.conftest import small_qwen2

pytestmark = pytest.mark.gpu


def test_published_state_equals_the_model_cast_to_bfloat16(device):
    model = small_qwen2(device, layers=3)
    staging = Staging()
    want = {k: v.detach().to(torch.bfloat16).cpu() for k, v in model.state_dict().items()}
    got = {}
    for bucket in iter_full_state(model, 0, 1, bucket_bytes=1 << 18, dtype=torch.bfloat16, staging=staging):
        for name, t in bucket.items():
            assert t.device.type == "cpu" and t.dtype == torch.bfloat16
            got[name] = t.clone()  # valid until the next bucket is asked for
    assert set(got) <= set(want) and len(got) >= len(want) - 1  # the tied lm_head travels once
    for name, t in got.items():
        assert torch.equal(t, want[name]), name
    if device.type == "cuda":
        hosts = [b for b in staging.buffers.values() if b.device.type == "cpu"]
        assert hosts and all(b.is_pinned() for b in hosts)
        assert staging.stream is not None  # the side stream of the device-to-host copies


def test_gather_full_state_twice_reuses_the_pinned_buffers(device):
    model = small_qwen2(device)
    staging = Staging()
    for _ in range(2):
        list(iter_full_state(model, 0, 1, bucket_bytes=1 << 18, dtype=torch.bfloat16, staging=staging))
    first = staging.allocations
    list(iter_full_state(model, 0, 1, bucket_bytes=1 << 18, dtype=torch.bfloat16, staging=staging))
    assert staging.allocations - first <= 2  # the device buffers come back after release; the pinned ones stay
    full = gather_full_state(model, 0, 1, dtype=torch.bfloat16)
    for name, t in model.state_dict().items():
        assert torch.equal(full[name], t.detach().to(torch.bfloat16).cpu()), name
