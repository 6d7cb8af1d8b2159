"""The full state dict of an FSDP2-sharded model on rank 0, streamed in flat buckets at the copy limit.

The state is cut into buckets of up to `bucket_bytes` (state-dict order, any dtypes); each is gathered on the
device into one flat buffer (tensors 64-byte aligned: the collective wire layout), copied to the host once and
handed over as a `FlatBucket` (name -> tensor view). Contract: **a yielded bucket's tensors are valid until the
consumer asks for the next bucket**; whoever keeps data longer must copy before it asks. Tied parameters travel
once; LoRA targets are published merged (with `adapters=True`, the adapter tensors alone). Works on any backend
that implements `gather`; imports only torch and the stdlib.

Why, the pipeline step by step, its buffers, FSDP2's shard shapes: docs/internals.md#learnergatherpy
"""

from __future__ import annotations

import ctypes
import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

DEFAULT_BUCKET_BYTES = 256 << 20
ALIGN = 64  # bytes: every tensor of a flat bucket starts at a multiple of this (so `.view(dtype)` works)


def shard_rows(n: int, world: int, rank: int) -> int:
    """Rows of a dim-0 size-n parameter held by `rank` under FSDP2's even chunking."""
    c = math.ceil(n / world) if n else 0
    return max(0, min(n, (rank + 1) * c) - rank * c)


def release_freed_memory() -> None:
    """Give freed heap memory back to the OS (glibc `malloc_trim`; nothing elsewhere). Freed buffers otherwise
    stay in the process's resident memory: glibc raises its mmap threshold after large frees."""
    global _LIBC
    if _LIBC is None:
        try:
            _LIBC = ctypes.CDLL("libc.so.6")
            _LIBC.malloc_trim.argtypes = [ctypes.c_size_t]
        except (OSError, AttributeError):
            _LIBC = False
    if _LIBC:
        _LIBC.malloc_trim(0)


_LIBC = None


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def tied_aliases(model: torch.nn.Module) -> dict[str, str]:
    """{alias: name} for every parameter or buffer reachable under more than one name (a tied head), `name` being
    the first one `named_parameters`/`named_buffers` gives (for Qwen2.5: lm_head.weight -> model.embed_tokens.weight).
    FSDP2 keeps a shared parameter shared, so this holds before and after sharding."""
    out: dict[str, str] = {}
    for named in (model.named_parameters, model.named_buffers):
        first: dict[int, str] = {}
        for name, t in named(remove_duplicate=False):
            out.update({name: first[id(t)]} if id(t) in first else {})
            first.setdefault(id(t), name)
    return out


@dataclass(frozen=True, slots=True)
class Entry:
    """One tensor of a flat bucket."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    offset: int  # bytes from the bucket's start (a multiple of ALIGN)
    nbytes: int


class FlatBucket(Mapping):
    """A gathered bucket: its tensors laid out in one flat uint8 buffer; a read-only mapping name -> view.

    `data` is a view into a reused buffer (see the module docstring): valid until the next bucket is asked for;
    unless `owned`: then it is a buffer the consumer's `alloc` gave (`iter_flat_buckets(alloc=...)`), its to keep."""

    __slots__ = ("data", "entries", "_index", "owned")

    def __init__(self, data: torch.Tensor, entries: list[Entry], owned: bool = False):
        self.data = data  # [nbytes] uint8, on the host (or the device: `iter_flat_buckets(to_host=False)`)
        self.entries = entries
        self._index = {e.name: e for e in entries}
        self.owned = owned  # `data` came from the consumer's `alloc`: its own, never reused by the gather

    @property
    def nbytes(self) -> int:
        """Payload bytes (without the alignment gaps)."""
        return sum(e.nbytes for e in self.entries)

    def _view(self, e: Entry) -> torch.Tensor:
        return self.data[e.offset:e.offset + e.nbytes].view(e.dtype).view(e.shape)

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._view(self._index[name])

    def __iter__(self):
        return iter(self._index)

    def __len__(self) -> int:
        return len(self.entries)

    def items(self):
        return self.tensors().items()

    def values(self):
        return self.tensors().values()

    def tensors(self) -> dict[str, torch.Tensor]:
        """{name: view} in bucket order (a dict of views: valid as long as `data` is)."""
        return {e.name: self._view(e) for e in self.entries}


