"""Liveness decisions as pure functions: placement refusals and warnings, stall timing, diagnoses."""

from __future__ import annotations

from cluster.liveness import (
    NOTHING_LEFT, ErrorWindow, Readings, RunOutline, StallWatch, check_placement, diagnose, sample_text,
    zero_reward_hint,
)
from common.config import GeneratorConfig, LearnerConfig

GEN, LEARNER = GeneratorConfig(), LearnerConfig()  # 1 CPU per generator, 1 learner rank of 1 CPU


def _place(n: int, cpus: float, gpus: float = 0.0, gen=GEN, learner=LEARNER, fixed: bool = True):
    total = {"CPU": cpus, "GPU": gpus}
    return check_placement(gen, learner, n, total, total, fixed=fixed)


def test_everything_fits():
    p = _place(2, 4)
    assert (p.fit, p.refuse, p.warning) == (2, None, None)


def test_more_generators_than_fit_start_with_what_fits_and_say_so():
    p = _place(2, 2)  # learner 1 CPU + 2 generators x 1 CPU = 3 > 2
    assert p.fit == 1 and p.refuse is None
    assert "generator.num_generators=2 needs 2 CPU + the learner 1 CPU = 3 CPU, the cluster has 2 CPU" in p.warning
    assert "generator.num_cpus=0.5" in p.warning and "starting with the 1 generator that fit" in p.warning


def test_not_even_one_generator_and_the_learner_fit_is_refused_with_what_to_change():
    p = _place(1, 1)
    assert p.fit == 0 and p.warning is None
    assert "one generator (generator.num_cpus=1) and the learner (learner.num_ranks=1 x learner.num_cpus=1) " \
           "need 2 CPU; the cluster has 1 CPU" in p.refuse
    assert "learner.num_cpus=0.5 and generator.num_cpus=0.5" in p.refuse  # 1 CPU shared by 2 processes


def test_gpus_asked_on_a_cluster_without_gpus_are_refused():
    p = _place(1, 8, gen=GeneratorConfig(num_gpus=1))
    assert "the cluster has 0 GPU: set generator.num_gpus=0 and learner.num_gpus=0" in p.refuse


def test_a_generator_larger_than_any_node_is_refused():
    gen = GeneratorConfig(num_cpus=4)
    p = check_placement(gen, LEARNER, 1, {"CPU": 8}, {"CPU": 2}, fixed=True)
    assert "a generator needs 4 CPU" in p.refuse and "the largest node has 2 CPU" in p.refuse


def test_a_tensor_parallel_generator_needs_its_gpus_on_one_node():
    gen = GeneratorConfig(num_gpus=1, tensor_parallel_size=4, engine={"kind": "vllm"})
    learner = LearnerConfig(num_gpus=1)
    p = check_placement(gen, learner, 1, {"CPU": 16, "GPU": 8}, {"CPU": 8, "GPU": 3}, fixed=True)
    assert "a generator needs 4 GPU (generator.num_gpus x generator.tensor_parallel_size=4)" in p.refuse
    assert "the largest node has 3 GPU" in p.refuse
    p = check_placement(gen, learner, 2, {"CPU": 16, "GPU": 8}, {"CPU": 8, "GPU": 4}, fixed=True)
    assert p.fit == 1 and p.refuse is None  # 8 GPUs: the learner's 1 and one generator's 4 (two would need 9)


def test_a_joined_cluster_may_grow_so_it_is_a_warning_there():
    p = _place(1, 1, fixed=False)
    assert p.refuse is None and p.fit == 0 and "waiting for nodes to join" in p.warning


def test_stall_watch_reports_every_n_seconds_and_expires_without_progress():
    w = StallWatch(report_every_s=30, timeout_s=100, now=0)
    assert not w.report_due(10) and w.report_due(31) and not w.report_due(40) and w.report_due(61)
    assert not w.expired(99) and w.expired(100)
    w.progress(90)
    assert w.seconds(120) == 30 and not w.expired(189) and not w.report_due(119)
    assert not StallWatch(30, 0, now=0).expired(10**9)  # 0: never give up


