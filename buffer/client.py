"""The buffer client: routes to shard actors by the stable hash, one Ray call per shard per operation.

    client = BufferClient.create(cfg, questions, run="r1", namespace=None, snapshot_dir="/ckpt/buf")
    items = client.lease("gen-0", 8); client.submit(groups)              # WorkSource (generators)
    batch = client.get_batch(version, timeout_s=60)                       # BatchSource (learner)
    client.feedback(fb); client.set_version(version + 1)

Picklable, so it can be passed to generator actors. The client that takes batches (the driver's) owns the
run's one `MixedSwitch` (the delayed start). A shard that is dead or restarting makes calls fail with
`BufferUnavailableError` after at most `cfg.call_timeout_s`, never a hang.
Details: docs/internals.md#bufferclientpy
"""

from __future__ import annotations

import logging
import math
import time
from collections import defaultdict
from pathlib import Path

import ray
from ray.exceptions import GetTimeoutError, RayActorError

from buffer.batch_plan import merge_accounting, merge_metrics, plan_take, zero_signal_news
from buffer.experience_policy import make_experience_policy
from buffer.keys import shard_of, split_key
from buffer.shard import make_shard_actor, pack, unpack
from common import codec
from common.config import BufferConfig
from common.disk import atomic_write_bytes
from common.interfaces import actor_name
from common.messages import LearnerFeedback, Question, ScoredGroup, TrainGroup, TrainingBatch, WorkItem, float32_array

log = logging.getLogger(__name__)

try:  # ActorUnavailableError exists in newer Ray versions only
    from ray.exceptions import ActorUnavailableError as _Unavailable
except ImportError:  # pragma: no cover
    _Unavailable = RayActorError


SWITCH_FILE = "switch.msgpack"


class BufferUnavailableError(RuntimeError):
    """A buffer shard did not answer (dead, restarting, or overloaded)."""


def batch_shares(counts: list[int], batch_questions: int) -> list[int]:
    """Per-shard share of a batch, proportional to its questions: B * n_i / N rounded by largest remainder, so
    the shares sum to B (a synchronous run then generates exactly one batch per step, not a group more that goes
    stale), and at least 1 for a shard with questions (else they would never be issued)."""
    total = sum(counts)
    if total == 0:
        raise ValueError("no questions to put in the buffer; check the dataset")
    exact = [batch_questions * c / total for c in counts]
    shares = [math.floor(x) for x in exact]
    for i in sorted(range(len(counts)), key=lambda i: shares[i] - exact[i])[:batch_questions - sum(shares)]:
        shares[i] += 1
    return [max(s, 1) if c else 0 for s, c in zip(shares, counts)]


