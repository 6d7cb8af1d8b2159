"""The `buffer` section."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from common.config.base import Section


class BufferConfig(Section):
    """The experience buffer: sharding, buckets, replay, leases, batches."""

    num_shards: int = Field(1, ge=1, le=1024)
    """Buffer shard actors; questions are partitioned by a stable hash of their id."""
    group_size: int = Field(8, ge=2, le=1024)
    """K: rollouts per question group (a mixed group is K-1 fresh + 1 replayed)."""
    batch_questions: int = Field(16, ge=1, le=100_000)
    """B: groups per learner batch."""
    replay_ratio: float = Field(0.5, ge=0, lt=1)
    """rho: fraction of each batch made of mixed (replayed) groups once mixed mode is on."""
    question_sampler: Literal["gaussian", "uniform", "advantage"] = "gaussian"
    """Which stored question a replay draws (`buffer/sampling.py`). gaussian (ExGRPO's): a bucket by N(b/K;
    bucket_mean, bucket_std), then uniform inside it. uniform: every stored question alike, buckets unused (plain
    replay's draw, Arnal et al., arXiv 2604.08706). advantage: in proportion to the |advantage| its correct
    trajectories had in its latest group, 1 - k/K (|advantage|-prioritised replay: arXiv 2606.04560, prime-rl
    #2273). Always without repeats within a batch."""
    bucket_mean: float = Field(0.5, ge=0, le=1)
    """mu of the bucket weight N(b/K; mu, sigma) (question_sampler=gaussian only)."""
    bucket_std: float = Field(0.125, gt=0, le=10)
    """sigma of the bucket weight (question_sampler=gaussian only)."""
    retire: bool = True
    """A question whose latest group is all correct (k = K) is retired (ExGRPO's): its stored trajectories are
    deleted and it is never issued fresh again. false (plain replay): nothing happens to it (as for k = 0: its
    trajectories and bucket stay, nothing of that group is stored, it stays in the fresh epochs)."""
    retire_fresh: Literal["with_pool", "last_three_correct"] = "with_pool"
    """When a question leaves the fresh stream (is never issued fresh again). with_pool (ExGRPO's): when it retires
    from the experience pool (`retire`, `retire_above`). last_three_correct (SU-01's code): retirement takes it out
    of the experience pool only; it stays in the fresh stream unless its last three tracked rollouts (the fresh
    rollouts of its groups, in order) were all correct, whatever `retire` says."""
    k_fresh_only: bool = False
    """k of a mixed group (its bucket, retirement, `store_below`) counts its fresh rollouts only (SU-01's code counts
    on-policy samples), out of K - 1; false (ExGRPO's): o* counts as one correct rollout of K."""
    retire_above: int | None = Field(None, ge=1, le=1023)
    """Retire a question once more than this many of its K rollouts are correct (None: K - 1, ExGRPO's: only
    when all K are). SU-01's exgrpo_retire_threshold=4 of 8 (docs/algorithm.md, SU-01's thresholds)."""
    store_below: int | None = Field(None, ge=2, le=1024)
    """Store correct rollouts only from groups with fewer than this many correct of K (None: K, ExGRPO's: any
    group not all correct). A group at or above it still updates its question's bucket. SU-01's
    experience_in_threshold=2: only groups with one correct rollout."""
    trajectory_eviction: Literal["highest_entropy", "oldest"] = "highest_entropy"
    """Which of a question's stored trajectories go past max_traj_per_question. highest_entropy (ExGRPO's): the
    learner-measured ones with the highest entropy, new ones waiting unmeasured beside them (docs/algorithm.md).
    oldest (plain replay's FIFO): the first stored, measured or not, as soon as a group brings more. Either way whole
    questions go least recently refreshed first past max_traj_total / max_bytes."""
    trajectory_selector: Literal["lowest_entropy", "lowest_stored_entropy", "random"] = "lowest_entropy"
    """Which stored trajectory completes a mixed group. lowest_entropy (the paper, and SU-01's code, which also
    re-scores its candidates under the current weights): the buffer ships the question's stored trajectories and the
    learner picks the one with the lowest score (`trajectory_score`) under the policy it is training (one no-grad
    forward per candidate). lowest_stored_entropy (no scoring forward): the buffer ships the
    one with the lowest entropy as stored, the learner's last measures first, else the generator's estimate (vLLM:
    from `logprobs_topk` log-probs). random (ablation): one at random."""
    fresh_draw: Literal["trained", "per_step"] = "trained"
    """Which fresh questions a run consumes. trained: only those it trains (a replayed group takes no fresh
    question). per_step: as the authors' loader, which draws batch_questions fresh questions each step and
    replaces the replay_ratio share of them by replays: each replay issued (not a re-issue) also consumes the
    next fresh question of the epoch order, unused (`buffer/fresh_discarded`); 700 steps at rho 0.5 then cover
    about twice the questions."""
    trajectory_score: Literal["mean_entropy", "chunk_window"] = "mean_entropy"
    """What lowest_entropy minimises. mean_entropy (the paper's rule): the candidate's mean token entropy over its
    response. chunk_window: what the authors' code computes (experience_helpers.py, exp_metric=ent): candidates scored
    in chunks of 8, each masked with the padding of the response in its slot of the LAST chunk, so candidate i
    scores (its entropies of the last max_new_tokens positions of prompt + response, from the first not covered by
    that other response) / (max_new_tokens - that response's non-pad tokens): it favours short trajectories, with
    noise from the other row (docs/algorithm.md). Either way the buffer keeps and ranks stored trajectories by the
    mean entropy the learner reports."""
    experience_policy: str | None = Field(None, pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
    """A class of your own that decides what a finished group does to the experience pool, package.module:Class
    (built as Class(buffer_config); subclass buffer.experience_policy.ExGrpo, docs/algorithm.md). None: the built-in
    rule the settings below choose (collect, retire, retire_fresh, drop_zero_signal)."""
    collect: bool = True
    """Manage experience: store correct rollouts of partly solved questions and retire solved ones.
    `collect=false` with `replay_ratio=0` is plain on-policy GRPO with the same components."""
    collect_before_mixed: bool = False
    """Store experience before mixed mode switches on (the authors' code does not)."""
    mixed_switch_accuracy: float = Field(0.35, ge=0, le=1)
    """Mixed mode switches on, once and for good for the whole run, when the moving accuracy of the
    fresh groups of trained batches exceeds this (checked once per batch)."""
    switch_window: int | None = Field(None, ge=1, le=1_000_000)
    """Moving-average window of that accuracy, in fresh groups; None = one batch (batch_questions).
    Must be at least one batch, so that the switch follows the batch accuracy as in the authors' code."""
    max_lag: int = Field(1, ge=0, le=1000)
    """Maximum age of a rollout in a batch, in learner steps (policy versions; one per batch whatever
    learner.batching.mini_batches is); 0 = synchronous training."""
    last_chance_wait_s: float = Field(30.0, ge=0, le=86_400)
    """How long a whole batch may wait for groups still being generated that it is the last able to train within
    `max_lag` (instead of newer groups taking their places and those going stale: docs/design.md, "Bounded
    staleness without waste"); past it the batch is formed without them. It bounds the wait on a generator that
    stalls or whose death the run has not seen. 0: never wait (what is in flight may go stale)."""
    drop_zero_signal: bool = False
    """Keep groups whose rewards are all equal (no GRPO signal) out of batches (DAPO-style dynamic
    sampling). Off by default: the authors' code trains on them with advantage 0."""
    lease_timeout_s: float = Field(120.0, gt=0, le=86_400)
    """A lease not returned within this is expired and its question issued again (a generator whose process dies has
    its leases ended when the run sees it, without waiting for this)."""
    max_traj_per_question: int = Field(8, ge=1, le=10_000)
    """Learner-measured trajectories kept per question (on overflow the highest measured entropy goes, see
    docs/algorithm.md). New correct rollouts wait beside them, up to group_size, until the learner has measured
    them (when it trains their group); so a mixed group ships at most this + group_size candidates to score."""
    max_traj_total: int = Field(1_000_000, ge=1)
    """Stored trajectories in a shard (least recently refreshed questions evicted first)."""
    max_bytes: int | None = Field(None, ge=1 << 20)
    """Bytes of stored trajectories in a shard (about 8 per response token: token ids and log-probs); past it,
    whole questions are evicted, least recently refreshed first (`buffer/evicted_for_bytes`). None: bounded by
    max_traj_total only. 46k questions x 8 trajectories x 8k tokens is ~24 GB: set it at real lengths."""
    snapshot_every_s: float = Field(30.0, gt=0)
    """Background snapshot period of each shard (for restart after a crash)."""
    seed: int = Field(0, ge=0, le=2**32 - 1)  # numpy and vLLM take 32-bit seeds
    """Seed of per-epoch shuffling and sampling."""
    call_timeout_s: float = Field(30.0, gt=0, le=3600)
    """The client raises BufferUnavailableError when a shard does not answer within this (e.g. while it restarts)."""
    start_timeout_s: float = Field(600.0, gt=0, le=86_400)
    """Upper bound on the shards' start: a worker process each, and the restore of a snapshot on resume (a shard of
    1M trajectories of 1k tokens restores in ~16 s; a busy node starts processes slowly). The error names the
    shards not ready."""
    max_restarts: int = Field(10, ge=-1, le=10_000)
    """Automatic restarts of a crashed shard actor (-1 = unlimited); each restart restores the latest snapshot."""
    max_concurrency: int = Field(16, ge=2, le=1024)
    """Threads of each shard actor (lease, submit and batch requests run concurrently)."""
    lease_wait_threads: int = Field(128, ge=1, le=4096)
    """Threads of each shard actor for idle generators' long-poll leases (generator.lease_wait_s), apart from
    max_concurrency so that waiting generators never hold up the learner's calls. More idle generators than
    this queue at the shard (each still returns within its bound)."""

    @model_validator(mode="after")
    def _modes_that_apply(self) -> BufferConfig:
        """Settings of one replay mode set beside another that never reads them are refused, by name. By value, not
        by what the input named: a saved config (every field written out) loads again."""
        default = {f: type(self).model_fields[f].default for f in type(self).model_fields}
        unused = [f"buffer.{f}" for f in ("bucket_mean", "bucket_std") if getattr(self, f) != default[f]]
        if unused and self.question_sampler != "gaussian":
            raise ValueError(f"{' and '.join(unused)}: the bucket weight of question_sampler=gaussian, unused by "
                             f"buffer.question_sampler={self.question_sampler}; leave them out or use gaussian")
        managed = [f"buffer.{f}={v}" for f, v, d in (("retire", "false", True),
                                                     ("trajectory_eviction", "oldest", "highest_entropy"),
                                                     ("retire_above", self.retire_above, None),
                                                     ("store_below", self.store_below, None),
                                                     ("k_fresh_only", "true", False),
                                                     ("retire_fresh", self.retire_fresh, "with_pool"))
                   if getattr(self, f) != d]
        if managed and not self.collect:
            raise ValueError(f"{' and '.join(managed)}: buffer.collect=false stores and retires nothing; set "
                             "buffer.collect=true (replay) or leave them out (plain GRPO)")
        replay = [f"buffer.{f}" for f in ("question_sampler", "trajectory_selector", "trajectory_eviction")
                  if getattr(self, f) != default[f]]
        if replay and self.replay_ratio == 0:
            raise ValueError(f"{' and '.join(replay)}: buffer.replay_ratio=0 replays nothing; set "
                             "buffer.replay_ratio > 0 or leave them out")
        return self

    @model_validator(mode="after")
    def _thresholds_within_a_group(self) -> BufferConfig:
        """retire_above and store_below count correct rollouts of one group: within 1..K-1 and 2..K."""
        k = self.group_size
        if self.retire_above is not None and not self.retire:
            raise ValueError(f"buffer.retire_above={self.retire_above}: buffer.retire=false retires nothing; "
                             "leave one of them out")
        if self.retire_above is not None and self.retire_above > k - 1:
            raise ValueError(f"buffer.retire_above={self.retire_above}: more than {self.retire_above} of "
                             f"buffer.group_size={k} can never be correct; use 1..{k - 1} ({k - 1}: all K, the "
                             "default)")
        if self.store_below is not None and self.store_below > k:
            raise ValueError(f"buffer.store_below={self.store_below}: a group has {k} rollouts "
                             f"(buffer.group_size); use 2..{k} ({k}: any group not all correct, the default)")
        return self

    @model_validator(mode="after")
    def _window_covers_a_batch(self) -> BufferConfig:
        if self.switch_window is not None and self.switch_window < self.batch_questions:
            raise ValueError(
                f"buffer.switch_window: {self.switch_window} fresh groups is less than one batch "
                f"(buffer.batch_questions={self.batch_questions}); use at least {self.batch_questions} or leave it unset")
        return self

    @property
    def switch_groups(self) -> int:
        """The switch window in fresh groups (one batch unless configured)."""
        return self.switch_window or self.batch_questions