POOL = {"running": ["r/generator-0"], "restarting": [], "starting": [], "pending": ["r/generator-1"], "respawn": []}


def test_diagnosis_names_generators_leases_and_drops():
    buf = {"leases_outstanding": 8, "ready_fresh": 3, "ready_mixed": 1, "accepted": 4, "zero_signal": 40,
           "stale_dropped": 2, "rejected": 1, "expired": 5, "retired": 7}
    gen = {"reward_errors": 0, "rollouts": 400, "rewarded": 30}
    d = diagnose(95, 3, Readings(POOL, "generators: 1 running, 1 pending", buf, gen), RunOutline(10, 100, "countdown"))
    assert d.line.startswith("no learner step for 95s (step 3/10): generators: 1 running, 1 pending")
    assert "leases outstanding 8, ready groups 4" in d.line
    assert "zero-signal 40, stale 2, rejected 1, expired leases 5" in d.line and "retired 7/100" in d.line
    assert d.metrics["stall/generators_pending"] == 1 and d.metrics["stall/zero_signal"] == 40
    assert d.metrics["stall/seconds"] == 95 and not d.nothing_left and not d.all_rewards_zero


def test_a_batch_held_for_groups_at_their_last_chance_says_so():
    buf = {"leases_outstanding": 3, "ready_fresh": 16, "accepted": 40, "in_flight_last_chance": 3}
    gen = {"reward_errors": 0, "rollouts": 400, "rewarded": 30}
    run = RunOutline(10, 100, "countdown", batch_questions=16)
    d = diagnose(95, 3, Readings(POOL, "generators: 1 running", buf, gen), run)
    assert d.metrics["stall/in_flight_last_chance"] == 3
    assert any("waits for 3 group(s) still being generated" in h and "buffer.lease_timeout_s" in h for h in d.hints)
    d = diagnose(95, 3, Readings(POOL, "generators: 1 running", {**buf, "ready_fresh": 15}, gen), run)
    assert not any("still being generated" in h for h in d.hints)  # not whole without them: not what holds it


def test_all_zero_rewards_name_the_reward_function():
    gen = {"reward_errors": 0, "rollouts": 64, "rewarded": 0}
    d = diagnose(30, 0, Readings(POOL, "", {"zero_signal": 8}, gen), RunOutline(10, 100, "countdown"))
    assert d.all_rewards_zero and any("every reward so far is 0 (64 rollouts)" in h and "reward.name=countdown" in h
                                      for h in d.hints)


def test_a_hanging_reward_is_named_first_with_calls_in_flight_timeouts_and_time_per_call():
    gen = {"reward_errors": 0, "rollouts": 0, "rewarded": 0, "reward_in_flight": 57, "reward_timeouts": 7,
           "reward_oldest_s": 4.2, "reward_call_p50_s": 5.0, "reward_call_max_s": 5.01}
    d = diagnose(40, 0, Readings(POOL, "generators: 1 running", {"leases_outstanding": 32}, gen),
                 RunOutline(2, 100, "m:sleeps", 5.0))
    assert d.scoring_holds and d.line.startswith("scoring holds the run: no learner step for 40s")
    assert "reward calls in flight 57 (oldest 4s), timed out 7, per call p50 5.00s max 5.01s" in d.line
    assert d.hints[0].startswith("the reward function holds the run: reward.name=m:sleeps has 57 call(s) in flight, "
                                 "the oldest for 4s, and 7 timed out after reward.timeout_s=5s")
    assert d.metrics["stall/reward_timeouts"] == 7 and d.metrics["stall/reward_in_flight"] == 57
    # no timeout yet, but the oldest call is past the timeout: also held by scoring
    late = {**gen, "reward_timeouts": 0, "reward_oldest_s": 6}
    assert diagnose(40, 0, Readings(POOL, "", {}, late), RunOutline(2, 100, "m", 5)).scoring_holds
    # calls in flight that are quick: not what holds the run
    quick = {**gen, "reward_timeouts": 0, "reward_oldest_s": 0.1, "reward_call_max_s": 0.2}
    assert not diagnose(40, 0, Readings(POOL, "", {}, quick), RunOutline(2, 100, "m", 5)).scoring_holds


