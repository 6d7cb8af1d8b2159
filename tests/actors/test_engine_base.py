"""Pure pieces shared by the engines: the top-k entropy estimate, stop strings, engine choice."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from actors.engines import describe_engine, model_parameters, resolve_engine_config, topk_entropy_estimate, vllm_importable
from actors.engines.base import Sampling, stop_cut
from common.config import AutoEngineConfig, GeneratorConfig, TransformersEngineConfig, VllmEngineConfig


def test_topk_entropy_is_exact_without_a_tail():
    # p = (0.5, 0.25, 0.25): H = 0.5 ln 2 + 2 * 0.25 ln 4 = 1.5 ln 2
    lp = np.log([0.5, 0.25, 0.25])
    assert topk_entropy_estimate(lp, vocab_size=3) == pytest.approx(1.5 * math.log(2))
    assert topk_entropy_estimate(lp, vocab_size=1000) == pytest.approx(1.5 * math.log(2))  # tail mass 0


def test_topk_entropy_tail_lower_bound():
    # uniform over V=4, top-2 seen: head = 2 * 0.25 ln 4 = 0.5 ln 4; tail mass 0.5 at p_min 0.25 adds 0.5 ln 4.
    # Here the lower bound is exact: the tail really is two tokens at p_min.
    assert topk_entropy_estimate(np.log([0.25, 0.25]), vocab_size=4) == pytest.approx(math.log(4))
    # uniform over V=8, top-2 seen: head = 2 * 1/8 ln 8 = 0.25 ln 8; tail 0.75 * ln 8 -> ln 8 exactly again
    assert topk_entropy_estimate(np.log([0.125, 0.125]), vocab_size=8) == pytest.approx(math.log(8))
    # peaked: p = (0.9, 0.05) seen, 0.05 spread over 98 unseen tokens. Exact: 0.9 ln(1/0.9) + 0.05 ln 20
    # + 0.05 ln(98/0.05); estimate takes the tail at ln 20 -> below the exact value.
    est = topk_entropy_estimate(np.log([0.9, 0.05]), vocab_size=100)
    exact = -0.9 * math.log(0.9) + 0.05 * math.log(20) + 0.05 * math.log(98 / 0.05)
    assert est == pytest.approx(-0.9 * math.log(0.9) + 0.05 * math.log(20) + 0.05 * math.log(20))
    assert est < exact


def test_stop_cut_takes_the_earliest_stop_string():
    assert stop_cut("12+3=15\nnext", ("\n", "=")) == 4
    assert stop_cut("abc", ("x",)) is None
    assert Sampling.from_config(GeneratorConfig(stop=["", "\n"])).stop == ("\n",)


def test_auto_engine_resolves_by_availability_gpu_and_model_size(tmp_path):
    from safetensors.torch import save_file

    save_file({"a": torch.zeros(1000, 20), "b": torch.zeros(500)}, str(tmp_path / "model.safetensors"))
    assert model_parameters(tmp_path) == 20_500 and model_parameters(tmp_path / "none") is None
    auto = GeneratorConfig(engine=AutoEngineConfig(cpu_vllm_min_params=20_501))
    if vllm_importable():
        assert isinstance(resolve_engine_config(auto), VllmEngineConfig)  # no model: vLLM when it may be
        assert isinstance(resolve_engine_config(auto, tmp_path), TransformersEngineConfig)  # small on CPU
        assert "transformers (auto: CPU, 0.0M parameters, < cpu_vllm_min_params=0.020501M" in \
            describe_engine(auto, tmp_path)
        at_limit = auto.model_copy(update={"engine": AutoEngineConfig(cpu_vllm_min_params=20_500)})
        assert isinstance(resolve_engine_config(at_limit, tmp_path), VllmEngineConfig)
        on_gpu = auto.model_copy(update={"num_gpus": 1.0})
        assert isinstance(resolve_engine_config(on_gpu, tmp_path), VllmEngineConfig)
    else:
        assert isinstance(resolve_engine_config(auto, tmp_path), TransformersEngineConfig)
    t = GeneratorConfig(engine=TransformersEngineConfig(batch_rows=3))
    assert resolve_engine_config(t, tmp_path) is t.engine
    assert describe_engine(t, tmp_path) == "generator engine: transformers"
