"""The MLflow tracker against a real SQLite store, a server that is down, and a real server that stalls."""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

from mlflow.tracking import MlflowClient

from cluster.tracking import LateStart, Tracker, default_tracking_uri
from tests.cluster.runs import mlflow_server


def test_metrics_params_text_and_plots_reach_sqlite_store(tmp_path):
    uri = default_tracking_uri(tmp_path)
    tr = Tracker(uri, "exp-test", flush_every_s=0.2)
    run_id = tr.start("r1")
    assert run_id
    tr.log_params({"buffer.group_size": 8, "learner.optim.lr": 1e-4})
    tr.log_text("a: 1\n", "config.yaml")
    for step in range(1, 6):
        tr.log_metrics({"train/reward_mean": step / 10, "buffer/bucket_3": step, "staleness/lag_0": 4.0,
                        "bad": float("nan"), "text": "x"}, step)
    paths = tr.log_plots(tmp_path / "plots")
    tr.finish()
    assert {p.name for p in paths} >= {"bucket_occupancy.png", "reward_accuracy.png", "staleness_hist.png"}
    client = MlflowClient(tracking_uri=uri)
    run = client.get_run(run_id)
    assert run.data.params["buffer.group_size"] == "8"
    hist = client.get_metric_history(run_id, "train/reward_mean")
    assert [m.step for m in hist] == [1, 2, 3, 4, 5]
    assert "bad" not in run.data.metrics and "text" not in run.data.metrics
    arts = {a.path for a in client.list_artifacts(run_id)} | {a.path for a in client.list_artifacts(run_id, "plots")}
    assert "config.yaml" in arts and "plots/bucket_occupancy.png" in arts
    assert run.info.status == "FINISHED"


def test_a_late_start_keeps_the_points_logged_before_it_opens_in_order(tmp_path):
    """The driver begins MLflow's start after the first learner update: the points logged before it opened reach
    the run, in order, with the later ones; `opened` runs once; a start never begun is begun by the first wait."""
    uri = default_tracking_uri(tmp_path)
    gate, opened = threading.Event(), []

    def start():
        gate.wait(60)  # the start is still going on while the first steps log
        tr = Tracker(uri, "exp-late", flush_every_s=0.2)
        tr.start("late")
        return tr

    late = LateStart(start, opened.append)
    late.log_metrics({"m": 1.0}, 1)  # not begun yet: kept
    late.begin()
    late.begin()  # idempotent
    late.log_metrics({"m": 2.0}, 2)  # begun, not open: kept
    gate.set()
    tracker = late()
    late.log_metrics({"m": 3.0}, 3)
    assert late() is tracker and opened == [tracker]
    tracker.finish()
    assert [(m.step, m.value) for m in MlflowClient(tracking_uri=uri).get_metric_history(tracker.run_id, "m")] == \
        [(1, 1.0), (2, 2.0), (3, 3.0)]
    never = LateStart(lambda: Tracker(uri, "exp-late", enabled=False))
    assert never().run_id is None  # called without begin: begun and waited for


def test_resume_reopens_the_same_run(tmp_path):
    uri = default_tracking_uri(tmp_path)
    tr = Tracker(uri, "exp-test")
    run_id = tr.start("r1")
    tr.log_metrics({"m": 1.0}, 1)
    tr.finish("KILLED")
    tr2 = Tracker(uri, "exp-test")
    assert tr2.start("r1", run_id=run_id) == run_id
    tr2.log_metrics({"m": 2.0}, 2)
    tr2.finish()
    hist = MlflowClient(tracking_uri=uri).get_metric_history(run_id, "m")
    assert [(m.step, m.value) for m in hist] == [(1, 1.0), (2, 2.0)]


def test_down_server_never_blocks_training_and_is_reported_once(monkeypatch, caplog):
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "1")
    tr = Tracker("http://127.0.0.1:9", "exp", flush_every_s=0.1)
    with caplog.at_level(logging.WARNING, logger="exgrpo.tracking"):
        assert tr.start("r") is None
        for step in range(200):
            tr.log_metrics({"a": float(step)}, step)
        tr.finish()
    assert len(tr.history["a"]) == 200  # kept locally for plots
    assert sum("could not start the MLflow run" in r.message for r in caplog.records) == 1
    assert len([r for r in caplog.records if r.levelno >= logging.WARNING]) == 1


