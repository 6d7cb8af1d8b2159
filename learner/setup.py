"""One learner rank's model, optimizer and training step, built without Ray: `learner.pool.LearnerRank` and
`bench/gpu_bench.py` (a bare GPU machine has no Ray) run the same code.

    torch.distributed.init_process_group(...)              # the caller's; FSDP2's mesh spans the whole group
    shape = TrainShape(max_new_tokens=T, dtype="bfloat16", world=w)   # the run's lengths and dtypes, the ranks
    built = setup_rank(cfg, model_path, shape, rank=r, device=device)
    stats = built.trainer.run(batch)                       # learner.step.TrainStep

Parameters and AdamW's state are float32 (FSDP2 mixed precision); a sharded model is built on the meta device,
sharded layer by layer and filled by each rank from the model folder (`learner.loading`; `fill` replaces that).
Details (precision, the build, LoRA): docs/internals.md#learnersetuppy
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from common.config import LearnerConfig
from learner.activation_checkpointing import eager_fallback_note, resolve_checkpointing
from learner.compile_cache import compiled_graphs, enable_cache
from learner.forward import check_packing, prepare_model
from learner.levers import apply_compile, attention_problem, build_optimizer, remove_compile, resolve_levers
from learner.loading import build_empty, load_shards, materialize
from learner.lora import adapter_names, apply_lora, hold_frozen_in, init_adapters
from learner.shape import TrainShape
from learner.step import TrainStep
from learner.trial import try_levers

log = logging.getLogger(__name__)


@dataclass(slots=True)
class RankModel:
    """What `setup_rank` built for one rank."""

    model: torch.nn.Module  # FSDP2-sharded (or plain for one float32 rank), prepared
    optimizer: torch.optim.Optimizer
    trainer: TrainStep
    ref_model: torch.nn.Module | None = None  # frozen reference copy (learner.loss.kl_coef > 0 without LoRA)
    packing_gap: float | None = None  # largest change measured by check_packing (None: padded micro-batches)
    levers_off: dict[str, str] | None = None  # levers that failed their trial at setup -> the error (learner.trial)
    summary: str | None = None  # one line for the run's console (LoRA: rank, targets, trainable parameters)
    trial_graphs: int = 0  # graphs torch.compile built during the lever trial (the run's compile warm-up)
    trial_s: float = 0.0  # seconds the lever trial took (with compile on: mostly compiling)


def _hidden_size(model_path: str) -> int | None:
    """The model folder's config.json hidden_size (None where it cannot be read: the levers' rule without it)."""
    try:
        with open(os.path.join(model_path, "config.json")) as f:
            width = json.load(f).get("hidden_size")
    except (OSError, ValueError, AttributeError):
        return None
    return width if isinstance(width, int) else None


def setup_rank(cfg: LearnerConfig, model_path: str, shape: TrainShape, *, rank: int, device: torch.device,
               fill: Callable[[torch.nn.Module], None] | None = None) -> RankModel:
    """Build, prepare, shard and fill the model of `model_path` on `device`, its AdamW and its `TrainStep`, rank
    `rank` of `shape.world` in `shape.dtype`. Collective under FSDP (the packing check runs forwards): every rank of
    the group calls it. `fill(model)`: fills the allocated parameters instead of reading them from the folder's
    weight files. The shape's longest prompt and batch rows let activation checkpointing "auto" budget the run's
    real micro-batch (`resolve_checkpointing`)."""
    world, dtype = shape.world, shape.torch_dtype
    sharded = world > 1 or dtype != torch.float32
    problem = attention_problem(cfg.levers.attn_implementation)  # on a cluster, the node of this rank decides
    if problem is not None:
        log.error("learner rank %d: %s", rank, problem)
        raise ValueError(problem)
    asked = cfg
    cfg, notes = resolve_levers(cfg, device, dtype, width=_hidden_size(model_path))  # "auto", for this device
    cfg, model = _load_model(cfg, asked, model_path, device, empty=sharded or fill is not None, notes=notes)
    shape = shape.with_model(model)  # its positions, EOS and pad tokens
    targets = apply_lora(model, cfg.lora) if cfg.lora is not None else []  # before the head and sharding
    # activation checkpointing "auto": from the memory the weights, gradients and AdamW state leave (meta shapes)
    cfg, checkpointing_note = resolve_checkpointing(cfg, model, device, shape)
    notes.append(checkpointing_note)
    prepare_model(model, cfg)  # before sharding: FSDP then manages the new head's (tied) weight as before
    frozen = 0
    if cfg.lora is not None and cfg.lora.base_dtype == "auto" and sharded and dtype != torch.float32:
        frozen = hold_frozen_in(model, dtype)  # the frozen base in the compute dtype: half of float32's bytes
    if dtype == torch.float16 and rank == 0:
        log.warning("model.dtype=float16: the learner trains without loss scaling (gradients may underflow); "
                    "use bfloat16 where the hardware has it")
    if sharded:
        _shard(model, device, dtype, world)
    if sharded or fill is not None:
        materialize(model, device)
        fill(model) if fill is not None else load_shards(model, model_path, rank, world, skip=adapter_names(model))
    summary = _init_lora(model, cfg, targets, rank, shape, frozen) if cfg.lora is not None else None
    optimizer, optimizer_note = build_optimizer((p for p in model.parameters() if p.requires_grad), cfg)
    trainer = TrainStep(model, optimizer, cfg, shape, rank=rank, device=device,
                        ref_model=_reference_model(cfg, model_path, device, dtype))
    levers = _RankLevers(trainer, chose_attention=asked.levers.attn_implementation is None)
    off, trial_graphs, trial_s = _trial(levers, trainer, notes, checkpointing_note, rank)
    cfg, optimizer_note = levers.cfg, levers.optimizer_note or optimizer_note
    gap = None
    if cfg.levers.packs_padding_free:  # collective under FSDP: every rank runs the same two forwards
        gap = check_packing(model, device, tolerance=1e-3 if dtype == torch.float32 else 2e-2)
    if rank == 0:
        log.info("learner micro-batches: %s (attention %s)%s",
                 "padding-free packing" if cfg.levers.packs_padding_free else "padded",
                 model.config._attn_implementation,
                 "" if gap is None else f"; packed rows checked apart (largest change {gap:.2g})")
        log.info("learner levers on %s: %s; %s", device.type, "; ".join(notes), optimizer_note)
    return RankModel(model=model, optimizer=trainer.optimizer, trainer=trainer, ref_model=trainer.ref_model,
                     packing_gap=gap, levers_off=off, summary=summary, trial_graphs=trial_graphs, trial_s=trial_s)


def _load_model(cfg: LearnerConfig, asked: LearnerConfig, model_path: str, device: torch.device, *, empty: bool,
                notes: list[str]) -> tuple[LearnerConfig, torch.nn.Module]:
    """The model with the attention asked for; when we chose it (padding_free=auto on CUDA) and its kernel cannot
    load here, transformers' default attention, padded (said in `notes`)."""
    try:
        return cfg, _build(cfg, model_path, device, empty=empty)
    except (ImportError, ValueError) as e:
        if cfg.levers.attn_implementation is None:
            raise
        if asked.levers.attn_implementation is not None:
            raise ValueError(f"learner.levers.attn_implementation={cfg.levers.attn_implementation} cannot load on "
                             f"this learner ({device.type}): {e} Set learner.levers.attn_implementation to sdpa (or "
                             "leave it unset), "
                             "or install the kernel where the learner runs") from None
        notes[-1] = f"padded micro-batches ({cfg.levers.attn_implementation} cannot load here: {e}; attention sdpa)"
        cfg = cfg.with_levers(attn_implementation=None, padding_free=False)
        return cfg, _build(cfg, model_path, device, empty=empty)


