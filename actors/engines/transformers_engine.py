"""A plain transformers engine: a batched sampling loop with a KV cache (no vLLM needed).

Rows (prompt × sample) are generated `batch_rows` at a time, prompts left-padded. Each step takes
the last position's logits [R, V] and computes, at temperature 1, the log-prob of every token and
the exact full-vocabulary entropy; the next token is drawn from the sampling distribution
(logits / temperature, then top-p). See `actors.engines.base` for the log-prob convention.

Streaming (`add`/`step`) is batch-at-a-time behind the streaming interface: `step` generates up to
`batch_rows` queued samples to completion, so weights never change under a sample in flight.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable

import numpy as np
import torch

from actors.engines.base import GenSample, Sampling, derive_seed, stop_cut, weight_buckets
from common.config import TransformersEngineConfig

log = logging.getLogger(__name__)

GREEDY_BELOW = 1e-5
"""Temperatures at or below this sample greedily (argmax), as vLLM does below its epsilon."""

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class TransformersEngine:
    """`common.interfaces.Engine` over a Hugging Face causal LM on CPU (or one GPU)."""

    def __init__(self, cfg: TransformersEngineConfig, sampling: Sampling, model_path: str, *,
                 dtype: str = "float32", device: str | None = None):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.cfg = cfg
        self.sampling = sampling
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.dtype = _DTYPES[dtype]
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=self.dtype).to(self.device).eval()
        self.version = 0
        self.slots = cfg.batch_rows  # samples decoded at once (the streaming generator keeps them full)
        self.last_load_s = 0.0
        self._queue: dict[str, tuple[np.ndarray, int]] = {}  # streaming requests not generated yet
        eos = self.model.generation_config.eos_token_id
        if eos is None:
            eos = self.tokenizer.eos_token_id
        self.eos_ids = torch.tensor(sorted({eos} if isinstance(eos, int) else set(eos or [])), dtype=torch.long)
        pad = self.tokenizer.pad_token_id
        self.pad_id = int(pad if pad is not None else (self.eos_ids[0] if len(self.eos_ids) else 0))

    # ------------------------------------------------------------------------------------ weights

    def load_weights(self, weights: dict[str, torch.Tensor] | Iterable[dict[str, torch.Tensor]], version: int,
                     partial: bool = False) -> None:
        """Replace all parameters (Hugging Face names; a state dict or buckets of one, loaded as they arrive),
        cast to the engine's dtype; missing or unknown names are an error. A tied parameter may come under any one
        of its names (the learner publishes a tied head once, as the embedding): loading it sets both. `partial`:
        only some parameters come (a merged adapter publication, `actors.adapters`); the others stay, missing
        names are no error (unknown ones still are)."""
        t0 = time.perf_counter()
        loaded: set[str] = set()
        unexpected: list[str] = []
        for bucket in weight_buckets(weights):
            bucket = {k: v.to(self.dtype) if v.is_floating_point() else v for k, v in bucket.items()}
            unexpected += self.model.load_state_dict(bucket, strict=False).unexpected_keys
            loaded.update(bucket)
        # A tied parameter's other names, and non-persistent entries, may legitimately be absent; real ones may not.
        names: dict[int, list[str]] = {}
        for k, p in self.model.named_parameters(remove_duplicate=False):
            names.setdefault(id(p), []).append(k)
        tied_loaded = {k for group in names.values() if len(group) > 1 and loaded.intersection(group) for k in group}
        missing = [] if partial else [k for k in self.model.state_dict() if k not in loaded and k not in tied_loaded
                                      and not k.endswith("rotary_emb.inv_freq")]
        if missing or unexpected:
            raise ValueError(
                f"weights for version {version} do not fit the model: missing {missing[:5]}, "
                f"unexpected {unexpected[:5]} (publish a full state dict with Hugging Face names)"
            )
        self.version = version
        self.last_load_s = time.perf_counter() - t0

    # ---------------------------------------------------------------------------------- streaming

    def add(self, request_id: str, prompt_ids: np.ndarray, seed: int) -> None:
        """Queue one sample; the next `step` generates it (with up to batch_rows - 1 others)."""
        if request_id in self._queue:
            raise ValueError(f"request {request_id!r} is already in flight")
        self._queue[request_id] = (np.asarray(prompt_ids), seed)

    @torch.inference_mode()
    def step(self) -> list[tuple[str, GenSample]]:
        """Generate the oldest `batch_rows` queued samples to completion and return them."""
        ids = list(self._queue)[: self.cfg.batch_rows]
        if not ids:
            return []
        chunk = [self._queue.pop(r) for r in ids]
        gen = torch.Generator(device=self.device).manual_seed(chunk[0][1])
        return list(zip(ids, self._generate_rows([p for p, _ in chunk], gen)))

    def abort(self, request_ids: list[str]) -> None:
        for r in request_ids:
            self._queue.pop(r, None)

    def in_flight(self) -> int:
        return len(self._queue)

    # --------------------------------------------------------------------------------- generation

    @torch.inference_mode()
    def generate(self, prompts: list[np.ndarray], n: list[int], seed: int) -> list[list[GenSample]]:
        """`n[i]` samples of `prompts[i]`; returns one list per prompt, in order."""
        if len(prompts) != len(n):
            raise ValueError(f"got {len(prompts)} prompts but {len(n)} sample counts")
        rows = [(i, j) for i, k in enumerate(n) for j in range(k)]
        out: list[list[GenSample]] = [[] for _ in prompts]
        for start in range(0, len(rows), self.cfg.batch_rows):
            chunk = rows[start:start + self.cfg.batch_rows]
            gen = torch.Generator(device=self.device).manual_seed(derive_seed(seed, start))
            for (i, _), sample in zip(chunk, self._generate_rows([prompts[i] for i, _ in chunk], gen)):
                out[i].append(sample)
        return out

    def _generate_rows(self, prompts: list[np.ndarray], gen: torch.Generator) -> list[GenSample]:
        s = self.sampling
        R = len(prompts)
        P = max(len(p) for p in prompts)
        ids = torch.full((R, P), self.pad_id, dtype=torch.long)  # [R, P] left-padded
        mask = torch.zeros((R, P), dtype=torch.long)  # [R, P]
        for r, p in enumerate(prompts):
            ids[r, P - len(p):] = torch.as_tensor(np.asarray(p, dtype=np.int64))
            mask[r, P - len(p):] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        eos = self.eos_ids.to(self.device)

        tokens = torch.zeros((R, s.max_new_tokens), dtype=torch.long, device=self.device)  # [R, T]
        logps = torch.zeros((R, s.max_new_tokens), dtype=torch.float32, device=self.device)  # [R, T]
        ents = torch.zeros((R, s.max_new_tokens), dtype=torch.float32, device=self.device)  # [R, T]
        length = torch.full((R,), s.max_new_tokens, dtype=torch.long, device=self.device)  # [R]
        stopped = torch.zeros(R, dtype=torch.bool, device=self.device)  # [R] EOS or stop string
        done = torch.zeros(R, dtype=torch.bool, device=self.device)  # [R]

        cache = None
        step_ids, positions = ids, (mask.cumsum(-1) - 1).clamp(min=0)  # [R, P]
        for t in range(s.max_new_tokens):
            out = self.model(input_ids=step_ids, attention_mask=mask, position_ids=positions,
                             past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            logits = out.logits[:, -1, :].float()  # [R, V]
            logp = torch.log_softmax(logits, dim=-1)  # [R, V] temperature 1 (the policy)
            tok = self._sample(logits, gen)  # [R]
            tokens[:, t] = tok
            logps[:, t] = logp.gather(1, tok[:, None])[:, 0]
            ents[:, t] = -(logp.exp() * logp).sum(-1)
            hit_eos = torch.isin(tok, eos) & ~done
            newly = hit_eos | (self._stop_string_hits(tokens[:, :t + 1]) & ~done)
            length = torch.where(newly, torch.full_like(length, t + 1), length)
            stopped |= newly
            done |= newly
            if bool(done.all()):
                break
            step_ids = tok[:, None]  # [R, 1]
            positions = positions[:, -1:] + 1  # [R, 1]
            mask = torch.cat([mask, torch.ones((R, 1), dtype=mask.dtype, device=self.device)], dim=1)
        return [self._sample_out(tokens[r, :length[r]], logps[r, :length[r]], ents[r, :length[r]], bool(stopped[r]))
                for r in range(R)]

    def _sample(self, logits: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
        s = self.sampling
        if s.temperature <= GREEDY_BELOW:
            return logits.argmax(dim=-1)  # [R]
        probs = torch.softmax(logits / s.temperature, dim=-1)  # [R, V] sampling distribution
        if s.top_p < 1.0:
            sp, si = probs.sort(dim=-1, descending=True)  # [R, V]
            keep = (sp.cumsum(-1) - sp) < s.top_p  # the top token is always kept
            sp = sp * keep
            probs = torch.zeros_like(probs).scatter_(1, si, sp)
        return torch.multinomial(probs, 1, generator=gen)[:, 0]  # [R]

    def _stop_string_hits(self, tokens: torch.Tensor) -> torch.Tensor:
        """[R] bool: the response so far contains a stop string (decoded text, as vLLM checks it)."""
        hits = torch.zeros(tokens.shape[0], dtype=torch.bool, device=tokens.device)
        if not self.sampling.stop:
            return hits
        texts = self.tokenizer.batch_decode(tokens.tolist(), skip_special_tokens=True)
        for r, text in enumerate(texts):
            hits[r] = stop_cut(text, self.sampling.stop) is not None
        return hits

    def _sample_out(self, tok: torch.Tensor, logp: torch.Tensor, ent: torch.Tensor, stopped: bool) -> GenSample:
        ids = tok.to("cpu", torch.int32).numpy().copy()
        text = self.tokenizer.decode(ids.tolist(), skip_special_tokens=True)
        cut = stop_cut(text, self.sampling.stop)
        if cut is not None:
            text = text[:cut]
        return GenSample(
            token_ids=ids,
            logprobs=logp.to("cpu", torch.float32).numpy().copy(),
            entropy=float(ent.mean()) if len(ent) else 0.0,
            finish_reason="stop" if stopped else "length",
            text=text,
            segments=((self.version, 0),),
        )
