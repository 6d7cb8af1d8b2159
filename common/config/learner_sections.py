"""The learner's sections by what reads them: `learner.optim` (AdamW and its schedule), `learner.batching` (how a
step's rows become updates and forward passes) and `learner.levers` (the GPU levers, resolved per device)."""

from __future__ import annotations

import os
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from common.config.base import Section


class OptimConfig(Section):
    """AdamW, its learning-rate schedule and the gradient-norm guards (`learner.optim`; read by learner/schedule.py)."""

    lr: float = Field(1e-4, gt=0, le=1)
    """AdamW learning rate (the paper uses 1e-6 for 1.5B-8B models); the peak of `lr_schedule`."""
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    """After the warmup: constant `lr`, or linear / cosine decay from `lr` to `min_lr` at `lr_decay_steps`."""
    warmup_steps: int = Field(0, ge=0, le=10_000_000)
    """Learner steps of linear warmup from lr/warmup_steps to `lr` (0: none)."""
    warmup_ratio: float | None = Field(None, ge=0, lt=1)
    """Warmup as a share of `lr_decay_steps` (resolved into warmup_steps at start; not both)."""
    min_lr: float = Field(0.0, ge=0, le=1)
    """Where the linear and cosine decays end (held after `lr_decay_steps`)."""
    lr_decay_steps: int | None = Field(None, ge=1, le=10_000_000)
    """Learner steps from the start to the end of the decay (None: the run's total_steps, resolved at start and
    saved, so a resume that raises total_steps keeps the schedule)."""
    weight_decay: float = Field(0.01, ge=0, le=1)
    """AdamW weight decay."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas (beta1, beta2), each in [0, 1)."""
    grad_clip: float = Field(1.0, gt=0)
    """Gradient-norm clip."""
    skip_grad_norm: float = Field(500.0, gt=0)
    """Skip (and count) an update whose gradient norm is above this or non-finite."""

    @field_validator("betas")
    @classmethod
    def _betas_below_one(cls, v: tuple[float, float]) -> tuple[float, float]:
        for i, b in enumerate(v):
            if not 0 <= b < 1:
                raise ValueError(f"beta{i + 1} = {b} is outside [0, 1); AdamW's usual values are [0.9, 0.999]")
        return v

    @model_validator(mode="after")
    def _schedule_consistent(self) -> OptimConfig:
        if self.warmup_ratio is not None and self.warmup_steps:
            raise ValueError("learner.optim.warmup_ratio and learner.optim.warmup_steps: set one of them")
        if self.min_lr > self.lr:
            raise ValueError(f"learner.optim.min_lr: {self.min_lr:g} is above learner.optim.lr {self.lr:g}")
        return self


class BatchingConfig(Section):
    """How a step's rows become optimizer updates and forward/backward passes (`learner.batching`;
    read by learner/step.py and learner/forward.py)."""

    mini_batches: int = Field(1, ge=1, le=1024)
    """Optimizer updates per learner step (the paper: 2). Groups are shuffled, fresh and mixed evenly, before
    the split. The policy version still advances by 1 per step."""
    micro_batch_rows: int = Field(64, ge=1, le=100_000)
    """Rows per forward/backward (gradient accumulation inside a mini-batch); with `micro_batch_tokens`, a cap."""
    micro_batch_tokens: int | None = Field(None, ge=1, le=100_000_000)
    """Padded tokens (rows x longest row; with `padding_free`, the rows' own tokens) per forward/backward: each
    rank's rows, sorted by length, are packed greedily up to it, so memory follows the budget, not the longest
    response. Must hold one row of
    data.max_prompt_tokens + generator.max_new_tokens. None: `micro_batch_rows` rows (docs/memory.md)."""
    micro_batch_split: Literal["first_fit", "balanced"] = "first_fit"
    """How a rank's rows become micro-batches under `micro_batch_tokens` with padding-free packing. first_fit: each
    row, longest first, into the first micro-batch with room (every micro-batch within the budget and
    `micro_batch_rows`). balanced: verl's dynamic batch size (`use_dynamic_bsz`, what the ExGRPO paper's runs
    used): ceil(the rank's tokens / the budget) micro-batches, the largest count over the ranks for all, the
    rows partitioned into them with balanced token sums (Karmarkar-Karp, verl's order of merges), so with
    `entropy_agg=micro_batch` the entropy term is weighted as the authors' code weights it. Its sums are
    balanced, not capped: a micro-batch can exceed the budget (as in verl), and `micro_batch_rows` does not
    apply. Padded micro-batches always split first-fit (the start log says so)."""
    logits_chunk_tokens: int | None = Field(None, ge=0, le=1_000_000)
    """Tokens' worth of logits per block of the LM head: log-probs and entropies are computed from the final hidden
    states a block at a time ([tokens, vocabulary] in the forward, [all tokens, a vocabulary slice] in the backward,
    which writes each row of the head's weight gradient once per micro-batch), so no [rows, length, vocabulary]
    tensor exists. None: on CUDA sized once from the free memory (a quarter, at most 2 GiB of temporaries: 1,766
    tokens at a 152k vocabulary), elsewhere about 32M logits (220 tokens at 152k). 0: full logits (their
    memory grows with rows x length x vocabulary; for comparison only)."""