class BufferClient:
    """Routes work, groups, batches and feedback to the S shard actors of one run."""

    def __init__(self, shards: list, *, cfg: BufferConfig, run: str, namespace: str | None):
        if not shards:
            raise ValueError("a BufferClient needs at least one shard")
        self.shards, self.run, self.namespace = list(shards), run, namespace
        self.batch_questions, self.replay_ratio, self.call_timeout_s = cfg.batch_questions, cfg.replay_ratio, cfg.call_timeout_s
        self.group_size, self.max_lag = cfg.group_size, cfg.max_lag
        self.start_timeout_s = cfg.start_timeout_s
        self._pings: list = []  # the shards' first answers, until wait_ready has them
        # seconds get_batch held a whole batch for groups in flight that it is the last to be able to train
        self.held_s = 0.0
        self.last_chance_wait_s = cfg.last_chance_wait_s
        # (version, since, said) of the batch held for groups in flight: `since` is when its hold began (None: not
        # held yet), `said` whether its warning was logged
        self._hold: tuple[int, float | None, bool] | None = None
        self.trajectory_score = cfg.trajectory_score  # how the learner picks o* (buffer.trajectory_score)
        self.switch = make_experience_policy(cfg).mixed_switch()  # the delayed start is the experience policy's
        self._zero_signal_seen: list[list[int]] | None = None  # per shard: cumulative (fresh groups kept out, of
        # which all correct) at the last batch
        self._rr = 0
        self._wait_rr = -1  # the shard the last long-poll lease waited at

    def __getstate__(self) -> dict:
        """Pickled without the shards' handles (a generator actor gets the client as a constructor argument, and Ray
        keeps arguments holding actor handles in its object store, which a restart would depend on): the copy finds
        the shards by name when it first calls them."""
        return {**self.__dict__, "_shards": None, "_pings": []}  # nor the shards' first answers (ObjectRefs)

    @property
    def shards(self) -> list:
        if self._shards is None:
            try:
                self._shards = [ray.get_actor(actor_name(self.run, "buffer", i), namespace=self.namespace)
                                for i in range(self._num_shards)]
            except ValueError as e:
                raise BufferUnavailableError(f"buffer shards of run {self.run!r} not found in namespace "
                                             f"{self.namespace!r}: {e}") from None
        return self._shards

    @shards.setter
    def shards(self, shards: list) -> None:
        self._shards, self._num_shards = list(shards), len(shards)

    # ----------------------------------------------------------------------------------- building

    @classmethod
    def create(cls, cfg: BufferConfig, questions: list[Question], *, run: str, namespace: str | None,
               snapshot_dir: str | None, wait: bool = True) -> BufferClient:
        """Start the S named shard actors, each owning the questions that hash to it. `wait=False`: return at
        once (calls queue until the shards run; `wait_ready` then bounds the start and raises its error)."""
        parts: list[list[Question]] = [[] for _ in range(cfg.num_shards)]
        for q in questions:
            parts[shard_of(q.id, cfg.num_shards)].append(q)
        shares = batch_shares([len(p) for p in parts], cfg.batch_questions)
        shards = [
            make_shard_actor(cfg, parts[i], shard=i, shares=shares, name=actor_name(run, "buffer", i),
                             namespace=namespace, snapshot_dir=snapshot_dir)
            for i in range(cfg.num_shards)
        ]
        client = cls(shards, cfg=cfg, run=run, namespace=namespace)
        client._pings = [s.ping.remote() for s in shards]
        if wait:
            client.wait_ready()
        return client

    def wait_ready(self) -> None:
        """Wait (within buffer.start_timeout_s of this call) until every shard created by `create` answers; raises
        a shard's own start error, or BufferUnavailableError naming the shards that are late."""
        pings, self._pings = self._pings, []
        if not pings:
            return
        _, late = ray.wait(pings, num_returns=len(pings), timeout=self.start_timeout_s)
        if late:
            which = [i for i, ref in enumerate(pings) if ref in late]
            for ref in late:
                ray.cancel(ref)
            raise BufferUnavailableError(
                f"buffer start: shard(s) {which} of run {self.run!r} not ready within buffer.start_timeout_s="
                f"{self.start_timeout_s:g}s (each starts a worker process, then restores its snapshot on resume); "
                "see the run's logs/ray for the shard's own log, or raise buffer.start_timeout_s")
        self._get(pings, "start")  # all answered: raises a shard's own start error, if any

    @classmethod
    def connect(cls, run: str, namespace: str | None, num_shards: int, *, cfg: BufferConfig | None = None) -> BufferClient:
        """Look up a run's existing shard actors by name."""
        cfg = cfg or BufferConfig(num_shards=num_shards)
        try:
            shards = [ray.get_actor(actor_name(run, "buffer", i), namespace=namespace) for i in range(num_shards)]
        except ValueError as e:
            raise BufferUnavailableError(f"buffer shards of run {run!r} not found in namespace {namespace!r}: {e}") from None
        return cls(shards, cfg=cfg, run=run, namespace=namespace)

    def _get(self, refs: list, what: str, timeout_s: float | None = None):
        timeout = self.call_timeout_s if timeout_s is None else timeout_s
        try:
            return ray.get(refs, timeout=timeout)
        except GetTimeoutError:
            for r in refs:
                ray.cancel(r)
            raise BufferUnavailableError(
                f"buffer {what}: a shard of run {self.run!r} did not answer within {timeout:.1f}s "
                "(it may be restarting from its snapshot); retry later or raise buffer.call_timeout_s") from None
        except (RayActorError, _Unavailable) as e:
            raise BufferUnavailableError(
                f"buffer {what}: a shard of run {self.run!r} is dead or restarting: {type(e).__name__}; "
                "retry once it has restored its snapshot") from e

    # --------------------------------------------------------------------------------- WorkSource

    def lease(self, generator_id: str, max_items: int, wait_s: float = 0.0) -> list[WorkItem]:
        """Split `max_items` round-robin over the shards (rotating start); one call per shard asked. When none has
        work and `wait_s` > 0: one long-poll call to the next shard in turn, answered as soon as it has work or
        after `wait_s` (every shard's back-pressure opens at once, when the learner takes a batch)."""
        s = len(self.shards)
        quota = [0] * s
        for j in range(max_items):
            quota[(self._rr + j) % s] += 1
        self._rr = (self._rr + max_items) % s
        asked = [i for i in range(s) if quota[i]]
        replies = self._get([self.shards[i].lease.remote(generator_id, quota[i]) for i in asked], "lease")
        items = [item for r in replies for item in codec.decode_list(r, WorkItem)]
        if items or wait_s <= 0:
            return items
        self._wait_rr = (self._wait_rr + 1) % s
        reply = self._get([self.shards[self._wait_rr].lease_wait.remote(generator_id, max_items, wait_s)], "lease",
                          timeout_s=wait_s + self.call_timeout_s)[0]
        return codec.decode_list(reply, WorkItem)

    def submit(self, groups: list[ScoredGroup]) -> dict[str, int]:
        """Route groups to the shard that leased them (the lease id's shard prefix), one call per shard."""
        by_shard: dict[int, list[ScoredGroup]] = defaultdict(list)
        for g in groups:
            by_shard[self._lease_shard(g.lease_id, g.question_id)].append(g)
        order = sorted(by_shard)
        replies = self._get([self.shards[i].submit.remote(codec.encode_list(by_shard[i], ScoredGroup)) for i in order],
                            "submit")
        out: dict[str, int] = defaultdict(int)
        for r in replies:
            for k, v in unpack(r).items():
                out[k] += v
        return dict(out)

    def _lease_shard(self, lease_id: str, question_id: str) -> int:
        head, sep, _ = lease_id.partition("-")
        if sep and head.isdigit() and int(head) < len(self.shards):
            return int(head)
        return shard_of(question_id, len(self.shards))

    def return_leases(self, lease_ids: list[str]) -> None:
        by_shard: dict[int, list[str]] = defaultdict(list)
        for lid in lease_ids:
            by_shard[self._lease_shard(lid, "")].append(lid)
        self._get([self.shards[i].return_leases.remote(ids) for i, ids in by_shard.items()], "return_leases")

    def end_leases_of(self, generator_id: str) -> int:
        """End the leases of a generator whose process died, on every shard (`ShardCore.end_leases_of`); how many."""
        return sum(self._get([s.end_leases_of.remote(generator_id) for s in self.shards], "end_leases_of"))

    def _observe_switch(self, batch: list[TrainGroup], zero_signal: list[tuple[int, int, int]]) -> None:
        """Feed the run-wide switch with this batch's fresh groups and the zero-signal groups the shards kept out
        since the last batch (`zero_signal`: per shard, cumulative, with the shard's incarnation); switch every
        shard on when it fires."""
        n_zero, n_zero_correct, self._zero_signal_seen = zero_signal_news(self._zero_signal_seen, zero_signal)
        if self.switch.on:
            return
        acc = [1.0] * n_zero_correct + [0.0] * (n_zero - n_zero_correct)
        acc += [sum(r.correct for r in g.rollouts) / self.group_size for g in batch if not g.mixed]
        if self.switch.observe(acc):
            self._get([s.set_mixed_mode.remote() for s in self.shards], "set_mixed_mode")

    # -------------------------------------------------------------------------------- BatchSource

    def get_batch(self, version: int, timeout_s: float) -> TrainingBatch | None:
        """B groups: ceil(rho*B) mixed when available (once mixed mode is on), the rest fresh, in
        shard order (the learner shuffles before splitting into mini-batches). Polls all shards in
        parallel, then takes from each in parallel; None on timeout. Feeds the mixed-mode switch.

        `mixed_mode` is the mode the batch was composed in, which `learner.loss.clip_fresh=auto` reads: the
        batch whose accuracy fires the switch was composed (all fresh) before it and is still clipped; the switch acts
        from the next batch on, as the authors' trainer checks it after the update."""
        t0 = time.monotonic()
        deadline = t0 + timeout_s
        b = self.batch_questions
        got: list[TrainGroup] = []
        held_since = None  # when the shards first reported groups in flight that this batch is the last chance of
        while True:
            left = deadline - time.monotonic()
            want = math.ceil((b - len(got)) / len(self.shards))  # each shard waits for its part
            hold = self._may_hold(version)
            counts = self._get([s.wait_ready.remote(version, want, max(0.0, min(left, 0.25)), hold) for s in self.shards],
                               "get_batch", timeout_s=self.call_timeout_s + min(max(left, 0.0), 0.25))
            have_m = sum(1 for g in got if g.mixed)
            in_flight_last = sum(c[8] for c in counts) if hold else 0
            plan = plan_take([tuple(c[:4]) for c in counts], len(got) - have_m, have_m, b, self.replay_ratio,
                             self.switch.on, version - self.max_lag, in_flight_last)
            if plan is None and in_flight_last and held_since is None and plan_take(
                    [tuple(c[:4]) for c in counts], len(got) - have_m, have_m, b, self.replay_ratio, self.switch.on,
                    version - self.max_lag) is not None:  # whole without them: held for them from now on
                held_since = time.monotonic()
                self._hold_begins(version, held_since)
            if plan is not None:
                # a second round never replays a question the batch already replays (a shard that restarted
                # from an older snapshot may have re-leased one taken in the first round)
                replayed = [g.question_id for g in got if g.mixed]
                refs = [(i, self.shards[i].take.remote(version, f, m, replayed)) for i, (f, m) in enumerate(plan)
                        if f or m]
                for r in self._get([r for _, r in refs], "get_batch"):
                    got.extend(codec.decode_list(r, TrainGroup))
                if len(got) >= b:
                    break
            if time.monotonic() >= deadline:
                if got:  # groups already taken are not thrown away: hand back a short batch
                    break
                self._held(held_since)
                return None
        if self.switch.on and not all(c[6] for c in counts):  # a shard restarted from an older snapshot
            self._get([s.set_mixed_mode.remote() for s in self.shards], "set_mixed_mode")
        built_mixed = self.switch.on  # the mode this batch was composed in; a switch it fires acts from the next one
        self._observe_switch(got, [(c[4], c[5], c[7]) for c in counts])
        n_mixed = sum(1 for g in got if g.mixed)
        held = self._held(held_since)
        stats = {"batch_mixed": float(n_mixed), "batch_fresh": float(len(got) - n_mixed),
                 "batch_wait_s": time.monotonic() - t0, "batch_short": float(b - len(got)),
                 "batch_held_s": held,
                 "switch_accuracy": self.switch.mean(), "mixed_mode": float(built_mixed)}
        return TrainingBatch(groups=got, version=version, stats=stats, trajectory_score=self.trajectory_score,
                             mixed_mode=built_mixed)

    def _may_hold(self, version: int) -> bool:
        """Whether this version's batch may still wait for groups in flight at their last chance: never with
        `buffer.last_chance_wait_s=0`, else until that long after its hold began (`_hold_begins`, over all get_batch
        calls for it; a batch not held yet may be). Said once, when a hold runs out."""
        if self.last_chance_wait_s <= 0:
            return False
        if self._hold is None or self._hold[0] != version or self._hold[1] is None:
            return True
        waited = time.monotonic() - self._hold[1]
        if waited < self.last_chance_wait_s:
            return True
        if not self._hold[2]:
            log.warning("batch %d waited %.0f s for groups in flight that it is the last able to train "
                        "(buffer.last_chance_wait_s): formed without them, they go stale if they come", version, waited)
            self._hold = (version, self._hold[1], True)
        return False

    def _hold_begins(self, version: int, now: float) -> None:
        """This version's batch is whole without groups still in flight and waits for them: its hold's clock starts
        now, unless an earlier get_batch call for it already started it."""
        if self._hold is None or self._hold[0] != version or self._hold[1] is None:
            self._hold = (version, now, False)

    def _held(self, since: float | None) -> float:
        """Seconds since `since` (None: 0), added to `held_s`."""
        held = 0.0 if since is None else time.monotonic() - since
        self.held_s += held
        return held

    def feedback(self, fb: LearnerFeedback) -> None:
        """Route entropy feedback by the question id in each key (one call per shard)."""
        parts = self._feedback_parts(fb)
        self._get([self.shards[i].feedback.remote(parts[i]) for i in sorted(parts)], "feedback")

    def end_step(self, fb: LearnerFeedback, version: int) -> dict[str, float]:
        """After a learner step: `feedback(fb)`, `set_version(version)` and `metrics()` in one call per shard."""
        parts = self._feedback_parts(fb)
        replies = self._get([s.end_step.remote(parts.get(i), version) for i, s in enumerate(self.shards)], "end_step")
        return {**merge_metrics([unpack(r) for r in replies]), "batch_held_s": self.held_s}

    def _feedback_parts(self, fb: LearnerFeedback) -> dict[int, bytes]:
        """Each shard's part of `fb` (routed by the question id in each key), encoded; shards with none left out."""
        s = len(self.shards)

        def shard(key: str) -> int:
            try:
                qid, _ = split_key(key)
            except ValueError:
                qid = key  # malformed: the owning shard counts it as ignored feedback
            return shard_of(qid, s)

        parts: dict[int, tuple[list, ...]] = defaultdict(lambda: ([], [], [], [], [], []))
        for key, ent in zip(fb.keys, fb.entropies.tolist()):
            parts[shard(key)][0].append(key)
            parts[shard(key)][1].append(ent)
        for key in fb.chosen:
            parts[shard(key)][2].append(key)
        for j, (key, ent) in enumerate(zip(fb.fresh_keys, fb.fresh_entropies.tolist())):
            parts[shard(key)][3].append(key)
            parts[shard(key)][4].append(ent)
            if fb.fresh_logprobs:
                parts[shard(key)][5].append(fb.fresh_logprobs[j])
        return {i: codec.encode(LearnerFeedback(fb.version, keys, float32_array(ents), chosen, fresh,
                                                float32_array(fresh_ents), lps))
                for i, (keys, ents, chosen, fresh, fresh_ents, lps) in sorted(parts.items())}

    def set_version(self, version: int) -> None:
        self._get([s.set_version.remote(version) for s in self.shards], "set_version")

    # ------------------------------------------------------------------------------ observability

    def metrics(self) -> dict[str, float]:
        per = [unpack(r) for r in self._get([s.metrics.remote() for s in self.shards], "metrics")]
        return merge_metrics(per)

    def shard_metrics(self) -> list[dict[str, float]]:
        return [unpack(r) for r in self._get([s.metrics.remote() for s in self.shards], "metrics")]

    def accounting(self) -> dict[str, int]:
        """Summed shard accounting; `balance` is 0 when nothing was lost (see buffer.core)."""
        return merge_accounting([unpack(r) for r in self._get([s.accounting.remote() for s in self.shards],
                                                              "accounting")])

    def snapshot(self, dir: str) -> dict[str, int]:
        """Every shard writes buffer-shard-<i>.msgpack into `dir` (each file atomic); the client adds
        the run-wide switch state (switch.msgpack). Returns the summed accounting of exactly the states
        written (each shard's counts are taken under the lock that takes its state)."""
        counts = self._get([s.snapshot.remote(str(dir)) for s in self.shards], "snapshot",
                           timeout_s=max(self.call_timeout_s, 600))
        state = dict(self.switch.state(), zero_signal_seen=self._zero_signal_seen)
        path = Path(dir) / SWITCH_FILE
        atomic_write_bytes(path, pack(state))
        return merge_accounting([unpack(c) for c in counts])

    def restore(self, dir: str, expire_leases: bool = False) -> int:
        """Every shard replaces its state with its file in `dir` (validated first; a bad file changes nothing).

        `expire_leases=True` (resuming a run) ends the snapshot's outstanding leases at once — their
        generators are gone — so their questions are reissued now and counted as lost, not after
        `lease_timeout_s`. Returns how many leases were ended that way: exactly the snapshot's
        `outstanding` count (see `snapshot`)."""
        path = Path(dir) / SWITCH_FILE
        try:
            state = unpack(path.read_bytes())
        except FileNotFoundError:
            raise BufferUnavailableError(f"buffer snapshot {dir} has no {SWITCH_FILE} (written by an older version?)") from None
        expired = self._get([s.restore.remote(str(dir), expire_leases) for s in self.shards], "restore",
                            timeout_s=max(self.call_timeout_s, 600))
        self.switch.load_state(state)
        seen = state["zero_signal_seen"]  # per shard; a summed pair from an older version cannot be matched: []
        self._zero_signal_seen = seen if seen and isinstance(seen[0], list) else []
        if self.switch.on:
            self._get([s.set_mixed_mode.remote() for s in self.shards], "set_mixed_mode")
        return sum(expired)

    def shutdown(self) -> None:
        for s in self.shards:
            ray.kill(s, no_restart=True)

