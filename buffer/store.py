"""The experience store: per-question buckets, stored correct trajectories, entropy ranking, retired set.

`observe(question_id, k, correct_rollouts, collect)` applies the rules of docs/algorithm.md to q's latest group
of K rollouts with k correct: 1 <= k <= K-1 sets q's bucket to k (and stores its correct rollouts when
`collect`); k = K retires q (without retirement: marks it solved); k = 0 stores nothing. `feedback` brings the
learner's measured entropies. Capacity limits evict per question (`max_per_question` measured, `group_size`
pending) and in total (`max_total`: whole questions, least recently refreshed first). A trajectory is one
int32 numpy record; snapshots are incremental (`buffer.snapshot`).

Details (the rules, the two kinds of entropy, eviction, memory): docs/internals.md#bufferstorepy
"""

from __future__ import annotations

import random
import secrets
import struct
from array import array
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np

from buffer.keys import make_key, response_digest, split_key
from buffer.records import (ENGINE_ESTIMATE, pack_record, record_digest, record_entropy, record_entropy_version,
                            record_from_bytes, record_times_replayed, set_record_entropy, set_record_times_replayed,
                            with_logprobs)
from buffer.segments import LEN, SEGMENT_BYTES, SEGMENT_MAGIC, Segment, SnapshotPlan, segments_to_keep
from buffer.sampling import IndexedSet, QuestionSampler, TrajectorySelector
from common.messages import Rollout

class _Entry:
    """A stored question: its bucket, its records and, parallel to them (4-8 bytes each), the records'
    mutable header words (entropy estimate, its policy version, times replayed: mirrored from the headers so
    selection and snapshots read no numpy scalars) and where each record lies in the snapshot segments
    (`segs[i] = -1`: not written yet)."""

    __slots__ = ("bucket", "recs", "ents", "evers", "times", "segs", "offs")

    def __init__(self, bucket: int):
        self.bucket = bucket
        self.recs: list[np.ndarray] = []
        self.ents, self.evers, self.times = array("f"), array("i"), array("i")
        self.segs, self.offs = array("i"), array("q")

    def append(self, rec: np.ndarray, seg: int = -1, off: int = 0) -> None:
        self.recs.append(rec)
        self.ents.append(record_entropy(rec))
        self.evers.append(record_entropy_version(rec))
        self.times.append(record_times_replayed(rec))
        self.segs.append(seg)
        self.offs.append(off)

    def keep(self, idx: list[int]) -> None:
        """Keep only the records at `idx` (in that order)."""
        self.recs = [self.recs[i] for i in idx]
        for name, code in (("ents", "f"), ("evers", "i"), ("times", "i"), ("segs", "i"), ("offs", "q")):
            col = getattr(self, name)
            setattr(self, name, array(code, (col[i] for i in idx)))


@dataclass(slots=True)
class Counters:
    """A component's counters as a dataclass: each field is logged as buffer/<prefix><name>."""

    def load(self, saved: dict) -> None:
        """Counters from a snapshot (names it does not know are left out; ones it lacks stay 0)."""
        for f in fields(self):
            if f.name in saved:
                setattr(self, f.name, int(saved[f.name]))

    def as_metrics(self, prefix: str = "") -> dict[str, float]:
        return {f"{prefix}{k}": float(v) for k, v in asdict(self).items()}


@dataclass(slots=True)
class StoreCounters(Counters):
    """The store's counters; each is logged as buffer/<name>, summed over shards."""

    stored: int = 0
    deduplicated: int = 0
    evicted: int = 0
    evicted_measured: int = 0  # of evicted: past max_traj_per_question, by measured entropy
    evicted_questions: int = 0  # whole questions, past max_traj_total / max_bytes
    evicted_for_bytes: int = 0  # of evicted: past max_bytes
    deleted_on_retire: int = 0
    feedback_applied: int = 0
    feedback_ignored: int = 0
    feedback_older: int = 0
    late_for_retired: int = 0
    chosen: int = 0
    chosen_measured: int = 0
    chosen_gone: int = 0
    logprobs_from_learner: int = 0
    logprobs_mismatched: int = 0


