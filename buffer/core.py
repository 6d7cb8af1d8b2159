"""One buffer shard as a pure object (no Ray): work issuing, leases, ready queues, batches. The run-wide pieces
the client composes over shards (the mixed-mode switch, the batch plan, merged counters) are `buffer.batch_plan`.

    core = ShardCore(cfg, questions, shard=0, batch_share=16)
    items = core.lease("gen-0", 8)                  # fresh (K samples) and replay (K-1 + ReplayRef) items
    core.submit(scored_groups)                      # checked, joined with candidates, queued; store updated
    core.take(version, n_fresh, n_mixed)            # ready groups; stale ones dropped and re-issued
    core.feedback(learner_feedback); core.set_version(v)

All times come from `now` arguments, so tests drive expiry by hand. `accounting()`: every issued lease ends in
exactly one terminal state or is still live. Replay, versions, the accounting: docs/internals.md#buffercorepy
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import random
import time
from collections import Counter, deque
from dataclasses import asdict, dataclass

import numpy as np

from buffer.batch_plan import balance, finish_metrics, mixed_shares, mixed_target, plan_take
from buffer.experience_policy import FinishedGroup, make_experience_policy
from buffer.sampling import make_question_sampler, make_trajectory_selector
from buffer.records import record_to_rollout
from buffer.segments import SnapshotPlan
from buffer.shard_state import (STATE_VERSION, Lease, Ready, check_state_version, decode_leases, decode_ready,
                                encode_leases, encode_ready)
from buffer.store import Counters, ExperienceStore
from common.config import BufferConfig
from common.messages import LearnerFeedback, Question, ReplayRef, Rollout, ScoredGroup, TrainGroup, WorkItem

log = logging.getLogger(__name__)


def question_fingerprint(question_ids) -> str:
    h = hashlib.blake2b(digest_size=16)
    for q in sorted(question_ids):
        h.update(q.encode("utf-8") + b"\0")
    return h.hexdigest()


class ShardCore:
    """The state of one shard. Not thread-safe: the actor serialises calls with a lock."""

    def __init__(self, cfg: BufferConfig, questions: list[Question], *, shard: int = 0, batch_share: int | None = None,
                 shares: list[int] | None = None):
        ids = [q.id for q in questions]
        if len(set(ids)) != len(ids):
            raise ValueError("question ids must be unique within a shard; fix the dataset's id field")
        self.cfg, self.shard = cfg, shard
        self.K = cfg.group_size
        self.batch_share = cfg.batch_questions if batch_share is None else batch_share
        if self.batch_share < 0:
            raise ValueError(f"batch_share must be >= 0, got {self.batch_share}")
        self.shares = shares  # every shard's batch share (None: this shard alone), for its part of the replays
        self.questions = {q.id: q for q in questions}
        self.order_ids = sorted(self.questions)
        self.fingerprint = question_fingerprint(self.order_ids)
        self.store = ExperienceStore(
            self.K,
            make_question_sampler(cfg.question_sampler, self.K, cfg.bucket_mean, cfg.bucket_std),
            make_trajectory_selector(cfg.trajectory_selector),
            max_per_question=cfg.max_traj_per_question,
            max_total=cfg.max_traj_total,
            max_bytes=cfg.max_bytes,
            evict=cfg.trajectory_eviction,
        )
        self.policy = make_experience_policy(cfg)  # what a finished group does: store, retire, keep out
        self.rng = random.Random(cfg.seed * 1_000_003 + shard)
        self.incarnation = new_incarnation()  # a new one when the shard restarts from a snapshot (BufferShard)
        self.epoch, self.cursor = 0, 0
        self._order = self._epoch_order(0)
        self.reissue: deque[str] = deque()  # fresh questions to issue again
        self.reissue_replay: deque[str] = deque()  # replay questions to issue again (as replay)
        self.leases: dict[str, Lease] = {}
        self.next_lease = 0
        self.ready_fresh: deque[Ready] = deque()
        self.ready_mixed: deque[Ready] = deque()
        self.version = 0
        self.taken_at_version = 0  # groups taken for batches at self.version (back-pressure)
        self.mixed_mode = False  # set by the run-wide MixedSwitch (client), never by the shard alone
        self.leased_at_version = [0, 0]  # (replay, all) work items issued at self.version: the mix of new work
        self.n = ShardCounters()

    # -------------------------------------------------------------------------------------- issuing

    def _epoch_order(self, epoch: int) -> list[str]:
        order = list(self.order_ids)
        random.Random(f"{self.cfg.seed}/{self.shard}/{epoch}").shuffle(order)
        return order

    def capacity(self) -> int:
        """Back-pressure: at most (max_lag + 1) * batch_share work items are live (outstanding + ready),
        less what was already taken for a batch at the current version.

        Work leased at version v can be trained at versions v .. v + max_lag: max_lag + 1 batches, one
        of which (v's) may already be taken. Counting it means a synchronous run (max_lag = 0) leases
        nothing between taking batch v and the learner publishing v + 1 — work leased then would only be
        generated with the old weights and dropped as stale. All of it is counted (up to a whole batch), also beyond
        this shard's share: a batch takes the oldest groups of all shards first, so one shard may give more than its
        share, and the shards together then lease no more than (max_lag + 1) batches hold. Replay items are further limited to
        floor(rho_i * capacity), rho_i = mixed_share() / batch_share, where the shards' mixed shares sum to
        the batch's ceil(rho * B) mixed groups: together the shards can always lease a whole batch's replays. With
        the batch taking ceil(rho * B) mixed groups, a shard full of ready groups can always contribute to a
        batch: no state in which every shard is full but no batch can be formed (max_lag = 0 included).
        """
        taken = min(self.taken_at_version, self.cfg.batch_questions)  # (a batch's worth: more is taken only by
        # callers that take batches without advancing the version, and must still get work)
        return max(0, (self.cfg.max_lag + 1) * self.batch_share - taken)

    def mixed_share(self) -> int:
        """This shard's part of the batch's ceil(rho * B) mixed groups at the current version (`mixed_shares`)."""
        if self.shares is None:
            return mixed_target(self.batch_share, self.cfg.replay_ratio)
        return mixed_shares(self.shares, mixed_target(self.cfg.batch_questions, self.cfg.replay_ratio),
                            self.version)[self.shard]

    def live(self) -> int:
        return len(self.leases) + len(self.ready_fresh) + len(self.ready_mixed)

    def _mixed_live(self) -> int:
        return sum(1 for x in self.leases.values() if x.replay) + len(self.ready_mixed)

    def _replay_live(self) -> set[str]:
        """Questions with a live replay (leased, or ready as a mixed group): not replayed again meanwhile."""
        live = {x.question_id for x in self.leases.values() if x.replay}
        live.update(x.group.question_id for x in self.ready_mixed)
        return live

    def left_fresh(self) -> set[str]:
        """Questions never issued fresh again (the experience policy's say: ExGRPO's, those retired from the pool)."""
        return self.policy.left_fresh(self.store.retired)

    def _next_fresh(self) -> str | None:
        out = self.left_fresh()
        while self.reissue:
            q = self.reissue.popleft()
            if q not in out:
                return q
        return self._next_in_epoch()

    def _next_in_epoch(self) -> str | None:
        """The next question of the epoch order still in the fresh stream (a new epoch when it ends); None: none
        is."""
        out = self.left_fresh()
        if len(out) >= len(self.order_ids):
            return None
        while True:
            if self.cursor >= len(self._order):
                self.epoch += 1
                self.n.epochs_completed += 1
                self.cursor, self._order = 0, self._epoch_order(self.epoch)
            q = self._order[self.cursor]
            self.cursor += 1
            if q not in out:
                return q

    def lease(self, generator_id: str, max_items: int, now: float | None = None) -> list[WorkItem]:
        """Up to `max_items` work items, fewer (possibly none) when back-pressure says wait."""
        now = time.time() if now is None else now
        self.expire(now)
        free = self.capacity() - self.live()
        n = min(max_items, free)
        if n <= 0:
            if max_items > 0:
                self.n.lease_requests_throttled += 1
            return []
        n_replay = 0
        if self.mixed_mode and (self.store.has_replay() or self.reissue_replay):
            ratio = self.mixed_share() / self.batch_share if self.batch_share else 0.0
            quota = math.floor(ratio * self.capacity() + 1e-9)
            live_mixed = self._mixed_live()
            mixed, total = self.leased_at_version
            for _ in range(n):  # this version's new work at this shard's ratio, within its replay quota
                if live_mixed < quota and mixed < ratio * (total + 1) + 1e-9:
                    n_replay += 1
                    mixed += 1
                    live_mixed += 1
                total += 1
        picks = self._replay_picks(n_replay)
        items = [self._issue(generator_id, qid, now, ref, recs) for qid, ref, recs in picks]
        if self.policy.replay_takes_fresh_slot:  # each new replay takes a fresh question's place, consumed unused
            for _ in range(sum(not ref.reissue for _, ref, _ in picks)):
                self.n.fresh_discarded += self._next_in_epoch() is not None
        for _ in range(n - len(items)):
            qid = self._next_fresh()
            if qid is None:
                break
            items.append(self._issue(generator_id, qid, now, None, []))
        return items

    def _replay_picks(self, n: int) -> list[tuple[str, ReplayRef, list[np.ndarray]]]:
        """Up to n replay questions: re-issues first, then drawn by the question sampler; never one
        with a live replay, never the same one twice."""
        if n <= 0:
            return []
        live = self._replay_live()
        picks = []
        while self.reissue_replay and len(picks) < n:
            qid = self.reissue_replay.popleft()
            recs = self.store.candidates(qid, self.rng) if qid not in live and self.store.drawable(qid) else []
            if not recs:  # retired, evicted, solved (advantage), already live again: its slot goes back to the sampler
                self.n.replay_reissue_dropped += 1
                continue
            live.add(qid)
            picks.append((qid, ReplayRef(probability=0.0, candidates=len(recs), reissue=True), recs))
        if len(picks) < n:
            for qid, prob, recs in self.store.sample(n - len(picks), self.rng, exclude=live):
                picks.append((qid, ReplayRef(probability=prob, candidates=len(recs)), recs))
        return picks

    def _issue(self, generator_id: str, qid: str, now: float, ref: ReplayRef | None,
               recs: list[np.ndarray]) -> WorkItem:
        lid = f"{self.shard}-{self.next_lease}"
        self.next_lease += 1
        deadline = now + self.cfg.lease_timeout_s
        lease = Lease(lid, qid, self.K, deadline, generator_id, version=self.version)
        if ref is not None:
            lease.num_samples, lease.replay, lease.candidates = self.K - 1, True, recs
            self.n.issued_replay += 1
        self.leases[lid] = lease
        self.n.issued += 1
        self.leased_at_version[0] += lease.replay
        self.leased_at_version[1] += 1
        return WorkItem(lid, self.questions[qid], lease.num_samples, deadline, self.shard, ref, self.version,
                        min_weights=self._min_weights(self.version))

    def _min_weights(self, lease_version: int) -> int:
        """The oldest weights a generator may start work leased at `lease_version` on (it loads newer ones first)."""
        return lease_version + 1 - max(self.cfg.max_lag, 1)

    def last_chance_in_flight(self, version: int) -> int:
        """Outstanding leases whose group, if generated on the oldest weights its lease allows, can be trained at
        `version` and not after (exactly: a lease that could not be trained at the last version already is not waited
        for at every later one): a batch of `version` formed without them would leave them to go stale. The client
        holds such a batch while they are generated (`plan_take`'s `in_flight_last`); the hold ends when they arrive
        or their leases end (expiry, a holder that died)."""
        last = version - self.cfg.max_lag  # (older ones are past their last chance already: nothing to wait for)
        return sum(1 for x in self.leases.values() if self._min_weights(x.version) == last)

    def _end_lease_reissue(self, lease: Lease) -> None:
        """A lease that ends unfinished (the caller counts why); its question is issued again."""
        if lease.version == self.version:  # its question is issued again: not part of this version's mix any more
            self.leased_at_version[0] -= lease.replay
            self.leased_at_version[1] -= 1
        self._reissue(lease.question_id, lease.replay)

    def _reissue(self, qid: str, replay: bool) -> None:
        self.n.reissued += 1
        if replay:
            self.n.reissued_replay += 1
            self.reissue_replay.append(qid)
        else:
            self.reissue.append(qid)

    def expire(self, now: float | None = None, *, all_leases: bool = False) -> int:
        """End every lease past its deadline (or every lease, when the generators holding them are
        known to be gone, e.g. after resuming a run); its question is issued again."""
        now = time.time() if now is None else now
        dead = [lid for lid, x in self.leases.items() if all_leases or x.deadline < now]
        for lid in dead:
            self._end_lease_reissue(self.leases.pop(lid))
        self.n.expired += len(dead)
        return len(dead)

    def return_leases(self, lease_ids: list[str]) -> int:
        """Leases given back unfinished (a generator stopping) or declared lost: re-issue their questions."""
        n = 0
        for lid in lease_ids:
            lease = self.leases.pop(lid, None)
            if lease is not None:
                self._end_lease_reissue(lease)
                n += 1
        self.n.returned += n
        return n

    def end_leases_of(self, generator_id: str) -> int:
        """End every lease `generator_id` holds, counted as expired: its process died (the generator pool saw
        it restarting or dead), so that work never comes back, and waiting out lease_timeout_s would hold the
        back-pressure window for nothing (a lost node stalled a run for the whole 120 s). Its questions are
        issued again at once; a group it submits after all is a late submission (counted, discarded)."""
        gone = [lid for lid, x in self.leases.items() if x.generator_id == generator_id]
        for lid in gone:
            self._end_lease_reissue(self.leases.pop(lid))
        self.n.expired += len(gone)
        self.n.expired_holder_died += len(gone)  # of `expired`: buffer/expired_holder_died
        return len(gone)

    # ------------------------------------------------------------------------------------ submitting

    def submit(self, groups: list[ScoredGroup], now: float | None = None) -> dict[str, int]:
        """Check, join and queue returned groups; update the store."""
        now = time.time() if now is None else now
        out = dict(accepted=0, zero_signal=0, rejected=0, late=0)
        for g in groups:
            lease = self.leases.pop(g.lease_id, None)
            if lease is None:
                self.n.late_submissions += 1
                out["late"] += 1
                continue
            problem = self._check(g, lease)
            if problem:
                log.warning("shard %d rejected a group from %s and re-issues its question: %s",
                            self.shard, g.generator_id, problem)
                self._end_lease_reissue(lease)
                self.n.rejected += 1
                out["rejected"] += 1
                continue
            out["zero_signal" if self._accept(g, lease) else "accepted"] += 1
        self.expire(now)
        return out

    def _check(self, g: ScoredGroup, lease: Lease) -> str:
        if g.question_id != lease.question_id:
            return f"lease {lease.lease_id} is for question {lease.question_id!r}, group is for {g.question_id!r}"
        if len(g.rollouts) != lease.num_samples:
            return f"lease {lease.lease_id} wants {lease.num_samples} rollouts, group has {len(g.rollouts)}"
        for r in g.rollouts:
            if len(r.response_ids) != len(r.logprobs) or not 0.0 <= r.reward <= 1.0 or r.version < 0:
                return f"lease {lease.lease_id}: rollout arrays differ in length or reward/version out of range"
        return ""

    def _accept(self, g: ScoredGroup, lease: Lease) -> bool:
        """Queue one checked group, after the experience policy's decision has changed the store; True when it was
        kept out of training as zero-signal."""
        qid, fresh = g.question_id, list(g.rollouts)
        cands: list[Rollout] = []
        if lease.replay:  # the candidates for o*, taken before this group changes the store
            recs = self.store.candidates(qid, self.rng) or lease.candidates
            cands = [record_to_rollout(r, qid) for r in recs]
        d = self.policy.decide(FinishedGroup(qid, tuple(fresh), bool(cands), self.K, self.mixed_mode))
        if d is not None:
            keys = self.store.observe(qid, d.k, [fresh[i] for i in d.store], d.collect, solved=d.solved,
                                      retire=d.retire)
            for i, key in zip(d.store, keys):
                if key:
                    fresh[i] = _with_key(fresh[i], key)
        rewards = [r.reward for r in fresh] + [c.reward for c in cands[:1]]
        if all(x == rewards[0] for x in rewards):
            self.n.zero_signal_seen += 1
            if self.policy.filters_zero_signal:
                self.n.zero_signal += 1
                if not lease.replay:  # the run-wide switch still sees this fresh group's accuracy
                    self.n.zero_signal_fresh += 1
                    self.n.zero_signal_fresh_correct += int(all(r.correct for r in fresh))
                return True
        group = TrainGroup(qid, self.questions[qid].prompt_ids, fresh, lease.replay, g.lease_id, cands)
        self.n.candidates_shipped += len(cands)
        (self.ready_mixed if lease.replay else self.ready_fresh).append(Ready(group, min(r.version for r in fresh)))
        self.n.accepted += 1
        return False

    # ------------------------------------------------------------------------------------- batching

    def set_version(self, version: int) -> None:
        if version > self.version:
            self.version = version
            self.taken_at_version = 0
            self.leased_at_version = [0, 0]

    def set_mixed_mode(self) -> None:
        """Switch mixed mode on (the client's run-wide `MixedSwitch` decides when)."""
        self.mixed_mode = True

    def _drop_stale(self) -> None:
        oldest = self.version - self.cfg.max_lag
        for qname in ("ready_fresh", "ready_mixed"):
            q = getattr(self, qname)
            if any(x.version < oldest for x in q):
                keep = deque()
                for x in q:
                    if x.version < oldest:
                        self.n.stale_dropped += 1
                        self.n.stale_dropped_mixed += x.group.mixed
                        # generated across a weight update (a long generation), not started late or left waiting
                        self.n.stale_dropped_spanning += any(r.newest_version > r.version for r in x.group.rollouts)
                        self._reissue(x.group.question_id, x.group.mixed)
                    else:
                        keep.append(x)
                setattr(self, qname, keep)

    def ready_counts(self, version: int | None = None) -> tuple[int, int]:
        """(fresh, mixed) groups ready for a batch at `version`, after dropping stale ones."""
        if version is not None:
            self.set_version(version)
        self._drop_stale()
        return len(self.ready_fresh), len(self.ready_mixed)

    def ready_summary(self, version: int | None = None) -> tuple[int, int, tuple, tuple]:
        """`ready_counts` plus each queue's groups per version, ((version, groups), ...), for `plan_take`."""
        f, m = self.ready_counts(version)
        return f, m, _per_version(self.ready_fresh), _per_version(self.ready_mixed)

    def take(self, version: int, n_fresh: int, n_mixed: int, exclude: frozenset[str] | set[str] = frozenset()
             ) -> list[TrainGroup]:
        """Up to n_fresh fresh and n_mixed mixed ready groups (oldest first), after dropping stale ones. Mixed
        groups of questions in `exclude` (already replayed in the batch being assembled) stay ready."""
        self.ready_counts(version)
        held = deque(x for x in self.ready_mixed if x.group.question_id in exclude)
        allowed = deque(x for x in self.ready_mixed if x.group.question_id not in exclude)
        allowed, mixed = _take_oldest(allowed, n_mixed)
        self.ready_mixed = held + allowed
        self.ready_fresh, fresh = _take_oldest(self.ready_fresh, n_fresh)
        out = mixed + fresh
        self.n.trained += len(out)
        self.taken_at_version += len(out)
        self.n.trained_mixed += sum(1 for g in out if g.mixed)
        return out

    def batch(self, version: int) -> list[TrainGroup]:
        """A whole single-shard batch: ceil(rho*B) mixed (when available), filled with fresh; [] if short."""
        plan = plan_take([self.ready_summary(version)], 0, 0, self.cfg.batch_questions, self.cfg.replay_ratio,
                         self.mixed_mode, version - self.cfg.max_lag)
        return [] if plan is None else self.take(version, *plan[0])

    def feedback(self, fb: LearnerFeedback) -> None:
        self.store.feedback(fb.keys, fb.entropies.tolist(), fb.version, fb.chosen, fb.fresh_keys,
                            fb.fresh_entropies.tolist(), fb.fresh_logprobs)

    # ---------------------------------------------------------------------------------- observation

    def accounting(self) -> dict[str, int]:
        """The terms of `issued = trained + stale_dropped + zero_signal + lost + outstanding + ready`
        (see the module docstring), plus `balance` = left side minus right side (always 0)."""
        n = self.n
        a = dict(issued=n.issued, trained=n.trained, stale_dropped=n.stale_dropped,
                 zero_signal=n.zero_signal, lost=n.expired + n.returned + n.rejected,
                 expired=n.expired, returned=n.returned, rejected=n.rejected,
                 outstanding=len(self.leases), ready=len(self.ready_fresh) + len(self.ready_mixed),
                 reissued=n.reissued, late_submissions=n.late_submissions)
        a["balance"] = balance(a)
        return a

    def metrics(self) -> dict[str, float]:
        m = self.store.metrics()
        # `retired`: questions out of the fresh stream (never issued fresh again: what a run's end checks read);
        # `retired_from_pool`: questions whose experience was deleted, never stored again (the same set unless
        # buffer.retire_fresh=last_three_correct)
        m["retired_from_pool"], m["retired"] = m["retired"], float(len(self.left_fresh()))
        m.update(self.n.as_metrics())
        m.update({f"policy/{k}": float(v) for k, v in self.policy.metrics().items()})
        m.update(leases_outstanding=float(len(self.leases)), ready_fresh=float(len(self.ready_fresh)),
                 in_flight_last_chance=float(self.last_chance_in_flight(self.version)),
                 ready_mixed=float(len(self.ready_mixed)), mixed_mode=float(self.mixed_mode),
                 version=float(self.version), epoch=float(self.epoch), questions=float(len(self.order_ids)),
                 replay_reissue_pending=float(len(self.reissue_replay)))
        return finish_metrics(m)

    # ------------------------------------------------------------------------------------ snapshots

    def snapshot_state(self, target) -> tuple[dict, SnapshotPlan]:
        """The manifest of a snapshot into the folder of `target` (segment name -> path there) and the store's
        plan for it (`ExperienceStore.plan_snapshot`); write both with `buffer.snapshot.write_shard_snapshot`."""
        plan = self.store.plan_snapshot(target)
        return self.state(self.store.state(plan)), plan

    def state(self, store: dict) -> dict:
        """The whole shard state as msgpack-ready plain data, with `store` (a store manifest) inside."""
        rs = self.rng.getstate()
        return {
            "state_version": STATE_VERSION, "shard": self.shard, "fingerprint": self.fingerprint,
            "group_size": self.K, "epoch": self.epoch, "cursor": self.cursor, "reissue": list(self.reissue),
            "reissue_replay": list(self.reissue_replay), "next_lease": self.next_lease, "version": self.version,
            "mixed_mode": self.mixed_mode, "taken_at_version": self.taken_at_version, "incarnation": self.incarnation,
            "counters": asdict(self.n), "rng": [rs[0], list(rs[1]), rs[2]], "leases": encode_leases(self.leases),
            "ready_fresh": encode_ready(self.ready_fresh), "ready_mixed": encode_ready(self.ready_mixed),
            "policy": self.policy.state(), "store": store,
        }

    @classmethod
    def from_state(cls, cfg: BufferConfig, questions: list[Question], state: dict, *, open_segment,
                   batch_share: int | None = None, shares: list[int] | None = None) -> ShardCore:
        """A new core holding `state`; `open_segment(name, size, digest)` gives a store segment's bytes
        (`buffer.snapshot.load_core`). Raises ValueError when the state does not fit this shard."""
        check_state_version(state)
        core = cls(cfg, questions, shard=state["shard"], batch_share=batch_share, shares=shares)
        core._load(state, open_segment)
        return core

    def _load(self, state: dict, open_segment) -> None:
        if state["fingerprint"] != self.fingerprint:
            raise ValueError(f"snapshot of shard {state['shard']} was taken with a different question set "
                             "(dataset or num_shards changed); restore it with the same data and shard count")
        if state["group_size"] != self.K:
            raise ValueError(f"snapshot has group_size {state['group_size']}, config has {self.K}")
        self.epoch, self.cursor = int(state["epoch"]), int(state["cursor"])
        self._order = self._epoch_order(self.epoch)
        self.reissue = deque(state["reissue"])
        self.reissue_replay = deque(state["reissue_replay"])
        self.next_lease, self.version = int(state["next_lease"]), int(state["version"])
        self.mixed_mode = bool(state["mixed_mode"])
        self.taken_at_version = int(state.get("taken_at_version", 0))
        self.incarnation = int(state.get("incarnation", self.incarnation))
        self.n.load(state["counters"])
        v, internal, gauss = state["rng"]
        self.rng.setstate((v, tuple(internal), gauss))
        self.leases = decode_leases(state["leases"], self.questions)
        self.ready_fresh, self.ready_mixed = decode_ready(state["ready_fresh"]), decode_ready(state["ready_mixed"])
        # (older snapshots keep SU-01's fresh-stream state beside the rest)
        self.policy.load_state(state.get("policy", {k: state[k] for k in ("fresh_out", "tracked") if k in state}))
        self.store.load_state(state["store"], open_segment)


@dataclass(slots=True)
class ShardCounters(Counters):
    """A shard's counters; each is logged as buffer/<name>, summed over shards. The accounting's terms are among
    them (`ShardCore.accounting`)."""

    issued: int = 0
    issued_replay: int = 0
    trained: int = 0
    trained_mixed: int = 0
    stale_dropped: int = 0
    stale_dropped_mixed: int = 0  # of stale_dropped: mixed groups
    stale_dropped_spanning: int = 0  # of stale_dropped: generated across a weight update
    zero_signal: int = 0  # kept out of training (the policy filters zero-signal groups)
    zero_signal_seen: int = 0  # groups whose rewards were all equal, kept out or not
    zero_signal_fresh: int = 0  # of zero_signal: fresh groups (the run-wide switch counts them)
    zero_signal_fresh_correct: int = 0  # of those: all correct
    expired: int = 0
    expired_holder_died: int = 0  # of expired: the generator holding the lease died
    returned: int = 0
    rejected: int = 0
    reissued: int = 0
    reissued_replay: int = 0
    replay_reissue_dropped: int = 0
    late_submissions: int = 0
    accepted: int = 0
    candidates_shipped: int = 0
    epochs_completed: int = 0
    lease_requests_throttled: int = 0
    fresh_discarded: int = 0


def new_incarnation() -> int:
    """A random id for a shard state's lineage (`zero_signal_news`)."""
    return int.from_bytes(os.urandom(4), "little") >> 1


def _per_version(q: deque[Ready]) -> tuple[tuple[int, int], ...]:
    return tuple(sorted(Counter(x.version for x in q).items()))


def _take_oldest(q: deque[Ready], n: int) -> tuple[deque[Ready], list[TrainGroup]]:
    """The `n` groups of the oldest policy versions (arrival order among equals) and the queue without them.

    Arrival order is not version order: with partial rollouts a long response started under an old version
    arrives after short ones started later, and taken last it would age past max_lag and be dropped."""
    if n >= len(q):
        return deque(), [x.group for x in q]
    chosen = set(sorted(range(len(q)), key=lambda i: q[i].version)[:max(n, 0)])
    return (deque(x for i, x in enumerate(q) if i not in chosen),
            [x.group for i, x in enumerate(q) if i in chosen])


def _with_key(r: Rollout, key: str) -> Rollout:
    return Rollout(r.response_ids, r.logprobs, r.reward, r.correct, r.entropy, r.version, r.finish_reason, key, r.replayed,
                   r.newest_version, r.valid)
