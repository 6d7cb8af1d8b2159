"""The GPU levers of a learner rank, each a `learner.*` switch, resolved once the rank knows its device.

    cfg, notes = resolve_levers(cfg, device, dtype)   # "auto" -> true/false, attention chosen; one note per lever
    prepare_model(model, cfg)                         # learner.forward: apply_compile when cfg.compile
    optimizer, note = build_optimizer(model.parameters(), cfg)

torchtitan's shape: each lever is a small step over a plain model, switched on and off in the config, and each
was measured on its own (one H200, a 1.5B step at 8 x 8k responses, issue 34): per-layer compile +15%, fused
AdamW +1% and 1 GiB less, flex_attention packing 1.22x the padded step at mixed lengths. `auto` means "on where
it was measured to help", i.e. on CUDA. A lever that cannot run here falls back and its note says why; the
notes go into the rank's start log. None of them changes what is computed (the CPU tests train the same update
with each on and off).
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Iterable

import torch

from common.config import LearnerConfig

log = logging.getLogger(__name__)


def flash_attention_installed() -> bool:
    """Whether the flash-attn package (transformers' flash_attention_2) is importable here."""
    return importlib.util.find_spec("flash_attn") is not None


def flex_attention_available() -> bool:
    """Whether torch has flex_attention and transformers can run it (torch >= 2.5)."""
    from transformers.utils import is_torch_flex_attn_available

    return bool(is_torch_flex_attn_available())


def resolve_levers(cfg: LearnerConfig, device: torch.device, dtype: torch.dtype = torch.float32, *,
                   flash: bool | None = None, flex: bool | None = None) -> tuple[LearnerConfig, list[str]]:
    """`cfg` with `compile`, `fused_optimizer` and `padding_free` decided for `device` (and, for an unset
    attention on CUDA, `attn_implementation`), and one note per lever saying what runs and why.
    `flash`/`flex`: whether those kernels are available (None: look)."""
    cuda = device.type == "cuda"
    update: dict = {}
    notes = []

    compile_on = cuda if cfg.compile == "auto" else bool(cfg.compile)
    why = _why(cfg.compile, cuda)
    if compile_on and not torch._dynamo.is_dynamo_supported():
        compile_on, why = False, "torch.compile is not supported by this Python/platform; eager instead"
    update["compile"] = compile_on
    notes.append(f"compile {'on' if compile_on else 'off'} ({why})" + (
        f": each decoder layer, backend {cfg.compile_backend}, dynamic shapes; the first step compiles (minutes "
        "at 1.5B), later processes on this machine reuse inductor's cache (TORCHINDUCTOR_CACHE_DIR)"
        if compile_on else ""))

    fused = cuda if cfg.fused_optimizer == "auto" else bool(cfg.fused_optimizer)
    update["fused_optimizer"] = fused
    notes.append(f"fused AdamW {'on' if fused else 'off'} ({_why(cfg.fused_optimizer, cuda)})")

    attn = cfg.attn_implementation
    if cfg.padding_free != "auto":
        packs, why = bool(cfg.padding_free), "set"
    elif cfg.varlen_attention:
        packs, why = True, f"auto: {attn} is a variable-length kernel"
    elif not cuda:
        packs, why = False, "auto: not CUDA, where flex_attention has no backward and sdpa would build a dense mask"
    elif attn not in (None, "flex_attention"):
        packs, why = False, f"auto: attn_implementation={attn} would pack with a dense [tokens, tokens] mask"
    elif attn is None and (flash_attention_installed() if flash is None else flash) and dtype != torch.float32:
        packs, attn, why = True, "flash_attention_2", "auto: CUDA with flash-attn installed"
    elif flex_attention_available() if flex is None else flex:
        packs, why = True, "auto: CUDA without flash-attn" if attn is None else "auto: flex_attention on CUDA"
        attn = "flex_attention"
    else:
        packs, why = False, "auto: this torch/transformers has no flex_attention (and flash-attn is absent)"
    update["padding_free"], update["attn_implementation"] = packs, attn
    notes.append(f"{'padding-free packing' if packs else 'padded micro-batches'} ({why}; attention "
                 f"{attn or 'sdpa (transformers default)'})")
    if cfg.micro_batch_split == "balanced":  # verl's dynamic batch size balances the real tokens of packed rows
        if packs:  # the config refuses it without micro_batch_tokens or with padding_free=false
            notes.append("micro-batches balanced (verl's dynamic batch size: ceil(tokens / micro_batch_tokens) per "
                         "rank, token sums balanced, not capped)")
        else:  # padding_free=auto resolved to padded on this device
            update["micro_batch_split"] = "first_fit"
            notes.append("micro_batch_split=balanced needs padding-free packing; padded micro-batches run here "
                         f"({why}), so first_fit")
    return cfg.model_copy(update=update), notes


def _why(value: bool | str, cuda: bool) -> str:
    if value != "auto":
        return "set"
    return "auto: CUDA" if cuda else "auto: not CUDA"


def apply_compile(model: torch.nn.Module, backend: str | object = "inductor") -> int:
    """torch.compile the forward of every decoder layer (`model.model.layers`) in place; returns how many.

    Per block, as torchtitan: the layers share one code object, so one set of graphs serves them all, and the
    module hooks around each forward (FSDP2's all-gather, activation checkpointing) stay eager. The module and
    its parameter names are unchanged (checkpoints and publications see the same state dict). `dynamic=True`:
    sequence lengths are symbolic from the first compile, so a new micro-batch length does not recompile
    (row counts 1 and >1 are two specialisations, train/eval and grad/no-grad a few more; bounded)."""
    layers = model.model.layers
    for layer in layers:
        layer.forward = torch.compile(layer.forward, backend=backend, dynamic=True)
    return len(layers)


def build_optimizer(params: Iterable[torch.nn.Parameter], cfg: LearnerConfig) -> tuple[torch.optim.AdamW, str]:
    """AdamW of `cfg` (lr, betas, weight decay), fused when `cfg.fused_optimizer` is true (resolve "auto" first:
    here it means off). A fused request the kernel refuses (parameters on a device or of a dtype it lacks)
    falls back to the unfused AdamW; the returned note says which one runs and why."""
    params = list(params)
    kwargs = dict(lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay)
    if cfg.fused_optimizer is True:
        try:
            return torch.optim.AdamW(params, fused=True, **kwargs), "AdamW fused"
        except RuntimeError as e:  # torch refuses fused=True for unsupported devices/dtypes at construction
            note = f"AdamW unfused (fused refused: {e})"
            log.warning("learner.fused_optimizer: %s", note)
            return torch.optim.AdamW(params, **kwargs), note
    return torch.optim.AdamW(params, **kwargs), "AdamW unfused (torch's default: foreach on CUDA)"
