"""Shared fixtures: one real local Ray cluster per test module, tiny model folders, quiet vLLM."""

from __future__ import annotations

import contextlib
import gc
import os
import shutil
import sys
import tempfile
import warnings
from pathlib import Path

import pytest

# vLLM inside Ray actors on a shared 2-core machine: no engine subprocess, one thread, small KV cache.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")


@contextlib.contextmanager
def ray_auth_of_this_process():
    """RAY_AUTH_MODE set, while a cluster starts from this process, to the mode this process's Ray loaded when it was
    imported (Ray reads it once): its GCS and raylet, started as subprocesses, read it from the environment, and an
    in-process `exgrpo` command of an earlier test may have set it (cluster.auth) after Ray was imported. Under
    `make test`'s two workers the modules' order differs, and a mismatch failed every ray.init ("InvalidAuthToken")."""
    from ray._raylet import AuthenticationMode, get_authentication_mode

    before = os.environ.get("RAY_AUTH_MODE")
    os.environ["RAY_AUTH_MODE"] = "token" if get_authentication_mode() == AuthenticationMode.TOKEN else "disabled"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("RAY_AUTH_MODE", None)
        else:
            os.environ["RAY_AUTH_MODE"] = before


@pytest.fixture(autouse=True)
def _ray_auth_mode_put_back():
    """An in-process `exgrpo` command sets RAY_AUTH_MODE for the cluster it joins (cluster.auth): put back after the
    test, so that it does not reach the next tests' clusters and subprocesses."""
    before = os.environ.get("RAY_AUTH_MODE")
    yield
    if before is None:
        os.environ.pop("RAY_AUTH_MODE", None)
    else:
        os.environ["RAY_AUTH_MODE"] = before


@pytest.fixture(scope="module")
def ray_cluster():
    """A private local Ray cluster for this module (never attaches to another cluster)."""
    import ray

    tmp = tempfile.mkdtemp(prefix="exgrpo-ray-", dir="/tmp")
    with ray_auth_of_this_process():
        _init_local_ray(ray, tmp)
    try:
        yield ray
    finally:
        ray.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)  # test clusters do not pile up in /tmp


def _init_local_ray(ray, tmp: str) -> None:
    ray.init(
        address="local",
        num_cpus=4,
        _temp_dir=tmp,
        include_dashboard=False,
        namespace="exgrpo-test",
        log_to_driver=False,
        runtime_env={"env_vars": {"OMP_NUM_THREADS": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                                  "VLLM_CPU_KVCACHE_SPACE": "1", "TOKENIZERS_PARALLELISM": "false"}},
    )


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """An untrained tiny Llama + char tokenizer folder (vLLM-compatible head size)."""
    from common.modeling import make_tiny_model_folder

    return make_tiny_model_folder(tmp_path_factory.mktemp("tiny-model") / "model")


def vllm_available() -> bool:
    try:
        import vllm  # noqa: F401
    except Exception:
        return False
    return True


requires_vllm = pytest.mark.skipif(not vllm_available(), reason="vllm is not importable on this machine")