class Staging:
    """The reusable buffers of `iter_flat_buckets`: on CUDA two pinned host buffers (so device-to-host copies are
    asynchronous and overlap the next bucket's gather), two device buffers, the gather's send/receive buffers and
    the side stream of the copies; on the CPU one host buffer (nothing overlaps there) and the send/receive
    buffers. Grown to the largest bucket when a publication starts, never shrunk; keep one per learner rank so
    every publication reuses them. The device buffers go back to torch's caching allocator after each publication
    (`release`): only the pinned host buffers, costly to allocate, are kept on the device's machine. `allocations`
    counts the buffers ever allocated (a test reads it)."""

    def __init__(self):
        self.buffers: dict[tuple, torch.Tensor] = {}
        self.allocations = 0
        self.stream = None  # CUDA: the side stream of the device-to-host copies

    def get(self, key: tuple, nbytes: int, device: torch.device) -> torch.Tensor:
        """The first `nbytes` of buffer `key` on `device` (allocated or grown when too small)."""
        buf = self.buffers.get(key)
        if buf is None or buf.numel() < nbytes or buf.device != device:
            if buf is not None and self.stream is not None:
                self.stream.synchronize()  # no copy may still read or write the buffer being replaced
            pin = device.type == "cpu" and torch.cuda.is_available()
            self.buffers[key] = buf = torch.empty(max(nbytes, 1), dtype=torch.uint8, device=device, pin_memory=pin)
            self.allocations += 1
        return buf[:nbytes]

    def release(self, device: torch.device) -> None:
        """Drop the buffers on `device` (once every copy reading them is done): on CUDA they return to torch's
        caching allocator, where the next step's activations can use them; the pinned host buffers stay."""
        if self.stream is not None:
            self.stream.synchronize()
        self.buffers = {k: b for k, b in self.buffers.items() if b.device != device}

    def copy_stream(self, device: torch.device):
        if self.stream is None:
            self.stream = torch.cuda.Stream(device=device)
        return self.stream


_DEFAULT_STAGING = Staging()  # the caller's buffers when it passes none: reused by every call in this process


@dataclass(slots=True)
class _Plan:
    """One bucket: its entries in the full layout, their sources, and the gather's send layout on every rank."""

    entries: list[Entry]
    sources: list  # the state-dict tensors (DTensors or plain) or `Deferred` entries
    sharded: list[bool]  # a dim-0 shard gathered (else rank 0 copies the full tensor)
    nbytes: int  # the full layout's size, alignment gaps included
    send: list[list[tuple[int, int]]]  # [rank][i] = (offset, nbytes) of sharded entry i's rows in that rank's send
    width: int  # bytes of the largest rank's send layout


@dataclass(frozen=True, slots=True)
class Deferred:
    """A state entry made when its bucket is gathered (a merged LoRA weight): `like` has its shape, dtype and
    placement; `make()` (collective under FSDP) returns it, freed once the bucket is filled."""

    like: torch.Tensor
    make: Callable[[], torch.Tensor]


def _ref(t) -> torch.Tensor:
    """The tensor giving an entry's shape, size and placement."""
    return t.like if isinstance(t, Deferred) else t


def _is_dim0_shard(t) -> bool:
    from torch.distributed.tensor import DTensor, Shard

    return isinstance(t, DTensor) and len(t.placements) == 1 and t.placements[0] == Shard(0)


def _plans(items: list[tuple[str, torch.Tensor, torch.dtype]], bucket_bytes: int, world: int) -> list[_Plan]:
    """Consecutive entries, up to `bucket_bytes` per bucket in the aligned full layout (at least one entry each)."""
    groups: list[list[tuple[str, torch.Tensor, torch.dtype, int]]] = []
    size = 0
    for name, t, dt in items:
        nbytes = _ref(t).numel() * dt.itemsize
        offset = _align(size)
        if not groups or (offset + nbytes > bucket_bytes and size > 0):
            groups.append([])
            offset = 0
        groups[-1].append((name, t, dt, offset))
        size = offset + nbytes
    out = []
    for g in groups:
        entries = [Entry(n, tuple(_ref(t).shape), dt, off, _ref(t).numel() * dt.itemsize) for n, t, dt, off in g]
        sharded = [world > 1 and _is_dim0_shard(_ref(t)) for _, t, _, _ in g]
        send: list[list[tuple[int, int]]] = []
        for r in range(world):
            layout, pos = [], 0
            for e, s in zip(entries, sharded):
                if s:
                    n = shard_rows(e.shape[0], world, r) * math.prod(e.shape[1:]) * e.dtype.itemsize
                    pos = _align(pos)
                    layout.append((pos, n))
                    pos += n
            send.append(layout)
        width = max((lay[-1][0] + lay[-1][1] for lay in send if lay), default=0)
        out.append(_Plan(entries, [t for _, t, _, _ in g], sharded, entries[-1].offset + entries[-1].nbytes,
                         send, width))
    return out


