"""The `learner` section and its weight-sync backends."""

from __future__ import annotations

import os
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from common.config.base import Section, pick_kind


class ObjectStoreSyncConfig(Section):
    """Publish weights through Ray's object store via a named weight-store actor (CPU and any cluster)."""

    kind: Literal["object_store"] = "object_store"
    bucket_mb: float = Field(256.0, gt=0, le=16_384)
    """A publication is gathered and put into the object store in objects of about this size; learner rank 0
    holds one at a time beside its shard (a tensor larger than this is an object of its own)."""
    delta: bool = False
    """Publish only what changed since the previous version (per tensor: the positions whose bits changed and
    their values, or the whole tensor when that is smaller; with a checksum), beside the full version. A
    generator holding the previous version applies the delta (bit-exact, verified); one that joins, is more
    than one version behind, or finds a checksum mismatch gets the full copy. Costs a host copy of the
    published weights on learner rank 0 and on each generator. Bytes per publication: docs/cluster.md."""


class CollectiveSyncConfig(Section):
    """Learner rank 0 serves each generator over its own 2-process channel (gloo/NCCL); see learner.collective."""

    kind: Literal["collective"] = "collective"
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    """Channel transport: auto = nccl when learner rank 0 and the generator both see CUDA, else gloo."""
    bucket_mb: float = Field(64.0, gt=0, le=16_384)
    """Size of the flat buffers the state dict is sent in (MiB; a larger tensor gets a buffer of its own)."""
    timeout_s: float = Field(60.0, gt=0, le=3600)
    """Upper bound on every send/receive of a transfer and on opening a channel (capped by
    learner.publish_timeout_s); the error names the generator and the version."""
    port: int = Field(0, ge=0, le=65535)
    """TCP port of the rendezvous store on learner rank 0 (0 = a free port, announced to the generators)."""
    keep_versions: int = Field(2, ge=1, le=16)
    """Published versions rank 0 keeps packed, so a generator that read an announcement just before the next
    publication still receives that version. Host memory (pinned on GPU machines); where rank 0's channels may be
    NCCL the newest is also held on its GPU and sent from there (one packed copy in the publication dtype), its
    host copy made in the background, and with 1 no host copy at all."""
    delta: bool = False
    """Publish only what changed since the previous version (per tensor: the positions whose bits changed and
    their values, or the whole tensor when that is smaller; with a checksum), beside the full version. A
    generator holding the previous version applies the delta (bit-exact, verified); one that joins, is more
    than one version behind, or finds a checksum mismatch gets the full copy. Costs a host copy of the
    published weights on learner rank 0 and on each generator. Bytes per publication: docs/cluster.md."""
    relay_fanout: int = Field(0, ge=0, le=64)
    """0: every generator pulls each version from learner rank 0 (a star: rank 0 sends N copies). k >= 1:
    generators relay to each other in a pipelined tree of fan-out k in arrival order (1 = a chain), forwarding
    buckets as they arrive, so rank 0 sends about k copies and the time stays near one transfer as N grows. A
    relay that dies or stalls: its children resume at rank 0 from the first missing bucket. Costs each
    generator one packed copy of the newest version in host memory, and a port. Measured:
    docs/cluster.md ("Weight fan-out")."""


WeightSyncConfig = Annotated[ObjectStoreSyncConfig | CollectiveSyncConfig, Field(discriminator="kind")]

OWN_LOSS_AGG = {"ppo_clip": "token_mean", "gspo": "seq_mean_token_mean", "cispo": "token_mean",
                "sapo": "seq_mean_token_mean"}
"""Each `policy_loss`'s own `loss_agg` (what learner.loss_agg None resolves to): GSPO's and SAPO's papers, and verl,
average each row's token mean over the rows; PPO's and CISPO's (MiniMax-M1's token-level) take a token mean."""

