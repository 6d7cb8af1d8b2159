"""The full state dict of an FSDP2-sharded model on rank 0, in a few bucketed collectives.

`get_model_state_dict(full_state_dict=True)` all-gathers one parameter at a time: with 2 ranks that
made a publication cost ~12x a plain `ray.put` + `ray.get` of the same state dict. Here every rank
flattens its local shards of a bucket of parameters (one dtype, up to `bucket_bytes`) into one
buffer, one `gather` to rank 0 per bucket moves them, and rank 0 cuts the buffers back into the
full tensors. Works on any backend that implements `gather` (gloo on CPU, NCCL on GPU).

FSDP2 shards every parameter along dim 0 into `world` chunks of ceil(n / world) rows (the last ones
shorter or empty); each rank can therefore compute every rank's chunk shape from the global shape,
so no sizes need to be exchanged. A parameter with any other placement falls back to
`DTensor.full_tensor()` (a collective of its own, still correct).
"""

from __future__ import annotations

import ctypes
import math
from collections.abc import Iterator

import torch
import torch.distributed as dist

DEFAULT_BUCKET_BYTES = 256 << 20


def shard_rows(n: int, world: int, rank: int) -> int:
    """Rows of a dim-0 size-n parameter held by `rank` under FSDP2's even chunking."""
    c = math.ceil(n / world) if n else 0
    return max(0, min(n, (rank + 1) * c) - rank * c)


def release_freed_memory() -> None:
    """Give freed heap memory back to the OS (glibc `malloc_trim`; nothing elsewhere). Freed buckets otherwise
    stay in the process's resident memory: glibc raises its mmap threshold after large frees, so later
    buckets come from the heap and a streamed gather would keep growing as if nothing were released."""
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


def _is_dim0_shard(t) -> bool:
    from torch.distributed.tensor import DTensor, Shard

    return isinstance(t, DTensor) and len(t.placements) == 1 and t.placements[0] == Shard(0)


def _buckets(items: list[tuple[str, torch.Tensor]], bucket_bytes: int) -> list[list[tuple[str, torch.Tensor]]]:
    """Consecutive runs of one dtype, each up to bucket_bytes of full-tensor size (at least one entry)."""
    out: list[list[tuple[str, torch.Tensor]]] = []
    size = 0
    for name, t in items:
        nbytes = t.numel() * t.element_size()
        if not out or out[-1][0][1].dtype != t.dtype or size + nbytes > bucket_bytes:
            out.append([])
            size = 0
        out[-1].append((name, t))
        size += nbytes
    return out


def iter_full_state(model: torch.nn.Module, rank: int, world: int, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                    dtype: torch.dtype | None = None) -> Iterator[dict[str, torch.Tensor]]:
    """Collective, streamed: every rank iterates it to the end; rank 0 receives {name: full CPU tensor}
    one bucket at a time (first the replicated entries, then each gathered bucket), the others nothing.
    A consumer that drops each bucket before taking the next (a `ray.put` per bucket) holds at most one
    or two buckets beside its shard, never the whole model. `dtype`: floating-point entries are cast to it
    before they move (a bfloat16 publication gathers and carries half the bytes of the float32 masters)."""
    sd = model.state_dict()
    if dtype is not None:
        sd = {k: v.to(dtype) if v.is_floating_point() else v for k, v in sd.items()}
    sharded = [(k, v) for k, v in sd.items() if _is_dim0_shard(v)]
    replicated: dict[str, torch.Tensor] = {}
    size = 0
    for k, v in list(sd.items()):  # replicated entries (and any unusual placement): copied, in bucket-sized chunks
        if _is_dim0_shard(v):
            continue
        full = v.full_tensor() if hasattr(v, "full_tensor") else v
        if rank == 0:
            replicated[k] = full.detach().to("cpu", copy=True)
            size += replicated[k].numel() * replicated[k].element_size()
            if size >= bucket_bytes:
                yield replicated
                replicated, size = {}, 0
    del sd
    if replicated:
        yield replicated
    del replicated
    for bucket in _buckets(sharded, bucket_bytes):
        out: dict[str, torch.Tensor] = {}
        _gather_bucket(bucket, rank, world, out)
        if rank == 0:
            yield out
        del out
        release_freed_memory()


def gather_full_state(model: torch.nn.Module, rank: int, world: int, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                      dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Collective (every rank calls it): rank 0 gets {name: full CPU tensor} in state-dict order, the
    others {}. `iter_full_state` merged (see there for `dtype`)."""
    out: dict[str, torch.Tensor] = {}
    for chunk in iter_full_state(model, rank, world, bucket_bytes, dtype):
        out.update(chunk)
    return {k: out[k] for k in model.state_dict() if k in out} if rank == 0 else {}


def _gather_bucket(bucket: list[tuple[str, torch.Tensor]], rank: int, world: int, out: dict) -> None:
    shapes = [tuple(t.shape) for _, t in bucket]
    row = [math.prod(s[1:]) for s in shapes]  # elements per row of each parameter
    sizes = [sum(shard_rows(s[0], world, r) * e for s, e in zip(shapes, row)) for r in range(world)]
    width = max(sizes)
    local = [t.to_local().reshape(-1) for _, t in bucket]
    dtype, device = bucket[0][1].dtype, local[0].device
    send = torch.zeros(width, dtype=dtype, device=device)  # [width] padded flat shards of this rank
    if sizes[rank]:
        send[: sizes[rank]] = torch.cat(local)
    recv = [torch.empty(width, dtype=dtype, device=device) for _ in range(world)] if rank == 0 else None
    dist.gather(send, gather_list=recv, dst=0)
    if rank != 0:
        return
    del send
    offsets = [0] * world
    for (name, _), shape, e in zip(bucket, shapes, row):
        full = torch.empty(math.prod(shape), dtype=dtype)  # [numel] on the CPU, filled rank by rank
        pos = 0
        for r in range(world):
            n = shard_rows(shape[0], world, r) * e
            full[pos: pos + n].copy_(recv[r][offsets[r]: offsets[r] + n])
            offsets[r] += n
            pos += n
        out[name] = full.reshape(shape)
    del recv
