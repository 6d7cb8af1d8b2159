"""The transformers engine on a tiny local model: sample counts, log-prob parity, stop strings, EOS."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from actors.engines import Sampling, make_engine
from actors.engines.transformers_engine import TransformersEngine
from common.config import GeneratorConfig, TransformersEngineConfig
from tests.actors.engine_checks import perturbed_state_dict, teacher_forced


@pytest.fixture(scope="module")
def setup(tiny_model_dir):
    cfg = GeneratorConfig(engine=TransformersEngineConfig(batch_rows=16), max_new_tokens=12)
    engine = make_engine(cfg, str(tiny_model_dir))
    assert isinstance(engine, TransformersEngine)
    ref = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    return engine, ref, tok


def prompt_ids(tok, text: str) -> np.ndarray:
    return np.asarray([tok.bos_token_id, *tok.encode(text)], dtype=np.int32)


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
    stops = ("a", "e", "i", "o", "u")
    old = engine.sampling
    engine.sampling = Sampling(temperature=1.0, max_new_tokens=24, stop=stops)
    try:
        outs = engine.generate([prompt_ids(tok, "q: "), prompt_ids(tok, "r: ")], [32, 32], seed=3)
    finally:
        engine.sampling = old
    check_stops(outs, tok, stops, max_new_tokens=24)


def check_stops(outs, tok, stops, max_new_tokens):
    by_string = by_eos = 0
    for s in (s for o in outs for s in o):
        full = tok.decode(s.token_ids.tolist(), skip_special_tokens=True)
        assert not any(x in s.text for x in stops), "the returned text is cut before the stop string"
        body = s.token_ids[:-1].tolist()
        assert tok.eos_token_id not in body, "nothing is generated after EOS"
        if s.finish_reason == "length":
            assert len(s.token_ids) == max_new_tokens and not any(x in full for x in stops)
        elif s.token_ids[-1] == tok.eos_token_id:
            by_eos += 1
        else:
            by_string += 1
            assert any(x in full for x in stops)
            prefix = tok.decode(body, skip_special_tokens=True)
            assert not any(x in prefix for x in stops), "generation stops at the first stop string"
    assert by_string > 0 and by_eos > 0, f"expected both stop kinds in 64 samples: {by_string=} {by_eos=}"
