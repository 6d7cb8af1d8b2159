"""Loading that fits the learner: each rank builds the model without its weights, shards it, and reads only its
own rows of every parameter from the model folder's safetensors files.

    model = build_empty(model_path)                  # parameters on the meta device, buffers real (tiny)
    prepare_model(model, cfg); fully_shard(...)      # as for a loaded model
    materialize(model, device)                       # this rank's shards allocated, buffers kept
    load_shards(model, model_path, rank, world)      # each shard filled from the files, a tensor slice at a time

A rank never holds more than its shards plus one slice. Why, and which rows a rank reads:
docs/internals.md#learnerloadingpy
"""

from __future__ import annotations

import contextlib
import json
import math
from pathlib import Path

import torch


@contextlib.contextmanager
def _parameters_on_meta():
    """Every parameter registered inside goes to the meta device; buffers stay real."""
    register = torch.nn.Module.register_parameter

    def on_meta(module, name, param):
        register(module, name, param)
        if param is not None and param.device.type != "meta":  # (a meta one is a tie: kept, the same object)
            p = module._parameters[name]
            module._parameters[name] = type(p)(p.to("meta"), requires_grad=p.requires_grad)

    torch.nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register


def build_empty(model_path: str | Path, attn_implementation: str | None = None) -> torch.nn.Module:
    """The model of `model_path` with float32 parameters on the meta device (no memory) and real buffers."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_path)
    with _parameters_on_meta():
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation=attn_implementation)
    return model


def materialize(model: torch.nn.Module, device: torch.device) -> None:
    """Allocate the (sharded) parameters on `device`, uninitialised; buffers keep their values."""
    buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
    model.to_empty(device=device)
    with torch.no_grad():
        for name, b in model.named_buffers():
            b.copy_(buffers[name])


def _weight_files(model_path: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it (one file, or a sharded checkpoint's index)."""
    index = model_path / "model.safetensors.index.json"
    if index.is_file():
        return {k: model_path / f for k, f in json.loads(index.read_text())["weight_map"].items()}
    single = model_path / "model.safetensors"
    if not single.is_file():
        raise FileNotFoundError(f"{model_path} has no model.safetensors (or index): the learner loads safetensors")
    from safetensors import safe_open

    with safe_open(str(single), "pt") as f:
        return {k: single for k in f.keys()}


def load_shards(model: torch.nn.Module, model_path: str | Path, rank: int, world: int,
                skip: set[str] | frozenset[str] = frozenset()) -> None:
    """Fill every parameter of `model` (after `materialize`) with this rank's rows read from the files; the
    parameters named in `skip` (LoRA adapters, which no weight file holds) are left for the caller."""
    from safetensors import safe_open

    model_path = Path(model_path)
    files = _weight_files(model_path)
    aliases: dict[int, list[str]] = {}  # tied parameters have several names; the file may hold any one of them
    for n, q in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(q), []).append(n)
    handles: dict[Path, object] = {}
    try:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name in skip:
                    continue
                source = next((n for n in aliases[id(p)] if n in files), None)
                if source is None:
                    raise ValueError(f"{model_path}: parameter {' / '.join(aliases[id(p)])} is in no weight file")
                f = handles.get(files[source])
                if f is None:
                    f = handles[files[source]] = safe_open(str(files[source]), "pt").__enter__()
                local = p.to_local() if hasattr(p, "to_local") else p
                rows_total = p.shape[0] if p.dim() else 1
                if local.dim() == 0 or local.shape[0] == rows_total:  # replicated or unsharded
                    local.copy_(f.get_tensor(source).to(local.dtype))
                    continue
                start = rank * math.ceil(rows_total / world)
                rows = local.shape[0]
                if rows:
                    local.copy_(f.get_slice(source)[start:start + rows].to(local.dtype))
    finally:
        for h in handles.values():
            h.__exit__(None, None, None)
