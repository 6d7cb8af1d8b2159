"""The built-in model: offline build, cache, save/load through transformers and vLLM, accuracy spread."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from common.config import DataConfig, ModelConfig, ToyModelConfig
from common.tasks import get_task
from common.toy_model import INFO_FILE, Policy, cache_key, ensure_toy_model, measure_spread
from tests.conftest import requires_vllm

TINY = ToyModelConfig(hidden_size=32, num_heads=1, num_layers=1, max_train_steps=20, eval_every=10, batch_size=16,
                      probe_questions=8, samples=2, supervised_questions=64)
TINY_DATA = DataConfig(num_train=64, num_test=16)


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    cfg = ModelConfig(cache_dir=str(tmp_path_factory.mktemp("cache")), toy=TINY)
    return cfg, ensure_toy_model(cfg, TINY_DATA)


def test_tiny_build_is_a_hugging_face_folder(tiny_folder):
    _, folder = tiny_folder
    for name in ("config.json", "model.safetensors", "tokenizer.json", INFO_FILE):
        assert (folder / name).is_file()
    info = json.loads((folder / INFO_FILE).read_text())
    assert info["task"] == "countdown" and 1 <= info["chosen_step"] <= info["steps"] <= 20
    assert set(info["train_spread"]) == {"mean", "always", "partly", "never", "questions", "samples"}

    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder)
    assert tok.decode(tok.encode("3 7 8>29=", add_special_tokens=False)) == "3 7 8>29="
    assert len(tok.encode("3 7 8>29=", add_special_tokens=False)) == 9  # one token per character
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (1, 2, 0)
    assert model.config.hidden_size == 32 and model.config.num_hidden_layers == 1
    with torch.no_grad():
        logits = model(torch.tensor([[1, 10, 11]])).logits  # [1, 3, V]
    assert logits.shape == (1, 3, len(tok)) and torch.isfinite(logits).all()


def test_second_call_is_cached_and_force_rebuilds(tiny_folder):
    cfg, folder = tiny_folder
    stamp = (folder / "model.safetensors").stat().st_mtime_ns
    assert ensure_toy_model(cfg, TINY_DATA) == folder  # cached: the file is not rewritten
    assert (folder / "model.safetensors").stat().st_mtime_ns == stamp
    assert ensure_toy_model(cfg, TINY_DATA, force=True) == folder
    assert (folder / "model.safetensors").stat().st_mtime_ns != stamp
    assert [p.name for p in folder.parent.iterdir()] == [folder.name]  # no temporary folders left behind


def test_cache_key_follows_the_settings_that_matter():
    base = cache_key(TINY, TINY_DATA)
    assert base == cache_key(TINY.model_copy(update={"threads": 2}), TINY_DATA)
    assert base != cache_key(TINY.model_copy(update={"seed": 1}), TINY_DATA)
    assert base != cache_key(TINY, TINY_DATA.model_copy(update={"seed": 1}))
    assert base != cache_key(TINY, TINY_DATA.model_copy(update={"task": "arithmetic"}))


def test_character_models_keep_their_cache_keys():
    """Adding the chat task changed nothing for the character-level models: their cached builds stay valid."""
    assert cache_key(ToyModelConfig(), DataConfig()) == "8b6c2e1d4c0c66e7"
    assert cache_key(ToyModelConfig(), DataConfig(task="arithmetic")) == "e57198f7de3be21b"


def test_tiny_chat_build_has_a_bpe_tokenizer_with_a_chat_template(tmp_path):
    data = DataConfig(task="think_arith", use_chat_template=True, num_train=64, num_test=16)
    folder = ensure_toy_model(ModelConfig(cache_dir=str(tmp_path), toy=TINY), data)
    assert folder.name == f"toy-think_arith-{cache_key(TINY, data)}"
    info = json.loads((folder / INFO_FILE).read_text())
    assert info["task"] == "think_arith" and 20 <= info["max_new_tokens"] <= 40 and info["vocab_size"] <= 320
    tok = AutoTokenizer.from_pretrained(folder)
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is 2*3+4*5?"}], tokenize=False,
                                     add_generation_prompt=True)
    assert prompt == "<s><|user|>What is 2*3+4*5?<|assistant|>"
    model = AutoModelForCausalLM.from_pretrained(folder)
    assert model.config.vocab_size == len(tok) and model.config.hidden_size == 32


def test_file_datasets_need_a_model_path(tmp_path):
    with pytest.raises(ValueError, match="set data.task, or set model.path"):
        ensure_toy_model(ModelConfig(cache_dir=str(tmp_path)), DataConfig(task=None, train_path="x.jsonl"))


def test_verbose_prints_the_spread(tiny_folder, capsys):
    cfg, _ = tiny_folder
    ensure_toy_model(cfg, TINY_DATA, verbose=True)
    out = capsys.readouterr().out
    assert "built-in model (cached)" in out and "always right" in out and "partly" in out and "never" in out


@pytest.fixture(scope="module")
def default_model():
    """The real default build (about a minute the first time; cached under ~/.cache/exgrpo afterwards)."""
    return ensure_toy_model(ModelConfig(), DataConfig(), verbose=True)


def test_default_build_has_a_spread_of_accuracy(default_model):
    info = json.loads((default_model / INFO_FILE).read_text())
    for split in ("train_spread", "test_spread"):
        s = info[split]
        assert 0.15 <= s["mean"] <= 0.5, info
        assert s["partly"] >= 0.4 and s["never"] > 0, info
    model = AutoModelForCausalLM.from_pretrained(default_model)
    tok = AutoTokenizer.from_pretrained(default_model)
    _, test = get_task("countdown").generate(0, 2000, 200)
    again = measure_spread(Policy(model, tok, get_task("countdown")), test[:64], 8, seed=123)
    assert abs(again.mean - info["test_spread"]["mean"]) < 0.12  # the saved weights are the measured ones


@requires_vllm
def test_vllm_loads_the_built_in_model_and_agrees_with_transformers(default_model):
    from vllm import LLM, SamplingParams

    tok = AutoTokenizer.from_pretrained(default_model)
    model = AutoModelForCausalLM.from_pretrained(default_model)
    prompts = ["3 7 8>29=", "9 9 9>90=", "2 7 7>14=", "4 5 6>26="]
    ids = [[tok.bos_token_id] + tok.encode(p, add_special_tokens=False) for p in prompts]
    llm = LLM(model=str(default_model), enforce_eager=True, dtype="float32", max_model_len=64, seed=0)
    outs = llm.generate([{"prompt_token_ids": i} for i in ids], SamplingParams(temperature=0, max_tokens=8))
    for prompt_ids, out in zip(ids, outs):
        hf = model.generate(torch.tensor([prompt_ids]), do_sample=False, max_new_tokens=8,
                            pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
        assert list(out.outputs[0].token_ids) == hf[0, len(prompt_ids):].tolist()


REAL_SHAPES = TINY.model_copy(update={"architecture": "qwen2", "num_heads": 2, "hidden_size": 64,
                                      "vocab_rows": 151_936, "max_positions": 10_240})


@pytest.fixture(scope="module")
def real_shaped_folder(tmp_path_factory):
    cfg = ModelConfig(cache_dir=str(tmp_path_factory.mktemp("cache-real")), toy=REAL_SHAPES)
    return ensure_toy_model(cfg, DataConfig(task="think_arith", num_train=64, num_test=16, use_chat_template=True))


def test_real_shaped_recipe_is_qwen2_with_a_padded_vocabulary_it_never_samples(real_shaped_folder):
    """model.toy.architecture=qwen2 + vocab_rows=151936 + max_positions=10240: Qwen2.5's layout at tiny width;
    the padded rows carry at most 1e-6 of the probability on the probe tokens, and sampling never picks them."""
    config = json.loads((real_shaped_folder / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForCausalLM"] and config["vocab_size"] == 151_936
    assert config["tie_word_embeddings"] is True and config["max_position_embeddings"] == 10_240
    assert config["num_attention_heads"] == 2 and config["num_key_value_heads"] == 1
    info = json.loads((real_shaped_folder / INFO_FILE).read_text())
    assert info["vocab_rows"] == 151_936 and info["vocab_size"] < 1000 and 0 <= info["padded_mass_max"] <= 1e-6
    tok = AutoTokenizer.from_pretrained(real_shaped_folder)
    model = AutoModelForCausalLM.from_pretrained(real_shaped_folder)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    ids = tok.apply_chat_template([{"role": "user", "content": "What is 3+4?"}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)["input_ids"]
    torch.manual_seed(0)
    out = model.generate(ids.repeat(16, 1), do_sample=True, max_new_tokens=24, pad_token_id=tok.pad_token_id)
    assert int(out[:, ids.shape[1]:].max()) < len(tok)  # 384 samples, none from the padded rows


def test_new_settings_at_their_defaults_keep_the_cache_keys():
    assert cache_key(TINY, TINY_DATA) == cache_key(TINY.model_copy(update={"architecture": "llama"}), TINY_DATA)
    assert cache_key(TINY, TINY_DATA) != cache_key(REAL_SHAPES, TINY_DATA)