class LeversConfig(Section):
    """The GPU levers (`learner.levers`): each a switch with `auto` resolved once a rank knows its device
    (`resolve_levers` in learner/levers.py), tried at setup (`learner.trial`); none changes what is computed."""

    attn_implementation: str | None = None
    """The learner model's attention (transformers' `attn_implementation`): sdpa, eager, flash_attention_2,
    flash_attention_3, flex_attention or a kernels-hub repo such as kernels-community/flash-attn2. None:
    transformers' default (sdpa). The generators' vLLM engines choose their own."""
    compile: bool | Literal["auto"] = "auto"
    """torch.compile each decoder layer of the trained model (torchtitan's per-block compile; only rows and length
    dynamic, so micro-batches of any length reuse the same graphs).
    auto: on where the learner runs on CUDA and the model's hidden size is 512 or more (a toy model's step never
    buys its compile back), off on CPU. The setup's trial compiles the graphs the run uses (minutes at 1.5B; later
    steps reuse them, and a later graph is counted in learner/recompiles); later processes on the machine reuse
    inductor's on-disk cache. Tried at setup (`learner.trial`): a compile that fails is off for the run, which
    trains eager and says so; falls back to eager where torch.compile is unsupported (docs/gpu-settings.md,
    levers)."""
    compile_backend: str = Field("inductor", min_length=1, max_length=64)
    """The torch.compile backend of `compile`: inductor (the fast one); aot_eager or eager trace without
    generating kernels (tests, debugging)."""
    compile_cache_dir: str | None = Field(None, max_length=4096)
    """A folder for inductor's compile cache (every learner rank's TORCHINDUCTOR_CACHE_DIR) where `compile` is on.
    On storage every node reaches, a rank on a fresh machine (a new node, a restarted container) reuses the kernels
    an earlier rank compiled for the same GPU and torch instead of compiling them again. None:
    inductor's default under the machine's temp folder, reused only by later processes of that machine. An absolute
    path (`~` expanded)."""
    compile_head_math: bool = False
    """torch.compile (inductor) the chunked head's per-block float32 math (`learner.token_stats.COMPILE_BLOCK_MATH`),
    fusing its elementwise passes over [tokens, vocabulary] blocks. Exact against full logits; off by default
    (opt-in) until its speed on a GPU is known (`python bench/gpu_bench.py --runs 1.5B:fixed --compile-head-math`)."""
    activation_checkpointing: Literal["auto", "full", "selective", "none"] = "auto"
    """Recompute decoder layers' activations in the backward instead of keeping them
    (`learner/activation_checkpointing.py`). full: each layer keeps only its input and re-runs its forward (about 1/3
    more compute; one layer's activations instead of all). selective: torchtitan's op-level checkpointing, each layer
    keeps its matmul and attention outputs and recomputes only the elementwise ops between them (no matmul twice; about
    half the activations of none). none: keep everything. auto: on CUDA, the least recompute whose estimated activations
    for one micro-batch (`micro_batch_tokens`, or `micro_batch_rows` x the longest row) fit the memory left after the
    weights, gradients and AdamW state (the start log says what it chose and why); none off CUDA. true and false
    (older configs) mean full and none."""
    padding_free: bool | Literal["auto"] = "auto"
    """Pack each micro-batch's rows into one sequence without padding (position ids restart at every row; the
    attention keeps rows apart), so `micro_batch_tokens` counts real tokens and no compute goes to padding.
    auto: on only where `attn_implementation` is a variable-length kernel the user chose (flash_attention_2/3 or a
    kernels-hub flash-attention); padded micro-batches elsewhere, CUDA included (packing through flex_attention is
    opt-in). true: on CUDA with `attn_implementation` unset, flash_attention_2 where flash-attn is
    installed (bf16/fp16), else flex_attention (kept out of the compiled layers' graphs); with sdpa/eager, or on a
    CPU, a [tokens, tokens] block-diagonal mask per micro-batch (exact; memory grows with the budget squared).
    Tried at setup like every lever (`learner.trial`): if it fails, the run trains padded and says so. The learner
    also checks at start that the model keeps packed rows apart and refuses it otherwise; the metric
    `learner/padding_free` and the start log say which path ran and why (docs/gpu-settings.md, levers)."""
    pad_multiple: int | Literal["auto"] = "auto"
    """Padded micro-batches' length (rows x longest row) rounded up to a multiple of this many tokens (1 to 4096).
    The extra positions come after every real token, so no real token attends to them: log-probs, entropies and
    gradients are those of the unrounded micro-batch. Kernels chosen per shape (cuDNN attention builds a graph per
    rows x length; inductor's autotuning) then meet a few lengths instead of every one. auto: 64 on CUDA, 1 (no
    rounding) elsewhere. Packed micro-batches (`padding_free`) are not rounded."""
    fused_optimizer: bool | Literal["auto"] = "auto"
    """AdamW's fused kernel (one launch over all parameters instead of several per tensor). auto: on when the
    parameters are on CUDA. Tried at setup with a step that moves no
    weight (`learner.trial`); falls back to the foreach AdamW, and says why, where the kernel fails or does not take
    the parameters."""

    @field_validator("activation_checkpointing", mode="before")
    @classmethod
    def _checkpointing_from_bool(cls, v: Any) -> Any:
        return {True: "full", False: "none"}[v] if isinstance(v, bool) else v

    @field_validator("compile_cache_dir")
    @classmethod
    def _absolute_cache_dir(cls, v: str | None) -> str | None:
        if v is None:
            return v
        path = os.path.expanduser(v)
        if not os.path.isabs(path):
            raise ValueError(f"{v!r} is relative, and a learner rank's working folder is Ray's, not yours: give an "
                             "absolute path on storage every node reaches, e.g. /shared/exgrpo-inductor-cache")
        return path

    @field_validator("pad_multiple", mode="before")
    @classmethod
    def _pad_multiple_bounds(cls, v: object) -> object:
        """One line for any wrong value (before pydantic's union, whose members' errors name its internals)."""
        if v == "auto":
            return v
        n = v if isinstance(v, int) and not isinstance(v, bool) else (
            int(v) if isinstance(v, str) and v.strip().isdigit() else None)
        if n is None or not 1 <= n <= 4096:
            raise ValueError(f"give a token count from 1 (no rounding) to 4096, or auto (64 on CUDA, 1 elsewhere), "
                             f"not {v!r}")
        return n

    @field_validator("attn_implementation")
    @classmethod
    def _known_attention(cls, v: str | None) -> str | None:
        known = ("sdpa", "eager", "flash_attention_2", "flash_attention_3", "flex_attention")
        if v is not None and v not in known and "/" not in v:
            raise ValueError(f"{v!r} is not an attention implementation transformers knows: use one of "
                             f"{', '.join(known)} or a kernels-hub repo (e.g. kernels-community/flash-attn2)")
        return v

    @property
    def varlen_attention(self) -> bool:
        """Whether `attn_implementation` is a variable-length (flash-attention) kernel, which packs rows for free."""
        impl = self.attn_implementation or ""
        return impl.startswith("flash_attention") or ("flash" in impl and "/" in impl)

    @property
    def packs_padding_free(self) -> bool:
        """Whether micro-batches are packed without padding (`padding_free`, auto resolved)."""
        return self.varlen_attention if self.padding_free == "auto" else bool(self.padding_free)