def test_a_stalled_server_never_blocks_logging_and_gets_every_metric_when_it_answers_again(tmp_path, monkeypatch):
    """A real `mlflow server`, frozen with SIGSTOP after the run starts: its requests neither fail nor answer
    (each would wait for MLFLOW_HTTP_REQUEST_TIMEOUT, an hour here). Logging 200 steps meanwhile returns (it
    only appends to memory; the flush thread is the one that waits), and after SIGCONT every value reaches
    the store. No clock is read: a blocking `log_metrics` would hang for the hour, caught by the join."""
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "3600")
    with mlflow_server(tmp_path) as (uri, server):
        tr = Tracker(uri, "exp", flush_every_s=0.05)
        run_id = tr.start("stalled")
        assert run_id is not None
        os.killpg(server.pid, signal.SIGSTOP)
        logged = threading.Thread(target=lambda: [tr.log_metrics({"a": float(s)}, s) for s in range(200)])
        logged.start()
        logged.join(300)
        assert not logged.is_alive(), "log_metrics blocked on a stalled server"
        assert len(tr.history["a"]) == 200 and tr.pending > 0  # buffered: the server has not answered
        os.killpg(server.pid, signal.SIGCONT)
        tr.finish()
        hist = MlflowClient(tracking_uri=uri).get_metric_history(run_id, "a")
        assert sorted(m.step for m in hist) == list(range(200))
        assert tr.counts() == {"metrics_buffered": 0, "metrics_unsent": 0, "metrics_lost": 0}


_FULL_STORE_SCRIPT = """
import json, sys
from pathlib import Path
from cluster.console import setup_logging
from cluster.tracking import Tracker
from tests.small_fs import fill

store, run_dir = Path(sys.argv[1]), Path(sys.argv[2])
setup_logging(run_dir / "logs")
tr = Tracker(f"sqlite:///{store}/mlflow.db", "exp", flush_every_s=3600, max_buffered=500,
             unsent_path=run_dir / "metrics-unsent.jsonl")
print("RUN_ID", tr.start("full"), flush=True)
log = lambda steps: [tr.log_metrics({f"m{i}": float(s) for i in range(40)}, s) for s in steps]
filler = fill(store)
log(range(0, 20))                 # 800 points, 500 may wait in memory: the oldest 300 go to the unsent file
assert not tr.flush()             # the store is full: one warning
tr.flush_or_keep()                # a checkpoint: the 500 in memory go to the file too
counts = tr.counts()
filler.unlink()
log(range(20, 30))
assert tr.flush()                 # it takes writes again: one warning
fill(store)
log(range(30, 40))
tr.finish()                       # full again: the 400 left go to the file; the end line says 1200
print("COUNTS", json.dumps(counts), json.dumps(tr.counts()), flush=True)
"""


def test_a_full_store_keeps_tracebacks_off_the_console_and_replay_completes_the_history(tmp_path):
    """A SQLite store on a real 4 MB tmpfs that fills, recovers and fills again: the console shows one line when it
    starts failing, one when it recovers, and at the end how many points never reached it; MLflow's and
    SQLAlchemy's tracebacks are in logs/driver.log only. The points wait in the run folder's
    metrics-unsent.jsonl, and the replay puts them in the store: the history is complete."""
    from cluster.runtime import RunDir
    from cluster.tracking import UNSENT_FILE, count_unsent, replay
    from common.config import RunConfig
    from tests.small_fs import small_fs

    with small_fs(tmp_path / "store", 4) as store:
        cfg = RunConfig(name="full", checkpoint={"runs_root": str(tmp_path)},
                        tracking={"uri": f"sqlite:///{store}/mlflow.db", "experiment": "exp"})
        run_dir = RunDir.create(cfg)
        r = subprocess.run([sys.executable, "-c", _FULL_STORE_SCRIPT, str(store), str(run_dir.path)],
                           cwd=Path(__file__).resolve().parents[2], capture_output=True, text=True, timeout=600)
        console = r.stdout + r.stderr
        assert r.returncode == 0, console[-4000:]
        run_id = re.search(r"RUN_ID (\w+)", console)[1]
        at_checkpoint, at_end = (json.loads(x) for x in re.search(r"COUNTS (\{.*?\}) (\{.*?\})", console).groups())
        assert at_checkpoint == {"metrics_buffered": 0, "metrics_unsent": 800, "metrics_lost": 0}
        assert at_end == {"metrics_buffered": 0, "metrics_unsent": 1200, "metrics_lost": 0}
        lines = [ln for ln in console.splitlines() if not ln.startswith(("RUN_ID", "COUNTS"))]
        assert "Traceback" not in console and "sqlalchemy" not in console.lower(), console[-3000:]
        assert sum("stopped taking writes" in ln for ln in lines) == 2, lines
        assert sum("takes writes again" in ln for ln in lines) == 1, lines
        assert any(f"1200 metric points never reached the store" in ln and "exgrpo track --replay" in ln
                   for ln in lines), lines
        assert len(lines) == 4, lines  # nothing else reached the console
        driver_log = (run_dir.path / "logs" / "driver.log").read_text()
        assert "Traceback" in driver_log and "database or disk is full" in driver_log
        assert count_unsent(run_dir.path / UNSENT_FILE) == 1200

        (store / "filler").unlink()
        client = MlflowClient(tracking_uri=cfg.tracking.uri)
        # what `exgrpo track --replay RUN` does (the command itself: tests/cluster/test_disk_faults_e2e.py)
        assert replay(client, run_id, run_dir.path / UNSENT_FILE) == 1200
        assert not (run_dir.path / UNSENT_FILE).exists()
        for key in ("m0", "m39"):
            assert sorted(m.step for m in client.get_metric_history(run_id, key)) == list(range(40))