def _shard(model: torch.nn.Module, device: torch.device, dtype: torch.dtype, world: int) -> None:
    """FSDP2 over every decoder layer and the whole model (imported here: one float32 rank never loads FSDP, 0.5 s
    of its start)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(device.type, (world,))
    mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)


def _init_lora(model: torch.nn.Module, cfg: LearnerConfig, targets: list[str], rank: int, shape: TrainShape,
               frozen: int) -> str:
    """Initialise the adapters (the same on every rank) and say what trains; the one-line summary the driver logs.
    `frozen`: the base's parameters held in the compute dtype (`hold_frozen_in`)."""
    dtype = shape.torch_dtype
    init_adapters(model, cfg.seed, rank, shape.world)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)  # global counts (DTensor numel)
    total = sum(p.numel() for p in model.parameters())
    kinds = ", ".join(sorted({t.rsplit(".", 1)[-1] for t in targets}))
    if rank == 0:
        log.info("learner.lora: rank %d adapters (alpha %g) on %d Linear modules (%s); only they train. "
                 "Checkpoints export the merged model (W + alpha/rank B A under the base names) and the "
                 "adapters in peft's format (adapter/)%s", cfg.lora.rank, cfg.lora.alpha, len(targets), kinds,
                 "; the KL reference is the base (adapters disabled), no copy" if cfg.loss.kl_coef > 0 else "")
        if frozen:
            log.info("learner.lora.base_dtype=auto: the frozen base (%.3g M parameters) is held in %s, %.2f GiB "
                     "less than float32 (over all ranks)", frozen / 1e6, str(dtype).removeprefix("torch."),
                     frozen * (4 - dtype.itemsize) / 2**30)
    return (f"learner.lora: rank {cfg.lora.rank} adapters (alpha {cfg.lora.alpha:g}) on {len(targets)} Linear "
            f"modules ({kinds}): {trainable / 1e6:.3g} M trainable parameters of {total / 1e6:.4g} M "
            f"({trainable / max(total, 1):.2%})")


