"""The GPU levers of a learner rank, each a switch of `learner.levers`, resolved once the rank knows its device.

    cfg, notes = resolve_levers(cfg, device, dtype)   # "auto" -> true/false, attention chosen; one note per lever
    prepare_model(model, cfg)                         # learner.forward: apply_compile when cfg.levers.compile
    optimizer, note = build_optimizer(model.parameters(), cfg)

`auto` means "on where it has run and helped on a GPU" (per-layer compile and fused AdamW, on CUDA; padding-free
packing is opt-in). A lever that cannot run here falls back and its note says why; none of them changes what is
computed. Every lever that is on is tried at setup (`learner.trial`).
Details (measurements, padding-free packing, `learner.levers.pad_multiple`): docs/internals.md#learnerleverspy
"""

from __future__ import annotations

import functools
import importlib.util
import logging
from collections.abc import Iterable

import torch

from common.config import LearnerConfig

log = logging.getLogger(__name__)


def flash_attention_installed() -> bool:
    """Whether the flash-attn package (transformers' flash_attention_2) is importable here."""
    return importlib.util.find_spec("flash_attn") is not None


ATTENTION_PACKAGES = {"flash_attention_2": "flash_attn", "flash_attention_3": "flash_attn_interface"}
"""The package each attention kernel of transformers needs (what `is_flash_attn_*_available` looks for)."""


def attention_problem(attn: str | None) -> str | None:
    """Why `learner.levers.attn_implementation` cannot load on this machine: its package does not import (transformers
    would raise an ImportError when the learner loads the model). None: it imports, or needs no package."""
    package = ATTENTION_PACKAGES.get(attn or "")
    if package is None:
        return None
    try:
        importlib.import_module(package)
    except (ImportError, OSError) as e:  # not installed, or built for another torch/CUDA (undefined symbol)
        why = " ".join(str(e).split())[:200] or type(e).__name__
        return (f"learner.levers.attn_implementation: {attn} needs the {package} package, which does not import here "
                f"({why}); set learner.levers.attn_implementation=sdpa (transformers' default) or eager, or install "
                f"{package.replace('_', '-')} for this torch and CUDA")
    return None


def flex_attention_available() -> bool:
    """Whether torch has flex_attention and transformers can run it (torch >= 2.5)."""
    from transformers.utils import is_torch_flex_attn_available

    return bool(is_torch_flex_attn_available())


COMPILE_MIN_WIDTH = 512  # hidden size below which compile "auto" stays off on CUDA too


def resolve_levers(cfg: LearnerConfig, device: torch.device, dtype: torch.dtype = torch.float32, *,
                   flash: bool | None = None, flex: bool | None = None,
                   width: int | None = None) -> tuple[LearnerConfig, list[str]]:
    """`cfg` with `compile`, `fused_optimizer` and `padding_free` decided for `device` (and, for an unset
    attention on CUDA, `attn_implementation`), and one note per lever saying what runs and why.
    `flash`/`flex`: whether those kernels are available (None: look). `width`: the model's hidden size where
    known: compile "auto" stays off below `COMPILE_MIN_WIDTH` (a toy model's step is a few launch-bound
    milliseconds that compiling cannot buy back, while the compile costs the run's first update tens of seconds)."""
    cuda = device.type == "cuda"
    update: dict = {}
    notes = []

    compile_on, why = _compile_choice(cfg, cuda, width)
    update["compile"] = compile_on
    notes.append(f"compile {'on' if compile_on else 'off'} ({why})" + (
        f": each decoder layer, backend {cfg.levers.compile_backend}, rows and length dynamic (every other size a "
        "constant); the lever trial compiles the graphs the run uses, before the first step (minutes at 1.5B)" if compile_on else ""))
    pad = (64 if cuda else 1) if cfg.levers.pad_multiple == "auto" else cfg.levers.pad_multiple
    update["pad_multiple"] = pad

    fused = cuda if cfg.levers.fused_optimizer == "auto" else bool(cfg.levers.fused_optimizer)
    update["fused_optimizer"] = fused
    notes.append(f"fused AdamW {'on' if fused else 'off'} ({_why(cfg.levers.fused_optimizer, cuda)})")

    packs, attn, why = _packing_choice(cfg, cuda, dtype, flash, flex)
    update["padding_free"], update["attn_implementation"] = packs, attn
    notes.append(f"{'padding-free packing' if packs else 'padded micro-batches'} ({why}; attention "
                 f"{attn or 'sdpa (transformers default)'})" + (
                     f", lengths rounded up to a multiple of {pad} (learner.levers.pad_multiple)"
                     if pad > 1 and not packs else ""))
    batching = cfg.batching
    if batching.micro_batch_split == "balanced":  # verl's dynamic batch size balances the real tokens of packed rows
        if packs:  # the config refuses it without micro_batch_tokens or with padding_free=false
            notes.append("micro-batches balanced (verl's dynamic batch size: ceil(tokens / micro_batch_tokens) per "
                         "rank, token sums balanced, not capped)")
        else:  # padding_free=auto resolved to padded on this device
            batching = cfg.batching.model_copy(update={"micro_batch_split": "first_fit"})
            notes.append("micro_batch_split=balanced needs padding-free packing; padded micro-batches run here "
                         f"({why}), so first_fit")
    return cfg.with_levers(**update).model_copy(update={"batching": batching}), notes


