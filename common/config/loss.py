"""The `learner.loss` section: the policy loss (a section per surrogate, chosen by `kind`), its shaping of replayed
tokens, the regularisers and the corrections of train/inference mismatch (read by learner/policy_loss.py and
learner/objective.py).

A surrogate is one section here (its `kind`, its own parameters, its own aggregation, whether it has an unclipped
form, its line in `exgrpo config`) and one function in learner/policy_loss.py (`SURROGATES`): adding one touches
those two places.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from common.config.base import Section, pick_kind


class PpoClipLoss(Section):
    """PPO's clipped ratio (verl's vanilla loss, without its dual-clip unless clip_ratio_c is set)."""

    kind: Literal["ppo_clip"] = "ppo_clip"
    clip_low: float = Field(0.2, ge=0, le=1)
    """The ratio's clip below 1 for fresh tokens."""
    clip_high: float = Field(0.2, ge=0, le=100)
    """The ratio's clip above 1 for fresh tokens (DAPO's clip-higher: 0.28)."""
    clip_ratio_c: float | None = Field(None, gt=1, le=100)
    """The dual-clip (verl's `clip_ratio_c`, 3.0 there; Ye et al. 2020, "Mastering Complex Control in MOBA Games with
    Deep RL"): a token of negative advantage loses at most -A x clip_ratio_c, so a ratio far above the band cannot
    push its loss without bound. None (the default, and the paper command's: the authors' ExGRPO loss has none):
    PPO's clip alone. Counted in learner/clip_frac; only while fresh tokens are clipped."""

    own_loss_agg: ClassVar[str] = "token_mean"
    unclipped_form: ClassVar[bool] = True
    """Whether the surrogate has a form without its clip (-A r), which learner.loss.clip_fresh false or auto takes."""

    def describe(self, clip_fresh: bool | str) -> str:
        ppo = {True: "PPO clip", False: "PPO unclipped", "auto": "PPO clip until mixed mode"}[clip_fresh]
        dual = f", dual-clip {self.clip_ratio_c:g} for A < 0" if self.clip_ratio_c is not None else ""
        return f"{ppo} [1-{self.clip_low:g}, 1+{self.clip_high:g}]{dual}"


class GspoLoss(Section):
    """GSPO's sequence-level ratio (Zheng et al. 2025): PPO's clip on it, a row clipped whole."""

    kind: Literal["gspo"] = "gspo"
    clip_low: float = Field(3e-4, gt=0, le=1)
    """The sequence ratio's clip below 1 (the GSPO paper's 3e-4: a mean per-token log-ratio is small)."""
    clip_high: float = Field(4e-4, gt=0, le=100)
    """The sequence ratio's clip above 1 (the GSPO paper's 4e-4)."""

    own_loss_agg: ClassVar[str] = "seq_mean_token_mean"
    unclipped_form: ClassVar[bool] = False

    def describe(self, clip_fresh: bool | str) -> str:
        return f"GSPO sequence ratio clipped to [1-{self.clip_low:g}, 1+{self.clip_high:g}]"


class CispoLoss(Section):
    """MiniMax-M1's CISPO: a clipped, stop-gradient importance weight on every token's log-prob gradient."""

    kind: Literal["cispo"] = "cispo"
    clip_low: float = Field(1.0, ge=0, le=1)
    """The importance weight's band below 1 (1: no lower bound, as MiniMax-M1 and ScaleRL)."""
    clip_high: float = Field(4.0, gt=0, le=100)
    """The importance weight's band above 1 (4: weights capped at 5, as ScaleRL; MiniMax-M1 tunes it)."""

    own_loss_agg: ClassVar[str] = "token_mean"
    unclipped_form: ClassVar[bool] = False

    def describe(self, clip_fresh: bool | str) -> str:
        return f"CISPO weight in [{1 - self.clip_low:g}, {1 + self.clip_high:g}]"