LORA_DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class LoRAConfig(Section):
    """Low-rank adapters on the learner (learner.lora; docs/cluster.md "LoRA"): each target Linear's
    weight W is frozen and the learner trains W + (alpha / rank) B A only, A [rank, in] and B [out, rank] (B starts
    at zero, so step 0 is the base model). Only the adapters are in the optimizer. Publications carry the adapters
    only (`publish`; generators merge them into the base), or the merged weights under the model's own names.
    Checkpoints export the merged model (`learner/model/`) and the adapters in peft's format (`learner/adapter/`).
    With `kl_coef > 0` the KL reference is the base, the same model with its adapters disabled: no second copy."""

    rank: int = Field(8, ge=1, le=4096)
    """The adapters' rank r (A is [r, in], B is [out, r])."""
    alpha: float = Field(16.0, gt=0, le=1e6)
    """Scaling numerator: the update is (alpha / rank) B A."""
    dropout: float = Field(0.0, ge=0, lt=1)
    """Dropout on the adapter's input in training (the frozen path never drops)."""
    target_modules: list[str] = Field(default_factory=lambda: list(LORA_DEFAULT_TARGETS), min_length=1)
    """Linear modules that get an adapter, by the last part of their name (default: the attention and MLP
    projections). A name that matches no Linear of the model is refused at start with the model's Linear names."""

    @field_validator("target_modules")
    @classmethod
    def _adaptable(cls, v: list[str]) -> list[str]:
        head = sorted({"lm_head", "embed_tokens"} & set(v))
        if head:
            raise ValueError(f"{', '.join(head)}: the head and the embeddings take no adapter yet (the chunked head "
                             "reads lm_head.weight directly); list Linear projections such as q_proj, down_proj")
        if len(set(v)) != len(v) or not all(m.strip() for m in v):
            raise ValueError(f"{v}: module names must be non-empty and listed once")
        return v

    publish: Literal["adapters", "merged"] = "adapters"
    """What a publication carries: `adapters` (only every target's A and B, ~r (in + out) / (in out) of its
    weights; each generator merges W + (alpha / rank) B A into its copy of the base from the model folder, which
    stays the base: it is frozen) or `merged` (the whole model with the targets merged, as without LoRA).
    `weight_sync.delta` applies to merged publications only: adapters always travel whole."""
    base_dtype: Literal["auto", "float32"] = "auto"
    """How the learner holds the frozen base: `auto` in the compute dtype (`model.dtype`; bfloat16 takes 2 bytes
    per base parameter instead of 4, 3.1 GB less at 1.5B, spread over the ranks), `float32` as float32 copies.
    The training is the same either way (FSDP2 computes with the base cast to `model.dtype` in both); merged
    publications and exports add B A to the base as held, so with a float32 model folder they can differ by a
    bfloat16 rounding (none with a bfloat16 folder, as Qwen2.5's ships). A float32 learner holds it in float32."""