def _compile_choice(cfg: LearnerConfig, cuda: bool, width: int | None) -> tuple[bool, str]:
    """`learner.levers.compile` decided: whether each decoder layer is compiled, and why (see `resolve_levers`)."""
    on = cuda if cfg.levers.compile == "auto" else bool(cfg.levers.compile)
    why = _why(cfg.levers.compile, cuda)
    if on and cfg.levers.compile == "auto" and width is not None and width < COMPILE_MIN_WIDTH:
        on, why = False, (f"auto: a hidden size of {width} is below {COMPILE_MIN_WIDTH}, where compiling "
                          "costs the first update more than it saves; learner.levers.compile=true compiles anyway")
    if on and not torch._dynamo.is_dynamo_supported():
        on, why = False, "torch.compile is not supported by this Python/platform; eager instead"
    return on, why


def _packing_choice(cfg: LearnerConfig, cuda: bool, dtype: torch.dtype, flash: bool | None,
                    flex: bool | None) -> tuple[bool, str | None, str]:
    """`learner.levers.padding_free` decided: (packs, attention implementation, why). Packing set on CUDA with no
    attention chosen takes flash_attention_2 (flash-attn installed, below float32), else flex_attention."""
    attn = cfg.levers.attn_implementation
    if cfg.levers.padding_free == "auto":
        packs = cfg.levers.varlen_attention
        why = (f"auto: {attn} is a variable-length kernel" if packs else
               "auto: packing is opt-in (learner.levers.padding_free=true) until it has run on a GPU: through "
               "flex_attention under per-layer compile it failed on an H100" if cuda else
               "auto: not CUDA, where flex_attention has no backward and sdpa would build a dense mask")
    elif not cfg.levers.padding_free:
        packs, why = False, "set"
    elif not cuda or attn not in (None, "flex_attention"):
        packs, why = True, "set"
    elif attn is None and (flash_attention_installed() if flash is None else flash) and dtype != torch.float32:
        packs, attn, why = True, "flash_attention_2", "set; CUDA with flash-attn installed"
    elif flex_attention_available() if flex is None else flex:
        packs, attn, why = True, "flex_attention", "set; flex_attention on CUDA (tried at setup, off if it fails)"
    else:
        packs, why = True, "set; this torch/transformers has no flex_attention: sdpa with a dense mask per micro-batch"
    return packs, attn, why


def _why(value: bool | str, cuda: bool) -> str:
    if value != "auto":
        return "set"
    return "auto: CUDA" if cuda else "auto: not CUDA"


def apply_compile(model: torch.nn.Module, backend: str | object = "inductor") -> int:
    """torch.compile the forward of every decoder layer (`model.model.layers`) in place; returns how many.

    Per block, as torchtitan: the layers share one code object, so one set of graphs serves them all, and the
    module hooks around each forward (FSDP2's all-gather, activation checkpointing) stay eager. The module and
    its parameter names are unchanged (checkpoints and publications see the same state dict). Measured on an H100
    (+12.4% at 1.5B, padded sdpa).

    Shapes: `dynamic=None` with the rows and length dimensions of the layer's inputs marked dynamic
    (`mark_shapes`), so every other size (hidden, head_dim, num_key_value_groups) is a constant in the kernels. One
    row is a case of its own (dynamo specializes a size of 1, which broadcasts): a 1-row micro-batch (one long
    response, the packed layout, a rank's dummy) has its own graphs, which the lever trial builds before the first
    step. Dynamo's size-oblivious tracing (`backed_size_oblivious`) would let 1 row share the graphs of several, but
    under inductor it fixed the length of the graph with gradients (a recompile for every new length, on CPU), so it
    is not used. The layer's input always arrives as a view (`hidden_states.view_as(...)`, free): FSDP2's
    post-backward hook hands the forward a view but full checkpointing's recompute a plain tensor, and dynamo
    guards on the difference (a second graph). So a run uses 4 graphs: with and without gradients, for 1 row and
    for more (`tests/learner/test_trial.py` counts them: all built by the trial, none by the steps).

    flex_attention stays out of the layers' graphs (`isolate_flex_attention`), as torchtitan keeps it out of its
    compiled blocks: traced inside them with dynamic shapes, the hidden size became a symbol, the head count
    floor(T*H / (T*d)), and flex's lowering failed on it on an H100 (InductorError). Out of the graph,
    flex runs as transformers runs it uncompiled: its own separately compiled flex_attention. The layer's graph then
    breaks at flex, and dynamo compiles the pieces around it as frames of their own whose inputs carry no marks:
    there the layers keep `dynamic=True` (every size symbolic; packed rows are always 1)."""
    flex = getattr(model.config, "_attn_implementation", None) == "flex_attention"
    if flex:
        isolate_flex_attention()
    layers = model.model.layers
    for layer in layers:
        layer.forward = _shape_marked(torch.compile(layer.forward, backend=backend, dynamic=True if flex else None),
                                      mark=not flex)
    return len(layers)