def test_offline_run_keeps_every_point_and_the_replay_opens_its_mlflow_run(tmp_path, monkeypatch, caplog):
    """A run whose MLflow run cannot be opened (MLflow missing, as on the lent GPU machines, or its store down at
    the start: a closed port here) keeps every metric point in metrics-unsent.jsonl; `exgrpo track --replay RUN`
    later opens the run in a store (name, parameters, end status) and sends them all; state.json then names it."""
    from cluster.runtime import RunDir
    from cluster.tracking import UNSENT_FILE, count_unsent, replay_main
    from common.config import RunConfig

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "1")
    cfg = RunConfig(name="offline", checkpoint={"runs_root": str(tmp_path)}, tracking={"experiment": "exp"})
    run_dir = RunDir.create(cfg)
    tr = Tracker("http://127.0.0.1:9", "exp", flush_every_s=0.1, unsent_path=run_dir.path / UNSENT_FILE)
    with caplog.at_level(logging.WARNING, logger="exgrpo.tracking"):
        assert tr.start("offline") is None and tr.offline
        for step in range(1, 31):
            tr.log_metrics({"a": float(step), "b": 2.0 * step}, step)
        tr.flush_or_keep()  # a checkpoint: 60 points in the file
        assert count_unsent(run_dir.path / UNSENT_FILE) == 60
        tr.log_metrics({"a": 31.0}, 31)
        tr.finish()
    assert tr.counts() == {"metrics_buffered": 0, "metrics_unsent": 61, "metrics_lost": 0}
    assert any("exgrpo track --replay" in r.message and "61 metric points" in r.message for r in caplog.records)
    run_dir.update_state(status="FINISHED", step=31)

    assert replay_main(str(run_dir.path)) == 0  # the config's store: sqlite in the runs root
    run_id = run_dir.read_state()["mlflow_run_id"]
    client = MlflowClient(tracking_uri=default_tracking_uri(tmp_path))
    run = client.get_run(run_id)
    assert run.info.run_name == run_dir.name and run.info.status == "FINISHED"
    assert run.data.params["name"] == "offline"
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "a")] == [(s, float(s)) for s in range(1, 32)]
    assert not (run_dir.path / UNSENT_FILE).exists()


