"""Low-rank adapters on the learner's Linear projections (`learner.lora`).

    targets = apply_lora(model, cfg.lora)        # before prepare_model and FSDP2 sharding (meta device or real)
    ... fully_shard, materialize, load_shards(model, path, rank, world, skip=adapter_names(model))
    init_adapters(model, seed, rank, world)      # A kaiming-uniform, B zeros: the model starts as the base model
    optimizer = AdamW(p for p in model.parameters() if p.requires_grad)    # the adapters only
    with torch.no_grad(), adapters_disabled(model): ref = model(...)        # the base: the KL reference

`LoRALinear` keeps the base model's state-dict names and adds `...lora_A` [r, in] and `...lora_B` [out, r]:
y = x W^T + b + (alpha / r) dropout(x) A^T B^T. Imports only torch.
Why our own and not peft, and how publications merge: docs/internals.md#learnerlorapy
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import Tensor, nn


class LoRALinear(nn.Module):
    """A frozen Linear plus a trainable low-rank update. `weight` and `bias` are the wrapped Linear's parameters."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float, dropout: float = 0.0):
        super().__init__()
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight  # [out, in], frozen
        self.bias = base.bias  # [out] or None, frozen
        self.weight.requires_grad_(False)
        if self.bias is not None:
            self.bias.requires_grad_(False)
        device = base.weight.device  # the meta device in a sharded build: allocated by `materialize`
        self.lora_A = nn.Parameter(torch.empty(rank, self.in_features, device=device))  # [r, in]
        self.lora_B = nn.Parameter(torch.zeros(self.out_features, rank, device=device))  # [out, r]
        self.rank, self.scaling = rank, alpha / rank
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.disabled = False  # set only inside `adapters_disabled`: the forward is the base Linear's

    def forward(self, x: Tensor) -> Tensor:
        base = nn.functional.linear(x, self.weight, self.bias)  # [..., out]
        if self.disabled:
            return base
        low = nn.functional.linear(self.dropout(x).to(self.lora_A.dtype), self.lora_A)  # [..., r]
        return base + (self.scaling * nn.functional.linear(low, self.lora_B)).to(base.dtype)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, rank={self.rank}, scaling={self.scaling:g}"


def linear_names(model: nn.Module) -> list[str]:
    """Full names of every nn.Linear in `model` (what `target_modules` is matched against, by last part)."""
    return [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]


def apply_lora(model: nn.Module, cfg) -> list[str]:
    """Replace every nn.Linear whose last name part is in `cfg.target_modules` (a `LoRAConfig`) by a `LoRALinear`,
    freeze every other parameter; returns the replaced names. The head is never a target (the config refuses it).
    ValueError naming the model's Linear modules when a target matches none."""
    names = linear_names(model)
    targets = [n for n in names if n.rsplit(".", 1)[-1] in cfg.target_modules and n != "lm_head"]
    found = {n.rsplit(".", 1)[-1] for n in targets}
    missing = [t for t in cfg.target_modules if t not in found]
    if missing:
        kinds = sorted({n.rsplit(".", 1)[-1] for n in names})
        raise ValueError(f"learner.lora.target_modules: {', '.join(missing)} match no Linear of this model; its Linear "
                         f"modules are {', '.join(kinds)} (e.g. {names[0] if names else '-'}); "
                         "set learner.lora.target_modules to some of them")
    model.requires_grad_(False)
    for name in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        setattr(parent, child, LoRALinear(getattr(parent, child), cfg.rank, cfg.alpha, cfg.dropout))
    return targets


def lora_modules(model: nn.Module) -> dict[str, LoRALinear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, LoRALinear)}


def adapter_names(model: nn.Module) -> set[str]:
    """State-dict names of the adapter tensors (`...lora_A`, `...lora_B`): checkpointed; published alone (adapter
    publications) or not at all (merged ones)."""
    return {f"{n}.{p}" for n in lora_modules(model) for p in ("lora_A", "lora_B")}


@contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """Run `model` as its base model inside the block: every `LoRALinear` skips its low-rank term (and its dropout).
    This is the KL reference under LoRA (`learner.step.TrainStep`): the base weights are frozen, so the base is
    the same model with its adapters off, and no second copy is loaded. Under FSDP2 the forward still all-gathers
    each layer's adapters with its base weights (the units are unchanged; the adapters are unused), so every rank
    must run the same forwards inside the block, as outside.

    Use it for no-grad forwards only. Activation checkpointing re-runs a layer's forward in the backward: a
    forward that saved activations here and was backpropagated after the block would be recomputed with the
    adapters on. The flag is reset on exit, even on an error."""
    mods = list(lora_modules(model).values())
    for m in mods:
        m.disabled = True
    try:
        yield
    finally:
        for m in mods:
            m.disabled = False


def _local(t: Tensor) -> Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


@torch.no_grad()
def init_adapters(model: nn.Module, seed: int, rank: int, world: int) -> None:
    """A: kaiming-uniform (bound 1/sqrt(in), nn.Linear's default), drawn whole from one generator seeded `seed` in
    module order, so every rank and every world size gets the same A; each rank keeps its rows (FSDP2 dim-0
    shards). B: zeros, so the adapted model starts equal to the base."""
    gen = torch.Generator().manual_seed(seed)
    for m in lora_modules(model).values():
        full = (torch.rand(m.lora_A.shape, generator=gen) * 2 - 1) / math.sqrt(m.in_features)  # [r, in]
        local = _local(m.lora_A)
        if local.shape[0] != full.shape[0]:  # a shard: rows [rank * c, rank * c + its rows)
            start = rank * math.ceil(full.shape[0] / world)
            full = full[start:start + local.shape[0]]
        local.copy_(full)
        _local(m.lora_B).zero_()


def hold_frozen_in(model: nn.Module, dtype: torch.dtype) -> int:
    """Hold every frozen floating-point parameter of `model` in `dtype` (the LoRA base in the compute dtype, before
    FSDP2 shards it: on the meta device nothing is allocated); a tied parameter stays tied. FSDP2 asks a uniform
    dtype of the trainable parameters only, so the float32 adapters train beside a bfloat16 base. Returns the
    parameters changed (elements, a tied one once)."""
    changed = 0
    for p in model.parameters():  # each Parameter once (a tied one too)
        if not p.requires_grad and p.is_floating_point() and p.dtype != dtype:
            p.data = p.data.to(dtype)
            changed += p.numel()
    return changed


def merged_weight(m: LoRALinear) -> Callable[[], Tensor]:
    """A function computing W + scaling B A for `m` in float32, from `m.weight` as it is held (float32 or the
    compute dtype, `learner.lora.base_dtype`; a tensor or FSDP2's dim-0 DTensor shard: each rank merges its own
    rows). Collective under FSDP (A's full tensor is gathered): every rank
    calls it in the same order."""

    @torch.no_grad()
    def merge() -> Tensor:
        w, a, b = m.weight, m.lora_A, m.lora_B
        a_full = a.full_tensor() if hasattr(a, "full_tensor") else a  # [r, in]
        local = _local(w) + m.scaling * (_local(b) @ a_full)  # [rows, in]: this rank's rows of W + s B A
        if not hasattr(w, "to_local"):
            return local
        from torch.distributed.tensor import DTensor

        return DTensor.from_local(local, w.device_mesh, w.placements, run_check=False, shape=w.shape,
                                  stride=w.stride())

    return merge
