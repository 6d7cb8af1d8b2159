"""Rows, mini-batches and micro-batches: how a `TrainingBatch` becomes the tensors of one rank's forwards.

    rows = batch_rows(batch, std_normalize=..., max_positions=...)     # [Row], group advantages set
    for mini in split_mini_batches(rows, cfg.batching.mini_batches, seed):      # one optimizer update each
        for chunk in rank_micro_batches(mini, rank, world, MicroBatching.of(cfg)):   # equally many on every rank
            mb = collate(chunk, pad_id, device, packed=...)            # MicroBatch (+ Packing)

Pure: no model, no optimizer, no collective. Every rank computes the same split from the same batch.
How groups are dealt to mini-batches, and rows to ranks and micro-batches: docs/internals.md#learnerbatchingpy
"""

from __future__ import annotations

import heapq
import math
import random
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from common.config import LearnerConfig
from common.messages import TrainingBatch
from learner import loss as L


class BatchError(ValueError):
    """A TrainingBatch the learner cannot train on (the message says which group/rollout and why)."""


@dataclass(slots=True)
class Row:
    """One rollout ready for training: prompt + response, with its advantage."""

    prompt_ids: np.ndarray  # [P] int
    response_ids: np.ndarray  # [T] int
    behaviour_logprobs: np.ndarray  # [T] float32 (stored log-probs for a replayed rollout)
    advantage: float
    replayed: bool
    key: str
    group: int  # index of the group in the batch
    lag: int = 0  # batch version - rollout version, in learner steps (0: sampled by the weights being trained)
    old_logprobs: np.ndarray | None = None  # [T] float32 learner log-probs at the start of the step (TIS only)
    truncated: bool = False  # cut at max_new_tokens (finish reason "length")
    penalty: float = 0.0  # the overlong penalty added to its reward (learner.loss.overlong=penalty)
    eval_entropy: float | None = None  # mean response entropy at the start of the step, eval mode (LoRA dropout)

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)


def batch_rows(batch: TrainingBatch, *, std_normalize: bool, max_positions: int, overlong: str = "none",
               max_new_tokens: int = 0, overlong_buffer: int = 1) -> list[Row]:
    """Flatten a batch into rows with group advantages; refuse rows the model cannot take. With
    `overlong="penalty"` each row's reward gets `loss.overlong_penalty` of its length before the advantages."""
    if not batch.groups:
        raise BatchError("TrainingBatch has no groups: the driver must not call step() with an empty batch")
    rows: list[Row] = []
    rewards, group_ids = [], []
    for g, group in enumerate(batch.groups):
        if len(group.prompt_ids) == 0:
            raise BatchError(f"group {g} (question {group.question_id!r}) has an empty prompt")
        if not group.rollouts:
            raise BatchError(f"group {g} (question {group.question_id!r}) has no rollouts")
        for i, ro in enumerate(group.rollouts):
            where = f"group {g} (question {group.question_id!r}) rollout {i}"
            if len(ro.logprobs) != len(ro.response_ids):
                raise BatchError(f"{where}: {len(ro.logprobs)} log-probs for {len(ro.response_ids)} response tokens")
            n = len(group.prompt_ids) + len(ro.response_ids)
            if n > max_positions:
                raise BatchError(
                    f"{where}: prompt+response is {n} tokens, above the model's max_position_embeddings "
                    f"{max_positions}; lower data.max_prompt_tokens or generator.max_new_tokens"
                )
            if not np.all(np.isfinite(ro.logprobs)):
                raise BatchError(f"{where}: behaviour log-probs contain NaN/inf")
            rows.append(Row(np.asarray(group.prompt_ids), np.asarray(ro.response_ids),
                            np.asarray(ro.logprobs, dtype=np.float32), 0.0, bool(ro.replayed), ro.key, g,
                            lag=batch.version - ro.version, truncated=ro.finish_reason == "length"))
            rewards.append(float(ro.reward))
            group_ids.append(g)
    if overlong == "penalty":
        pen = L.overlong_penalty(torch.tensor([len(r.response_ids) for r in rows]), max_new_tokens, overlong_buffer)
        for row, p in zip(rows, pen.tolist()):
            row.penalty = p
        rewards = [r + p for r, p in zip(rewards, pen.tolist())]
    adv = L.group_advantages(torch.tensor(rewards), torch.tensor(group_ids), std_normalize=std_normalize)  # [N]
    for row, a in zip(rows, adv.tolist()):
        row.advantage = a
    return rows


