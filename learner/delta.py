"""Delta weight publications: only the weights that changed since the previous version travel.

    enc = DeltaEncoder()                                # learner rank 0, one per publisher
    for full, delta in enc.tee(version, chunks): ...    # publish `full`; and `delta` (None: no base for it)
    held = HeldWeights()                                # a generator, one per weight source
    if held.version == ann.version - 1 and held.apply(ann.version, delta_chunks):
        engine.load_weights(held.buckets(), ann.version)
    else:
        engine.load_weights(held.keep(ann.version, full_chunks), ann.version)

Applying a delta is bit-exact. Why it pays, and the encoding of a delta chunk: docs/internals.md#learnerdeltapy
"""

from __future__ import annotations

import logging
import zlib
from collections.abc import Iterable, Iterator

import numpy as np
import torch

from learner.gather import FlatBucket

log = logging.getLogger(__name__)

SEP = "@"
DELTA_WORTH = 0.8
"""A delta larger than this share of the whole version is not offered (applying it would cost more than it saves)."""
_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class DeltaMismatch(ValueError):
    """A delta does not apply to the held weights (missing tensor, wrong shape, or a checksum differs)."""


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's raw bits as a flat integer tensor of the same element size (no copy when contiguous)."""
    return t.detach().contiguous().reshape(-1).view(_INT[t.element_size()])


def checksum(t: torch.Tensor) -> int:
    """CRC-32 of the tensor's bytes, computed on a host copy (both ends hold host copies: rank 0 its last
    publication, a generator its last load), so a GPU and a CPU end agree."""
    return zlib.crc32(_bits(t).cpu().numpy().view(np.uint8))


def encode(prev: dict[str, torch.Tensor], chunk: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The delta of `chunk` against `prev` (same names, same device)."""
    out: dict[str, torch.Tensor] = {}
    for name, new in chunk.items():
        out[f"{name}{SEP}c"] = torch.tensor([checksum(new)], dtype=torch.int64)
        old = prev.get(name)
        if old is None or old.shape != new.shape or old.dtype != new.dtype:
            out[name] = new
            continue
        nb = _bits(new)
        idx = (nb != _bits(old)).nonzero().reshape(-1)
        idx = idx.to(torch.int32) if new.numel() < 2**31 else idx
        if idx.numel() * (idx.element_size() + new.element_size()) + 16 >= new.numel() * new.element_size():
            out[name] = new  # denser than the tensor itself
            continue
        out[f"{name}{SEP}i"] = idx
        out[f"{name}{SEP}v"] = new.detach().contiguous().reshape(-1)[idx.long()]
        out[f"{name}{SEP}s"] = torch.tensor([new.numel(), *new.shape], dtype=torch.int64)
    return out


def payload_bytes(chunk: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in chunk.values())


class DeltaEncoder:
    """Rank 0's side: a host copy of the last published version and the delta of each new one against it."""

    def __init__(self):
        self.prev: dict[str, torch.Tensor] = {}
        self.version: int | None = None  # the version `prev` holds completely; None while none or mid-publication
        self.last_full_bytes = self.last_delta_bytes = 0

    def tee(self, version: int, chunks: Iterable[dict[str, torch.Tensor]]
            ) -> Iterator[tuple[dict[str, torch.Tensor], dict[str, torch.Tensor] | None]]:
        """(full chunk, its delta against version-1 or None when this encoder does not hold version-1), chunk by
        chunk; the host copy becomes `version` once every chunk was taken."""
        base_ok, self.version = self.version == version - 1, None
        self.last_full_bytes = self.last_delta_bytes = 0
        for chunk in chunks:  # the gather's buckets are valid only until the next: copied here, once
            if isinstance(chunk, FlatBucket):  # one copy of the flat bucket, not one per tensor
                host = FlatBucket(chunk.data.to("cpu", copy=True), chunk.entries).tensors()
            else:
                host = {name: t.detach().to("cpu", copy=True) for name, t in chunk.items()}
            delta = encode(self.prev, host) if base_ok else None  # compared and checksummed on the host
            self.prev.update(host)
            self.last_full_bytes += payload_bytes(chunk)
            self.last_delta_bytes += payload_bytes(delta) if delta is not None else 0
            yield chunk, delta
        self.version = version


class HeldWeights:
    """A generator's side: a host copy of the last version it loaded completely (the base deltas apply to)."""

    def __init__(self):
        self.tensors: dict[str, torch.Tensor] = {}
        self.version: int | None = None
        self.delta_loads = self.full_loads = self.mismatches = 0

    def apply(self, version: int, delta_chunks: Iterable[dict[str, torch.Tensor]]) -> bool:
        """Apply every chunk of the delta `version-1 -> version` in place and verify each tensor's checksum; True
        when the held copy is now exactly `version`. False (the copy is then unusable: the next load must be
        full) on any mismatch. Nothing is handed to the engine before every chunk was verified."""
        if self.version != version - 1:
            return False
        self.version = None  # torn until every chunk is applied and verified
        try:
            for chunk in delta_chunks:
                self._apply_chunk(chunk)
        except DeltaMismatch as e:
            log.warning("weights version %d: the delta from version %d does not apply (%s); taking the full copy",
                        version, version - 1, e)
            self.mismatches += 1
            self.tensors.clear()
            return False
        self.version = version
        self.delta_loads += 1
        return True

    def _apply_chunk(self, chunk: dict[str, torch.Tensor]) -> None:
        names = {k.rsplit(SEP, 1)[0] for k in chunk if k.endswith(f"{SEP}c")}
        for name in names:
            if name in chunk:  # sent whole
                self.tensors[name] = chunk[name].detach().to("cpu", copy=True)
            else:
                held = self.tensors.get(name)
                numel, *shape = chunk[f"{name}{SEP}s"].tolist()
                if held is None or held.numel() != numel or list(held.shape) != shape:
                    raise DeltaMismatch(f"{name}: the held copy has no tensor of shape {shape}")
                flat = held.reshape(-1)
                flat[chunk[f"{name}{SEP}i"].long()] = chunk[f"{name}{SEP}v"].to(held.dtype)
            if checksum(self.tensors[name]) != int(chunk[f"{name}{SEP}c"][0]):
                raise DeltaMismatch(f"{name}: checksum differs after applying the delta")

    def stats(self) -> dict[str, int]:
        """Loads from a delta, full loads, and deltas that did not verify (each then loaded the full copy)."""
        return {"delta_loads": self.delta_loads, "full_loads": self.full_loads, "delta_mismatches": self.mismatches}

    def buckets(self) -> Iterator[dict[str, torch.Tensor]]:
        """The held version a tensor at a time, each a copy made when the engine asks for it: an engine that kept
        a tensor it was given (instead of copying it into its own) must not see the next delta applied to it."""
        for name, t in list(self.tensors.items()):
            yield {name: t.clone()}

    def keep(self, version: int, chunks: Iterable[dict[str, torch.Tensor]]) -> Iterator[dict[str, torch.Tensor]]:
        """Pass a full version through to the engine, keeping a host copy of each chunk; the copy is `version`
        once the engine took every chunk (a load that stops part-way leaves no usable base)."""
        self.version = None
        self.tensors.clear()
        for chunk in chunks:
            for name, t in chunk.items():
                self.tensors[name] = t.detach().to("cpu", copy=True)
            yield chunk
        self.version = version
        self.full_loads += 1