class SapoLoss(Section):
    """SAPO's soft sigmoid gate (Qwen 2025), its temperature by the advantage's sign."""

    kind: Literal["sapo"] = "sapo"
    tau_pos: float = Field(1.0, gt=0, le=100)
    """The gate's temperature for tokens of positive advantage (the SAPO paper's 1.0)."""
    tau_neg: float = Field(1.05, gt=0, le=100)
    """The gate's temperature for the others (the SAPO paper's 1.05: negative updates decay faster)."""

    own_loss_agg: ClassVar[str] = "seq_mean_token_mean"
    unclipped_form: ClassVar[bool] = False

    def describe(self, clip_fresh: bool | str) -> str:
        return f"SAPO gate, tau {self.tau_pos:g} / {self.tau_neg:g}"


SURROGATE_KINDS = {"ppo_clip": PpoClipLoss, "gspo": GspoLoss, "cispo": CispoLoss, "sapo": SapoLoss}
"""`learner.loss.policy_loss.kind` -> its section. Each surrogate's own `loss_agg` (what learner.loss.loss_agg None
resolves to): GSPO's and SAPO's papers, and verl, average each row's token mean over the rows; PPO's and CISPO's
(MiniMax-M1's token-level) take a token mean."""

PolicyLossConfig = Annotated[PpoClipLoss | GspoLoss | CispoLoss | SapoLoss, Field(discriminator="kind")]

FLAT_SURROGATE_KEYS = {"clip_low": ("ppo_clip", "clip_low"), "clip_high": ("ppo_clip", "clip_high"),
                       "clip_ratio_c": ("ppo_clip", "clip_ratio_c"),
                       "gspo_clip_low": ("gspo", "clip_low"), "gspo_clip_high": ("gspo", "clip_high"),
                       "cispo_clip_low": ("cispo", "clip_low"), "cispo_clip_high": ("cispo", "clip_high"),
                       "sapo_tau_pos": ("sapo", "tau_pos"), "sapo_tau_neg": ("sapo", "tau_neg")}
"""The surrogates' parameters as `learner.loss` held them flat before each surrogate had its section: old name ->
(the kind it applied to, its name in that kind's section). Refused when typed (with the new path); a run folder's
saved config is moved (`move_flat_surrogate`)."""


def flat_surrogate_hint(leaf: str) -> str:
    """What to type in place of the old flat `learner.loss.<leaf>`."""
    kind, name = FLAT_SURROGATE_KEYS[leaf]
    where = (f"learner.loss.policy_loss.{name} (of kind ppo_clip, the default)" if kind == "ppo_clip" else
             f"learner.loss.policy_loss.{name} with learner.loss.policy_loss.kind={kind}")
    return f"moved into the surrogate's own section: set {where}"


def move_flat_surrogate(loss: dict[str, Any]) -> list[str]:
    """A saved `learner.loss` mapping of an earlier release, in place: `policy_loss: gspo` and the flat parameters
    become the section of the kind it named (parameters of the other kinds, which had no effect, are dropped);
    the moves, in words."""
    flat = [k for k in FLAT_SURROGATE_KEYS if k in loss]
    if not flat and not isinstance(loss.get("policy_loss"), str):
        return []
    section = loss.get("policy_loss")
    section = {"kind": section} if isinstance(section, str) else dict(section or {})
    kind = section.setdefault("kind", "ppo_clip")
    moved = []
    for old in flat:
        value = loss.pop(old)
        old_kind, name = FLAT_SURROGATE_KEYS[old]
        if old_kind == kind:
            section.setdefault(name, value)
            moved.append(f"learner.loss.{old} -> learner.loss.policy_loss.{name}")
        else:
            moved.append(f"learner.loss.{old} dropped (a parameter of {old_kind}; the run's policy loss is {kind})")
    loss["policy_loss"] = section
    return moved


