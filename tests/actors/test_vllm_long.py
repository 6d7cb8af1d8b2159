"""Partial rollouts at real lengths: the real vLLM engine generating 2,048-token responses, with new weights
loaded (bucket by bucket) after 1,000 engine steps while every sample is in flight. Each sample says where the
new version starts and every token's behaviour log-prob is the one of the version that sampled it.

The model is an untrained tiny Qwen2 with 32,000 vocabulary rows over the character tokenizer and 4,096
positions: EOS is one row of 32,000, so a response hardly ever stops before the cap (ids past the tokenizer
decode to nothing); the length is what is under test."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from actors.engines import make_engine
from common.config import GeneratorConfig, VllmEngineConfig
from tests.actors.engine_checks import perturbed_state_dict, prompt_ids, teacher_forced
from tests.conftest import requires_vllm

pytestmark = [requires_vllm, pytest.mark.vllm, pytest.mark.slow]

NEW_TOKENS, LOAD_AFTER = 2048, 1000


@pytest.fixture(scope="module")
def long_model(tmp_path_factory):
    from common.modeling import TinyQwen2, build_char_tokenizer, save_model_folder

    tok = build_char_tokenizer()
    model = TinyQwen2(vocab_size=32_000, hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, seed=5,
                      max_positions=4096, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id).build()
    return save_model_folder(model, tok, tmp_path_factory.mktemp("long") / "qwen2-4k")


def test_partial_rollouts_at_2048_tokens_keep_per_version_logprobs(long_model):
    engine_cfg = VllmEngineConfig(max_model_len=64 + NEW_TOKENS, block_size=32, cpu_kv_cache_gb=0.125)
    engine = make_engine(GeneratorConfig(engine=engine_cfg, max_new_tokens=NEW_TOKENS), str(long_model))
    ref = AutoModelForCausalLM.from_pretrained(long_model, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(long_model)
    old = {k: v.clone() for k, v in ref.state_dict().items()}
    prompts = {f"r{i}": prompt_ids(tok, text) for i, text in enumerate(["1+2=", "the fox ", "x", "42"])}
    for rid, p in prompts.items():
        engine.add(rid, p, seed=7 + len(rid))
    done = {}
    for _ in range(LOAD_AFTER):
        done.update(engine.step())
    assert engine.in_flight() == len(prompts) - len(done) > 0
    new = perturbed_state_dict(ref, seed=9)
    items = list(new.items())  # two buckets, loaded as they come
    engine.load_weights(iter([dict(items[: len(items) // 2]), dict(items[len(items) // 2:])]), version=1)
    while engine.in_flight():
        done.update(engine.step())
    assert sorted(done) == sorted(prompts)
    spanning = 0
    for rid, s in done.items():
        assert len(s.token_ids) == len(s.logprobs) <= NEW_TOKENS
        if len(s.segments) == 1:  # finished (EOS) before the load
            continue
        spanning += 1
        (v0, start), (v1, cut) = s.segments
        assert (v0, start, v1) == (0, 0, 1) and LOAD_AFTER - 2 <= cut <= LOAD_AFTER  # where the load happened
        ref.load_state_dict(old)
        np.testing.assert_allclose(s.logprobs[:cut], teacher_forced(ref, prompts[rid], s.token_ids)[0][:cut], atol=2e-3)
        ref.load_state_dict(new)
        np.testing.assert_allclose(s.logprobs[cut:], teacher_forced(ref, prompts[rid], s.token_ids)[0][cut:], atol=2e-3)
    assert spanning >= 1 and max(len(s.token_ids) for s in done.values()) == NEW_TOKENS
    del engine.llm
