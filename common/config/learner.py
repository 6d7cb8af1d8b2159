"""The `learner` section and its weight-sync backends."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from common.config.base import Section, pick_kind
from common.config.learner_sections import BatchingConfig, LeversConfig, OptimConfig
from common.config.loss import FLAT_SURROGATE_KEYS, LossConfig


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
    generator one packed copy of the newest version in host memory, and a port.
    docs/cluster.md ("Weight fan-out")."""


WeightSyncConfig = Annotated[ObjectStoreSyncConfig | CollectiveSyncConfig, Field(discriminator="kind")]

LORA_DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class LoRAConfig(Section):
    """Low-rank adapters on the learner (learner.lora; docs/memory.md "LoRA"): each target Linear's
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
    """The learner pool: its ranks and their placement, weight publication, and its sections: `optim`, `batching`,
    `levers` and `loss`, each handed to the part of the learner that reads it."""

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
    optim: OptimConfig = OptimConfig()
    """AdamW, the learning-rate schedule and the gradient-norm guards."""
    batching: BatchingConfig = BatchingConfig()
    """Mini-batches, micro-batches and the LM head's blocks."""
    levers: LeversConfig = LeversConfig()
    """GPU levers: attention kernel, padding-free packing, compile, activation checkpointing, fused AdamW."""
    loss: LossConfig = LossConfig()
    """The policy loss, the replayed tokens' shaping, entropy and KL, aggregation, mismatch corrections."""
    lora: LoRAConfig | None = None
    """Train low-rank adapters instead of the full weights (`learner.lora.rank=8`; see its fields). None: full
    fine-tuning. Fixed for a run (the checkpoint holds the adapters and their optimizer state), except `base_dtype`."""
    weight_sync: WeightSyncConfig = ObjectStoreSyncConfig()
    """Weight sync backend (both the learner's and the generators' side), chosen by `kind`: object_store |
    collective. A field given without `kind` picks it: object_store's own fields keep it (`delta`, `bucket_mb`),
    a field only collective has sets collective (`learner.weight_sync.relay_fanout=2`)."""
    start_timeout_s: float = Field(900.0, gt=0, le=86_400)
    """The learner ranks must have loaded and sharded the model and joined their process group within this
    (the error names the ranks that did not)."""
    publish_timeout_s: float = Field(60.0, gt=0, le=3600)
    """A weight publication or acknowledgement slower than this fails loudly."""
    seed: int = Field(0, ge=0, le=2**32 - 1)  # numpy and vLLM take 32-bit seeds
    """Learner seed."""

    def loss_scale(self) -> str:
        """What divides the policy loss and the entropy bonus, in words (`exgrpo config` prints it)."""
        loss, w = self.loss, self.loss.loss_world_size
        if loss.loss_agg == "constant":
            c = "rows x generator.max_new_tokens" if loss.loss_constant is None else f"{loss.loss_constant:g}"
            if w and loss.loss_constant is not None:
                policy = (f"the mini-batch's token sum / {loss.loss_constant * w:g} (loss_constant {c} x "
                          f"loss_world_size {w})")
            else:
                policy = f"the mini-batch's token sum / {c}" + (f" x loss_world_size {w}" if w else "")
        elif loss.loss_agg == "seq_mean_token_mean":
            policy = "the mean over the mini-batch's rows of each row's token mean"
        else:
            policy = "the mini-batch's token mean"
        entropy = (f"entropy_coef x sum of the micro-batches' token means / {w or 'num_ranks'}"
                   if loss.entropy_agg == "micro_batch" else "entropy_coef x the mini-batch's token mean")
        if loss.entropy_agg == "micro_batch":
            entropy += f", micro-batches: {self._entropy_micro_batches()}"
        kind, own = loss.policy_loss.kind, loss.policy_loss.own_loss_agg
        policy += (f", loss_agg {loss.loss_agg} ({kind}'s own)" if loss.loss_agg == own else
                   f", loss_agg {loss.loss_agg} (named; {kind}'s own is {own})")
        surrogate = loss.policy_loss.describe(loss.clip_fresh)
        replay = "shaped" if loss.replay_loss == "shaping" else f"{kind} too"
        return f"policy loss = {policy} ({surrogate}; replayed tokens {replay}); entropy bonus = {entropy}"

    def _entropy_micro_batches(self) -> str:
        """The micro-batches `entropy_agg=micro_batch` weights the entropy term by, in words."""
        w, bt = self.loss.loss_world_size, self.batching
        gpus = f"loss_world_size {w}" if w else f"num_ranks {self.num_ranks}"
        if bt.micro_batch_tokens is None:
            rule = f"{bt.micro_batch_rows} rows each"
        elif bt.micro_batch_split == "balanced" and self.levers.packs_padding_free:
            rule = (f"ceil(its tokens / {bt.micro_batch_tokens}) each, the largest count for all, rows "
                    "balanced by Karmarkar-Karp")
        else:
            rule = f"first fit within {bt.micro_batch_tokens} tokens"
        return f"the mini-batch over {gpus} GPUs, {rule}"

    def with_levers(self, **levers: Any) -> LearnerConfig:
        """A copy with these `levers` fields set (no re-validation: the setup's resolved or tried values)."""
        return self.model_copy(update={"levers": self.levers.model_copy(update=levers)})

    @model_validator(mode="after")
    def _sections_agree(self) -> LearnerConfig:
        """Settings of two sections that have no meaning together."""
        if self.loss.store_learner_logprobs is True and self.batching.mini_batches > 1 \
                and not self.loss.needs_old_logprobs:
            raise ValueError("learner.loss.store_learner_logprobs=true with learner.batching.mini_batches > 1 needs "
                             "the start-of-step log-probs of every mini-batch: set "
                             "learner.loss.recompute_old_logprobs=true")
        if self.batching.micro_batch_split == "balanced" and (self.batching.micro_batch_tokens is None
                                                             or self.levers.padding_free is False):
            raise ValueError("learner.batching.micro_batch_split=balanced cuts padding-free micro-batches by their "
                             "token budget: set learner.batching.micro_batch_tokens (32768 in the paper's runs) and "
                             "leave learner.levers.padding_free true or auto, or use micro_batch_split=first_fit")
        if self.lora is not None and self.lora.publish == "adapters" and self.weight_sync.delta:
            raise ValueError("learner.weight_sync.delta=true applies to merged publications only, and "
                             "learner.lora.publish=adapters sends the adapters whole: set learner.weight_sync.delta=false, "
                             "or learner.lora.publish=merged to send deltas of the merged weights")
        return self

    @field_validator("weight_sync", mode="before")
    @classmethod
    def _no_nccl_kind(cls, v: Any) -> Any:
        # weight_sync.delta=true keeps object_store; weight_sync.relay_fanout=2 sets collective
        v = pick_kind(v, {"object_store": ObjectStoreSyncConfig, "collective": CollectiveSyncConfig},
                      "object_store", "learner.weight_sync")
        if isinstance(v, dict) and v.get("kind") == "nccl":
            raise ValueError("kind: nccl was replaced by the collective backend: use "
                             "{kind: collective, backend: nccl} (or backend: auto)")
        return v


LEARNER_SECTIONS = {name: section
                    for section, model in (("optim", OptimConfig), ("batching", BatchingConfig),
                                           ("levers", LeversConfig), ("loss", LossConfig))
                    for name in [*model.model_fields, *(FLAT_SURROGATE_KEYS if model is LossConfig else ())]}
"""The section of each field that moved out of the flat `learner` (`lr` -> `optim`): where `common.config.errors`
sends an old key."""