def _state_items(model: torch.nn.Module, dtype: torch.dtype | None, aliases: bool, adapters: bool = False
                 ) -> list[tuple[str, torch.Tensor, torch.dtype]]:
    """(name, state-dict tensor or `Deferred`, the dtype it is published in), tied aliases left out unless `aliases`;
    LoRA targets merged under their base names, adapters left out. `adapters`: only the LoRA adapter tensors
    (`...lora_A`, `...lora_B`, in state-dict order), nothing merged."""
    from learner.lora import adapter_names, lora_modules, merged_weight

    if adapters:
        keep = adapter_names(model)
        return [(k, v, dtype if dtype is not None else v.dtype) for k, v in model.state_dict().items() if k in keep]
    skip = (set() if aliases else set(tied_aliases(model))) | adapter_names(model)
    merged = {f"{n}.weight": merged_weight(m) for n, m in lora_modules(model).items()}
    return [(k, Deferred(v, merged[k]) if k in merged else v,
             dtype if dtype is not None and v.is_floating_point() else v.dtype)
            for k, v in model.state_dict().items() if k not in skip]


def published_specs(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The state-dict entries a publication or HF export carries (tied aliases included; LoRA adapters left out,
    their targets' `weight` entries being merged): what `learner.checkpoint.tensor_specs` lays out."""
    from learner.lora import adapter_names

    skip = adapter_names(model)
    return {k: v for k, v in model.state_dict().items() if k not in skip}


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _direct(plan: _Plan) -> bool:
    """A bucket of one dim-0 sharded tensor split into equal rows (the large embedding and head, each a bucket of
    its own above `bucket_bytes`): rank r's rows are bytes [r * width, (r + 1) * width) of the full layout, so the
    gather receives into the bucket itself (no receive buffer, no rearranging copy) and, without a cast, sends the
    local shard as it is (no send buffer)."""
    return len(plan.entries) == 1 and plan.sharded[0] and all(lay[0] == (0, plan.width) for lay in plan.send)


@dataclass(frozen=True)
class _Buffers:
    """Where one gather's buffers come from: `staging` on `device`, the send/receive buffers sized once for the
    `widest` send of the publication, the output buffers for the `largest` bucket."""

    staging: Staging
    device: torch.device
    largest: int
    widest: int


def _fill(plan: _Plan, rank: int, world: int, out: torch.Tensor | None, buffers: _Buffers) -> None:
    """Step 1 of the pipeline for one bucket (a collective: every rank calls it; `out` is rank 0's flat buffer)."""
    staging, device, widest = buffers.staging, buffers.device, buffers.widest
    recv = None
    sources = [t.make() if isinstance(t, Deferred) else t for t in plan.sources]  # in plan order on every rank
    if _direct(plan):  # one evenly split tensor: each rank's rows are one slice of the full layout, received in place
        e, local = plan.entries[0], _local(sources[0])
        send = local.reshape(-1) if local.dtype == e.dtype and local.is_contiguous() else \
            staging.get(("send",), plan.width, device).view(e.dtype).copy_(local.reshape(-1))
        gather_list = [out[r * plan.width:(r + 1) * plan.width].view(e.dtype) for r in range(world)] \
            if rank == 0 else None
        dist.gather(send, gather_list=gather_list, dst=0)
        return
    if any(plan.sharded):
        send = staging.get(("send",), widest, device)[:plan.width]  # [width] this rank's rows of the bucket, cast
        mine = iter(plan.send[rank])
        for e, t, s in zip(plan.entries, sources, plan.sharded):
            off, n = next(mine) if s else (0, 0)
            if n:
                send[off:off + n].view(e.dtype).copy_(_local(t).reshape(-1))
        if rank == 0:
            recv = staging.get(("recv",), world * widest, device)[:world * plan.width]  # every rank's send
        gather_list = [recv[r * plan.width:(r + 1) * plan.width] for r in range(world)] if rank == 0 else None
        dist.gather(send, gather_list=gather_list, dst=0)
    i = 0
    for e, t, s in zip(plan.entries, sources, plan.sharded):
        if not s:
            full = t.full_tensor() if world > 1 and hasattr(t, "full_tensor") else _local(t)
            if rank == 0 and e.nbytes:
                out[e.offset:e.offset + e.nbytes].view(e.dtype).view(e.shape).copy_(full)
            continue
        if rank == 0:  # the ranks' rows one after the other, as bytes (already cast)
            pos = e.offset
            for r in range(world):
                off, n = plan.send[r][i]
                start = r * plan.width + off
                if n:
                    out[pos:pos + n].copy_(recv[start:start + n])
                pos += n
        i += 1


def iter_flat_buckets(model: torch.nn.Module, rank: int, world: int, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                      dtype: torch.dtype | None = None, *, staging: Staging | None = None, to_host: bool = True,
                      aliases: bool = False, adapters: bool = False,
                      alloc: Callable[[int, torch.device], torch.Tensor] | None = None) -> Iterator[FlatBucket]:
    """Collective, streamed (every rank iterates it to the end): rank 0 receives the state as `FlatBucket`s, the
    others nothing. See the module docstring for the pipeline and the contract (a bucket is valid until the next is
    asked for). `dtype`: floating-point entries are cast to it as they are gathered. `staging`: the buffers to
    reuse (default: one per process). `to_host=False`: the buckets stay on the device (CUDA; on the CPU the two are
    the same), for a consumer that sends from there. `aliases`: tied aliases travel too (twice the bytes).
    `adapters`: only the LoRA adapters (an adapter-only publication; nothing without LoRA).
    `alloc(nbytes, device)`: for a consumer that keeps every bucket (the collective backend packs the version):
    each bucket lands in a uint8 buffer it returns (on the host when staged, else on the device), yielded `owned`,
    so no staging buffer holds it and the consumer copies nothing."""
    staging = staging or _DEFAULT_STAGING
    items = _state_items(model, dtype, aliases, adapters)
    if not items:
        return
    device = _local(_ref(items[0][1])).device
    cuda = device.type == "cuda"
    plans = _plans(items, bucket_bytes, world)
    largest = max(p.nbytes for p in plans)
    widest = max((p.width for p in plans if not _direct(p)), default=0)  # the send/receive buffers' size
    staged = cuda and to_host  # step 2 runs: device buffers, then a copy to the host buffers
    try:
        yield from _pipeline(plans, rank, world, _Buffers(staging, device, largest, widest), staged, alloc)
    finally:
        if cuda:  # the device buffers go back to torch's caching allocator, free for the next step's activations
            staging.release(device)


def _pipeline(plans: list[_Plan], rank: int, world: int, buffers: _Buffers, staged: bool,
              alloc) -> Iterator[FlatBucket]:
    staging, device, largest = buffers.staging, buffers.device, buffers.largest
    cuda, owned = device.type == "cuda", alloc is not None
    slots = 2 if cuda else 1  # CPU: nothing overlaps (bucket k + 1 is gathered when asked for), one buffer will do
    pending = None  # CUDA: (bucket in a host buffer, the event its copy completes)
    for k, plan in enumerate(plans):
        slot = k % slots
        out = None
        if rank == 0:
            if owned and not staged:
                out = alloc(plan.nbytes, device)
            else:
                out = staging.get(("device", slot), largest, device)[:plan.nbytes] if cuda else \
                    staging.get(("host", slot), largest, torch.device("cpu"))[:plan.nbytes]
        _fill(plan, rank, world, out, buffers)
        if rank != 0:
            continue
        if not staged:
            yield FlatBucket(out, plan.entries, owned)
            continue
        host = alloc(plan.nbytes, torch.device("cpu")) if owned else \
            staging.get(("host", slot), largest, torch.device("cpu"))[:plan.nbytes]
        stream = staging.copy_stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))  # the gather of this bucket is done first
        with torch.cuda.stream(stream):
            host.copy_(out, non_blocking=True)
            done = torch.cuda.Event()
            done.record(stream)
        if pending is not None:  # the previous bucket's copy overlapped this bucket's gather
            pending[1].synchronize()
            yield pending[0]
        pending = (FlatBucket(host, plan.entries, owned), done)
    if pending is not None:
        pending[1].synchronize()
        yield pending[0]