def test_an_offline_run_goes_online_when_its_store_answers_and_sends_what_it_kept(tmp_path, caplog):
    """A store that does not answer at the start (a file where its SQLite folder goes, here) puts the run offline; its
    MLflow run is tried again every tracking.retry_open_s, and once the store answers: the run is opened with its
    parameters, config and prompt, the points kept in metrics-unsent.jsonl are sent, the next ones follow, and
    state.json names the run (as `exgrpo train` wires it: cluster.run._start_tracking)."""
    import time

    from cluster.run import PROMPT_FILE, _start_tracking
    from cluster.runtime import RunDir
    from cluster.tracking import UNSENT_FILE, count_unsent
    from common.config import RunConfig
    from cluster.state import DriverState

    (tmp_path / "store").write_text("in the way")
    uri = f"sqlite:///{tmp_path}/store/mlflow.db"
    cfg = RunConfig(name="later", checkpoint={"runs_root": str(tmp_path / "runs")},
                    tracking={"uri": uri, "experiment": "exp", "retry_open_s": 0.3})
    run_dir = RunDir.create(cfg)
    (run_dir.path / PROMPT_FILE).write_text("<s>8 7>56=\n")
    state = DriverState()
    with caplog.at_level(logging.WARNING, logger="exgrpo.tracking"):
        tracker = _start_tracking(cfg, run_dir, state, uri)
        assert tracker.offline and state.mlflow_run_id is None
        assert any("it is tried again every 0.3 s" in r.message for r in caplog.records)
        for step in range(1, 11):
            tracker.log_metrics({"a": float(step)}, step)
        tracker.flush_or_keep()  # a checkpoint while offline: the points wait in the run folder
        assert count_unsent(run_dir.path / UNSENT_FILE) == 10
        (tmp_path / "store").unlink()  # the store answers from now on
        deadline = time.monotonic() + 120
        while tracker.offline and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not tracker.offline, "the MLflow run was not opened within 120 s of the store answering"
        for step in range(11, 16):
            tracker.log_metrics({"a": float(step)}, step)
        tracker.finish()
    run_id = run_dir.read_state()["mlflow_run_id"]
    assert run_id == state.mlflow_run_id == tracker.run_id and run_id is not None
    assert any("answers now" in r.message and "10 metric points" in r.message for r in caplog.records)
    client = MlflowClient(tracking_uri=uri)
    run = client.get_run(run_id)
    assert run.info.run_name == run_dir.name and run.info.status == "FINISHED" and run.data.params["name"] == "later"
    assert {a.path for a in client.list_artifacts(run_id)} >= {"config.yaml", PROMPT_FILE}
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "a")] == [(s, float(s)) for s in range(1, 16)]
    assert not (run_dir.path / UNSENT_FILE).exists() and tracker.counts()["metrics_unsent"] == 0


_SECRET_SCRIPT = """
import logging, os, sys
from pathlib import Path
from cluster.console import setup_logging
from cluster.tracking import Tracker

run_dir = Path(sys.argv[1])
setup_logging(run_dir / "logs")
tr = Tracker("http://alice:PASSWORD@127.0.0.1:9/", "exp", unsent_path=run_dir / "metrics-unsent.jsonl")
print("MLFLOW", tr.uri, os.environ["MLFLOW_TRACKING_USERNAME"], os.environ["MLFLOW_TRACKING_PASSWORD"] == "PASSWORD")
tr.start("r")  # the server is down: warnings that name the store
tr.log_metrics({"a": 1.0}, 1)
tr.finish()
try:
    raise ConnectionError("could not connect to postgresql+psycopg2://u:PASSWORD@db/x")
except ConnectionError:
    logging.getLogger("sqlalchemy.pool").exception("connecting to %s", "https://u:PASSWORD@h/?token=PASSWORD")
logging.getLogger("exgrpo").error("store %s", "redis://:PASSWORD@h:6379/0")
"""


def test_a_store_password_reaches_mlflow_in_this_process_only(tmp_path):
    """An http(s) store's user and password go to MLFLOW_TRACKING_USERNAME / _PASSWORD of the process (MLflow's own
    URL has none); the tracker's warnings, and any line of ours or a library's (its traceback too), show them
    redacted on the console and in logs/driver.log."""
    r = subprocess.run([sys.executable, "-c", _SECRET_SCRIPT, str(tmp_path)], cwd=Path(__file__).resolve().parents[2],
                       capture_output=True, text=True, timeout=300,
                       env={**os.environ, "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "2"})
    console = r.stdout + r.stderr
    assert r.returncode == 0, console[-3000:]
    assert "MLFLOW http://127.0.0.1:9/ alice True" in console
    assert "could not start the MLflow run at http://alice:***@127.0.0.1:9/" in console
    assert "redis://:***@h:6379/0" in console
    driver_log = (tmp_path / "logs" / "driver.log").read_text()
    assert "Traceback" in driver_log and "postgresql+psycopg2://u:***@db/x" in driver_log
    assert "https://u:***@h/?token=***" in driver_log
    assert "PASSWORD" not in console + driver_log
