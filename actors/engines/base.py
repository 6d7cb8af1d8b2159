"""What both engines share: the sample they return, the sampling settings, the entropy estimate.

Log-prob convention (both engines, and the learner): a rollout's behaviour log-prob is
`log softmax(logits)[token]` at **temperature 1, before top-p** — the log-prob of the sampled token
under the policy π itself, not under the temperature-scaled/truncated sampling distribution.
Entropy convention: mean over response tokens of the full-vocabulary entropy of π at temperature 1 (exact in
the transformers engine; from vLLM's top-k log-probs, `topk_entropy_estimate`).

Why these conventions: docs/internals.md#actorsenginesbasepy
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field

import numpy as np
import torch

from common.config import GeneratorConfig


def weight_buckets(weights: dict[str, torch.Tensor] | Iterable[dict[str, torch.Tensor]]
                   ) -> Iterator[dict[str, torch.Tensor]]:
    """`Engine.load_weights`'s argument as buckets: a whole state dict is one bucket."""
    return iter([weights]) if isinstance(weights, Mapping) else iter(weights)


@dataclass(slots=True)
class GenSample:
    """One engine output before scoring (implements `common.interfaces.Sample`)."""

    token_ids: np.ndarray  # [T] int32, EOS included when it was sampled
    logprobs: np.ndarray  # [T] float32, log π(token) at temperature 1
    entropy: float  # mean token entropy (exact or estimated, see module docstring)
    finish_reason: str  # "stop" (EOS or a stop string) | "length" | "abort"
    text: str  # decoded response, cut before the first stop string
    segments: tuple[tuple[int, int], ...] = ()
    """(policy version, index of the first token sampled under it), oldest first: one entry unless new
    weights were loaded while this sample was in flight (`load_weights` during streaming)."""

    @property
    def versions(self) -> tuple[int, int]:
        """(oldest, newest) policy version that sampled a token of this response."""
        return (self.segments[0][0], self.segments[-1][0]) if self.segments else (-1, -1)


@dataclass(frozen=True, slots=True)
class Sampling:
    """Sampling settings of training rollouts (the part of GeneratorConfig an engine needs)."""

    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 24
    stop: tuple[str, ...] = ()

    @classmethod
    def from_config(cls, cfg: GeneratorConfig) -> Sampling:
        return cls(cfg.temperature, cfg.top_p, cfg.max_new_tokens, tuple(s for s in cfg.stop if s))


@dataclass(slots=True)
class Partial:
    """A sample in flight in a streaming engine: what it has sampled so far, under which versions."""

    segments: list[tuple[int, int]]
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    entropies: list[float] = field(default_factory=list)
    text: str = ""

    def mark_version(self, version: int) -> None:
        """New weights were loaded: tokens sampled from now on come from `version`."""
        if self.segments[-1][1] == len(self.token_ids):
            self.segments[-1] = (version, len(self.token_ids))  # nothing sampled under the previous one
        else:
            self.segments.append((version, len(self.token_ids)))

    def finish(self, finish_reason: str, text: str | None = None) -> GenSample:
        return GenSample(
            token_ids=np.asarray(self.token_ids, dtype=np.int32),
            logprobs=np.asarray(self.logprobs, dtype=np.float32),
            entropy=mean_or_zero(self.entropies),
            finish_reason=finish_reason,
            text=self.text if text is None else text,
            segments=tuple(self.segments),
        )


def topk_entropy_estimate(top_logprobs: np.ndarray, vocab_size: int) -> float:
    """Entropy estimate of one token distribution from its k largest log-probs (temperature 1).

    H = Σ_top -p log p + H_tail. The tail holds mass m = 1 - Σ_top p spread over V - k tokens, each
    at most p_min (the smallest top-k probability), so H_tail lies in
    [m · (-log p_min), m · log((V - k) / m)]. We return the lower end: it is exact when the tail is
    empty (k ≥ V, or m → 0), never overestimates, and keeps the ranking "more confident first"
    for the peaked distributions that matter for trajectory selection. It underestimates the exact
    entropy by at most m · log((V - k) · p_min / m) — large only when the model is unsure (flat
    distributions with much tail mass). The learner's feedback replaces it with the exact value.
    """
    lp = np.asarray(top_logprobs, dtype=np.float64)
    lp = lp[np.isfinite(lp)]
    if lp.size == 0:
        return 0.0
    p = np.exp(lp)
    head = float(-(p * lp).sum())
    tail_mass = max(0.0, 1.0 - float(p.sum()))
    if tail_mass <= 1e-12 or lp.size >= vocab_size:
        return head
    return head + tail_mass * float(-lp.min())


def mean_or_zero(values: list[float]) -> float:
    return float(sum(values) / len(values)) if values else 0.0


def stop_cut(text: str, stop: tuple[str, ...]) -> int | None:
    """Index of the earliest stop string in `text`, or None."""
    cut = None
    for s in stop:
        i = text.find(s)
        if i >= 0 and (cut is None or i < cut):
            cut = i
    return cut


def derive_seed(seed: int, index: int) -> int:
    """A per-prompt sampling seed; distinct prompts get far-apart seeds (vLLM adds the sample index)."""
    return (seed * 1_000_003 + index * 65_537) % (2**31 - 1)