def split_mini_batches(rows: list[Row], n: int, seed: int = 0) -> list[list[Row]]:
    """Split rows into at most `n` mini-batches along group boundaries (a group is never split).

    Mixed groups (those holding a replayed row) and fresh groups are each shuffled with `seed`, then
    dealt round-robin, mixed first: every mini-batch gets floor or ceil of its share of each kind."""
    rng = random.Random(seed)
    mixed = sorted({r.group for r in rows if r.replayed})
    fresh = sorted({r.group for r in rows} - set(mixed))
    rng.shuffle(mixed)
    rng.shuffle(fresh)
    order = mixed + fresh
    k = min(n, len(order))
    if k == 0:
        return []
    where = {g: i % k for i, g in enumerate(order)}
    out: list[list[Row]] = [[] for _ in range(k)]
    for r in rows:
        out[where[r.group]].append(r)
    return out


@dataclass(frozen=True)
class MicroBatching:
    """How a mini-batch is cut into micro-batches: `rows` rows each at most, or (`tokens`) packed up to a token
    budget, a micro-batch costing the sum of its rows' lengths (`padding_free`) or rows x its longest row (padded),
    and dealt `first_fit` or `balanced` (`split`)."""

    rows: int  # learner.batching.micro_batch_rows
    tokens: int | None = None  # learner.batching.micro_batch_tokens (None: rows only)
    padding_free: bool = False  # learner.levers.padding_free (resolved)
    split: str = "first_fit"  # learner.batching.micro_batch_split

    @classmethod
    def of(cls, cfg: LearnerConfig) -> MicroBatching:
        """The learner section's micro-batching (read it again after the levers change: padding-free may)."""
        bt = cfg.batching
        return cls(bt.micro_batch_rows, bt.micro_batch_tokens, cfg.levers.packs_padding_free, bt.micro_batch_split)


def rank_micro_batches(rows: list[Row], rank: int, world: int, cut: MicroBatching) -> list[list[Row]]:
    """This rank's micro-batches of a mini-batch; equally many on every rank (padded with []).

    Rows are sorted by length (longest first) and dealt round-robin to the ranks. Without a token budget
    each rank cuts its rows into chunks of `cut.rows`. With `cut.tokens`, each rank packs its rows
    greedily (`pack_by_tokens`): padded, a micro-batch costs rows x its longest row; `padding_free`, the sum
    of its rows' lengths. A row longer than the budget is a micro-batch of its own. Every rank computes
    every rank's packing (all see all rows), so all agree on the count.

    `split="balanced"` (padding-free with a budget; `learner.batching.micro_batch_split`): verl's dynamic batch size
    instead. Each rank's micro-batch count is ceil(its tokens / budget), the largest over the ranks for all
    (verl all-reduces it), and its rows are partitioned into that many parts of balanced token sums
    (`balanced_partition`, Karmarkar-Karp). The sums are balanced, not capped: a part can exceed the budget (as
    in verl), and `cut.rows` does not apply."""
    micro_rows, micro_tokens, padding_free = cut.rows, cut.tokens, cut.padding_free
    ordered = sorted(rows, key=lambda r: (-r.length, r.group))
    if micro_tokens is None:
        mine = ordered[rank::world]
        n_micro = max(1, math.ceil(math.ceil(len(rows) / world) / micro_rows))
        return [mine[i * micro_rows:(i + 1) * micro_rows] for i in range(n_micro)]
    if cut.split == "balanced" and padding_free:
        n_micro = max(1, max(math.ceil(sum(r.length for r in ordered[k::world]) / micro_tokens)
                             for k in range(world)))
        mine = ordered[rank::world]
        parts = balanced_partition([r.length for r in mine], n_micro) if mine else [[] for _ in range(n_micro)]
        return [[mine[i] for i in part] for part in parts]
    packs = [pack_by_tokens(ordered[k::world], micro_tokens, micro_rows, padding_free) for k in range(world)]
    n_micro = max(1, max(len(p) for p in packs))
    return packs[rank] + [[] for _ in range(n_micro - len(packs[rank]))]


