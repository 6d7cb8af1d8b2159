"""The transformers engine on a tiny local model: sample counts, log-prob parity, stop strings, EOS."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from actors.engines import make_engine
from actors.engines.transformers_engine import TransformersEngine
from common.config import GeneratorConfig, TransformersEngineConfig
from tests.actors.engine_checks import check_stop_strings_and_eos, perturbed_state_dict, prompt_ids, teacher_forced


@pytest.fixture(scope="module")
def setup(tiny_model_dir):
    cfg = GeneratorConfig(engine=TransformersEngineConfig(batch_rows=16), max_new_tokens=12)
    engine = make_engine(cfg, str(tiny_model_dir))
    assert isinstance(engine, TransformersEngine)
    ref = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    return engine, ref, tok


def test_n_samples_per_prompt_and_types(setup):
    engine, _, tok = setup
    prompts = [prompt_ids(tok, "1+2="), prompt_ids(tok, "a much longer prompt, 7*8="), prompt_ids(tok, "x")]
    outs = engine.generate(prompts, [2, 3, 1], seed=0)
    assert [len(o) for o in outs] == [2, 3, 1]
    vocab = len(tok)
    for o in outs:
        for s in o:
            assert s.token_ids.dtype == np.int32 and s.logprobs.dtype == np.float32
            assert 1 <= len(s.token_ids) == len(s.logprobs) <= 12
            assert s.finish_reason in ("stop", "length")
            assert (s.logprobs <= 0).all()
            assert 0 < s.entropy <= math.log(vocab) + 1e-4
    again = engine.generate(prompts, [2, 3, 1], seed=0)
    assert [s.token_ids.tolist() for o in again for s in o] == [s.token_ids.tolist() for o in outs for s in o]


def test_logprob_parity_after_load(setup):
    engine, ref, tok = setup
    new = perturbed_state_dict(ref, seed=1)
    engine.load_weights(new, version=3)
    ref.load_state_dict(new)
    assert engine.version == 3
    prompts = [prompt_ids(tok, "12+34="), prompt_ids(tok, "what is 5*5? ")]
    outs = engine.generate(prompts, [4, 4], seed=7)  # left padding: prompts of different lengths together
    for p, o in zip(prompts, outs):
        for s in o:
            lp, ent = teacher_forced(ref, p, s.token_ids)
            np.testing.assert_allclose(s.logprobs, lp, atol=1e-4)
            assert abs(s.entropy - float(ent.mean())) < 1e-4  # exact full-vocabulary entropy


def test_load_refuses_wrong_names(setup):
    engine, ref, _ = setup
    bad = {"model.not_a_layer.weight": torch.zeros(2)}
    with pytest.raises(ValueError, match="do not fit the model"):
        engine.load_weights(bad, version=9)
    assert engine.version == 3


def test_stop_strings_and_eos(setup):
    engine, _, tok = setup
    check_stop_strings_and_eos(engine, tok)




def test_bfloat16_engine_casts_published_float32_weights(tiny_model_dir):
    """model.dtype=bfloat16 reaches the engine (generator.dtype None = model.dtype) and the learner's
    float32 master weights are rounded to bfloat16 on load; log-probs match a bfloat16 reference."""
    from common.config import RunConfig

    cfg = RunConfig(model={"dtype": "bfloat16"}, generator={"engine": {"kind": "transformers"}, "max_new_tokens": 8})
    assert cfg.generator.dtype == "bfloat16"
    engine = make_engine(cfg.generator, str(tiny_model_dir))
    assert {p.dtype for p in engine.model.parameters()} == {torch.bfloat16}
    ref = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    new = perturbed_state_dict(ref, seed=2)  # float32, as published
    engine.load_weights(new, version=1)
    got = engine.model.state_dict()
    assert all(torch.equal(got[k], v.to(torch.bfloat16)) for k, v in new.items())
    ref.load_state_dict(new)
    ref = ref.to(torch.bfloat16)
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    p = prompt_ids(tok, "12+34=")
    for s in engine.generate([p], [3], seed=1)[0]:
        lp, _ = teacher_forced(ref, p, s.token_ids)
        # bfloat16 (8-bit mantissa): the cached incremental forward and the full forward round differently
        np.testing.assert_allclose(s.logprobs, lp, atol=5e-2)


def test_streaming_is_batch_at_a_time_behind_the_same_interface(setup):
    """`add`/`step` on the transformers engine: each step generates up to batch_rows queued samples to the end."""
    engine, ref, tok = setup
    prompts = {f"q{i}": prompt_ids(tok, f"{i}+{i}=") for i in range(20)}
    for rid, p in prompts.items():
        engine.add(rid, p, seed=i if (i := int(rid[1:])) else 0)
    first = engine.step()
    assert len(first) == 16 and engine.in_flight() == 4  # batch_rows=16
    engine.abort(["q19"])
    rest = engine.step()
    assert len(rest) == 3 and engine.in_flight() == 0 and engine.step() == []
    for rid, s in first + rest:
        assert s.segments == ((engine.version, 0),)
        np.testing.assert_allclose(s.logprobs, teacher_forced(ref, prompts[rid], s.token_ids)[0], atol=1e-4)
