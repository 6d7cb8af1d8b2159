"""The collective backend's wire format: a published version as a JSON plan and flat uint8 buckets.

    packed = pack(version, state_dict_or_its_chunks, bucket_bytes, device)   # learner rank 0
    state_dict = unpack(meta_bytes, received_buckets)                       # a generator: views, no copy

Each tensor starts at a 64-byte aligned offset inside its bucket (`learner.gather.ALIGN`, so `.view(dtype)`
works); a tensor larger than `bucket_bytes` gets a bucket of its own. The plan lists (name, shape, dtype, bucket,
offset, nbytes) per tensor. `learner.collective` moves these buckets over its channels; `learner.gather`'s flat
buckets are already in this layout, so a gathered bucket becomes a wire bucket without a copy (`Packer`).
Imports only torch and the stdlib (and the gather's bucket type).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from learner.gather import ALIGN, FlatBucket


@dataclass(frozen=True, slots=True)
class Packed:
    """One published version as the wire carries it: a JSON plan and flat uint8 buckets."""

    version: int
    meta: torch.Tensor  # [M] uint8, JSON: {"tensors": [[name, shape, dtype, bucket, offset, nbytes], ...]}
    buckets: list[torch.Tensor]  # each [size] uint8


def host_device() -> torch.device:
    """Where a relay's versions and rank 0's older versions live: host memory, also on GPU machines (pinned)."""
    return torch.device("cpu")


def uint8_buffer(nbytes: int, device: torch.device) -> torch.Tensor:
    """A uint8 buffer; page-locked when on the host of a CUDA machine (fast, asynchronous copies to the device)."""
    pin = device.type == "cpu" and torch.cuda.is_available()
    return torch.empty(nbytes, dtype=torch.uint8, device=device, pin_memory=pin)


def dtype_named(name: str) -> torch.dtype:
    return getattr(torch, name.removeprefix("torch."))


class Packer:
    """Streams state-dict chunks into uint8 buckets of up to `bucket_bytes` (a larger tensor gets a bucket of its
    own). `add` chunks, then `finish`.

    A `FlatBucket` from the gather is already in the wire layout: it becomes one bucket at once, kept as it is when
    it was gathered into a buffer of ours (`CollectiveServer.bucket_buffer` passed as the gather's `alloc`), else
    copied in a single copy on its own device (the gather reuses its buffers after the next bucket is asked for). A dict's tensors are copied when their bucket closes, so the packer holds references to them until then:
    pass dicts that stay valid (the delta encoder's, a whole state dict), never views into the gather's buffers."""

    def __init__(self, version: int, bucket_bytes: int, device: torch.device):
        self.version, self.bucket_bytes, self.device = version, bucket_bytes, device
        self.plan: list[list] = []
        self.buckets: list[torch.Tensor] = []
        self.pending: list[tuple[torch.Tensor, int, int]] = []  # the open bucket's (tensor, offset, bytes)
        self.size: int | None = None  # bytes used in the open bucket; None: none open

    def _close(self) -> None:
        buf = uint8_buffer(max(self.size, 1), self.device)
        for t, off, nbytes in self.pending:
            if nbytes:
                buf[off:off + nbytes].copy_(t.detach().contiguous().reshape(-1).view(torch.uint8))
        self.buckets.append(buf)
        self.pending.clear()
        self.size = None

    def add(self, chunk: dict[str, torch.Tensor] | FlatBucket) -> None:
        if isinstance(chunk, FlatBucket):
            return self._add_flat(chunk)
        for name, t in chunk.items():
            nbytes = t.numel() * t.element_size()
            offset = 0 if self.size is None else -(-self.size // ALIGN) * ALIGN
            if self.size is not None and offset + nbytes > self.bucket_bytes and self.size > 0:
                self._close()
                offset = 0
            self.plan.append([name, list(t.shape), str(t.dtype).removeprefix("torch."), len(self.buckets), offset,
                              nbytes])
            self.pending.append((t, offset, nbytes))
            self.size = offset + nbytes

    def _add_flat(self, b: FlatBucket) -> None:
        if self.size is not None:
            self._close()
        if b.owned and b.data.numel():  # gathered into a buffer of our own (`bucket_buffer`): kept as it is
            buf = b.data
        else:
            buf = uint8_buffer(max(b.data.numel(), 1), b.data.device)
            buf[:b.data.numel()].copy_(b.data)  # the whole bucket in one copy (alignment gaps included)
        for e in b.entries:
            self.plan.append([e.name, list(e.shape), str(e.dtype).removeprefix("torch."), len(self.buckets), e.offset,
                              e.nbytes])
        self.buckets.append(buf)

    def finish(self) -> Packed:
        if self.size is not None:
            self._close()
        meta = torch.frombuffer(bytearray(json.dumps({"tensors": self.plan}).encode()), dtype=torch.uint8)
        return Packed(self.version, meta.to(self.device), self.buckets)


def pack(version: int, state_dict: dict[str, torch.Tensor] | Iterable[dict[str, torch.Tensor]], bucket_bytes: int,
         device: torch.device) -> Packed:
    """Copy `state_dict` (a dict, or its chunks as they come: `learner.gather.iter_full_state`) into uint8 buckets
    of up to `bucket_bytes` (see `Packer`)."""
    packer = Packer(version, bucket_bytes, device)
    for chunk in ([state_dict] if isinstance(state_dict, dict) else state_dict):
        packer.add(chunk)
    return packer.finish()


def packed_bytes(p: Packed) -> int:
    """The payload bytes of a packed version (its tensors, without alignment padding)."""
    return sum(entry[5] for entry in json.loads(bytes(p.meta.cpu().numpy()))["tensors"])


def unpack(meta: bytes, buckets: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """The state dict a `Packed` carries: views into the received buckets (no copy)."""
    out = {}
    for name, shape, dtype, b, off, nbytes in json.loads(meta)["tensors"]:
        out[name] = buckets[b][off:off + nbytes].view(dtype_named(dtype)).reshape(shape)
    return out