def test_all_zero_rewards_lead_with_the_reward_errors_when_they_explain_them():
    assert zero_reward_hint("m:f", 64, 60, 8).startswith("every reward so far is 0, and 60 of 64 rollouts were reward "
                                                         "errors (8 timeouts) scored 0: reward.name=m:f fails or hangs")
    assert zero_reward_hint("m:f", 64, 3, 0).startswith("every reward so far is 0 (64 rollouts): check that "
                                                        "reward.name=m:f matches the data's answer field")
    gen = {"reward_errors": 64, "rollouts": 64, "rewarded": 0}
    d = diagnose(30, 0, Readings(POOL, "", {}, gen), RunOutline(10, 100, "m:f"))
    assert d.all_rewards_zero and "64 of 64 rollouts were reward errors" in d.hints[0]
    assert not any("failed 64 times" in h for h in d.hints)  # said once, first


def test_error_window_counts_the_last_steps_and_survives_a_generator_restart():
    w = ErrorWindow(steps=2)
    assert w.observe(0, 64) == (0, 64)
    assert w.observe(64, 128) == (64, 128)  # step 2: every rollout an error
    assert w.observe(64, 192) == (64, 128)  # step 1 left the window
    assert w.observe(10, 20) == (64, 128)  # totals went down (a generator restarted): a new count, nothing added
    assert w.observe(20, 84) == (10, 128)


def test_every_question_retired_means_nothing_left():
    seen = Readings(POOL, "", {"retired": 100, "zero_signal": 90}, {"rollouts": 800, "rewarded": 800})
    d = diagnose(3, 5, seen, RunOutline(10, 100, "x"))
    assert d.nothing_left and NOTHING_LEFT in d.hints


def test_retired_questions_whose_last_groups_still_make_a_batch_are_trained_first():
    """The last groups can come in after a batch wait ended (seen in CI: the run stopped before its only step)."""
    buf = {"retired": 16, "ready_fresh": 16}
    run = RunOutline(50, 16, "x", batch_questions=16)
    assert not diagnose(3, 0, Readings(POOL, "", buf, {}), run).nothing_left
    assert diagnose(3, 0, Readings(POOL, "", {**buf, "ready_fresh": 15}, {}), run).nothing_left


def test_no_generator_at_all_is_said():
    empty = {k: [] for k in POOL}
    d = diagnose(30, 0, Readings(empty, "generators: none", {}, {}), RunOutline(10, 100, "x"))
    assert any("no generator is running or starting" in h for h in d.hints)


def test_sample_text_shows_question_answer_response_and_reward():
    s = {"question_id": "q7", "answer": "42", "response": "x" * 400, "reward": 0.0, "error": None}
    text = sample_text(s, limit=10)
    assert text == "a sample: question q7, reference answer '42', response 'xxxxxxxxxx...' scored 0"
    assert sample_text(None) == "no sample response available yet"


def test_batches_that_train_on_nothing_are_said_after_three_in_a_row_then_every_fifty():
    from cluster.liveness import SignalWatch

    w = SignalWatch(temperature=1e-6)
    flat, mixed = [[1.0, 1.0], [0.0, 0.0]], [[1.0, 0.0], [1.0, 1.0]]
    assert [w.observe(flat), w.observe(flat), w.observe(mixed), w.observe(flat), w.observe(flat)] == [None] * 5
    line = w.observe(flat)  # the third in a row
    assert line.startswith("the last 3 batches held no group whose rollouts got different rewards: every advantage "
                           "is 0 and each step trains on nothing (learner/pg_loss 0); generator.temperature=1e-06 is "
                           "too low"), line
    assert [w.observe(flat) for _ in range(49)][-1] is None and w.observe(flat).startswith("the last 53 batches")
    assert "too low" not in SignalWatch(temperature=1.0, steps=1).observe(flat)
