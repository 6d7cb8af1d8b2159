"""A tied head travels once: the learner's gather leaves `lm_head.weight` out when it *is* the embedding (Qwen2.5's
small models), and both engines load such a state, the head following the embedding."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from actors.engines import make_engine
from common.config import GeneratorConfig, TransformersEngineConfig, VllmEngineConfig
from common.modeling import TinyQwen2, build_char_tokenizer, save_model_folder
from learner.gather import iter_full_state
from tests.actors.engine_checks import prompt_ids, teacher_forced
from tests.conftest import requires_vllm


@pytest.fixture(scope="module")
def tied(tmp_path_factory):
    """(a tied Qwen2 folder, the next version of its model: every distinct parameter moved, still tied)."""
    tok = build_char_tokenizer()
    model = TinyQwen2(vocab_size=len(tok), hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, seed=5,
                      max_positions=256, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id).build()
    folder = save_model_folder(model, tok, tmp_path_factory.mktemp("tied") / "model")
    new = copy.deepcopy(model).eval()
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for p in new.parameters():  # each distinct parameter once: the head moves with the embedding
            p.add_(torch.randn(p.shape, generator=g) * 0.5 * p.std())
    assert new.lm_head.weight is new.model.embed_tokens.weight
    return folder, new


def published(model) -> list[dict[str, torch.Tensor]]:
    """What the learner publishes of `model` (one rank, small buckets), each bucket copied (the gather reuses its
    buffers: a list kept past the next bucket must own its tensors)."""
    out = [{k: v.clone() for k, v in b.items()} for b in iter_full_state(model, 0, 1, bucket_bytes=1 << 14)]
    names = [k for b in out for k in b]
    assert "lm_head.weight" not in names and "model.embed_tokens.weight" in names
    return out


def check_logprobs(engine, model, tol: float) -> None:
    tok = engine.tokenizer if hasattr(engine, "tokenizer") else None
    if tok is None:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(engine.llm.llm_engine.model_config.model)
    prompts = [prompt_ids(tok, "12+34="), prompt_ids(tok, "what is 5*5? ")]
    errs = [np.abs(s.logprobs - teacher_forced(model, p, s.token_ids)[0]).max()
            for p, o in zip(prompts, engine.generate(prompts, [3, 3], seed=7)) for s in o]
    assert max(errs) < tol, errs


def test_transformers_engine_loads_a_state_without_the_tied_head(tied):
    folder, new = tied
    engine = make_engine(GeneratorConfig(engine=TransformersEngineConfig(batch_rows=8), max_new_tokens=8), str(folder))
    engine.load_weights(iter(published(new)), version=1)
    m = engine.model
    assert m.lm_head.weight is m.model.embed_tokens.weight  # still tied, and now the new embedding
    assert torch.equal(m.lm_head.weight, new.model.embed_tokens.weight)
    check_logprobs(engine, new, 1e-4)


@requires_vllm
@pytest.mark.vllm
def test_vllm_engine_loads_a_state_without_the_tied_head(tied):
    folder, new = tied
    cfg = GeneratorConfig(engine=VllmEngineConfig(max_model_len=256, block_size=32, cpu_kv_cache_gb=0.0625),
                          max_new_tokens=8)
    engine = make_engine(cfg, str(folder))
    try:
        engine.load_weights(iter(published(new)), version=1)  # vLLM ties lm_head to the embedding itself
        check_logprobs(engine, new, 2e-3)
    finally:
        del engine.llm