def _shape_marked(compiled, mark: bool = True):
    """`compiled` (a torch.compile'd layer forward) called with its input as a view and, with `mark`, its rows and
    length dimensions marked dynamic (see `apply_compile`). Eager code around the compiled region: marking is
    refused while tracing."""

    @functools.wraps(compiled)
    def forward(hidden_states, *args, **kwargs):
        hidden_states = hidden_states.view_as(hidden_states)  # [R, L, H]: a view, in the forward and the recompute
        if mark:
            mark_shapes(hidden_states, kwargs)
        return compiled(hidden_states, *args, **kwargs)

    return forward


def mark_shapes(hidden_states: torch.Tensor, kwargs: dict) -> None:
    """Mark the dimensions that change from micro-batch to micro-batch dynamic: rows and length of `hidden_states`
    [R, L, H] (and of its base), length of the rotary `position_embeddings` ([B, L, d] each), of `position_ids`
    [B, L], of `cache_position` [L], and of a tensor `attention_mask` ([R, L] or [R, 1, L, L]). B = 1 (transformers'
    position ids of padded rows, or a packed sequence) is left as the constant it is: it broadcasts.
    `maybe_mark_dynamic`: a model whose code needs one of them constant specializes it (a recompile, which
    `learner/recompiles` counts and logs) instead of raising, which would switch compile off for the run."""
    mark = torch._dynamo.maybe_mark_dynamic
    mark(hidden_states, [0, 1])
    base = hidden_states._base
    if base is not None and base.shape == hidden_states.shape:
        mark(base, [0, 1])
    for t in kwargs.get("position_embeddings") or ():
        if isinstance(t, torch.Tensor) and t.dim() >= 2:
            mark(t, 1)
    ids = kwargs.get("position_ids")
    if isinstance(ids, torch.Tensor) and ids.dim() == 2:
        mark(ids, 1)
    cache = kwargs.get("cache_position")
    if isinstance(cache, torch.Tensor) and cache.dim() == 1:
        mark(cache, 0)
    mask = kwargs.get("attention_mask")
    if isinstance(mask, torch.Tensor) and mask.dim() in (2, 4):  # rows only where not broadcast (1)
        mark(mask, ([0] if mask.shape[0] > 1 else []) + ([1] if mask.dim() == 2 else [2, 3]))


def isolate_flex_attention() -> None:
    """Make transformers' flex_attention a graph break for torch.compile (`torch.compiler.disable`), process-wide.
    Eager code is unaffected (the decorator only acts while compiling); idempotent."""
    from transformers.modeling_utils import AttentionInterface

    current = AttentionInterface._global_mapping["flex_attention"]
    if not getattr(current, "_exgrpo_isolated", False):
        isolated = torch.compiler.disable(current, recursive=True)
        isolated._exgrpo_isolated = True
        AttentionInterface.register("flex_attention", isolated)


def remove_compile(model: torch.nn.Module) -> int:
    """Undo `apply_compile`: every decoder layer runs its own (eager) forward again; returns how many."""
    n = 0
    for layer in model.model.layers:
        if "forward" in vars(layer):
            del layer.forward
            n += 1
    torch._dynamo.reset()  # drop the graphs (and a failed compile's state) of the layers
    return n


def build_optimizer(params: Iterable[torch.nn.Parameter], cfg: LearnerConfig) -> tuple[torch.optim.AdamW, str]:
    """AdamW of `cfg` (lr, betas, weight decay), fused when `cfg.levers.fused_optimizer` is true (resolve "auto" first:
    here it means off). A fused request the kernel refuses (parameters on a device or of a dtype it lacks)
    falls back to the unfused AdamW; the returned note says which one runs and why."""
    params = list(params)
    kwargs = dict(lr=cfg.optim.lr, betas=cfg.optim.betas, weight_decay=cfg.optim.weight_decay)
    if cfg.levers.fused_optimizer is True:
        try:
            return torch.optim.AdamW(params, fused=True, **kwargs), "AdamW fused"
        except RuntimeError as e:  # torch refuses fused=True for unsupported devices/dtypes at construction
            note = f"AdamW unfused (fused refused: {e})"
            log.warning("learner.levers.fused_optimizer: %s", note)
            return torch.optim.AdamW(params, **kwargs), note
    return torch.optim.AdamW(params, **kwargs), "AdamW unfused (torch's default: foreach on CUDA)"
