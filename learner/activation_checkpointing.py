"""Activation checkpointing of the trained model's decoder layers (`learner.levers.activation_checkpointing`), and
"auto" chosen from the memory a rank has left.

    cfg, note = resolve_checkpointing(cfg, model, device, shape)   # "auto" -> a mode (shape: learner.shape)
    apply_checkpointing(model, cfg.levers.activation_checkpointing)   # learner.forward.prepare_model, before compile

Three modes, each training the same update: none (the most memory, no recompute), selective (torchtitan's
op-level policy: matmul and attention outputs kept, elementwise ops recomputed; about half the activations),
full (each layer keeps only its input: the least memory, about a third more compute).
The modes in detail, and their order with `compile`: docs/internals.md#learneractivation_checkpointingpy
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Literal

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from common.config import LearnerConfig
from learner.shape import TrainShape

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
        # transformers also hooks the embeddings to make their output require grad, which only reentrant
        # checkpointing needs; under no_grad it made the first layer's input require grad and the others' not,
        # two compiled graphs for one forward. The gradients are the same without it.
        model.disable_input_require_grads()
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


def bytes_per_token(mode: str, shape: LayerShape, dtype_bytes: int, compiled: bool = False) -> int:
    """Activation bytes one token of a micro-batch costs its forward/backward with `mode`.

    Counted from what autograd keeps in a Llama/Qwen decoder layer, per token, in elements of the compute dtype:
    - none, eager: 12 h + 2 kv + 4 i: each RMSNorm keeps its float32 input and two h-wide results (4 h each, the
      float32 counting twice), the attention q, k, v, its output and o_proj's input (3 h + 2 kv), the MLP's gate,
      up, SiLU(gate) and down_proj's input (4 i); `tests/learner/test_activation_checkpointing.py` counts the tiny
      model's;
    - selective: 5 h + 2 kv + 2 i: the layer's input and the matmul/attention outputs (q, k, v, attention, o_proj,
      gate, up, down); the rest is recomputed;
    - full: h per layer (its input), plus one layer's `none` while its backward recomputes it.
    `compiled` (per-layer torch.compile with inductor): inductor's partitioner recomputes most elementwise ops in
    the backward, so a layer's none keeps 6 h + 2 kv + 3 i (selective's and one h- and one i-wide tensor more),
    and full's one recomputed layer too. Measured on an H100 (`bench/gpu_bench.py`, peak memory less the
    states and RESERVE): compiled none 1.95 MB a token at 1.5B (this count: 2.07) and 3.29 at 3B (3.58);
    selective, compiled, 2.25 at 3B (this count: 2.39); full 245.8 kB at 3B, as counted.
    Outside the layers, every mode: 8 h per token (embeddings, final norm, the head's hidden states)."""
    h, kv, i, n = shape.hidden, shape.kv_hidden, shape.intermediate, shape.layers
    selective = 5 * h + 2 * kv + 2 * i
    none = 6 * h + 2 * kv + 3 * i if compiled else 12 * h + 2 * kv + 4 * i
    per_layer = {"none": none, "selective": selective}
    if mode == "full":
        elements = n * h + per_layer["none"]
    else:
        elements = n * per_layer[mode]
    return (elements + 8 * h) * dtype_bytes


@dataclass(frozen=True, slots=True)
class LayerCost:
    """How a token's activations are counted: the decoder's widths (`shape`), the compute dtype's bytes, and whether
    the layers run compiled under inductor (`compiled`)."""

    shape: LayerShape
    dtype_bytes: int
    compiled: bool = False

    def per_token(self, mode: str) -> int:
        return bytes_per_token(mode, self.shape, self.dtype_bytes, self.compiled)


@dataclass(frozen=True, slots=True)
class MicroBatchSize:
    """One micro-batch's `tokens`, how they were counted (`counted`, said in the note), and the smallest half a token
    budget may be cut to (`floor`; None: the micro-batch is not a token budget, never halved)."""

    tokens: int
    counted: str = ""
    floor: int | None = None


def activation_bytes(mode: str, tokens: int, shape: LayerShape, dtype_bytes: int, compiled: bool = False) -> int:
    """Estimated activation memory of one micro-batch of `tokens` tokens with `mode`, in bytes: `tokens` x
    `bytes_per_token`."""
    return tokens * bytes_per_token(mode, shape, dtype_bytes, compiled)


USABLE = 0.9  # of the budget: the rest is the CUDA context, NCCL's buffers and the allocator's slack
RESERVE = 2 << 30  # bytes: the chunked LM head's logits and gradients, FSDP2's gathered layers in flight

# Whether op-level selective checkpointing has trained on a GPU. It has: an H100 (torch 2.11) trained
# Qwen2.5-3B's shapes on 14 rows of 1,273-7,837 tokens with it under per-layer compile, 0 recompiles, 4.03 s a step
# (MFU 38.6%) at learner.batching.micro_batch_tokens=9216, against full's 4.78 s (32.5%) at 18,432; at 18,432 it ran out
# of memory, as its count says (41 GiB of activations where 22.5 were left). Auto takes it where none does not fit,
# under compile only: eager selective (compile off or failed) has not run on a GPU.
SELECTIVE_RAN_ON_GPU = True
# What "auto" may choose, least recompute first: the modes that have run on a GPU.
AUTO_MODES: tuple[Mode, ...] = ("none", "selective", "full") if SELECTIVE_RAN_ON_GPU else ("none", "full")
EAGER_AUTO_MODES: tuple[Mode, ...] = ("none", "full")  # the layers eager: selective has not run so on a GPU
# A token budget (`learner.batching.micro_batch_tokens`) auto may halve, once, so that selective fits where only full
# does at the budget as set: the H100 measurement above (3B, 18,432 -> 9,216 tokens: 16% less time a step). Never
# below this many tokens (smaller matmuls lose more than the recompute costs; unmeasured below it) nor below the
# longest row.
HALVE_FLOOR = 8192


@dataclass(frozen=True, slots=True)
class MemoryBudget:
    """Where auto's budget came from, in bytes: the device's memory free now (the CUDA driver's free plus what the
    caching allocator holds unused), capped at the Ray GPU share of the card's total."""

    free: int
    total: int
    share: float  # learner.num_gpus of one rank: 1 = the whole card; 0.5: half of it (a vLLM engine beside it)

    @property
    def bytes(self) -> int:
        return min(self.free, int(self.share * self.total))


def gpu_share(num_gpus: float) -> float:
    """The fraction of one card a rank was given (`learner.num_gpus`, what Ray reserved for the actor): a
    fraction below 1 as given, else the whole card (0, a rank not placed by Ray, included)."""
    return num_gpus if 0 < num_gpus < 1 else 1.0


def micro_batch_tokens(cfg: LearnerConfig, max_length: int, rows: int | None = None) -> tuple[int, str]:
    """(tokens of the largest micro-batch, how it was counted): `learner.batching.micro_batch_tokens` where set (every
    micro-batch is packed up to it); else `micro_batch_rows`, or the `rows` a rank trains per update where fewer,
    x `max_length` (prompt + response of the longest row)."""
    if cfg.batching.micro_batch_tokens:
        return cfg.batching.micro_batch_tokens, "learner.batching.micro_batch_tokens"
    n = cfg.batching.micro_batch_rows if rows is None else max(1, min(cfg.batching.micro_batch_rows, rows))
    return n * max_length, f"{n} rows x {max_length} tokens"


@dataclass(frozen=True, slots=True)
class Choice:
    """What auto chose and the numbers it used (`choose_checkpointing`)."""

    mode: Mode
    budget: MemoryBudget
    state: int  # bytes: the rank's parameters, gradients and AdamW state
    tokens: int  # of one micro-batch
    per_token: dict[str, int]  # mode -> activation bytes per token
    compiled: bool
    modes: tuple[Mode, ...]  # those auto could choose
    counted: str = ""  # how `tokens` was counted (`micro_batch_tokens`)
    halved_from: int = 0  # the token budget as set, where auto halved it for selective (`HALVE_FLOOR`)

    @property
    def left(self) -> float:
        return USABLE * self.budget.bytes - RESERVE - self.state

    def need(self, mode: str) -> int:
        return self.tokens * self.per_token[mode]

    def note(self) -> str:
        """One line for the start log (no semicolons: the levers' notes are joined by them)."""
        gib, b = 2 ** 30, self.budget
        kb = ", ".join(f"{m} {self.per_token[m] / 1e3:.1f}" for m in self.per_token)
        need = ", ".join(f"{m} {self.need(m) / gib:.1f}" for m in self.per_token)
        out = (f"auto{', compiled' if self.compiled else ''}: {self.left / gib:.1f} GiB left = {USABLE:g} x "
               f"{b.bytes / gib:.1f} GiB budget (free {b.free / gib:.1f}, GPU share {b.share:g} of "
               f"{b.total / gib:.1f}) - {RESERVE / gib:.1f} reserve - {self.state / gib:.1f} weights, gradients "
               f"and AdamW state, activations of {self.tokens} tokens{f' ({self.counted})' if self.counted else ''} "
               f"x kB/token {kb} = {need} GiB")
        if self.halved_from:
            out += (f", learner.batching.micro_batch_tokens halved from {self.halved_from} so that selective fits "
                    f"(where only full did: on an H100 at 3B, 16% less time a step)")
        if "selective" not in self.modes:
            out += ", selective not auto's without compile (it has run on a GPU compiled only)"
        if self.need(self.mode) > self.left:
            out += (", even full may not fit: lower learner.batching.micro_batch_tokens (or micro_batch_rows), "
                    "or add learner ranks")
        return out


def choose_checkpointing(budget: MemoryBudget, state_bytes: int, micro: MicroBatchSize, layers: LayerCost,
                         modes: tuple[Mode, ...] = AUTO_MODES) -> Choice:
    """The checkpointing of least recompute among `modes` whose activations fit the memory left.

    Left = USABLE x `budget.bytes` - RESERVE - `state_bytes` (the rank's parameters, gradients and AdamW state);
    none if its activations (`micro.tokens` x `layers.per_token`) fit in it, else selective, else full (also when
    full does not fit: the note says so and what to lower). Where only full fits and `micro.floor` is set (a token
    budget's smallest allowed half), selective at half the tokens when the half is at least the floor and fits (the
    Choice's `tokens` are then the half, and `halved_from` the budget as set)."""
    tokens, counted, floor, compiled = micro.tokens, micro.counted, micro.floor, layers.compiled
    per_token = {m: layers.per_token(m) for m in ("none", "selective", "full")}
    choice = Choice("full", budget, state_bytes, tokens, per_token, compiled, tuple(modes), counted)
    for mode in (m for m in ("none", "selective", "full") if m in modes):
        if choice.need(mode) <= choice.left:
            choice = Choice(mode, budget, state_bytes, tokens, per_token, compiled, tuple(modes), counted)
            break
    half = tokens // 2
    if (choice.mode == "full" and floor is not None and "selective" in modes and half >= floor
            and half * per_token["selective"] <= choice.left):
        return Choice("selective", budget, state_bytes, half, per_token, compiled, tuple(modes), counted, tokens)
    return choice


def state_bytes(model: torch.nn.Module, world: int) -> int:
    """Bytes of one rank's share of the parameters (as held: float32 masters, a LoRA base in its own dtype), and of
    the trained ones' float32 gradients and AdamW moments (4 + 8 B each), all sharded over `world` by FSDP2.
    Reads shapes and dtypes only, so a model on the meta device works."""
    held = sum(p.numel() * p.element_size() for p in model.parameters())
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return math.ceil((held + 12 * trained) / world)


def device_budget(device: torch.device, share: float) -> MemoryBudget:
    """The budget of `device` now: free (driver free + the allocator's cached, unused bytes), its total, `share`."""
    free, total = torch.cuda.mem_get_info(device)
    unused = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return MemoryBudget(free=free + unused, total=total, share=share)


def agreed_budget(budget: MemoryBudget, device: torch.device) -> MemoryBudget:
    """The smallest of the ranks' budgets (one all-reduce at setup; `budget` as it is outside a process group of 2
    or more), so that every rank chooses the same mode and token budget: FSDP2 needs the same collectives on every
    rank, and a rank that recomputes its layers, or cuts its rows into more micro-batches, gathers them more often."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return budget
    smallest = torch.tensor([budget.bytes], dtype=torch.int64, device=device)
    dist.all_reduce(smallest, op=dist.ReduceOp.MIN)
    least = int(smallest.item())
    return replace(budget, free=least) if least < budget.bytes else budget


def resolve_checkpointing(cfg: LearnerConfig, model: torch.nn.Module, device: torch.device, shape: TrainShape, *,
                          budget: MemoryBudget | None = None) -> tuple[LearnerConfig, str]:
    """`cfg` with `activation_checkpointing` "auto" decided for this rank, and the note for the start log.

    Off CUDA "auto" is none (what the CPU runs always did). On CUDA: `choose_checkpointing` over `budget` (None: the
    device's free memory now, capped at `learner.num_gpus`' share of its total: a learner beside a vLLM engine on
    one card budgets only what it was given; the smallest over the ranks, `agreed_budget`), `model`'s parameters
    (`state_bytes` over `shape.world` ranks; call after the build and LoRA, before sharding: the free memory then
    still holds the weights to come), the micro-batch's tokens (`micro_batch_tokens`: `shape.max_length` = the longest
    row's prompt + response, and the rows one rank trains per update where the shape knows a batch's rows), and bytes
    per token in `shape.dtype` with `cfg.levers.compile` (resolved)
    as the layers will run (selective only under inductor's compile, `EAGER_AUTO_MODES` without: how it ran on a GPU).
    A set mode is kept and its note says so. Where only full fits and `learner.batching.micro_batch_tokens` is set, auto
    may halve that budget once so that selective fits (`choose_checkpointing`'s floor: `HALVE_FLOOR`, and the longest
    row rounded up to `pad_multiple`); the returned cfg then carries the halved budget, and the note says so. Not
    covered: a compile that then fails its trial at setup (`learner.trial`) leaves the layers eager under a mode
    chosen from compiled bytes (none may then need up to twice its estimate); `learner.setup` does not re-resolve
    it, and logs `eager_fallback_note`'s WARNING instead. A run's driver hands down `data.max_prompt_tokens` (so
    `max_length` = that + `generator.max_new_tokens`) and a batch's rows (batch_questions x group_size, over
    mini_batches x num_ranks per rank and update); a shape that has neither budgets a 2,048-token prompt."""
    mode = cfg.levers.activation_checkpointing
    if mode != "auto":
        return cfg, f"activation checkpointing {mode} (set)"
    halved: int | None = None
    if device.type != "cuda":
        mode, why = "none", "auto: not CUDA"
    else:
        if budget is None:  # every rank's the same: the smallest over the ranks
            budget = agreed_budget(device_budget(device, gpu_share(cfg.num_gpus)), device)
        max_length = shape.max_length
        tokens, counted = micro_batch_tokens(cfg, max_length, shape.rows_per_update(cfg.batching.mini_batches))
        compiled = cfg.levers.compile is True and cfg.levers.compile_backend == "inductor"
        pad = cfg.levers.pad_multiple if isinstance(cfg.levers.pad_multiple, int) else 1
        floor = max(HALVE_FLOOR, -(-max_length // pad) * pad) if cfg.batching.micro_batch_tokens else None
        layers = LayerCost(LayerShape.of(model.config), shape.torch_dtype.itemsize, compiled)
        choice = choose_checkpointing(budget, state_bytes(model, shape.world), MicroBatchSize(tokens, counted, floor),
                                      layers, modes=AUTO_MODES if compiled else EAGER_AUTO_MODES)
        mode, why = choice.mode, choice.note()
        halved = choice.tokens if choice.halved_from else None
    cfg = cfg.with_levers(activation_checkpointing=mode)
    if halved is not None:
        cfg = cfg.model_copy(update={"batching": cfg.batching.model_copy(update={"micro_batch_tokens": halved})})
    return cfg, f"activation checkpointing {mode} ({why})"


def eager_fallback_note(mode: str, note: str, off: dict[str, str]) -> str | None:
    """The WARNING for a compile that failed its trial after auto chose `mode` from compiled layers' bytes (`note`:
    resolve_checkpointing's), None otherwise. The mode is not re-resolved (the layers are already checkpointed and
    sharded): an eager layer's none keeps 12 h + 2 kv + 4 i where the compiled count was 6 h + 2 kv + 3 i, and
    selective then runs eager, which has not run on a GPU; full is safe either way."""
    if "compile" not in off or "(auto, compiled:" not in note or mode == "full":
        return None
    keeps = "about 1.5-2x the activations auto counted" if mode == "none" else "eager selective (not run on a GPU)"
    return (f"learner.levers.compile failed its trial after activation checkpointing auto chose {mode} from compiled "
            f"layers' memory: the layers now run eager with {mode}, {keeps}; if this run runs out of memory, set "
            "learner.levers.activation_checkpointing=full (or learner.levers.compile=false: auto then counts eager "
            "layers)")
