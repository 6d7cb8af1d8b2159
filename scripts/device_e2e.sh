#!/usr/bin/env bash
# The whole loop on one GPU in one device call (issue 43): Ray, the learner and a transformers-engine generator
# sharing the GPU (0.4 of it each), weight sync through Ray's object store, 20 steps of `exgrpo train`; then the
# mismatch probe and the GPU tests (tests/gpu, pytest -m gpu).
#
#   bash scripts/device_e2e.sh [--quick]
#   device tool: run(command="bash scripts/device_e2e.sh", carry=["device-carry"], timeout_s=540)
#
# The image has python3 with torch, transformers, pytest, ... (scripts/device_image.txt) but no ray, pydantic,
# jsonschema, math-verify or mlflow: `make device-carry` puts their wheels and the project's in device-carry/
# (carried with the call); they are pip-installed here with --no-index into a target folder first on PYTHONPATH.
# Without MLflow the run keeps its metric points in <run>/metrics-unsent.jsonl (the tracker's offline mode), which
# the report reads, and `exgrpo track --replay <run>` sends to a store later.
#
# GPU: a random Qwen2 with Qwen2.5-0.5B's layers (bench/device_e2e.py make-model) in bfloat16, buffer.max_lag=0 (the
# mismatch gates are for lag 0), 128 new tokens, 8 questions x 8 rollouts a step.
# --quick: the same on the CPU with the built-in tiny model, 4 steps, the probe on a tiny random Qwen2 in float32
# (tests/test_device_e2e.py runs it from a bare environment of the image's packages plus device-carry-py3.11).
#
# Environment: OUT (default runs-device-e2e/) gets device_e2e.json, device_e2e.log, pytest-gpu.log and the run
# folder's small files (run/); DEVICE_WORK (default /tmp/exgrpo-device-e2e) holds the model and the run folder; PYTHON
# (default python3); DEVICE_CARRY (default device-carry, or device-carry-pyX.Y for this python when it exists);
# DEVICE_SITE (default /tmp/exgrpo-device-site, kept on a warm machine: a second call skips the install);
# DEVICE_E2E_BUDGET_S (default 480; --quick 900): the GPU tests get what is left of it, the run at most 330 s (--quick
# 420).
# Exit code: 0 when every part passed, else the first failure's.
set -uo pipefail
cd "$(dirname "$0")/.."
{  # read whole before it runs: an edit of this file during a run cannot change the run
QUICK=0
if [ "${1:-}" = "--quick" ]; then QUICK=1; shift; fi
OUTDIR=${OUT:-runs-device-e2e}
mkdir -p "$OUTDIR"
OUTDIR=$(cd "$OUTDIR" && pwd)
PY=${PYTHON:-python3}
START=$(date +%s)
# the whole call: 8 minutes on the GPU (the device tool's limit per command is 10); --quick: 15 on a slow CPU
if [ $QUICK -eq 1 ]; then BUDGET=${DEVICE_E2E_BUDGET_S:-900}; else BUDGET=${DEVICE_E2E_BUDGET_S:-480}; fi
export PYTHONUNBUFFERED=1
exec > >(tee -a "$OUTDIR/device_e2e.log") 2>&1
say() { echo "device_e2e [$(( $(date +%s) - START )) s]: $*"; }
fail() { say "FAILED: $*"; exit "${2:-1}"; }

# 1. The carry: the wheels the image lacks, installed once per carry into DEVICE_SITE.
PYVER=$("$PY" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")') || fail "no $PY" 2
CARRY=${DEVICE_CARRY:-}
if [ -z "$CARRY" ]; then
    CARRY=device-carry
    [ "$PYVER" != "3.12" ] && [ -d "device-carry-py$PYVER" ] && CARRY=device-carry-py$PYVER
fi
ls "$CARRY"/wheels/*.whl >/dev/null 2>&1 || fail "$CARRY/wheels holds no wheels: run 'make device-carry' (PY=$PYVER)" \
    "and carry the folder with the call" 2
SITE=${DEVICE_SITE:-/tmp/exgrpo-device-site}
WANT=$(cat "$CARRY"/wheels/*.whl | sha256sum | cut -c1-16)-$PYVER
if [ "$(cat "$SITE/.carry" 2>/dev/null)" != "$WANT" ]; then
    rm -rf "$SITE"
    if "$PY" -m pip --version >/dev/null 2>&1; then
        "$PY" -m pip install -q --disable-pip-version-check --no-index --no-deps --no-compile --target "$SITE" \
            "$CARRY"/wheels/*.whl || fail "pip could not install $CARRY/wheels into $SITE" 2
    else  # no pip: a wheel is a zip of importable packages (no console scripts: exgrpo runs as python -m)
        for w in "$CARRY"/wheels/*.whl; do "$PY" -m zipfile -e "$w" "$SITE/" || fail "could not unpack $w" 2; done
        chmod +x "$SITE"/ray/core/src/ray/gcs/gcs_server "$SITE"/ray/core/src/ray/raylet/raylet  # zipfile drops modes
    fi
    echo "$WANT" > "$SITE/.carry"
    say "installed $(ls "$CARRY"/wheels/*.whl | wc -l) wheels of $CARRY into $SITE"
fi
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
export PATH="$SITE/bin:$PATH"
EXGRPO=(exgrpo)
[ -x "$SITE/bin/exgrpo" ] || EXGRPO=("$PY" -m cluster.cli)
# From $OUTDIR, not the repository: the project must come from the carry's wheel (so must Ray's workers, which get
# the driver's folder on their path).
(cd "$OUTDIR" && "$PY" - <<'EOF') || fail "the image with the carry cannot import what a run needs (above)" 2
import importlib.util, sys
import torch, transformers, ray, pydantic, jsonschema, math_verify, cluster.cli  # noqa: F401
where = cluster.cli.__file__
print(f"python {sys.version.split()[0]}, torch {torch.__version__} (CUDA {torch.cuda.is_available()}), "
      f"transformers {transformers.__version__}, ray {ray.__version__}, pydantic {pydantic.__version__}; "
      f"exgrpo from {where}")
print("mlflow: " + ("installed" if importlib.util.find_spec("mlflow") else
      "not installed: tracking is offline, every metric point goes to <run>/metrics-unsent.jsonl; "
      "`exgrpo track --replay <run>` sends them to a store later"))
EOF

# 2. The run.
NAME=device-e2e-$(date +%Y%m%d-%H%M%S)
# the model and the run folder (its final checkpoint: GBs at 0.5B) stay out of $OUT, which goes back from the device
WORK=${DEVICE_WORK:-/tmp/exgrpo-device-e2e}
mkdir -p "$WORK"
RUNS=$WORK/runs
COMMON=(name="$NAME" checkpoint.runs_root="$RUNS" checkpoint.every_steps=0 eval.final=false
        generator.engine.kind=transformers 'learner.weight_sync={kind: object_store}' buffer.max_lag=0)
if [ $QUICK -eq 1 ]; then
    STEPS=4
    DEVICE=cpu; DTYPE=float32
    "$PY" bench/device_e2e.py make-model "$WORK/probe-model" --size tiny || fail "could not build the probe model"
    PROBE_MODEL=$WORK/probe-model
    RUN=(total_steps=$STEPS)
    TRAIN_TIMEOUT=420  # the built-in model is built once (cached in ~/.cache/exgrpo): ~2 min the first time
else
    STEPS=20
    DEVICE=cuda; DTYPE=bfloat16
    nvidia-smi -L || fail "nvidia-smi sees no GPU (use --quick on a CPU)" 2
    "$PY" bench/device_e2e.py make-model "$WORK/model" --size 0.5B || fail "could not build the model"
    PROBE_MODEL=$WORK/model
    RUN=(total_steps=$STEPS model.path="$WORK/model" model.dtype=bfloat16
         generator.num_gpus=0.4 learner.num_gpus=0.4 generator.max_new_tokens=128
         buffer.batch_questions=8 buffer.group_size=8)
    TRAIN_TIMEOUT=330
fi
say "exgrpo train ${COMMON[*]} ${RUN[*]}"
(cd "$OUTDIR" && timeout -k 20 "$TRAIN_TIMEOUT" "${EXGRPO[@]}" train "${COMMON[@]}" "${RUN[@]}")
rc=$?
mkdir -p "$OUTDIR/run"  # its small files come back: metric points, state, profile, the driver's and Ray's logs
cp -r "$RUNS/$NAME"/{metrics-unsent.jsonl,state.json,profile.json,config.yaml,logs} "$OUTDIR/run/" 2>/dev/null
[ $rc -eq 124 ] && fail "exgrpo train ran past ${TRAIN_TIMEOUT} s" $rc
[ $rc -ne 0 ] && fail "exgrpo train exited $rc" $rc
say "exgrpo train finished"

# 3. The figures and the probe.
"$PY" bench/device_e2e.py report "$RUNS/$NAME" --model "$PROBE_MODEL" --out "$OUTDIR/device_e2e.json" \
    --device $DEVICE --dtype $DTYPE --min-steps $STEPS
rc=$?
[ $rc -ne 0 ] && fail "the report (above)" $rc

# 4. The tests only a GPU answers (skipped, and said so, without CUDA).
LEFT=$(( BUDGET - ($(date +%s) - START) ))
[ $LEFT -lt 30 ] && fail "no time left for pytest tests/gpu within DEVICE_E2E_BUDGET_S=$BUDGET s" 3
say "pytest tests/gpu -m gpu (at most $LEFT s)"
timeout -k 10 $LEFT "$PY" -m pytest tests/gpu -m gpu -q -p no:cacheprovider -rs > "$OUTDIR/pytest-gpu.log" 2>&1
rc=$?
tail -n 15 "$OUTDIR/pytest-gpu.log"
[ $rc -eq 124 ] && fail "pytest tests/gpu ran past the budget (DEVICE_E2E_BUDGET_S=$BUDGET s)" $rc
[ $rc -ne 0 ] && fail "pytest tests/gpu (the log: $OUTDIR/pytest-gpu.log)" $rc
say "passed; JSON and logs in $OUTDIR"
exit 0
}
