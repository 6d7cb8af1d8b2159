"""Activation checkpointing of the trained model's decoder layers (`learner.activation_checkpointing`), and "auto"
chosen from the memory a rank has left.

    cfg, note = resolve_checkpointing(cfg, model, device, dtype, world=W, max_length=P + T)  # "auto" -> a mode
    apply_checkpointing(model, cfg.activation_checkpointing)   # learner.forward.prepare_model, before compile

Three modes, each training the same update (the CPU tests check values and gradients):
- none: every layer keeps what its backward reads (the most memory, no recompute).
- selective: torchtitan's op-level selective checkpointing (`_apply_op_sac`): each layer runs under
  `torch.utils.checkpoint` with a policy that keeps the outputs of its matmuls and attention kernels (`SAVED_OPS`)
  and recomputes the cheap elementwise ops between them (norms, RoPE, SiLU, products) in the backward: about half
  the activations of none, and no matmul runs twice. Unlike torchtitan every matmul is kept, not every second.
- full: each layer keeps only its input and re-runs its forward in the backward (transformers'
  `gradient_checkpointing_enable`, non-reentrant): the least memory, about a third more compute.

Order with `compile` (`learner.levers.apply_compile`, applied after this): selective replaces `layer.forward` by the
checkpointed call, so the compiled region holds the checkpoint and its policy (torchtitan's order, where inductor's
partitioner reads the policy); full checkpoints in the layer's `__call__`, around the compiled forward. Both sit
inside FSDP2's per-layer hooks: the recompute runs while the layer's parameters are gathered for its backward.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from common.config import LearnerConfig

Mode = Literal["none", "selective", "full"]

_SAVED_OP_NAMES = ("mm", "addmm", "bmm", "_scaled_dot_product_flash_attention",
                   "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_efficient_attention",
                   "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_attention_math",
                   "_flash_attention_forward", "_efficient_attention_forward")


def _saved_ops() -> frozenset:
    """The aten overloads (those this torch has) whose outputs selective checkpointing keeps, plus flex_attention."""
    ops = {getattr(torch.ops.aten, name).default for name in _SAVED_OP_NAMES if hasattr(torch.ops.aten, name)}
    try:
        from torch._higher_order_ops.flex_attention import flex_attention
        ops.add(flex_attention)
    except ImportError:  # a torch without flex_attention: nothing to keep for it
        pass
    return frozenset(ops)


SAVED_OPS = _saved_ops()


def _policy(ctx, func, *args, **kwargs):
    """Keep matmul and attention outputs (flash-attn's kernels too: its ops are registered once it is imported);
    recompute everything else (elementwise, norms, views)."""
    if func in SAVED_OPS or getattr(func, "namespace", None) == "flash_attn":
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def _selective_contexts():
    return create_selective_checkpoint_contexts(_policy)


def _selectively_checkpointed(forward: Callable) -> Callable:
    """`forward` run under op-level selective checkpointing when it builds a graph; under no_grad (the old
    log-probs, the reference model, evaluation) as it was."""

    @functools.wraps(forward)
    def run(*args, **kwargs):
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        return checkpoint(forward, *args, use_reentrant=False, context_fn=_selective_contexts, **kwargs)

    return run


def apply_checkpointing(model: torch.nn.Module, mode: str) -> int:
    """Checkpoint every decoder layer (`model.model.layers`) of `model` in place with `mode`; returns how many
    layers (0 for none, and for "auto" left unresolved: `resolve_checkpointing` decides it). The module and its
    parameter names are unchanged (checkpoints and publications see the same state dict)."""
    layers = model.model.layers
    if mode == "full":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return len(layers)
    if mode == "selective":
        for layer in layers:
            layer.forward = _selectively_checkpointed(layer.forward)
        return len(layers)
    return 0


# ------------------------------------------------------------------------------------------------- auto

@dataclass(frozen=True, slots=True)
class LayerShape:
    """What the activation estimate reads of a decoder model: widths in elements."""

    hidden: int
    kv_hidden: int  # key/value heads x head dim (GQA: below `hidden`)
    intermediate: int
    layers: int

    @classmethod
    def of(cls, config) -> LayerShape:
        heads = int(config.num_attention_heads)
        head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
        kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
        return cls(int(config.hidden_size), kv_heads * head_dim, int(config.intermediate_size),
                   int(config.num_hidden_layers))


def activation_bytes(mode: str, tokens: int, shape: LayerShape, dtype_bytes: int) -> int:
    """Estimated activation memory of one micro-batch's forward/backward with `mode`, in bytes.

    Counted from what autograd keeps in a Llama/Qwen decoder layer, per token, in elements of the compute dtype:
    - none: 12 h + 2 kv + 4 i: each RMSNorm keeps its float32 input and two h-wide results (4 h each, the float32
      counting twice), the attention q, k, v, its output and o_proj's input (3 h + 2 kv), the MLP's gate, up,
      SiLU(gate) and down_proj's input (4 i); `tests/learner/test_checkpointing.py` counts the tiny model's;
    - selective: 5 h + 2 kv + 2 i: the layer's input and the matmul/attention outputs (q, k, v, attention, o_proj,
      gate, up, down); the rest is recomputed;
    - full: h per layer (its input), plus one layer's `none` while its backward recomputes it.
    Outside the layers, every mode: 8 h per token (embeddings, final norm, the head's hidden states)."""
    h, kv, i, n = shape.hidden, shape.kv_hidden, shape.intermediate, shape.layers
    per_layer = {"none": 12 * h + 2 * kv + 4 * i, "selective": 5 * h + 2 * kv + 2 * i}
    if mode == "full":
        elements = n * h + per_layer["none"]
    else:
        elements = n * per_layer[mode]
    return tokens * (elements + 8 * h) * dtype_bytes


USABLE = 0.9  # of the device's memory: the rest is the CUDA context, NCCL's buffers and the allocator's slack
RESERVE = 2 << 30  # bytes: the chunked LM head's logits and gradients, FSDP2's gathered layers in flight


# What "auto" may choose: the modes that have run on a GPU. selective is opt-in until it has (issue 42).
AUTO_MODES: tuple[Mode, ...] = ("none", "full")


def choose_checkpointing(memory_bytes: int, state_bytes: int, tokens: int, shape: LayerShape,
                         dtype_bytes: int, modes: tuple[Mode, ...] = AUTO_MODES) -> tuple[Mode, str]:
    """(mode, why): the checkpointing of least recompute among `modes` whose activations fit the memory left.

    Left = USABLE x `memory_bytes` - RESERVE - `state_bytes` (the rank's parameters, gradients and AdamW state);
    none if its `activation_bytes` fit in it, else selective, else full (also when full does not fit: the reason
    says so and what to lower). `tokens`: of one micro-batch."""
    left = USABLE * memory_bytes - RESERVE - state_bytes
    need = {m: activation_bytes(m, tokens, shape, dtype_bytes) for m in ("none", "selective", "full")}
    gib = 2 ** 30
    sizes = ", ".join(f"{m} {b / gib:.1f}" for m, b in need.items())
    head = (f"auto: activations of {tokens} tokens ~ {sizes} GiB; {left / gib:.1f} GiB left of "
            f"{memory_bytes / gib:.1f} after {state_bytes / gib:.1f} GiB of weights, gradients and AdamW state")
    for mode in (m for m in ("none", "selective", "full") if m in modes):
        if need[mode] <= left:
            return mode, head
    return "full", head + ("; even full may not fit: lower learner.micro_batch_tokens (or micro_batch_rows), "
                           "or add learner ranks")


def state_bytes(model: torch.nn.Module, world: int) -> int:
    """Bytes of one rank's share of the parameters (as held: float32 masters, a LoRA base in its own dtype), and of
    the trained ones' float32 gradients and AdamW moments (4 + 8 B each), all sharded over `world` by FSDP2.
    Reads shapes and dtypes only, so a model on the meta device works."""
    held = sum(p.numel() * p.element_size() for p in model.parameters())
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return math.ceil((held + 12 * trained) / world)


def resolve_checkpointing(cfg: LearnerConfig, model: torch.nn.Module, device: torch.device, dtype: torch.dtype, *,
                          world: int, max_length: int, memory_bytes: int | None = None) -> tuple[LearnerConfig, str]:
    """`cfg` with `activation_checkpointing` "auto" decided for this rank, and the note for the start log.

    Off CUDA "auto" is none (what the CPU runs always did). On CUDA: `choose_checkpointing` over the device's
    memory (`memory_bytes`, else the device's total), `model`'s parameters (`state_bytes`; call after the build and
    LoRA, before sharding) and a micro-batch of `learner.micro_batch_tokens` tokens, or `micro_batch_rows` x
    `max_length` without a token budget. A set mode is kept and its note says so."""
    mode = cfg.activation_checkpointing
    if mode != "auto":
        return cfg, f"activation checkpointing {mode} (set)"
    if device.type != "cuda":
        mode, why = "none", "auto: not CUDA"
    else:
        if memory_bytes is None:
            memory_bytes = torch.cuda.get_device_properties(device).total_memory
        tokens = cfg.micro_batch_tokens or cfg.micro_batch_rows * max_length
        mode, why = choose_checkpointing(memory_bytes, state_bytes(model, world), tokens, LayerShape.of(model.config),
                                         dtype.itemsize)
    return cfg.model_copy(update={"activation_checkpointing": mode}), f"activation checkpointing {mode} ({why})"