class LearnerConfig(Section):
    """The learner pool: objective, optimisation, distribution, weight publication."""

    num_ranks: int = Field(1, ge=1, le=4096)
    """FSDP ranks (Ray actors joined by torch.distributed)."""
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    """torch.distributed backend (auto: nccl with GPUs, else gloo)."""
    num_cpus: float = Field(1.0, ge=0)
    """CPUs per rank."""
    num_gpus: float = Field(0.0, ge=0)
    """GPUs per rank."""
    placement: Literal["pack", "spread", "none"] = "pack"
    """Placement group of the ranks: pack (together, fast collectives), spread (across nodes) or none."""
    node_labels: dict[str, str] = Field(default_factory=dict)
    """Place the learner ranks only on Ray nodes with these labels (a Ray label selector, as
    `generator.node_labels`); with `placement: pack/spread` every bundle of the ranks' placement group carries it."""
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
    mini_batches: int = Field(1, ge=1, le=1024)
    """Optimizer updates per learner step (the paper: 2). Groups are shuffled, fresh and mixed evenly, before
    the split. The policy version still advances by 1 per step."""
    micro_batch_rows: int = Field(64, ge=1, le=100_000)
    """Rows per forward/backward (gradient accumulation inside a mini-batch); with `micro_batch_tokens`, a cap."""
    micro_batch_tokens: int | None = Field(None, ge=1, le=100_000_000)
    """Padded tokens (rows x longest row; with `padding_free`, the rows' own tokens) per forward/backward: each
    rank's rows, sorted by length, are packed greedily up to it, so memory follows the budget, not the longest
    response. Must hold one row of
    data.max_prompt_tokens + generator.max_new_tokens. None: `micro_batch_rows` rows (docs/cluster.md, Memory)."""
    micro_batch_split: Literal["first_fit", "balanced"] = "first_fit"
    """How a rank's rows become micro-batches under `micro_batch_tokens` with padding-free packing. first_fit: each
    row, longest first, into the first micro-batch with room (every micro-batch within the budget and
    `micro_batch_rows`). balanced: verl's dynamic batch size (`use_dynamic_bsz`, what the ExGRPO paper's runs
    used): ceil(the rank's tokens / the budget) micro-batches, the largest count over the ranks for all, the
    rows partitioned into them with balanced token sums (Karmarkar-Karp, verl's order of merges), so with
    `entropy_agg=micro_batch` the entropy term is weighted as the authors' code weights it. Its sums are
    balanced, not capped: a micro-batch can exceed the budget (as in verl), and `micro_batch_rows` does not
    apply. Padded micro-batches always split first-fit (the start log says so)."""
    padding_free: bool | Literal["auto"] = "auto"
    """Pack each micro-batch's rows into one sequence without padding (position ids restart at every row; the
    attention keeps rows apart), so `micro_batch_tokens` counts real tokens and no compute goes to padding.
    auto: on only where `attn_implementation` is a variable-length kernel the user chose (flash_attention_2/3 or a
    kernels-hub flash-attention); padded micro-batches elsewhere, CUDA included: through flex_attention under
    per-layer compile packing stopped the learner at its first step on an H100, so it is opt-in until
    it has run there. true: on CUDA with `attn_implementation` unset, flash_attention_2 where flash-attn is
    installed (bf16/fp16), else flex_attention (kept out of the compiled layers' graphs); with sdpa/eager, or on a
    CPU, a [tokens, tokens] block-diagonal mask per micro-batch (exact; memory grows with the budget squared).
    Tried at setup like every lever (`learner.trial`): if it fails, the run trains padded and says so. The learner
    also checks at start that the model keeps packed rows apart and refuses it otherwise; the metric
    `learner/padding_free` and the start log say which path ran and why (docs/cluster.md, GPU levers)."""
    attn_implementation: str | None = None
    """The learner model's attention (transformers' `attn_implementation`): sdpa, eager, flash_attention_2,
    flash_attention_3, flex_attention or a kernels-hub repo such as kernels-community/flash-attn2. None:
    transformers' default (sdpa). The generators' vLLM engines choose their own."""
    logits_chunk_tokens: int | None = Field(None, ge=0, le=1_000_000)
    """Tokens' worth of logits per block of the LM head: log-probs and entropies are computed from the final hidden
    states a block at a time ([tokens, vocabulary] in the forward, [all tokens, a vocabulary slice] in the backward,
    which writes each row of the head's weight gradient once per micro-batch), so no [rows, length, vocabulary]
    tensor exists. None: on CUDA sized once from the free memory (a quarter, at most 2 GiB of temporaries: 1,766
    tokens at a 152k vocabulary), elsewhere about 32M logits (220 tokens at 152k). 0: full logits (the old path;
    its memory grows with rows x length x vocabulary; for comparison only)."""
    compile_head_math: bool = False
    """torch.compile (inductor) the chunked head's per-block float32 math (`learner.token_stats.COMPILE_BLOCK_MATH`),
    fusing its elementwise passes over [tokens, vocabulary] blocks. Exact against full logits on CPU
    (tests/learner/test_token_stats.py); opt-in everywhere until tests/gpu/test_head_math.py has passed on a GPU
    (built, unmeasured: `python bench/gpu_bench.py --runs 1.5B:fixed --compile-head-math` measures it)."""
    activation_checkpointing: Literal["auto", "full", "selective", "none"] = "auto"
    """Recompute decoder layers' activations in the backward instead of keeping them (`learner/activation_checkpointing.py`).
    full: each layer keeps only its input and re-runs its forward (about 1/3 more compute; one layer's activations
    instead of all). selective: torchtitan's op-level checkpointing, each layer keeps its matmul and attention
    outputs and recomputes only the elementwise ops between them (no matmul twice; about half the activations of
    none). none: keep everything. auto: on CUDA, the least recompute whose estimated activations for one
    micro-batch (`micro_batch_tokens`, or `micro_batch_rows` x the longest row) fit the memory left after the
    weights, gradients and AdamW state (the start log says what it chose and why); none off CUDA. true and false
    (older configs) mean full and none."""

    @field_validator("activation_checkpointing", mode="before")
    @classmethod
    def _checkpointing_from_bool(cls, v: Any) -> Any:
        return {True: "full", False: "none"}[v] if isinstance(v, bool) else v

    compile: bool | Literal["auto"] = "auto"
    """torch.compile each decoder layer of the trained model (torchtitan's per-block compile; only rows and length
    dynamic, so micro-batches of any length reuse the same graphs; measured +12.4% on a 1.5B step on an H100).
    auto: on where the learner runs on CUDA and the model's hidden size is 512 or more (a toy model's step never
    buys its compile back), off on CPU. The setup's trial compiles the graphs the run uses (minutes at 1.5B; later
    steps reuse them, and a later graph is counted in learner/recompiles); later processes on the machine reuse
    inductor's on-disk cache. Tried at setup (`learner.trial`): a compile that fails is off for the run, which
    trains eager and says so; falls back to eager where torch.compile is unsupported (docs/cluster.md, GPU
    levers)."""
    compile_backend: str = Field("inductor", min_length=1, max_length=64)
    """The torch.compile backend of `compile`: inductor (the fast one); aot_eager or eager trace without
    generating kernels (tests, debugging)."""
    compile_cache_dir: str | None = Field(None, max_length=4096)
    """A folder for inductor's compile cache (every learner rank's TORCHINDUCTOR_CACHE_DIR) where `compile` is on.
    On storage every node reaches, a rank on a fresh machine (a new node, a restarted container) reuses the kernels
    an earlier rank compiled for the same GPU and torch instead of compiling them again: at 1.5B on an H100 the setup
    reached its first step in 10.1 s with them, 31.1 s cold (the same artifacts carried as a file). None:
    inductor's default under the machine's temp folder, reused only by later processes of that machine. An absolute
    path (`~` expanded)."""

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
    pad_multiple: int | Literal["auto"] = "auto"
    """Padded micro-batches' length (rows x longest row) rounded up to a multiple of this many tokens (1 to 4096).
    The extra positions come after every real token, so no real token attends to them: log-probs, entropies and
    gradients are those of the unrounded micro-batch. Kernels chosen per shape (cuDNN attention builds a graph per
    rows x length; inductor's autotuning) then meet a few lengths instead of every one. auto: 64 on CUDA, 1 (no
    rounding: the CPU path bit for bit as before) elsewhere. Packed micro-batches (`padding_free`) are not rounded."""

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

    fused_optimizer: bool | Literal["auto"] = "auto"
    """AdamW's fused kernel (one launch over all parameters instead of several per tensor). auto: on when the
    parameters are on CUDA (it ran in every H100 case measured). Tried at setup with a step that moves no
    weight (`learner.trial`); falls back to the foreach AdamW, and says why, where the kernel fails or does not take
    the parameters."""
    policy_loss: Literal["ppo_clip", "gspo", "cispo", "sapo"] = "ppo_clip"
    """The fresh tokens' surrogate (docs/algorithm.md, Policy losses). ppo_clip: PPO's clipped ratio (clip_low,
    clip_high; verl's vanilla loss without its dual-clip unless clip_ratio_c is set). gspo: GSPO's sequence-level ratio, a row clipped whole (gspo_clip_low, gspo_clip_high). cispo:
    MiniMax-M1's clipped, stop-gradient importance weight on every token's log-prob gradient (cispo_clip_low,
    cispo_clip_high). sapo: SAPO's soft sigmoid gate (sapo_tau_pos, sapo_tau_neg). Replayed rows take ExGRPO's
    policy shaping whichever it is (`replay_loss`)."""
    replay_loss: Literal["shaping", "policy_loss"] = "shaping"
    """Replayed tokens' objective. shaping: ExGRPO's -A w / (w + shaping_beta), w the ratio to the stored
    log-probs (with gspo the row's sequence ratio, shaped the same way). policy_loss: `policy_loss` itself with its
    ratio taken to the stored log-probs (an ablation: is the loss's own band or gate enough for replayed data?)."""
    gspo_clip_low: float = Field(3e-4, gt=0, le=1)
    """gspo: the sequence ratio's clip below 1 (the GSPO paper's 3e-4: a mean per-token log-ratio is small)."""
    gspo_clip_high: float = Field(4e-4, gt=0, le=100)
    """gspo: the sequence ratio's clip above 1 (the GSPO paper's 4e-4)."""
    cispo_clip_low: float = Field(1.0, ge=0, le=1)
    """cispo: the importance weight's band below 1 (1: no lower bound, as MiniMax-M1 and ScaleRL)."""
    cispo_clip_high: float = Field(4.0, gt=0, le=100)
    """cispo: the importance weight's band above 1 (4: weights capped at 5, as ScaleRL; MiniMax-M1 tunes it)."""
    sapo_tau_pos: float = Field(1.0, gt=0, le=100)
    """sapo: the gate's temperature for tokens of positive advantage (the SAPO paper's 1.0)."""
    sapo_tau_neg: float = Field(1.05, gt=0, le=100)
    """sapo: the gate's temperature for the others (the SAPO paper's 1.05: negative updates decay faster)."""
    clip_low: float = Field(0.2, ge=0, le=1)
    """PPO ratio clip below 1 for fresh tokens."""
    clip_high: float = Field(0.2, ge=0, le=100)
    """PPO ratio clip above 1 for fresh tokens."""
    clip_ratio_c: float | None = Field(None, gt=1, le=100)
    """ppo_clip's dual-clip (verl's `clip_ratio_c`, 3.0 there; Ye et al. 2020, "Mastering Complex Control in MOBA
    Games with Deep RL"): a token of negative advantage loses at most -A x clip_ratio_c, so a ratio far above the
    band cannot push its loss without bound. None (the default, and the paper command's: the authors' ExGRPO loss
    has none): PPO's clip alone. Counted in learner/clip_frac; only with policy_loss=ppo_clip and while fresh
    tokens are clipped."""
    clip_fresh: bool | Literal["auto"] = True
    """Clip fresh tokens' PPO ratio. auto: clip until the buffer's mixed mode starts, not after (the authors'
    ExGRPO schedule: the policy-shaped replayed tokens take over the role of the trust region); false: never."""
    shaping_beta: float | None = Field(0.1, gt=0)
    """Policy-shaping beta for replayed tokens: -A*w/(w+beta). None = plain importance-weighted (ablation)."""
    entropy_coef: float = Field(0.001, ge=0, le=1)
    """Entropy bonus coefficient."""
    kl_coef: float = Field(0.0, ge=0, le=10)
    """KL-to-reference coefficient (0: no reference model is kept)."""
    std_normalize: bool = False
    """Divide advantages by the group's std."""
    loss_agg: Literal["token_mean", "constant", "seq_mean_token_mean"] | None = None
    """How the policy loss aggregates over a mini-batch: token_mean (every token alike), constant (the token sum
    divided by a constant: Dr. GRPO), or seq_mean_token_mean (each row's token mean, averaged over the mini-batch's
    rows: the original GRPO's, and GSPO's and SAPO's as their papers and verl aggregate them). None (the default):
    the policy loss's own, resolved when the config loads: seq_mean_token_mean for gspo and sapo, token_mean for
    ppo_clip and cispo; another combination only when named (`exgrpo config` prints the one in force and says when
    it is not the loss's own). The entropy bonus and the KL term stay token means under seq_mean_token_mean."""
    loss_constant: float | None = Field(None, gt=0)
    """Divisor for loss_agg=constant (default: batch rows x max_new_tokens), times loss_world_size when set."""
    loss_world_size: int | None = Field(None, ge=1, le=100_000)
    """The GPU count of a run whose loss scale to reproduce whatever num_ranks is (8 for the authors' ExGRPO run).
    With loss_agg=constant the mini-batch's token sum is divided by loss_constant x loss_world_size: the
    authors' code divides each GPU's micro-batch token sums by loss_constant (8192) and FSDP averages the gradients
    over its 8 GPUs, so its divisor is 65,536. With entropy_agg=micro_batch it also sets the micro-batches the
    entropy term is weighted by: the mini-batch split over this many GPUs (rows dealt longest first), each taking
    its micro-batches by micro_batch_tokens / micro_batch_split (the authors' run: ceil(its tokens / 32,768), the
    largest count for all, Karmarkar-Karp), whatever our own ranks and micro-batches are; the sum of those means is
    divided by it. None: loss_constant alone (one rank training on the whole mini-batch), and our own num_ranks
    and micro-batches."""
    entropy_agg: Literal["token_mean", "micro_batch"] = "token_mean"
    """How the entropy bonus aggregates. token_mean: one masked token mean over the mini-batch. micro_batch: the
    the authors' weighting (verl's actor with use_dynamic_bsz): each micro-batch's masked token mean, summed over a GPU's
    micro-batches and averaged over the GPUs. The micro-batches are those of loss_world_size GPUs when it is
    set (computed per row, so it holds at any num_ranks), else our own over num_ranks. Its weight then grows with the
    number of micro-batches per GPU, which micro_batch_tokens sets (the authors' run: 32,768 tokens per GPU)."""
    store_learner_logprobs: bool | Literal["auto"] = "auto"
    """Store the learner's start-of-step log-probs of the fresh correct rollouts it trains (sent back with the
    step's feedback) in place of the generator's, so that a replay's weight pi_theta / pi_stored compares the
    learner with itself, as the authors' code stores the actor's recomputed old_log_probs. auto: with
    recompute_old_logprobs (the authors' setting). Needs the start-of-step log-probs of every mini-batch:
    recompute_old_logprobs (or another setting that implies it) when mini_batches > 1."""
    grad_clip: float = Field(1.0, gt=0)
    """Gradient-norm clip."""
    lora: LoRAConfig | None = None
    """Train low-rank adapters instead of the full weights (`learner.lora.rank=8`; see its fields). None: full
    fine-tuning. Fixed for a run (the checkpoint holds the adapters and their optimizer state), except `base_dtype`."""
    skip_grad_norm: float = Field(500.0, gt=0)
    """Skip (and count) an update whose gradient norm is above this or non-finite."""
    replay_eos: bool = False
    """Append the model's EOS token to a replayed trajectory that was cut at generator.max_new_tokens (finish reason
    "length"): a truncated one gains a token (max_new_tokens + 1); one that ended with EOS is unchanged. Not the
    authors' rule: the authors' code appends EOS to every replayed o* and then cuts the response back to the length
    limit, so a full-length truncated o* keeps no EOS, as with replay_eos=false (the paper command leaves it off).
    The appended token has no stored log-prob: its weight w is 1 (the policy's own log-prob in the forward that
    trains it). Not where prompt + response already fill the model's positions. Metric learner/replay_eos_appended."""
    recompute_old_logprobs: bool = False
    """Centre the fresh tokens' PPO ratio on the learner's own log-probs at the start of the step (pi_old
    recomputed with one extra no-grad forward through the chunked path, as the authors' code and verl do),
    instead of the generator's log-probs. Under asynchrony the generator's log-probs come from an older policy
    (and another engine): the default ratio then also measures staleness and train/inference mismatch, so
    clipping bites sooner; recomputing clips only the step's own update and leaves the gap uncorrected
    (add tis_cap to correct it). tis_cap, icepop_band and mis imply it."""
    tis_cap: float | None = Field(None, ge=1, le=1000)
    """Truncated importance sampling of fresh tokens (verl/OpenRLHF TIS; e.g. 2): the PPO ratio is taken
    against the learner's own log-probs at the start of the step, and each fresh token's loss is multiplied
    by min(exp(logp_learner_start - logp_behaviour), tis_cap), which corrects train/inference mismatch and
    staleness. None: the ratio is taken against the behaviour log-probs (no correction)."""
    icepop_band: tuple[float, float] | None = None
    """IcePop-style token masking (e.g. [0.5, 2.0]): a fresh token whose train/inference ratio
    exp(logp_learner_start - logp_behaviour) lies outside [low, high] takes no part in the loss
    (`learner/icepop_masked_frac`). Uses the learner's start-of-step log-probs, like tis_cap."""
    mis: Literal["none", "truncate", "mask"] = "none"
    """Sequence-level mismatch correction (MIS) of fresh rows, with rho = exp(sum over the row's tokens of
    logp_learner_start - logp_behaviour): truncate multiplies the row's loss by min(rho, mis_cap); mask leaves
    rows with rho outside [1/mis_cap, mis_cap] out (`learner/mis_weight_mean`, `learner/mis_masked_frac`)."""
    mis_cap: float = Field(2.0, gt=1, le=1000)
    """The cap of `mis` (truncate: the largest weight; mask: the band [1/mis_cap, mis_cap])."""
    overlong: Literal["none", "mask", "penalty"] = "none"
    """Responses cut at generator.max_new_tokens (finish reason "length"): none trains them as scored; mask
    leaves them out of the loss (DAPO's overlong filtering; they still count in their group's advantages);
    penalty adds DAPO's soft overlong penalty to every response's reward before the advantages (the buffer keeps
    the verifier's reward): 0 up to max_new_tokens - overlong_buffer tokens, then falling linearly to -1 at
    max_new_tokens. Metrics: learner/overlong_masked, learner/overlong_penalty_mean."""
    overlong_buffer: int | None = Field(None, ge=1, le=1_000_000)
    """Tokens before max_new_tokens where the soft penalty ramps (DAPO: 4,096 of 20,480). None: a fifth of
    generator.max_new_tokens."""
    weight_sync: WeightSyncConfig = ObjectStoreSyncConfig()
    """Weight sync backend (both the learner's and the generators' side), chosen by `kind`: object_store |
    collective. A field given without `kind` picks it: object_store's own fields keep it (`delta`, `bucket_mb`),
    a field only collective has sets collective (`learner.weight_sync.relay_fanout=2`)."""
    start_timeout_s: float = Field(900.0, gt=0, le=86_400)
    """The learner ranks must have loaded and sharded the model and joined their process group within this
    (the error names the ranks that did not)."""
    publish_timeout_s: float = Field(60.0, gt=0, le=3600)
    """A weight publication or acknowledgement slower than this fails loudly."""
    seed: int = Field(0, ge=0)
    """Learner seed."""

    @property
    def needs_old_logprobs(self) -> bool:
        """Whether a step needs the learner's own start-of-step log-probs (recomputed pi_old, TIS, IcePop, MIS)."""
        return (self.recompute_old_logprobs or self.tis_cap is not None or self.icepop_band is not None
                or self.mis != "none")

    def loss_scale(self) -> str:
        """What divides the policy loss and the entropy bonus, in words (`exgrpo config` prints it)."""
        w = self.loss_world_size
        if self.loss_agg == "constant":
            c = "rows x generator.max_new_tokens" if self.loss_constant is None else f"{self.loss_constant:g}"
            if w and self.loss_constant is not None:
                policy = f"the mini-batch's token sum / {self.loss_constant * w:g} (loss_constant {c} x loss_world_size {w})"
            else:
                policy = f"the mini-batch's token sum / {c}" + (f" x loss_world_size {w}" if w else "")
        elif self.loss_agg == "seq_mean_token_mean":
            policy = "the mean over the mini-batch's rows of each row's token mean"
        else:
            policy = "the mini-batch's token mean"
        entropy = (f"entropy_coef x sum of the micro-batches' token means / {w or 'num_ranks'}"
                   if self.entropy_agg == "micro_batch" else "entropy_coef x the mini-batch's token mean")
        if self.entropy_agg == "micro_batch":
            gpus = f"loss_world_size {w}" if w else f"num_ranks {self.num_ranks}"
            if self.micro_batch_tokens is None:
                rule = f"{self.micro_batch_rows} rows each"
            elif self.micro_batch_split == "balanced" and self.packs_padding_free:
                rule = (f"ceil(its tokens / {self.micro_batch_tokens}) each, the largest count for all, rows "
                        "balanced by Karmarkar-Karp")
            else:
                rule = f"first fit within {self.micro_batch_tokens} tokens"
            entropy += f", micro-batches: the mini-batch over {gpus} GPUs, {rule}"

        own = OWN_LOSS_AGG[self.policy_loss]
        policy += (f", loss_agg {self.loss_agg} ({self.policy_loss}'s own)" if self.loss_agg == own else
                   f", loss_agg {self.loss_agg} (named; {self.policy_loss}'s own is {own})")
        ppo = {True: "PPO clip", False: "PPO unclipped", "auto": "PPO clip until mixed mode"}[self.clip_fresh]
        dual = f", dual-clip {self.clip_ratio_c:g} for A < 0" if self.clip_ratio_c is not None else ""
        surrogate = {"ppo_clip": f"{ppo} [1-{self.clip_low:g}, 1+{self.clip_high:g}]{dual}",
                     "gspo": f"GSPO sequence ratio clipped to [1-{self.gspo_clip_low:g}, 1+{self.gspo_clip_high:g}]",
                     "cispo": f"CISPO weight in [{1 - self.cispo_clip_low:g}, {1 + self.cispo_clip_high:g}]",
                     "sapo": f"SAPO gate, tau {self.sapo_tau_pos:g} / {self.sapo_tau_neg:g}"}[self.policy_loss]
        replay = "shaped" if self.replay_loss == "shaping" else f"{self.policy_loss} too"
        return f"policy loss = {policy} ({surrogate}; replayed tokens {replay}); entropy bonus = {entropy}"

    @model_validator(mode="after")
    def _loss_agg_of_the_loss(self) -> LearnerConfig:
        """loss_agg None means the policy loss's own aggregation: resolved here so the saved config carries it."""
        if self.loss_agg is None:
            self.__dict__["loss_agg"] = OWN_LOSS_AGG[self.policy_loss]  # no re-validation: nothing else changes
        return self

    @model_validator(mode="after")
    def _loss_combinations(self) -> LearnerConfig:
        """The policy loss's options that have no meaning together, refused here so that the loss built from them
        (`learner.policy_loss.setup_policy_loss`) never checks a name at run time."""
        if self.policy_loss != "ppo_clip" and self.clip_fresh is not True:
            raise ValueError(f"learner.clip_fresh={str(self.clip_fresh).lower()} turns PPO's clip off (auto: once mixed "
                             f"mode starts), but learner.policy_loss={self.policy_loss} has no unclipped form: its "
                             f"{'gate' if self.policy_loss == 'sapo' else 'band'} is the loss itself. Set "
                             f"learner.clip_fresh=true, or learner.policy_loss=ppo_clip")
        if self.clip_ratio_c is not None and (self.policy_loss != "ppo_clip" or self.clip_fresh is False):
            raise ValueError(f"learner.clip_ratio_c={self.clip_ratio_c:g} is a second bound of PPO's clip, but "
                             + (f"learner.policy_loss={self.policy_loss} has no PPO clip" if self.policy_loss != "ppo_clip"
                                else "learner.clip_fresh=false never clips")
                             + ": leave learner.clip_ratio_c unset (null)")
        return self

    @property
    def stores_learner_logprobs(self) -> bool:
        """`store_learner_logprobs` with auto resolved."""
        return self.recompute_old_logprobs if self.store_learner_logprobs == "auto" else self.store_learner_logprobs

    @model_validator(mode="after")
    def _learner_logprobs_known(self) -> LearnerConfig:
        if self.store_learner_logprobs is True and self.mini_batches > 1 and not self.needs_old_logprobs:
            raise ValueError("learner.store_learner_logprobs=true with mini_batches > 1 needs the start-of-step "
                             "log-probs of every mini-batch: set learner.recompute_old_logprobs=true")
        if self.micro_batch_split == "balanced" and (self.micro_batch_tokens is None or self.padding_free is False):
            raise ValueError("learner.micro_batch_split=balanced cuts padding-free micro-batches by their token budget: "
                             "set learner.micro_batch_tokens (32768 in the paper's runs) and leave learner.padding_free "
                             "true or auto, or use micro_batch_split=first_fit")
        if self.lora is not None and self.lora.publish == "adapters" and self.weight_sync.delta:
            raise ValueError("learner.weight_sync.delta=true applies to merged publications only, and "
                             "learner.lora.publish=adapters sends the adapters whole: set learner.weight_sync.delta=false, "
                             "or learner.lora.publish=merged to send deltas of the merged weights")
        return self

    @property
    def varlen_attention(self) -> bool:
        """Whether `attn_implementation` is a variable-length (flash-attention) kernel, which packs rows for free."""
        impl = self.attn_implementation or ""
        return impl.startswith("flash_attention") or ("flash" in impl and "/" in impl)

    @property
    def packs_padding_free(self) -> bool:
        """Whether micro-batches are packed without padding (`padding_free`, auto resolved)."""
        return self.varlen_attention if self.padding_free == "auto" else bool(self.padding_free)

    @field_validator("attn_implementation")
    @classmethod
    def _known_attention(cls, v: str | None) -> str | None:
        known = ("sdpa", "eager", "flash_attention_2", "flash_attention_3", "flex_attention")
        if v is not None and v not in known and "/" not in v:
            raise ValueError(f"{v!r} is not an attention implementation transformers knows: use one of "
                             f"{', '.join(known)} or a kernels-hub repo (e.g. kernels-community/flash-attn2)")
        return v

    @field_validator("icepop_band")
    @classmethod
    def _band_ordered(cls, v: tuple[float, float] | None) -> tuple[float, float] | None:
        if v is not None and not 0 < v[0] < 1 < v[1]:
            raise ValueError(f"[{v[0]}, {v[1]}] must satisfy 0 < low < 1 < high (e.g. [0.5, 2.0])")
        return v

    @field_validator("betas")
    @classmethod
    def _betas_below_one(cls, v: tuple[float, float]) -> tuple[float, float]:
        for i, b in enumerate(v):
            if not 0 <= b < 1:
                raise ValueError(f"beta{i + 1} = {b} is outside [0, 1); AdamW's usual values are [0.9, 0.999]")
        return v

    @field_validator("weight_sync", mode="before")
    @classmethod
    def _no_nccl_kind(cls, v: Any) -> Any:
        kind = v.get("kind") if isinstance(v, dict) else None
        if kind == "nccl":
            raise ValueError("kind: nccl was replaced by the collective backend: use "
                             "{kind: collective, backend: nccl} (or backend: auto)")
        # weight_sync.delta=true keeps object_store; weight_sync.relay_fanout=2 sets collective
        return pick_kind(v, {"object_store": ObjectStoreSyncConfig, "collective": CollectiveSyncConfig},
                         "object_store", "learner.weight_sync")
