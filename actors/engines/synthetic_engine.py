"""SIMULATION ONLY: an engine that samples random tokens at a set rate, for benchmarks and capacity planning.

    generator.engine: {kind: synthetic, tokens_per_s: 100, length: lognormal, length_median: 64}

It implements the streaming interface of the real engines with almost no CPU: a sample produces `tokens_per_s`
tokens a second up to a length drawn per sample, at most `max_num_seqs` decode together; the response is
`correct` with a probability fixed per prompt, else `wrong` (the `synthetic` reward scores it). Nothing it
produces can teach a model anything: learning tests and training runs never use it.
Details: docs/internals.md#actorsenginessynthetic_enginepy
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import torch

from actors.engines.base import GenSample, Sampling, weight_buckets
from common.config import SyntheticEngineConfig


@dataclass(slots=True)
class _Seq:
    length: int
    correct: bool
    rng: np.random.Generator
    segments: list[tuple[int, int]]
    done_tokens: float = 0.0
    running: bool = False


class SyntheticEngine:
    """`common.interfaces.Engine` with simulated timing; see the module docstring."""

    def __init__(self, cfg: SyntheticEngineConfig, sampling: Sampling, *, seed: int = 0):
        self.cfg, self.sampling = cfg, sampling
        self.version = 0
        self.slots = cfg.max_num_seqs  # samples decoded at once (the streaming generator keeps them full)
        self.last_load_s = 0.0
        self._seed = seed
        self._seqs: dict[str, _Seq] = {}  # insertion order = admission order
        self._tick = time.monotonic()

    # ------------------------------------------------------------------------------------ weights

    def load_weights(self, weights: dict[str, torch.Tensor] | Iterable[dict[str, torch.Tensor]], version: int,
                     partial: bool = False) -> None:
        """Takes `load_s` (simulated) after taking every bucket (a `partial` state too); samples in flight continue
        under the new version."""
        for _ in weight_buckets(weights):  # fetched for real (a source error propagates, as for the real engines)
            pass
        self._advance()
        time.sleep(self.cfg.load_s)
        self._tick = time.monotonic()  # no decoding while loading
        self.version = version
        for s in self._seqs.values():
            n = int(s.done_tokens)
            if s.segments[-1][1] == n:
                s.segments[-1] = (version, n)
            else:
                s.segments.append((version, n))
        self.last_load_s = self.cfg.load_s

    # ---------------------------------------------------------------------------------- streaming

    def add(self, request_id: str, prompt_ids: np.ndarray, seed: int) -> None:
        if request_id in self._seqs:
            raise ValueError(f"request {request_id!r} is already in flight")
        prompt = np.asarray(prompt_ids, dtype=np.int32)
        p_correct = int.from_bytes(hashlib.blake2b(prompt.tobytes(), digest_size=4).digest(), "little") / 2**32
        rng = np.random.default_rng([self._seed, seed & 0x7FFFFFFF])
        self._seqs[request_id] = _Seq(self._draw_length(rng), bool(rng.random() < p_correct), rng,
                                      [(self.version, 0)])

    def step(self) -> list[tuple[str, GenSample]]:
        if not self._seqs:
            return []
        time.sleep(self.cfg.step_s)
        self._advance()
        done = [(rid, s) for rid, s in self._seqs.items() if s.done_tokens >= s.length]
        for rid, _ in done:
            del self._seqs[rid]
        return [(rid, self._sample(s)) for rid, s in done]

    def abort(self, request_ids: list[str]) -> None:
        for r in request_ids:
            self._seqs.pop(r, None)

    def in_flight(self) -> int:
        return len(self._seqs)

    def generate(self, prompts: list[np.ndarray], n: list[int], seed: int) -> list[list[GenSample]]:
        """Batch use: every sample of every prompt, streamed to the end."""
        ids = {f"b{i}/{j}": i for i, k in enumerate(n) for j in range(k)}
        for rid, i in ids.items():
            self.add(rid, prompts[i], seed + len(self._seqs))
        out: list[list[GenSample]] = [[] for _ in prompts]
        while any(r in self._seqs for r in ids):
            for rid, sample in self.step():
                out[ids[rid]].append(sample)
        return out

    # -------------------------------------------------------------------------------- internals

    def _advance(self) -> None:
        now = time.monotonic()
        dt, self._tick = now - self._tick, now
        for i, s in enumerate(self._seqs.values()):
            if i >= self.cfg.max_num_seqs:
                break
            s.done_tokens += dt * self.cfg.tokens_per_s

    def _draw_length(self, rng: np.random.Generator) -> int:
        c, cap = self.cfg, self.sampling.max_new_tokens
        match c.length:
            case "fixed":
                n = c.length_median
            case "uniform":
                n = rng.integers(c.min_length, 2 * c.length_median - c.min_length + 1)
            case _:  # lognormal: median length_median, long right tail
                n = c.length_median * float(np.exp(c.length_sigma * rng.standard_normal()))
        return int(min(cap, max(c.min_length, 1, round(n))))

    def _sample(self, s: _Seq) -> GenSample:
        return GenSample(
            token_ids=s.rng.integers(0, self.cfg.vocab_size, s.length, dtype=np.int32),
            logprobs=-s.rng.exponential(1.0, s.length).astype(np.float32),
            entropy=float(s.rng.uniform(0.1, 2.0)),
            finish_reason="length" if s.length >= self.sampling.max_new_tokens else "stop",
            text="correct" if s.correct else "wrong",
            segments=tuple(s.segments),
        )