class ExperienceStore:
    """Stored correct trajectories of one shard's questions, grouped into accuracy buckets."""

    def __init__(
        self,
        group_size: int,
        sampler: QuestionSampler,
        selector: TrajectorySelector,
        *,
        max_per_question: int,
        max_total: int,
        max_bytes: int | None = None,
        evict: str = "highest_entropy",
    ):
        if group_size < 2:
            raise ValueError(f"group_size must be >= 2, got {group_size}")
        if evict not in ("highest_entropy", "oldest"):
            raise ValueError(f"trajectory eviction must be 'highest_entropy' or 'oldest', got {evict!r}")
        self.evict = evict  # buffer.trajectory_eviction: oldest = FIFO per question (plain replay)
        self.k_max = group_size
        self.sampler, self.selector = sampler, selector
        self.max_per_question, self.max_total, self.max_bytes = max_per_question, max_total, max_bytes
        self.entries: OrderedDict[str, _Entry] = OrderedDict()  # LRU order: least recently refreshed first
        self.buckets: dict[int, IndexedSet] = {b: IndexedSet() for b in range(1, group_size)}
        self.retired: set[str] = set()
        self.solved: set[str] = set()  # stored questions whose latest group was all correct (without retirement)
        self.total = 0
        self.bytes = 0  # sum of the stored records' sizes (tokens, log-probs and header: ~8 bytes per token)
        self.replay_hist = [0] * 5  # stored trajectories by times replayed: 0, 1, 2, 3, 4+
        self.c = StoreCounters()
        self.entropy_chosen_sum = 0.0
        self.entropy_available_sum = 0.0
        # snapshot segments (see `plan_snapshot`): id -> segment; questions with records not written yet
        self.segments: dict[int, Segment] = {}
        self.dirty: set[str] = set()
        self.next_segment = 0
        self.segment_prefix = secrets.token_hex(4)  # this store's segment names never collide with another's

    # ------------------------------------------------------------------------------------- writing

    def observe(self, question_id: str, k: int, correct: list[Rollout], collect: bool, *, solved: bool = False,
                retire: bool = False) -> list[str]:
        """Apply q's latest group as the experience policy decided (`buffer.experience_policy.Decision`): k correct
        of K sets its bucket (0: left as it is); `correct` are stored when `collect`; `retire` deletes q's
        experience and stores none again; `solved`: all K were correct and q is kept. Returns the keys of `correct`
        that are stored now ("" for those that are not)."""
        keys = [""] * len(correct)
        if solved and question_id in self.entries:
            self.solved.add(question_id)
        else:
            self.solved.discard(question_id)
        if question_id in self.retired:
            self.c.late_for_retired += 1
            return keys
        if not retire and not 0 <= k < self.k_max:
            raise ValueError(f"experience policy: k={k} for {question_id!r} without retiring it; a bucket is 1..K-1 "
                             f"(K={self.k_max}; 0 leaves it as it is): retire an all-correct question or mark it solved")
        if retire:
            self._retire(question_id)
            return keys
        e = self.entries.get(question_id)
        if k <= 0:
            if e is not None:
                self.entries.move_to_end(question_id)
            return keys
        if e is None and not (collect and correct):
            return keys
        if e is None:
            e = self.entries[question_id] = _Entry(k)
            self.buckets[k].add(question_id)
        else:
            self.entries.move_to_end(question_id)
            self._set_bucket(question_id, e, k)
        if collect:
            digests = [response_digest(r.response_ids) for r in correct]
            self._add(question_id, e, correct, digests)
            if self.evict == "oldest":
                self._trim_oldest(e)
            else:
                self._trim_pending(e)
            self._evict_total()
            have = {record_digest(r) for r in e.recs} if question_id in self.entries else set()
            keys = [make_key(question_id, d) if d in have else "" for d in digests]
        return keys

    def _add(self, qid: str, e: _Entry, correct: list[Rollout], digests: list[bytes]) -> None:
        have = {record_digest(r) for r in e.recs}
        for r, d in zip(correct, digests):
            if d in have:
                self.c.deduplicated += 1
                continue
            have.add(d)
            e.append(pack_record(r, d))
            self.dirty.add(qid)
            self.total += 1
            self.bytes += e.recs[-1].nbytes
            self.replay_hist[0] += 1
            self.c.stored += 1

    def _set_bucket(self, qid: str, e: _Entry, k: int) -> None:
        if e.bucket != k:
            self.buckets[e.bucket].discard(qid)
            self.buckets[k].add(qid)
            e.bucket = k

    def _drop_recs(self, e: _Entry, idx) -> None:
        """Account for dropping e's records at `idx` (the caller removes them from `e`)."""
        for i in idx:
            r = e.recs[i]
            self.replay_hist[min(e.times[i], 4)] -= 1
            self.bytes -= r.nbytes
            self.total -= 1
            if e.segs[i] >= 0:
                self.segments[e.segs[i]].live -= LEN + r.nbytes

    def _trim_pending(self, e: _Entry) -> None:
        """At most `group_size` unmeasured trajectories: the ones with the highest estimates go."""
        pending = [i for i in range(len(e.recs)) if e.evers[i] == ENGINE_ESTIMATE]
        if len(pending) > self.k_max:
            drop = set(sorted(pending, key=lambda i: e.ents[i])[self.k_max :])
            self._drop_recs(e, drop)
            self.c.evicted += len(drop)
            e.keep([i for i in range(len(e.recs)) if i not in drop])

    def _trim_oldest(self, e: _Entry) -> None:
        """FIFO (trajectory_eviction=oldest): at most `max_per_question` trajectories, the first stored go."""
        n = len(e.recs) - self.max_per_question
        if n > 0:
            self._drop_recs(e, range(n))
            self.c.evicted += n
            e.keep(list(range(n, len(e.recs))))

    def _trim_measured(self, e: _Entry) -> None:
        """At most `max_per_question` measured trajectories: the ones with the highest entropy go (FIFO: none here)."""
        if self.evict == "oldest":
            return
        measured = [i for i in range(len(e.recs)) if e.evers[i] != ENGINE_ESTIMATE]
        if len(measured) > self.max_per_question:
            drop = set(sorted(measured, key=lambda i: e.ents[i])[self.max_per_question :])
            self._drop_recs(e, drop)
            self.c.evicted += len(drop)
            self.c.evicted_measured += len(drop)
            e.keep([i for i in range(len(e.recs)) if i not in drop])

    def _evict_total(self) -> None:
        """Whole questions, least recently refreshed first, until the shard holds at most `max_total`
        trajectories and `max_bytes` bytes of records (retired questions hold none: deleted on retiring)."""
        while self.entries and (self.total > self.max_total or (self.max_bytes is not None
                                                                and self.bytes > self.max_bytes)):
            qid = next(iter(self.entries))
            n = len(self.entries[qid].recs)
            self.c.evicted += n
            self.c.evicted_questions += 1
            if self.total <= self.max_total:
                self.c.evicted_for_bytes += n
            self._remove(qid)

    def _remove(self, qid: str) -> None:
        e = self.entries.pop(qid, None)
        if e is None:
            return
        self._drop_recs(e, range(len(e.recs)))
        self.buckets[e.bucket].discard(qid)
        self.dirty.discard(qid)
        self.solved.discard(qid)

    def _retire(self, qid: str) -> None:
        e = self.entries.get(qid)
        if e is not None:
            self.c.deleted_on_retire += len(e.recs)
        self._remove(qid)
        self.retired.add(qid)

    # ------------------------------------------------------------------------------------- reading

    def sample(self, n: int, rng: random.Random, exclude: set[str] | frozenset = frozenset()
               ) -> list[tuple[str, float, list[np.ndarray]]]:
        """Up to n distinct stored questions, none in `exclude`, each with the candidates the selector
        ships: [(question_id, probability of the question draw, [record, ...])]. Nothing is counted as
        replayed here: a replay counts when the learner trains it (`feedback(chosen=...)`)."""
        if self.sampler.skips_solved and self.solved:  # |A| = 0 for every trajectory of theirs
            exclude = set(exclude) | self.solved
        hidden = [(qid, self.entries[qid].bucket) for qid in exclude if qid in self.entries]
        for qid, b in hidden:  # drawn over the others only (O(len(exclude)), no copy of the buckets)
            self.buckets[b].discard(qid)
        try:
            picks = self.sampler.sample(self.buckets, n, rng)
        finally:
            for qid, b in hidden:
                self.buckets[b].add(qid)
        return [(qid, prob, self.candidates(qid, rng)) for qid, prob in picks]

    def drawable(self, qid: str) -> bool:
        """Whether the question sampler may replay `qid` now: stored, and not solved where the sampler skips solved
        questions (|advantage| 0). A re-issued replay is checked against it as a drawn one is."""
        return qid in self.entries and not (self.sampler.skips_solved and qid in self.solved)

    def candidates(self, qid: str, rng: random.Random) -> list[np.ndarray]:
        """The records of `qid` the trajectory selector ships with a mixed group ([] if none stored)."""
        e = self.entries.get(qid)
        if e is None or not e.recs:
            return []
        measured = [v != ENGINE_ESTIMATE for v in e.evers]
        return [e.recs[i] for i in self.selector.candidates(e.ents, measured, rng)]

    def has_replay(self) -> bool:
        return self.total > 0

    def feedback(self, keys: list[str], entropies, version: int, chosen: list[str] = (), fresh_keys: list[str] = (),
                 fresh_entropies=(), fresh_logprobs=()) -> None:
        """Learner -> buffer: exact entropies under policy `version` of `keys` (the replay candidates it scored)
        and of `fresh_keys` (fresh correct rollouts it trained), and the `chosen` keys (trained as o*; each counts
        one replay). Keys of evicted or retired trajectories are ignored and counted; an estimate from an older
        policy version than the stored one is skipped. Then each question measured is trimmed to
        `max_per_question` measured trajectories (lowest entropy kept); a chosen trajectory evicted there still
        counts as replayed. `entropy_available_sum` adds, per chosen o*, the mean over its question's scored
        candidates only (not the fresh rows measured in the same step). `fresh_logprobs` (per fresh key, when the
        learner sends them: learner.loss.store_learner_logprobs) replace the stored trajectory's behaviour log-probs
        with the learner's start-of-step ones, once: only a trajectory not measured before this feedback takes them, so
        a later fresh rollout with the same tokens leaves the first stored log-probs (as the authors' pool keeps the
        first entry)."""
        first_seen = {key for key in fresh_keys
                      if (f := self._find(key)) is not None and f[0].evers[f[1]] == ENGINE_ESTIMATE}
        measured: set[str] = set()
        candidates: dict[str, list[float]] = {}
        by_key: dict[str, float] = {}
        for n, (key, ent) in enumerate(zip([*keys, *fresh_keys], [*entropies, *fresh_entropies])):
            found = self._find(key)
            if found is None:
                self.c.feedback_ignored += 1
                continue
            e, i = found
            ent = float(ent)
            measured.add(split_key(key)[0])
            if n < len(keys):
                by_key[key] = ent
                candidates.setdefault(split_key(key)[0], []).append(ent)
            if version < e.evers[i]:
                self.c.feedback_older += 1
                continue
            set_record_entropy(e.recs[i], ent, version)
            e.ents[i], e.evers[i] = ent, version
            self.c.feedback_applied += 1
        for key, lp in zip(fresh_keys, fresh_logprobs):
            found = self._find(key) if key in first_seen else None
            if found is not None:
                self._replace_logprobs(*found, split_key(key)[0], lp)
        for key in chosen:
            found = self._find(key)
            if found is None:
                self.c.chosen_gone += 1
                continue
            e, i = found
            t = e.times[i]
            self.replay_hist[min(t, 4)] -= 1
            self.replay_hist[min(t + 1, 4)] += 1
            e.times[i] = t + 1
            set_record_times_replayed(e.recs[i], t + 1)
            self.c.chosen += 1
            if key in by_key:
                ents = candidates[split_key(key)[0]]
                self.entropy_chosen_sum += by_key[key]
                self.entropy_available_sum += sum(ents) / len(ents)
                self.c.chosen_measured += 1
        for qid in measured:
            e = self.entries.get(qid)
            if e is not None:
                self._trim_measured(e)

    def _replace_logprobs(self, e: _Entry, i: int, qid: str, logprobs) -> None:
        """Record i of `e` with `logprobs` as its behaviour log-probs: a new record (the written one stays as it is
        in its snapshot segment, which no longer counts it), written with the next snapshot."""
        old = e.recs[i]
        new = with_logprobs(old, logprobs)
        if new is None:
            self.c.logprobs_mismatched += 1
            return
        if e.segs[i] >= 0:
            self.segments[e.segs[i]].live -= LEN + old.nbytes
        e.recs[i], e.segs[i] = new, -1
        self.dirty.add(qid)
        self.c.logprobs_from_learner += 1

    def _find(self, key: str) -> tuple[_Entry, int] | None:
        try:
            qid, digest = split_key(key)
        except ValueError:
            return None
        e = self.entries.get(qid)
        if e is not None:
            for j, r in enumerate(e.recs):
                if record_digest(r) == digest:
                    return e, j
        return None

    def metrics(self) -> dict[str, float]:
        m: dict[str, float] = {f"bucket_{b}": float(len(s)) for b, s in self.buckets.items()}
        m.update(stored_trajectories=float(self.total), stored_questions=float(len(self.entries)),
                 stored_bytes=float(self.bytes), stored_bytes_max=float(self.bytes),
                 retired=float(len(self.retired)),
                 entropy_chosen_sum=self.entropy_chosen_sum, entropy_available_sum=self.entropy_available_sum)
        for i, label in enumerate(("0", "1", "2", "3", "4plus")):
            m[f"times_replayed_{label}"] = float(self.replay_hist[i])
        m.update(self.c.as_metrics())
        return m

    # ----------------------------------------------------------------------------------- snapshots
    # (what a snapshot writes and links, and why it costs only what changed: buffer/segments.py)

    def plan_snapshot(self, target: Callable[[str], Path]) -> SnapshotPlan:
        """What a snapshot into the folder of `target` (segment name -> its path there) writes, links and
        records. Call under the same lock as the writes; nothing changes until `mark_written`."""
        keep, rewrite = segments_to_keep(self.segments, target)
        qids = set(self.dirty)
        if rewrite:
            qids.update(q for q, e in self.entries.items() if any(x in rewrite for x in e.segs))
        plan = SnapshotPlan(keep=keep)
        sid, off = -1, SEGMENT_BYTES
        for qid in qids:
            e = self.entries.get(qid)
            if e is None:
                continue
            segs, offs = array("i", e.segs), array("q", e.offs)
            for i, r in enumerate(e.recs):
                if segs[i] >= 0 and segs[i] not in rewrite:
                    continue
                if off + LEN + r.nbytes > SEGMENT_BYTES and off > len(SEGMENT_MAGIC):
                    sid, off = self.next_segment, len(SEGMENT_MAGIC)
                    self.next_segment += 1
                    plan.names[sid] = f"{self.segment_prefix}-{sid:06d}"
                    plan.new[sid] = []
                plan.new[sid].append(r)
                plan.moves.append((qid, r, sid, off))
                segs[i], offs[i] = sid, off
                off += LEN + r.nbytes
            plan.placed[qid] = (segs, offs)
        plan.rows = [[q, e.bucket, *(x.tobytes() for x in plan.placed.get(q, (e.segs, e.offs))),
                      e.ents.tobytes(), e.evers.tobytes(), e.times.tobytes()] for q, e in self.entries.items()]
        return plan

    def state(self, plan: SnapshotPlan) -> dict:
        """The manifest part of a snapshot made by `plan` (the writer adds the new segments' sizes and digests)."""
        return {
            "rows": plan.rows,
            "segments": {sid: [self.segments[sid].name, self.segments[sid].size, self.segments[sid].digest]
                         for sid in plan.keep},
            "next_segment": self.next_segment,
            "retired": sorted(self.retired),
            "solved": sorted(self.solved),
            "counters": asdict(self.c),
            "entropy_sums": [self.entropy_chosen_sum, self.entropy_available_sum],
        }

    def mark_written(self, plan: SnapshotPlan, written: dict[int, tuple[str, int, str]],
                     target: Callable[[str], Path]) -> None:
        """The snapshot of `plan` is on disk: its new segments (`written`: id -> name, size, digest) hold the
        planned records. Records dropped since the plan are skipped; ones added since stay unwritten."""
        for sid, (name, size, digest) in written.items():
            self.segments[sid] = Segment(name, size, digest, 0, [str(target(name))])
        for sid in plan.keep:
            path = str(target(self.segments[sid].name))
            if path not in self.segments[sid].paths:
                self.segments[sid].paths.append(path)
        for qid, rec, sid, off in plan.moves:
            e = self.entries.get(qid)
            i = next((j for j, r in enumerate(e.recs) if r is rec), None) if e is not None else None
            if i is None:
                continue
            if e.segs[i] >= 0:
                self.segments[e.segs[i]].live -= LEN + rec.nbytes
            e.segs[i], e.offs[i] = sid, off
            self.segments[sid].live += LEN + rec.nbytes
        for qid in plan.placed:
            e = self.entries.get(qid)
            if e is None or min(e.segs, default=0) >= 0:
                self.dirty.discard(qid)
        for sid in [sid for sid, g in self.segments.items() if g.live <= 0]:
            del self.segments[sid]

    def load_state(self, s: dict, open_segment: Callable[[str, int, str], Any]) -> None:
        """Fill an EMPTY store from a manifest (`state`); `open_segment(name, size, digest)` returns a
        segment's verified bytes (a buffer with `close`). Segments are read one at a time, so a restore holds
        the store plus one segment. ValueError when the manifest does not fit; the caller builds a new store,
        so failure leaves no partial state."""
        segments = {int(sid): v for sid, v in s["segments"].items()}
        wanted: dict[int, list[tuple[str, _Entry, int, int]]] = {sid: [] for sid in segments}
        for qid, bucket, segs, offs, ents, evers, times in s["rows"]:
            if not 1 <= bucket <= self.k_max - 1:
                raise ValueError(f"snapshot puts question {qid!r} in bucket {bucket}, outside 1..{self.k_max - 1}")
            e = self.entries[qid] = _Entry(bucket)
            for name, b in zip(("segs", "offs", "ents", "evers", "times"), (segs, offs, ents, evers, times)):
                getattr(e, name).frombytes(b)
            if len({len(e.segs), len(e.offs), len(e.ents), len(e.evers), len(e.times)}) != 1:
                raise ValueError(f"snapshot row of question {qid!r} has columns of different lengths")
            e.recs = [None] * len(e.segs)
            for j, (sid, off) in enumerate(zip(e.segs, e.offs)):
                if sid not in wanted:
                    raise ValueError(f"snapshot row of question {qid!r} points to segment {sid}, which it does not list")
                wanted[sid].append((qid, e, j, off))
            self.buckets[bucket].add(qid)
        for sid, refs in wanted.items():
            data = open_segment(*segments[sid])
            try:
                for qid, e, j, off in refs:
                    if not len(SEGMENT_MAGIC) <= off <= len(data) - LEN:
                        raise ValueError(f"snapshot row of question {qid!r} points outside segment {sid} (offset {off})")
                    (n,) = struct.unpack_from("<I", data, off)
                    if off + LEN + 4 * n > len(data):
                        raise ValueError(f"record of question {qid!r} runs past the end of segment {sid}")
                    rec = e.recs[j] = record_from_bytes(data[off + LEN : off + LEN + 4 * n])
                    set_record_entropy(rec, e.ents[j], e.evers[j])
                    set_record_times_replayed(rec, e.times[j])
                    self.total += 1
                    self.bytes += rec.nbytes
                    self.replay_hist[min(e.times[j], 4)] += 1
            finally:
                data.close()
            live = sum(LEN + e.recs[j].nbytes for _, e, j, _ in refs)
            self.segments[sid] = Segment(segments[sid][0], int(segments[sid][1]), segments[sid][2], live, [])
        self.next_segment = int(s["next_segment"])
        self.retired = set(s["retired"])
        self.solved = {q for q in s.get("solved", ()) if q in self.entries}  # (absent from older snapshots)
        self.c.load(s["counters"])
        self.entropy_chosen_sum, self.entropy_available_sum = (float(x) for x in s["entropy_sums"])

    def opened_from(self, target: Callable[[str], Path]) -> None:
        """The segments this store was loaded from lie at `target(name)` (a later snapshot links them)."""
        for g in self.segments.values():
            g.paths.append(str(target(g.name)))