def _reference_model(cfg: LearnerConfig, model_path: str, device: torch.device,
                     dtype: torch.dtype) -> torch.nn.Module | None:
    """The frozen KL reference (None without KL; under LoRA the reference is the base: the adapters disabled)."""
    if cfg.loss.kl_coef <= 0 or cfg.lora is not None:
        return None
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype,
                                               attn_implementation=cfg.levers.attn_implementation).to(device).eval()
    ref.requires_grad_(False)
    prepare_model(ref, cfg, trainable=False)
    return ref


def _trial(levers, trainer, notes: list[str], checkpointing_note: str, rank: int) -> tuple[dict, int, float]:
    """Try the levers on real micro-batches (collective: every rank tries the same); those that fail are switched
    off for the run. (levers off, graphs the trial compiled, its seconds)."""
    if levers.cfg.levers.compile is True and levers.cfg.levers.compile_backend == "inductor":
        notes.append(enable_cache(levers.cfg.levers.compile_cache_dir))
    graphs, t0 = compiled_graphs(), time.perf_counter()
    off = try_levers(levers, trainer, levers.unfused)
    trial_graphs, trial_s = compiled_graphs() - graphs, time.perf_counter() - t0
    for lever, error in off.items():
        notes.append(f"{lever} off: it failed its trial at setup ({error})")
    fallback = eager_fallback_note(levers.cfg.levers.activation_checkpointing, checkpointing_note, off)
    if fallback and rank == 0:
        log.warning("%s", fallback)
    if levers.cfg.levers.compile is True:
        notes.append(f"the trial compiled {trial_graphs} graph(s) in {trial_s:.1f} s (the run's warm-up: a graph "
                     "compiled later is counted in learner/recompiles)")
    return off, trial_graphs, trial_s


class _RankLevers:
    """The levers of one built rank, switched over its model (`learner.trial.Levers`): compile applied to or
    removed from the decoder layers; packing on or off (with the attention `resolve_levers` chose for it: flex or
    flash back to sdpa, on the trained model and a reference copy); fused AdamW in the config only (the trial's
    `rebuild_optimizer` builds the unfused one). The trainer's config follows every switch."""

    def __init__(self, trainer: TrainStep, *, chose_attention: bool):
        self.trainer, self.cfg = trainer, trainer.cfg
        self.packed_attention = trainer.model.config._attn_implementation
        self.chose_attention = chose_attention and self.cfg.levers.packs_padding_free
        self.optimizer_note: str | None = None  # the rebuilt optimizer's, once the trial rebuilt it

    def unfused(self) -> None:
        """The trial's `rebuild_optimizer`: AdamW as the config now says (fused off)."""
        params = (p for p in self.trainer.model.parameters() if p.requires_grad)
        self.trainer.optimizer, self.optimizer_note = build_optimizer(params, self.cfg)

    def set(self, lever: str, on: bool) -> None:
        model = self.trainer.model
        if lever == "compile":
            apply_compile(model, self.cfg.levers.compile_backend) if on else remove_compile(model)
        elif lever == "padding_free" and self.chose_attention:
            for m in (model, self.trainer.ref_model):
                if m is not None:
                    m.set_attn_implementation(self.packed_attention if on else "sdpa")
            if self.cfg.levers.compile is True:  # the layers were compiled for the other attention
                remove_compile(model)
                apply_compile(model, self.cfg.levers.compile_backend)
        self.cfg = self.cfg.with_levers(**{lever: on})
        self.trainer.cfg = self.cfg


def _build(cfg: LearnerConfig, model_path: str, device: torch.device, *, empty: bool) -> torch.nn.Module:
    """The model of `model_path` with `cfg.levers.attn_implementation`: on the meta device to be filled shard by shard
    (`empty`), or loaded whole in float32 on `device`."""
    from transformers import AutoModelForCausalLM

    attn = {"attn_implementation": cfg.levers.attn_implementation}
    if empty:
        return build_empty(model_path, **attn)
    return AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32, **attn).to(device)