def _torch_thread_leaks() -> list[str]:
    """What a test left wrong in the main thread's torch state, for the next test (none before torch is imported)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return []
    excluded = torch._C._dispatch_tls_local_exclude_set()
    keys = torch._C.DispatchKey
    layers = torch._C._functorch.get_dynamic_layer_stack_depth()  # vmap/grad levels of a transform never exited
    return ([f"dispatch key {k.name} excluded" for k in (keys.Python, keys.PythonTLSSnapshot) if excluded.has(k)]
            + ([] if torch.is_grad_enabled() else ["grad mode off"])
            + ([f"{layers} functorch transform level(s) still entered"] if layers else []))


@pytest.fixture(autouse=True, scope="module")
def _collect_vllms_garbage_after_its_module(request):
    """The garbage of a module that runs vLLM in this process is collected when the module ends (after its
    fixtures), not at whatever allocation triggers Python's GC later. vLLM's CPU engine leaves objects in reference
    cycles whose `__del__` calls `tensor.item()` (CPUDNNLGEMMHandler); collected inside a later module's
    torch.compile trace, that call ran under the trace's fake tensors, raised, and left the main thread's dispatch
    state broken: 9 of test_trial's 14 tests failed with "element 0 of tensors does not require grad" after
    tests/learner/test_lora.py's vLLM test (.ci/run, 2026-11-29; not reproduced alone: it depends on when the GC
    runs). A full collection costs ~0.2 s once vLLM is imported, so only those modules pay it."""
    yield
    if "vllm" in Path(request.module.__file__).read_text():
        gc.collect()


@pytest.fixture(autouse=True)
def _restore_torch_thread_state(request):
    """After each test, the main thread's torch state is put back where the next test expects it, with a warning
    naming the test that left it (in the summary). The suite runs ~870 tests in one process; CI once saw every
    torch.compile after one point fail with "you set no_dispatch() before calling into this function" and eager
    backwards with "does not require grad": the thread was left inside meta_utils' `no_grad(), no_dispatch()` (a
    torch guard restored out of order; not reproduced here), and 10 tests far from the cause failed."""
    yield
    leaks = _torch_thread_leaks()
    if leaks:
        import torch

        if torch._C._functorch.get_dynamic_layer_stack_depth():
            torch._C._functorch.pop_dynamic_layer_stack_and_undo_to_depth(0)
        for key in (torch._C.DispatchKey.Python, torch._C.DispatchKey.PythonTLSSnapshot):
            torch._C._dispatch_tls_set_dispatch_key_excluded(key, False)
        torch.set_grad_enabled(True)
        warnings.warn(f"{request.node.nodeid} left torch's main thread with {', '.join(leaks)}: put back",
                      stacklevel=1)


_TIMES = os.environ.get("EXGRPO_TEST_TIMES")
"""A file that gets one line per test phase as it ends ("seconds phase nodeid"): the suite's timings as it goes,
also from a run stopped before its end (pytest's --durations prints them only at the end)."""


def pytest_runtest_logreport(report) -> None:
    if _TIMES and not os.environ.get("PYTEST_XDIST_WORKER"):  # under xdist the controller writes every report once
        with open(_TIMES, "a") as f:
            f.write(f"{report.duration:.2f} {report.when} {report.nodeid} {report.outcome}\n")


SLOWEST_FIRST = (  # the files that take longest (a run's EXGRPO_TEST_TIMES, under two workers), heaviest first
    "actors/test_generator_ray.py", "cluster/test_liveness_e2e.py", "cluster/test_train_e2e.py", "learner/test_pool.py",
    "cluster/test_bad_input.py", "cluster/test_cluster_nodes.py", "cluster/test_chaos.py", "learner/test_trial.py",
    "cluster/test_real_shapes_e2e.py", "cluster/test_disk_faults_e2e.py", "cluster/test_cluster_autoscaler.py",
    "cluster/test_lora_e2e.py", "learner/test_collective.py", "cluster/test_losses_e2e.py", "learner/test_levers.py",
    "cluster/test_input_checks.py", "cluster/test_resume_e2e.py", "actors/test_generator_vllm.py",
    "cluster/test_experiment.py", "test_device_e2e.py", "test_gpu_bench.py", "learner/test_lora.py",
    "learner/test_real_shapes.py", "learner/test_lora_publication.py", "learner/test_token_stats.py",
    "actors/test_adapters.py", "cluster/test_stale_e2e.py", "cluster/test_think_arith_e2e.py",
)


def pytest_collection_modifyitems(config, items) -> None:
    """Under `make test`'s workers (pytest-xdist, whole files each, in this order: `--no-loadscope-reorder`), the
    slowest files are handed out first, so that no worker is left with a long one at the end while the other idles.
    One process keeps the usual order."""
    if not (config.getoption("numprocesses", None) or os.environ.get("PYTEST_XDIST_WORKER")):
        return
    rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}

    def key(item) -> int:
        path = Path(str(item.fspath)).resolve().relative_to(Path(__file__).resolve().parent).as_posix()
        return rank.get(path, len(rank))

    items.sort(key=key)  # stable: the files' own order, and their tests' order, otherwise kept
