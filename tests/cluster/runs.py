"""Helpers for end-to-end tests: run `exgrpo train` as a user would (a subprocess), read its MLflow run."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

from mlflow.tracking import MlflowClient

ROOT = Path(__file__).resolve().parents[2]


def train_cmd(runs_root: Path, name: str, *overrides: str, resume: Path | None = None) -> list[str]:
    cmd = [sys.executable, "-m", "cluster.cli", "train"]
    if resume is not None:
        return cmd + ["--resume", str(resume), *overrides]
    return cmd + [f"name={name}", f"checkpoint.runs_root={runs_root}", *overrides]


def start_train(runs_root: Path, name: str, *overrides: str, resume: Path | None = None,
                log_name: str = "train", env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start `exgrpo train` in its own process group (so that kill -9 hits the driver only); `env`: its
    environment (default: this process's)."""
    log = open(runs_root / f"{name}-{log_name}.log", "w")
    env = dict(os.environ if env is None else env, PYTHONUNBUFFERED="1")
    return subprocess.Popen(train_cmd(runs_root, name, *overrides, resume=resume), cwd=ROOT, stdout=log,
                            stderr=subprocess.STDOUT, env=env, start_new_session=True)


@contextmanager
def train_process(runs_root: Path, name: str, *overrides: str, env: dict[str, str] | None = None):
    """`start_train` whose process group is killed on leaving the block if it still runs (test failed)."""
    p = start_train(runs_root, name, *overrides, env=env)
    try:
        yield p
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)


def run_train(runs_root: Path, name: str, *overrides: str, timeout_s: float = 900,
              resume: Path | None = None, log_name: str = "train", env: dict[str, str] | None = None
              ) -> subprocess.CompletedProcess:
    p = start_train(runs_root, name, *overrides, resume=resume, log_name=log_name, env=env)
    try:
        rc = p.wait(timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        raise AssertionError(f"exgrpo train did not finish in {timeout_s}s; log:\n{read_log(runs_root, name, log_name)}")
    return subprocess.CompletedProcess(p.args, rc, read_log(runs_root, name, log_name), "")


def read_log(runs_root: Path, name: str, log_name: str = "train") -> str:
    p = runs_root / f"{name}-{log_name}.log"
    return p.read_text() if p.exists() else ""


def state(run_dir: Path) -> dict:
    p = run_dir / "state.json"
    return json.loads(p.read_text()) if p.exists() else {}


def or_exited(p: subprocess.Popen):
    """`or_exited(p)(pred)`: a wait_for predicate that also ends the wait when the run's process exited (the caller
    then asserts on its log instead of timing out)."""
    return lambda pred: (lambda: pred() or p.poll() is not None)


def wait_for(pred, timeout_s: float, what: str, poll_s: float = 1.0):
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        v = pred()
        if v:
            return v
        time.sleep(poll_s)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")


def mlflow_client(runs_root: Path) -> MlflowClient:
    return MlflowClient(tracking_uri=f"sqlite:///{runs_root.resolve() / 'mlflow.db'}")


def history(client: MlflowClient, run_id: str, key: str) -> list[tuple[int, float]]:
    return [(m.step, m.value) for m in client.get_metric_history(run_id, key)]


def accounting(metrics: dict[str, float]) -> dict[str, float]:
    return {k.removeprefix("accounting/"): v for k, v in metrics.items() if k.startswith("accounting/")}


def assert_balanced(acc: dict[str, float]) -> None:
    """issued = trained + stale_dropped + zero_signal + lost + outstanding + ready (buffer/core.py)."""
    rhs = acc["trained"] + acc["stale_dropped"] + acc["zero_signal"] + acc["lost"] + acc["outstanding"] + acc["ready"]
    assert acc["issued"] == rhs, f"accounting does not balance: {acc}"
    assert acc["lost"] == acc["expired"] + acc["returned"] + acc["rejected"], acc


class ClusterHelper:
    """A process of its own that holds a Ray cluster for tests (tests/cluster/cluster_nodes.py, shared_ray.py), driven
    over stdin: one command a line, answered by one line that starts with a word. It prints "address <host:port>"
    once its cluster runs."""

    def __init__(self, module: str, *args: str, env: dict[str, str] | None = None):
        self.proc = subprocess.Popen([sys.executable, "-m", module, *args], cwd=ROOT, env=env, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        self.address = self._answer("address", 300)

    def _answer(self, word: str, timeout_s: float) -> str:
        """The rest of the helper's next line, which must start with `word` (within `timeout_s`)."""
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout_s)
        line = self.proc.stdout.readline() if ready else ""
        assert line.startswith(word + " "), f"cluster helper: expected {word!r}, got {line!r} (rc {self.proc.poll()})"
        return line.split(maxsplit=1)[1].strip()

    def _ask(self, cmd: str, word: str, timeout_s: float = 300) -> str:
        self.proc.stdin.write(cmd + "\n")
        self.proc.stdin.flush()
        return self._answer(word, timeout_s)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.write("quit\n")
            self.proc.stdin.flush()
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                self.proc.kill()


@contextmanager
def mlflow_server(folder: Path, timeout_s: float = 300):
    """A real `mlflow server` on 127.0.0.1 with its SQLite store and artifacts in `folder`: yields (its URL with no
    trailing slash, its process); killed (resumed first, if a test stopped it) on leaving the block. AssertionError,
    saying why, when it exits or does not answer /health within `timeout_s`."""
    import urllib.request

    from tests.ports import port_for_a_server

    port = port_for_a_server()  # mlflow takes a port number, not a socket
    server = subprocess.Popen([sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port),
                               "--workers", "1", "--backend-store-uri", f"sqlite:///{folder / 'server.db'}",
                               "--artifacts-destination", str(folder / "server-artifacts")],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout_s  # a healthy machine answers in seconds
        while True:
            try:
                urllib.request.urlopen(f"{url}/health", timeout=5).read()
                break
            except OSError:
                assert server.poll() is None, f"mlflow server exited with {server.returncode} before answering"
                assert time.monotonic() < deadline, f"mlflow server at {url} did not answer /health in {timeout_s:.0f}s"
                time.sleep(0.5)
        yield url, server
    finally:
        os.killpg(server.pid, signal.SIGCONT)
        os.killpg(server.pid, signal.SIGKILL)
        server.wait(60)
