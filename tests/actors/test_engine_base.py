"""Pure pieces shared by the engines: the top-k entropy estimate, stop strings, engine choice."""

from __future__ import annotations

import math

import numpy as np
import pytest

from actors.engines import resolve_engine_config, topk_entropy_estimate, vllm_importable
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


def test_auto_engine_resolves_by_availability():
    auto = AutoEngineConfig()
    expected = VllmEngineConfig if vllm_importable() else TransformersEngineConfig
    assert isinstance(resolve_engine_config(auto), expected)
    t = TransformersEngineConfig(batch_rows=3)
    assert resolve_engine_config(t) is t
