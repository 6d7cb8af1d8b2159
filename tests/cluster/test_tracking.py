"""The MLflow tracker against a real SQLite store, a server that is down, and a real server that stalls."""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request

from mlflow.tracking import MlflowClient

from cluster.tracking import Tracker, default_tracking_uri


def test_metrics_params_text_and_plots_reach_sqlite_store(tmp_path):
    uri = default_tracking_uri(tmp_path)
    tr = Tracker(uri, "exp-test", flush_every_s=0.2)
    run_id = tr.start("r1")
    assert run_id
    tr.log_params({"buffer.group_size": 8, "learner.lr": 1e-4})
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
    assert sum("reported once" in r.message for r in caplog.records) == 1


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_stalled_server_never_blocks_logging_and_gets_every_metric_when_it_answers_again(tmp_path, monkeypatch):
    """A real `mlflow server`, frozen with SIGSTOP after the run starts: its requests neither fail nor answer
    (each would wait for MLFLOW_HTTP_REQUEST_TIMEOUT, an hour here). Logging 200 steps meanwhile returns (it
    only appends to memory; the flush thread is the one that waits), and after SIGCONT every value reaches
    the store. No clock is read: a blocking `log_metrics` would hang for the hour, caught by the join."""
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "3600")
    port = _free_port()
    server = subprocess.Popen([sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port),
                               "--workers", "1", "--backend-store-uri", f"sqlite:///{tmp_path / 'srv.db'}",
                               "--default-artifact-root", str(tmp_path / "art")],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        uri = f"http://127.0.0.1:{port}"
        for _ in range(600):  # up to ~5 min on a slow machine; a healthy one answers in seconds
            try:
                urllib.request.urlopen(f"{uri}/health", timeout=5).read()
                break
            except OSError:
                assert server.poll() is None, "mlflow server exited"
                time.sleep(0.5)
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
        assert sorted(m.step for m in hist) == list(range(200)) and tr.dropped == 0
    finally:
        os.killpg(server.pid, signal.SIGCONT)
        os.killpg(server.pid, signal.SIGKILL)
        server.wait(60)
