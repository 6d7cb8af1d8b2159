"""Every hang a user met, reproduced with `exgrpo train` as a user runs it: each now ends with a message
that says why and an exit code (cluster/liveness.py lists them). One short run each; two situations that
can share a run share it."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

from tests.cluster.runs import mlflow_client, read_log, run_train, state, train_process, wait_for

pytestmark = pytest.mark.slow

FNS = "tests.common.reward_fns"


@pytest.fixture(scope="module")
def runs_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("runs")


def _metrics(runs_root: Path, name: str) -> dict[str, float]:
    return mlflow_client(runs_root).get_run(state(runs_root / name)["mlflow_run_id"]).data.metrics


def test_stalls_say_why_and_stop_all_zero_rewards_and_a_reward_that_sleeps_side_by_side(runs_root, tmp_path, joined):
    """Two runs that each wait out a stall timeout, started side by side (a stall bound of 12 s, reported every 4 s:
    the smallest that still shows a report before the stop on a slow machine). Each has its own runs root: two
    processes never share one MLflow SQLite file.

    All-zero rewards. Before: zero-signal groups were dropped forever with no line and no metric.

    A reward that sleeps. Before: every call of the batch waited out its timeout in turn inside one `score`, the stall
    report said `reward errors 0`, and close waited for that batch to drain (generator.stop_timeout_s). Here the drain
    bound is an hour: the run still ends (exit 3) right after its checkpoint, because close abandons the reward call
    and returns the leases instead of draining."""
    stall = ("cluster.stall_report_s=4", "cluster.stall_timeout_s=12", *joined.overrides)
    with train_process(runs_root, "zero", f"reward.name={FNS}:zero", "buffer.drop_zero_signal=true", "total_steps=2",
                       *stall, env=joined.env) as zero, \
            train_process(tmp_path, "sleeps", f"reward.name={FNS}:sleeps", "total_steps=2", "reward.timeout_s=2",
                          "generator.stop_timeout_s=3600", *stall, env=joined.env) as sleeps:
        zero_rc, sleeps_rc = zero.wait(900), sleeps.wait(900)

    out = read_log(runs_root, "zero")
    assert zero_rc == 3, ("all-zero rewards", out[-4000:])
    assert "stalled: no learner step for" in out and "dropped so far: zero-signal" in out
    assert "every reward so far is 0" in out and f"reward.name={FNS}:zero" in out
    assert "a sample: question" in out and "scored 0" in out
    assert "stopping after cluster.stall_timeout_s=12s without progress" in out
    m = _metrics(runs_root, "zero")
    assert m["stall/seconds"] >= 4 and m["stall/zero_signal"] > 0 and m["stall/generators_running"] == 1
    assert state(runs_root / "zero")["checkpoints"], "a stalled run (all-zero rewards) writes a checkpoint before it stops"

    out = read_log(tmp_path, "sleeps")
    assert sleeps_rc == 3, ("a reward that sleeps", out[-4000:])
    assert "scoring holds the run: no learner step for" in out
    assert f"the reward function holds the run: reward.name={FNS}:sleeps has" in out
    assert "timed out after reward.timeout_s=2s" in out
    assert "the first reward call that timed out: a sample: question" in out
    assert "(reward error: timed out after 2 s)" in out
    assert "stopping after cluster.stall_timeout_s=12s without progress" in out
    assert "generators stopped: " in out and "abandoned the reward calls of" in out
    assert "Traceback" not in out
    m = _metrics(tmp_path, "sleeps")
    assert m["stall/reward_timeouts"] >= 1 and m["stall/reward_in_flight"] >= 1
    assert state(tmp_path / "sleeps")["checkpoints"], "a stalled run (a reward that sleeps) writes a checkpoint"


def test_more_generators_than_cpus_train_with_what_fits_until_every_question_is_retired(runs_root):
    """Two situations in one run. Before: the second generator waited for a CPU that never came, and the
    driver waited for it, silently. Then every question is solved in all K samples: the run stops at once."""
    data = runs_root / "tiny.jsonl"
    data.write_text("".join(json.dumps({"id": f"q{i}", "question": f"{i} {i + 1} -> {2 * i + 1}",
                                        "answer": str(2 * i + 1)}) + "\n" for i in range(16)))
    r = run_train(runs_root, "retired", f"reward.name={FNS}:one", f"data.train_path={data}", "total_steps=50",
                  "cluster.stall_timeout_s=0", "generator.num_generators=2", "cluster.num_cpus=2",
                  "cluster.stall_report_s=2")
    assert r.returncode == 3, r.stdout[-4000:]
    assert "generator.num_generators=2 needs 2 CPU + the learner 1 CPU = 3 CPU, the cluster has 2 CPU" in r.stdout
    assert "1 pending (each needs 1 CPU; the cluster has 0 CPU free)" in r.stdout
    assert "step 1/50" in r.stdout  # trained with the one generator that fit
    assert "every training question is retired (solved in all K samples): nothing left to train on (16 " \
           "questions)" in r.stdout
    assert _metrics(runs_root, "retired")["stall/retired"] == 16
    run_dir = runs_root / "retired"  # the embedded Ray's temp folder is gone, its actors' logs kept
    assert not Path((run_dir / "ray_temp_dir").read_text()).exists() and (run_dir / "logs" / "ray").is_dir()


def test_a_config_never_placed_is_refused_and_sigterm_during_start_stops_the_run(runs_root, tmp_path, joined):
    """Two runs that stop before training, started side by side (they only start up). A config that can never
    be placed is refused with what to change. SIGTERM during start stops the run; before, the handler only set
    a flag that the training loop, not yet running, would check. (The refused run has its own runs root: two
    processes never share one MLflow SQLite file.)"""
    with train_process(tmp_path, "one-cpu", "cluster.num_cpus=1", "total_steps=2") as refused, \
            train_process(runs_root, "term", "total_steps=100000", *joined.overrides, env=joined.env) as p:
        # the start (learner ranks import torch and load the model) takes seconds on any machine: a 50 ms
        # poll sends the signal inside it
        wait_for(lambda: "starting 1 buffer shard" in read_log(runs_root, "term") or p.poll() is not None, 300,
                 "the start of the components", poll_s=0.05)
        p.send_signal(signal.SIGTERM)
        rc = p.wait(120)
        refused_rc = refused.wait(300)
    out = read_log(tmp_path, "one-cpu")
    assert refused_rc == 2, out[-4000:]
    assert "this configuration can never be placed on the cluster: one generator (generator.num_cpus=1) and the " \
           "learner (learner.num_ranks=1 x learner.num_cpus=1) need 2 CPU; the cluster has 1 CPU: set " \
           "learner.num_cpus=0.5 and generator.num_cpus=0.5" in out
    assert "Traceback" not in out and "starting 1 buffer shard" not in out  # nothing was started
    assert not (tmp_path / "one-cpu").exists()  # the name stays free for the corrected command
    assert "name=one-cpu can be used again" in out
    log = read_log(runs_root, "term")
    assert rc == 0, log[-4000:]
    assert "SIGTERM during start: stopping now" in log and "Traceback" not in log


def test_a_reward_that_hangs_on_some_inputs_trains_on_with_timeouts_counted(runs_root, joined):
    r = run_train(runs_root, "sometimes", f"reward.name={FNS}:hangs_sometimes", "total_steps=3",
                  "reward.timeout_s=1", "reward.num_workers=2", "checkpoint.every_steps=0", *joined.overrides,
                  env=joined.env)
    assert r.returncode == 0, r.stdout[-4000:]
    assert "step 3/3" in r.stdout
    client = mlflow_client(runs_root)
    run_id = state(runs_root / "sometimes")["mlflow_run_id"]
    m = client.get_run(run_id).data.metrics
    assert m["generator/reward_timeouts"] > 0 and m["generator/reward_errors"] > 0
    fractions = [x.value for x in client.get_metric_history(run_id, "train/reward_error_fraction")]
    assert len(fractions) == 3 and all(0 < f < 0.5 for f in fractions), fractions


def test_reward_errors_past_max_error_fraction_stop_the_run(runs_root, joined):
    r = run_train(runs_root, "errors", f"reward.name={FNS}:raises", "total_steps=10", "reward.max_error_fraction=0.5",
                  *joined.overrides, env=joined.env)
    assert r.returncode == 1, r.stdout[-4000:]
    assert "were reward errors scored 0" in r.stdout and "above reward.max_error_fraction=0.5" in r.stdout
    assert "(reward error: raised RuntimeError: broken on" in r.stdout  # the error itself, with its sample
    assert "step 1/10" in r.stdout and "step 2/10" not in r.stdout
    assert state(runs_root / "errors")["checkpoints"]
