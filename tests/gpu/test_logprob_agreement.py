"""bf16 log-probs agree between the transformers engine (incremental decoding with a KV cache) and the learner's
forward (one pass over prompt + response through its chunked LM head in float32), on the same sampled tokens:
NeMo-RL's gates, median exp|d| < 1.1 and KL (k3) < 5e-4, on the 0.5B-layered random Qwen2 of the device run."""

from __future__ import annotations

import pytest

from bench.device_e2e import make_model, mismatch_probe

pytestmark = pytest.mark.gpu


def test_engine_and_learner_logprobs_agree_in_bfloat16(tmp_path, device):
    path = make_model(tmp_path / "model", "0.5B" if device.type == "cuda" else "tiny")
    m = mismatch_probe(path, device=device.type, dtype="bfloat16", prompts=8, samples=4, max_new_tokens=64)
    assert m["tokens"] >= 8 * 4 * 32, m
    assert m["median_exp_abs_diff"] < 1.1, m
    assert 0 <= m["kl_k3"] < 5e-4, m