def iter_full_state(model: torch.nn.Module, rank: int, world: int, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                    dtype: torch.dtype | None = None, **kwargs) -> Iterator[dict[str, torch.Tensor]]:
    """`iter_flat_buckets` as {name: full tensor view} dicts (rank 0; the others get nothing but must iterate to the
    end). Each dict's tensors are valid until the next one is asked for. Tied aliases are left out (`aliases=True`
    keeps them). `dtype`: floating-point entries are cast to it before they move (a bfloat16 publication gathers
    and carries half the bytes of the float32 masters)."""
    for bucket in iter_flat_buckets(model, rank, world, bucket_bytes, dtype, **kwargs):
        yield bucket.tensors()


def gather_full_state(model: torch.nn.Module, rank: int, world: int, bucket_bytes: int = 32 << 20,
                      dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Collective (every rank calls it): rank 0 gets {name: full CPU tensor} in state-dict order, tied aliases
    included (the same tensor under both names), the others {}. Each tensor is copied out of the reused buffers
    into its own storage (a view into a shared one would be pickled whole, once per tensor, by Ray)."""
    out: dict[str, torch.Tensor] = {}
    # its own buffers, dropped on return: the whole state is copied out anyway, nothing is worth keeping
    for bucket in iter_flat_buckets(model, rank, world, bucket_bytes, dtype, staging=Staging()):
        out.update({k: v.clone() for k, v in bucket.items()})
    if rank != 0:
        return {}
    for alias, name in tied_aliases(model).items():
        if name in out:
            out[alias] = out[name]
    return {k: out[k] for k in model.state_dict() if k in out}
