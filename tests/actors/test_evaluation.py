"""The evaluation's standard error of pass@1 (`actors.evaluation.pass_at_1_se`), worked by hand."""

from __future__ import annotations

import math

import numpy as np
import pytest

from actors.evaluation import EvalResult, pass_at_1_se


def test_pass_at_1_se_worked_by_hand():
    # question 1: 2 of 4 correct, p = 0.5, p(1-p) = 0.25; question 2: 1 of 4, p = 0.25, p(1-p) = 0.1875.
    # SE = sqrt((0.25 + 0.1875) / (k - 1)) / Q = sqrt(0.145833) / 2 = 0.190941
    correct = np.array([[1, 1, 0, 0], [1, 0, 0, 0]], dtype=np.float64)  # [Q=2, k=4]
    assert pass_at_1_se(correct) == pytest.approx(0.190941, abs=1e-6)
    # a question always or never solved adds nothing: the noise is in the sampling of the responses only
    assert pass_at_1_se(np.array([[1, 1, 1, 1], [0, 0, 0, 0]], dtype=np.float64)) == 0.0
    # 200 questions at p = 0.5 each: sqrt(200 * 0.25 / (k - 1)) / 200, 0.0204 at k = 4 and 0.0091 at k = 16 (half:
    # the SE falls as 1/sqrt(k))
    for k, se in [(4, 0.020412), (16, 0.009129)]:
        half = np.tile([1.0] * (k // 2) + [0.0] * (k // 2), (200, 1))  # [200, k]
        assert pass_at_1_se(half) == pytest.approx(se, abs=1e-6)
    assert math.isnan(pass_at_1_se(np.ones((5, 1))))  # one sample: no within-question variance to measure


def test_the_se_is_logged_and_printed_beside_pass_at_1():
    r = EvalResult(questions=2, greedy_accuracy=0.5, pass_at_1=0.375, pass_at_k=1.0, k=4, temperature=0.6,
                   seconds=1.0, pass_at_1_se=0.190941)
    assert r.metrics()["eval/pass_at_1_se"] == 0.190941 and r.metrics("aime")["eval/aime/pass_at_1_se"] == 0.190941
    assert "pass@1 (T=0.6, 4 samples)  0.375 (SE 0.191)" in r.table("m")
    one = EvalResult(questions=2, greedy_accuracy=0.5, pass_at_1=0.5, pass_at_k=0.5, k=1, temperature=0.6, seconds=1.0)
    assert "eval/pass_at_1_se" not in one.metrics() and "SE" not in one.table("m")