class LossConfig(Section):
    """The objective (docs/algorithm.md): the fresh tokens' surrogate, the replayed tokens' shaping, the entropy and
    KL terms, how the loss aggregates, and the corrections that take the learner's own start-of-step log-probs."""

    policy_loss: PolicyLossConfig = PpoClipLoss()
    """The fresh tokens' surrogate, chosen by `kind` (docs/algorithm.md, Policy losses): ppo_clip (PPO's clipped
    ratio), gspo (GSPO's sequence ratio, a row clipped whole), cispo (MiniMax-M1's clipped stop-gradient importance
    weight), sapo (SAPO's soft sigmoid gate), each with its own parameters (`learner.loss.policy_loss.clip_high=0.28`;
    `learner.loss.policy_loss=gspo` names the kind alone). Replayed rows take ExGRPO's policy shaping whichever it is
    (`replay_loss`)."""
    replay_loss: Literal["shaping", "policy_loss"] = "shaping"
    """Replayed tokens' objective. shaping: ExGRPO's -A w / (w + shaping_beta), w the ratio to the stored
    log-probs (with gspo the row's sequence ratio, shaped the same way). policy_loss: `policy_loss` itself with its
    ratio taken to the stored log-probs (an ablation: is the loss's own band or gate enough for replayed data?)."""
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
    the authors' weighting (verl's actor with use_dynamic_bsz): each micro-batch's masked token mean, summed over a
    GPU's micro-batches and averaged over the GPUs. The micro-batches are those of loss_world_size GPUs when it is
    set (computed per row, so it holds at any num_ranks), else our own over num_ranks. Its weight then grows with the
    number of micro-batches per GPU, which micro_batch_tokens sets (the authors' run: 32,768 tokens per GPU)."""
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
    store_learner_logprobs: bool | Literal["auto"] = "auto"
    """Store the learner's start-of-step log-probs of the fresh correct rollouts it trains (sent back with the
    step's feedback) in place of the generator's, so that a replay's weight pi_theta / pi_stored compares the
    learner with itself, as the authors' code stores the actor's recomputed old_log_probs. auto: with
    recompute_old_logprobs (the authors' setting). Needs the start-of-step log-probs of every mini-batch:
    recompute_old_logprobs (or another setting that implies it) when mini_batches > 1."""

    @field_validator("icepop_band")
    @classmethod
    def _band_ordered(cls, v: tuple[float, float] | None) -> tuple[float, float] | None:
        if v is not None and not 0 < v[0] < 1 < v[1]:
            raise ValueError(f"[{v[0]}, {v[1]}] must satisfy 0 < low < 1 < high (e.g. [0.5, 2.0])")
        return v

    @property
    def needs_old_logprobs(self) -> bool:
        """Whether a step needs the learner's own start-of-step log-probs (recomputed pi_old, TIS, IcePop, MIS)."""
        return (self.recompute_old_logprobs or self.tis_cap is not None or self.icepop_band is not None
                or self.mis != "none")

    @property
    def stores_learner_logprobs(self) -> bool:
        """`store_learner_logprobs` with auto resolved."""
        return self.recompute_old_logprobs if self.store_learner_logprobs == "auto" else self.store_learner_logprobs

    @field_validator("policy_loss", mode="before")
    @classmethod
    def _kind_from_fields(cls, v: Any) -> Any:
        return pick_kind(v, SURROGATE_KINDS, "ppo_clip", "learner.loss.policy_loss")

    @model_validator(mode="after")
    def _loss_agg_of_the_loss(self) -> LossConfig:
        """loss_agg None means the policy loss's own aggregation: resolved here so the saved config carries it."""
        if self.loss_agg is None:
            self.__dict__["loss_agg"] = self.policy_loss.own_loss_agg  # no re-validation: nothing else changes
        return self

    @model_validator(mode="after")
    def _loss_combinations(self) -> LossConfig:
        """The policy loss's options that have no meaning together, refused here so that the loss built from them
        (`learner.policy_loss.setup_policy_loss`) never checks a name at run time."""
        kind = self.policy_loss.kind
        if not self.policy_loss.unclipped_form and self.clip_fresh is not True:
            raise ValueError(f"learner.loss.clip_fresh={str(self.clip_fresh).lower()} turns PPO's clip off (auto: once "
                             f"mixed mode starts), but learner.loss.policy_loss.kind={kind} has no unclipped "
                             f"form: its {'gate' if kind == 'sapo' else 'band'} is the loss itself. Set "
                             f"learner.loss.clip_fresh=true, or learner.loss.policy_loss.kind=ppo_clip")
        dual = getattr(self.policy_loss, "clip_ratio_c", None)
        if dual is not None and self.clip_fresh is False:
            raise ValueError(f"learner.loss.policy_loss.clip_ratio_c={dual:g} is a second bound of PPO's clip, but "
                             "learner.loss.clip_fresh=false never clips: leave learner.loss.policy_loss.clip_ratio_c "
                             "unset (null)")
        return self