def entropy_weights(rows: list[Row], gpus: int, cut: MicroBatching) -> list[float]:
    """Per row of a mini-batch, the weight of each of its response tokens' entropy under
    `learner.loss.entropy_agg=micro_batch`: 1 / (gpus x the response tokens of its micro-batch), the micro-batches
    being those `rank_micro_batches` makes when the mini-batch is split over `gpus` GPUs.

    The authors' entropy term (verl's actor) is each micro-batch's masked token mean, summed over a GPU's
    micro-batches and averaged over its GPUs: sum_m mean_m / gpus, i.e. these weights. With `gpus` =
    `learner.loss.loss_world_size` they are the authors' ones whatever our own rank count and micro-batches are
    (the authors' 8 GPUs each take ceil(their tokens / 32,768) micro-batches, the largest count for all; at 1
    rank we would take ceil(all tokens / 32,768), fewer means of more tokens each). Aligned with `rows`; a row
    with no response token weighs 0."""
    weight = {}
    for g in range(gpus):
        for part in rank_micro_batches(rows, g, gpus, cut):
            tokens = sum(len(r.response_ids) for r in part)
            for r in part:
                weight[id(r)] = 1.0 / (gpus * tokens) if tokens else 0.0
    return [weight[id(r)] for r in rows]


def chunk_window_spans(lengths: list[int], responses: list[np.ndarray], max_target: int, pad_id: int,
                           chunk: int = 8) -> list[tuple[int, int]]:
    """`buffer.trajectory_score=chunk_window`: per candidate (start, divisor), its score being the sum of its
    entropies h_t (t indexes the [L-1] positions of prompt + response, h_t predicting token t + 1) for start <= t
    < L - 1, over divisor (0: NaN, the authors' mean of nothing). Candidates in scoring order; `lengths` their
    L, `responses` their response token ids.

    The authors' code (ExGRPO experience_helpers.py `compute_postcal_metrics`, exp_metric=ent) scores candidates
    in chunks of `chunk` = 8, each row prompt + response left-padded, the entropies those of the last
    `max_target` positions (verl's `compute_log_prob`; padding removed, so 0 on pad positions), and then masks
    candidate i with `responses[i % 8] == pad` of the batch left over from the loop: the last chunk's (its dummy
    rows are all pad). With m = the non-pad tokens of that response (its first max_target), window positions
    m..max_target-1 count: our t >= L - max_target - 1 + m, divided by max_target - m. So it sums the entropy over
    the prompt and the response (no response mask), and the divisor depends on another row."""
    n = len(lengths)
    last = chunk * ((n - 1) // chunk) if n else 0
    out = []
    for i, length in enumerate(lengths):
        j = last + i % chunk
        m = int(np.count_nonzero(np.asarray(responses[j][:max_target]) != pad_id)) if j < n else 0
        out.append((max(0, length - max_target - 1 + m), max_target - m))
    return out


def balanced_partition(lengths: list[int], k: int) -> list[list[int]]:
    """Indices of `lengths` in `k` parts of balanced sums: the largest differencing method (Karmarkar and Karp
    1982, k-way), as verl's dynamic batch size runs it (`get_seqlen_balanced_partitions`, equal_size=False), with
    its order of merges and ties, so the same lengths give the same parts. Every item starts as a k-tuple of
    subsets (itself and k - 1 empty ones), pushed shortest first; the two tuples of largest spread (largest sum -
    smallest sum; on a tie, the one whose largest subset is larger) are merged, the largest subset of one with
    the smallest of the other and so on, until one tuple remains. Parts come largest first (empty where there
    are fewer items than k), indices ascending within each."""
    if k < 1:
        raise ValueError(f"k={k}: at least one part")
    if not lengths:
        return [[] for _ in range(k)]
    heap: list[_Spread] = []
    for n, i in sorted((n, i) for i, n in enumerate(lengths)):
        heapq.heappush(heap, _Spread([_Subset(n, [(i, n)])] + [_Subset(0, []) for _ in range(k - 1)]))
    while len(heap) > 1:
        a, b = heapq.heappop(heap), heapq.heappop(heap)
        heapq.heappush(heap, _Spread([a.parts[j].merged(b.parts[k - 1 - j]) for j in range(k)]))
    return [sorted(i for i, _ in part.items) for part in heap[0].parts]


@dataclass(slots=True)
class _Subset:
    """One part of a `_Spread`: its sum and its (index, length) items in merge order."""

    total: int
    items: list[tuple[int, int]]

    def key(self) -> tuple:
        return self.total, len(self.items), self.items

    def merged(self, other: _Subset) -> _Subset:
        return _Subset(self.total + other.total, self.items + other.items)


class _Spread:
    """A k-tuple of subsets, largest first; the heap pops the largest spread first, then the larger largest
    subset."""

    __slots__ = ("parts", "spread")

    def __init__(self, parts: list[_Subset]):
        self.parts = sorted(parts, key=_Subset.key, reverse=True)
        self.spread = self.parts[0].total - self.parts[-1].total

    def __lt__(self, other: _Spread) -> bool:
        if self.spread != other.spread:
            return self.spread > other.spread
        return self.parts[0].key() > other.parts[0].key()


def pack_by_tokens(rows: list[Row], budget: int, max_rows: int, padding_free: bool = False) -> list[list[Row]]:
    """Rows sorted longest first into micro-batches of at most `budget` tokens and `max_rows` rows.

    Padded (the cost is rows x the first, longest, row): a micro-batch takes the next row while it fits.
    Padding-free (the cost is the sum of the lengths): first fit, each row into the first micro-batch with
    room, which fills the gaps the long rows leave with short ones."""
    if padding_free:
        packs: list[list[Row]] = []
        used: list[int] = []
        for r in rows:
            for i, pack in enumerate(packs):
                if len(pack) < max_rows and used[i] + r.length <= budget:
                    pack.append(r)
                    used[i] += r.length
                    break
            else:
                packs.append([r])
                used.append(r.length)
        return packs
    out: list[list[Row]] = []
    cur: list[Row] = []
    for r in rows:
        if cur and ((len(cur) + 1) * cur[0].length > budget or len(cur) >= max_rows):
            out.append(cur)
            cur = []
        cur.append(r)
    if cur:
        out.append(cur)
    return out


@dataclass
class Packing:
    """A micro-batch's rows as one sequence without padding: the forward's layout (the loss keeps [R, L-1]).
    Row i occupies tokens [o_i, o_i + len_i) with positions 0..len_i-1; the attention keeps rows apart by the
    restarts of `position_ids` (transformers' packed-sequence format) or by `document_ids` (`learner.forward`
    builds the mask from them, without reading the tensors back)."""

    input_ids: Tensor  # [1, T] the rows one after another, T = the sum of their lengths
    position_ids: Tensor  # [1, T]
    targets: Tensor  # [1, T-1] = input_ids[:, 1:]
    mask: Tensor  # [1, T-1] 1 where the target is a response token (in row order, as response_mask's)
    index: Tensor | None = None  # [N] int64 flat positions in [T-1] where `mask` is 1, in order
    document_ids: Tensor | None = None  # [1, T] int64 the row each token belongs to


@dataclass
class MicroBatch:
    input_ids: Tensor  # [R, L] right-padded prompt+response
    attention_mask: Tensor  # [R, L]
    targets: Tensor  # [R, L-1] = input_ids[:, 1:]
    response_mask: Tensor  # [R, L-1] 1 where the target is a response token
    replay_mask: Tensor  # [R, L-1] 1 on the response tokens of replayed rows
    behaviour_logprobs: Tensor  # [R, L-1] behaviour log-probs aligned with targets (0 elsewhere)
    advantages: Tensor  # [R]
    rows: list[Row] = field(default_factory=list)
    lag0_mask: Tensor | None = None  # [R, L-1] 1 on the response tokens of fresh rows with lag 0
    old_logprobs: Tensor | None = None  # [R, L-1] rows' `old_logprobs` when every row has them, else None
    packed: Packing | None = None  # the padding-free forward layout (learner.levers.padding_free), else None
    response_index: Tensor | None = None  # [N] int64 flat positions in [R, L-1] where response_mask is 1, in order
    uneven: bool = False  # rows of different lengths: the padded forward needs its attention mask

    @property
    def forward_tokens(self) -> int:
        """Tokens the forward computes (padding included)."""
        return int(self.packed.input_ids.numel() if self.packed is not None else self.input_ids.numel())


def _to(a: np.ndarray, device: torch.device) -> Tensor:
    """One host -> device copy that does not wait for the device's queue (the source is pageable: CUDA stages
    it before returning, so it may be freed at once)."""
    return torch.from_numpy(a).to(device, non_blocking=True)


def pack_rows(rows: list[Row], device: torch.device) -> Packing:
    """The rows as one padding-free sequence (see `Packing`); two host -> device copies."""
    total = sum(r.length for r in rows)
    ints = np.empty((3, total), dtype=np.int64)  # [3, T] input ids, positions, document ids
    mask = np.zeros(total - 1, dtype=np.float32)  # [T-1]
    o = 0
    for i, r in enumerate(rows):
        p, t = len(r.prompt_ids), len(r.response_ids)
        ints[0, o:o + p] = r.prompt_ids
        ints[0, o + p:o + p + t] = r.response_ids
        ints[1, o:o + p + t] = np.arange(p + t)
        ints[2, o:o + p + t] = i
        mask[o + p - 1:o + p - 1 + t] = 1.0  # token o+p+j is predicted at o+p+j-1, inside the row
        o += p + t
    index = np.flatnonzero(mask)  # [N]
    ints_t = _to(np.concatenate([ints.reshape(-1), index]), device)  # [3T + N]
    ids_t, pos_t, doc_t = (ints_t[k * total:(k + 1) * total][None] for k in range(3))  # [1, T] each
    return Packing(ids_t, pos_t, ids_t[:, 1:], _to(mask, device)[None], index=ints_t[3 * total:], document_ids=doc_t)


def collate(rows: list[Row], pad_id: int, device: torch.device, packed: bool = False) -> MicroBatch:
    """Right-pad rows into tensors; an empty list gives one all-masked dummy row (keeps FSDP in step).
    `packed`: the forward runs on the rows packed without padding (`pack_rows`); the loss tensors stay padded.
    Built on the host and moved in two copies that do not wait for the device (with `pack_rows`', four)."""
    if not rows:
        z = torch.zeros(1, 1, device=device)
        ids = torch.full((1, 2), pad_id, dtype=torch.long, device=device)  # [1, 2]
        return MicroBatch(ids, torch.ones_like(ids), ids[:, 1:], z, z, z, torch.zeros(1, device=device), [], z,
                          response_index=torch.zeros(0, dtype=torch.long, device=device))
    length = max(r.length for r in rows)
    n = len(rows)
    ids = np.full((n, length), pad_id, dtype=np.int64)  # [R, L]
    attn = np.zeros((n, length), dtype=np.int64)  # [R, L]
    has_old = all(r.old_logprobs is not None for r in rows)
    per_token = np.zeros((5 if has_old else 4, n, length - 1), dtype=np.float32)  # [K, R, L-1]
    resp, beh, rep, lag0 = per_token[:4]  # [R, L-1] each (views)
    old = per_token[4] if has_old else None  # [R, L-1]
    for i, r in enumerate(rows):
        p, t = len(r.prompt_ids), len(r.response_ids)
        ids[i, :p] = r.prompt_ids
        ids[i, p:p + t] = r.response_ids
        attn[i, :p + t] = 1
        # Response token j sits at position p+j and is predicted by the logits at position p+j-1.
        resp[i, p - 1:p - 1 + t] = 1.0
        beh[i, p - 1:p - 1 + t] = r.behaviour_logprobs
        if r.replayed:
            rep[i, p - 1:p - 1 + t] = 1.0
        elif r.lag == 0:
            lag0[i, p - 1:p - 1 + t] = 1.0
        if old is not None:
            old[i, p - 1:p - 1 + t] = r.old_logprobs
    adv = np.array([r.advantage for r in rows], dtype=np.float32)  # [R]
    index = np.flatnonzero(resp)  # [N]
    ints_t = _to(np.concatenate([ids.reshape(-1), attn.reshape(-1), index]), device)  # [2 R L + N]
    floats_t = _to(np.concatenate([per_token.reshape(-1), adv]), device)  # [K R (L-1) + R]
    ids_t = ints_t[:n * length].view(n, length)
    tok = floats_t[:per_token.size].view(per_token.shape)  # [K, R, L-1]
    return MicroBatch(
        input_ids=ids_t,
        attention_mask=ints_t[n * length:2 * n * length].view(n, length),
        targets=ids_t[:, 1:],
        response_mask=tok[0],
        replay_mask=tok[2],
        behaviour_logprobs=tok[1],
        advantages=floats_t[per_token.size:],  # [R]
        rows=rows,
        lag0_mask=tok[3],
        old_logprobs=tok[4] if has_old else None,
        packed=pack_rows(rows, device) if packed else None,
        response_index=ints_t[2 * n * length:],
        uneven=any(r.length < length for r in rows),
    )
