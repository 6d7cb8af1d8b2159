#!/usr/bin/env bash
# ExGRPO itself on one GPU in one device call (issues 43, 50, 73): the carry's install, a learning run that replays,
# a learning run at real width whose learner compiles, the mismatch probe at 0.5B's width and the GPU tests, each
# part with its own time budget, then a one-screen summary with the gates judged, printed whatever happened to the
# parts (partial results come back).
#
#   bash scripts/device_e2e.sh [--quick]
#   on the host first: make device-carry && .venv/bin/python bench/device_e2e.py carry-model device-carry
#   device tool: run(command="bash scripts/device_e2e.sh", carry=["device-carry"], timeout_s=300)
#
# The parts (budget at the default DEVICE_E2E_BUDGET_S=285, within 300 s of device time with the real-width run; the
# learning run's budget went from 130 to 90 s for it (it took 47 s on the H100); --quick: 900 on a slow CPU):
# 1. the carry (60 s): the image has python3 with torch, transformers, pytest, ... (scripts/device_image.txt) but no
#    ray, pydantic, jsonschema, math-verify or mlflow: `make device-carry` puts their wheels and the project's in
#    device-carry/ (carried with the call), pip-installed here with --no-index into DEVICE_SITE, first on PYTHONPATH.
#    Without MLflow a run keeps its metric points in <run>/metrics-unsent.jsonl (the tracker's offline mode), which
#    the summary reads.
# 2. the learning run (90 s; --quick 480): `exgrpo train` of the built-in countdown model (common/toy_model.py; it
#    solves about a third of the questions from the start) on the GPU, learner and a transformers-engine generator
#    sharing it (0.4 each), weights through Ray's object store, up to 30 steps (--quick 8) at the defaults: mixed
#    mode switches on and stored trajectories are replayed. The model comes from device-carry/models
#    (`bench/device_e2e.py carry-model`), else it is built here first (minutes, outside the budgets). SIGTERM at
#    the budget: the run finishes its step and stops; the summary judges what it logged. DEVICE_E2E_TRAIN_ARGS:
#    more key=value overrides (of both learning runs).
# 3. the real-width run (90 s; --quick 300): the same at 512 wide (DEVICE_E2E_WIDE_HIDDEN), 12 steps (--quick 4),
#    with `learner.levers.compile=true` (96 wide, the run above stays eager). Its model is the built-in one widened
#    (`bench/device_e2e.py widen-model`, seconds, on the CPU while the learning run runs: the small model in the
#    corner of each wider matrix, the rest small noise, so it answers as the built-in model does and replays).
#    Inductor's cache is `learner.levers.compile_cache_dir` = DEVICE_WORK/inductor-cache, made fresh each call from
#    the carry's compile-cache/real-width-inductor.tar.gz where there is one (else cold), and saved after the run
#    into OUT/compile-cache/ (at most 8 MiB gzip'd). Gates on the GPU: compile on (inductor, graphs compiled by the
#    setup's trial), replayed rows > 0, the first update <= 60 s after `exgrpo train` started cold (<= 30 s from a
#    carried cache), 0 recompiles after its first step (`learner/recompiles`). --quick compiles with aot_eager
#    (DEVICE_E2E_WIDE_BACKEND): dynamo and AOTAutograd trace the layers and recompiles are counted, but inductor
#    generates no kernels (on 2 CPU cores its cold compile alone took 73 s) and no cache is saved; the summary says
#    so. DEVICE_E2E_WIDE_BACKEND=inductor runs inductor on a CPU too (it needs a C++ compiler).
# 4. the mismatch probe (60 s; --quick 240): a random Qwen2 with Qwen2.5-0.5B's layers in bfloat16 (--quick: a tiny
#    one in float32 on the CPU), made on the CPU while the learning run runs; the engine samples, the learner's
#    forward scores (bench/device_e2e.py probe): NeMo-RL's gates, and tokens/s at that width.
# 5. tests/gpu (pytest -m gpu; skipped, and said so, without CUDA), beside the probe (neither judges time): what is
#    left of the budget, 8 s kept for 6 (about 140 s if the parts above take their H100 times and the real-width run
#    ~75 s; tests/gpu took 134 s cold on the H100, less from the carried tests-gpu.bin: it may be cut short cold).
# 6. the summary (bench/device_e2e.py summary): parts, figures, gates; OUT/device_e2e.json.
#
# Environment: OUT (default runs-device-e2e/) gets device_e2e.json, device_e2e.log, parts.tsv, probe.json, probe.log,
# pytest-gpu.log, the run folders' small files (run/, wide-run/) and the inductor artifacts (compile-cache/: the
# real-width run's real-width-inductor.tar.gz and tests/gpu's tests-gpu.bin; the last lease's load from the carry's
# compile-cache/, or DEVICE_E2E_COMPILE_CACHE). With OUT set (the device tool sets it), the summary packs OUT
# into what one call brings back (scripts/device_out.py: the first three as they are, results.tar.gz,
# compile-cache.tar); here `python3 scripts/device_out.py unpack <files_at> runs-device-e2e/lease --cache-to
# device-carry/compile-cache` undoes it and puts the artifacts where the next call carries them; DEVICE_WORK
# (default /tmp/exgrpo-device-e2e) holds the models, the run folders and the real-width run's inductor cache; PYTHON
# (default python3); DEVICE_CARRY (default device-carry, or device-carry-pyX.Y for this python when it exists);
# DEVICE_SITE (default /tmp/exgrpo-device-site, kept on a warm machine: a second call skips the install);
# DEVICE_E2E_BUDGET_S (the whole check); DEVICE_E2E_STEPS, DEVICE_E2E_WIDE_STEPS (the learning runs' steps);
# DEVICE_E2E_LEARN_S, DEVICE_E2E_WIDE_S, DEVICE_E2E_PROBE_S (those parts' budgets).
# Exit code: 0 when every gate judged passed, 1 when one failed, 2 when the carry cannot be installed or imported.
set -uo pipefail
cd "$(dirname "$0")/.."
{  # read whole before it runs: an edit of this file during a run cannot change the run
QUICK=0
if [ "${1:-}" = "--quick" ]; then QUICK=1; shift; fi
OUTDIR=${OUT:-runs-device-e2e}
mkdir -p "$OUTDIR"
OUTDIR=$(cd "$OUTDIR" && pwd)
rm -f "$OUTDIR"/{parts.tsv,probe.json,probe.log,pytest-gpu.log,device_e2e.json,make-model.*,widen-model.*} \
    "$OUTDIR"/real-width-cache-{in,out}.json
PY=${PYTHON:-python3}
case $PY in */*) PY=$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY") ;; esac  # parts run from $OUT too
START=$(date +%s.%N)
if [ $QUICK -eq 1 ]; then
    BUDGET=${DEVICE_E2E_BUDGET_S:-900}; STEPS=${DEVICE_E2E_STEPS:-8}; LEARN_S=480; PROBE_S=240
    WIDE_STEPS=${DEVICE_E2E_WIDE_STEPS:-4}; WIDE_S=300; WIDE_BACKEND=${DEVICE_E2E_WIDE_BACKEND:-aot_eager}
else
    BUDGET=${DEVICE_E2E_BUDGET_S:-285}; STEPS=${DEVICE_E2E_STEPS:-30}; LEARN_S=90; PROBE_S=60
    WIDE_STEPS=${DEVICE_E2E_WIDE_STEPS:-12}; WIDE_S=90; WIDE_BACKEND=${DEVICE_E2E_WIDE_BACKEND:-inductor}
fi
LEARN_S=${DEVICE_E2E_LEARN_S:-$LEARN_S}; PROBE_S=${DEVICE_E2E_PROBE_S:-$PROBE_S}; WIDE_S=${DEVICE_E2E_WIDE_S:-$WIDE_S}
WIDE_HIDDEN=${DEVICE_E2E_WIDE_HIDDEN:-512}
export PYTHONUNBUFFERED=1
exec > >(tee -a "$OUTDIR/device_e2e.log") 2>&1
elapsed() { awk -v a="$START" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }'; }
say() { echo "device_e2e [$(elapsed) s]: $*"; }
left() { awk -v a="$START" -v b="$(date +%s.%N)" -v t="$BUDGET" 'BEGIN { printf "%d", t - (b - a) }'; }
# part NAME BUDGET_S NOTE LOG COMMAND...: run it under its budget (SIGTERM, then SIGKILL 15 s later; a shell
# function runs unbounded), its output into LOG (-: this log), and record it in parts.tsv
part() {
    local name=$1 budget=$2 note=$3 log=$4 t0 rc
    shift 4
    t0=$(date +%s.%N)
    say "$name (at most $budget s): $*"
    if declare -F "$1" >/dev/null; then "$@"
    elif [ "$log" = - ]; then timeout -k 15 "$budget" "$@"
    else timeout -k 15 "$budget" "$@" > "$log" 2>&1
    fi
    rc=$?
    printf '%s\t%d\t%s\t%d\t%s\n' "$name" "$rc" "$(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')" \
        "$budget" "$note" >> "$OUTDIR/parts.tsv"
    [ $rc -eq 124 ] && say "$name: ran out of its $budget s" || say "$name: exit code $rc"
    return $rc
}
RUN_DIR=
WIDE_DIR=
DEVICE_WORDS=cpu
SUMMARY_DONE=0
summary() {  # once, whatever happened: the parts, the figures, the gates
    [ $SUMMARY_DONE -eq 1 ] && return
    SUMMARY_DONE=1
    "$PY" bench/device_e2e.py summary "$OUTDIR" ${RUN_DIR:+--run "$RUN_DIR"} ${WIDE_DIR:+--wide-run "$WIDE_DIR"} \
        --budget-s "$BUDGET" \
        --whole-s "$(elapsed)" --device "$DEVICE_WORDS" $([ $QUICK -eq 1 ] && echo --quick)
    local rc=$?
    # on the device: leave in $OUT only what one call brings back (8 files, 16 MiB each, 64 MiB); the cache within
    # what the next call carries beside device-carry's ~45 MB (the real-width run's archive, at most 8 MiB, always
    # goes in; tests/gpu's artifacts while they fit). Here: python3 scripts/device_out.py unpack <files_at>
    # runs-device-e2e/lease --cache-to device-carry/compile-cache
    [ -n "${OUT:-}" ] && "$PY" scripts/device_out.py pack "$OUTDIR" --keep device_e2e.json device_e2e.log parts.tsv \
        --cache "$OUTDIR/compile-cache" --carry-room-mib 12
    return $rc
}
trap 'summary; exit 130' INT TERM

# 1. The carry: the wheels the image lacks, installed once per carry into DEVICE_SITE.
PYVER=$("$PY" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")') || { say "FAILED: no $PY"; exit 2; }
CARRY=${DEVICE_CARRY:-}
if [ -z "$CARRY" ]; then
    CARRY=device-carry
    [ "$PYVER" != "3.12" ] && [ -d "device-carry-py$PYVER" ] && CARRY=device-carry-py$PYVER
fi
SITE=${DEVICE_SITE:-/tmp/exgrpo-device-site}
install_carry() {
    ls "$CARRY"/wheels/*.whl >/dev/null 2>&1 || { echo "$CARRY/wheels holds no wheels: run 'make device-carry'" \
        "(PY=$PYVER) and carry the folder with the call"; return 2; }
    local want
    want=$(cat "$CARRY"/wheels/*.whl | sha256sum | cut -c1-16)-$PYVER
    if [ "$(cat "$SITE/.carry" 2>/dev/null)" != "$want" ]; then
        rm -rf "$SITE"
        if "$PY" -m pip --version >/dev/null 2>&1; then
            "$PY" -m pip install -q --disable-pip-version-check --no-index --no-deps --no-compile --target "$SITE" \
                "$CARRY"/wheels/*.whl || { echo "pip could not install $CARRY/wheels into $SITE"; return 2; }
        else  # no pip: a wheel is a zip of importable packages (no console scripts: exgrpo runs as python -m)
            for w in "$CARRY"/wheels/*.whl; do "$PY" -m zipfile -e "$w" "$SITE/" || return 2; done
            chmod +x "$SITE"/ray/core/src/ray/gcs/gcs_server "$SITE"/ray/core/src/ray/raylet/raylet  # zipfile drops modes
        fi
        echo "$want" > "$SITE/.carry"
        echo "installed $(ls "$CARRY"/wheels/*.whl | wc -l) wheels of $CARRY into $SITE"
    fi
    # From $OUTDIR, not the repository: the project must come from the carry's wheel (so must Ray's workers, which
    # get the driver's folder on their path).
    (cd "$OUTDIR" && PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}" "$PY" - <<'EOF')
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
}
if ! part "carry install" 60 "$CARRY into $SITE" - install_carry; then
    say "FAILED: the image with the carry cannot run the check (above)"
    summary
    exit 2
fi
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
export PATH="$SITE/bin:$PATH"
EXGRPO=(exgrpo)
[ -x "$SITE/bin/exgrpo" ] || EXGRPO=("$PY" -m cluster.cli)

# 2. The learning run (and, beside it, the probe's model).
NAME=device-e2e-$(date +%Y%m%d-%H%M%S)
# the model and the run folder stay out of $OUT, which goes back from the device
WORK=${DEVICE_WORK:-/tmp/exgrpo-device-e2e}
mkdir -p "$WORK"
RUNS=$WORK/runs
RUN_DIR=$RUNS/$NAME
MODELS=()  # the built-in model: the carry's copy, else the default cache (built there once)
ls -d "$CARRY"/models/toy-countdown-* >/dev/null 2>&1 && MODELS=(model.cache_dir="$(cd "$CARRY/models" && pwd)")
LEARN=(name="$NAME" checkpoint.runs_root="$RUNS" checkpoint.every_steps=0 eval.final=false total_steps="$STEPS"
       generator.engine.kind=transformers 'learner.weight_sync={kind: object_store}' "${MODELS[@]}")
read -r -a EXTRA <<< "${DEVICE_E2E_TRAIN_ARGS:-}"  # more key=value overrides of the learning run
if [ $QUICK -eq 1 ]; then
    DEVICE=cpu; DTYPE=float32; SIZE=tiny
else
    DEVICE=cuda; DTYPE=bfloat16; SIZE=0.5B
    DEVICE_WORDS=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1)
    [ -n "$DEVICE_WORDS" ] || say "nvidia-smi sees no GPU (use --quick on a CPU); the GPU parts will fail"
    DEVICE_WORDS="cuda (${DEVICE_WORDS:-no GPU})"
    LEARN+=(generator.num_gpus=0.4 learner.num_gpus=0.4)
fi
WIDE_NAME=${NAME/device-e2e-/device-e2e-wide-}
WIDE_MODEL=$WORK/wide-$WIDE_HIDDEN
CACHE_IN=${DEVICE_E2E_COMPILE_CACHE:-$CARRY/compile-cache}  # what the last lease brought back, carried in
mkdir -p "$OUTDIR/compile-cache"
WIDE=(name="$WIDE_NAME" checkpoint.runs_root="$RUNS" checkpoint.every_steps=0 eval.final=false total_steps="$WIDE_STEPS"
      generator.engine.kind=transformers 'learner.weight_sync={kind: object_store}' model.path="$WIDE_MODEL"
      learner.levers.compile=true learner.levers.compile_backend="$WIDE_BACKEND"
      learner.levers.compile_cache_dir="$WORK/inductor-cache")
[ $QUICK -eq 1 ] || WIDE+=(generator.num_gpus=0.4 learner.num_gpus=0.4)
WIDEN_FROM=()  # the built-in model the real-width one is made from: the carry's copy, else the default cache's
[ ${#MODELS[@]} -gt 0 ] && WIDEN_FROM=(--cache-dir "$(cd "$CARRY/models" && pwd)")
if [ ${#MODELS[@]} -eq 0 ]; then  # not in the budgets: a carry without the model pays minutes here, once per machine
    say "no built-in model in $CARRY/models (bench/device_e2e.py carry-model puts it there): the default cache's" \
        "(built there first when absent: minutes)"
    (cd "$OUTDIR" && "${EXGRPO[@]}" toy-model) || say "building the built-in model failed (above)"
fi
# the probe's model and the real-width run's, made on the CPU while the learning run starts (niced: the run's start
# is what is measured)
(OMP_NUM_THREADS=4 nice -n 19 "$PY" bench/device_e2e.py make-model "$WORK/probe-model-$SIZE" --size $SIZE \
    > "$OUTDIR/make-model.log" 2>&1; echo $? > "$OUTDIR/make-model.rc") &
MAKE_PID=$!
(OMP_NUM_THREADS=4 nice -n 19 "$PY" bench/device_e2e.py widen-model "$WIDE_MODEL" --hidden "$WIDE_HIDDEN" \
    "${WIDEN_FROM[@]}" > "$OUTDIR/widen-model.log" 2>&1; echo $? > "$OUTDIR/widen-model.rc") &
WIDEN_PID=$!
(cd "$OUTDIR" && part "learning run" $LEARN_S "built-in countdown model, $STEPS steps" - \
    "${EXGRPO[@]}" train "${LEARN[@]}" "${EXTRA[@]}")
mkdir -p "$OUTDIR/run"  # its small files come back: metric points, state, profile, the driver's and Ray's logs
cp -r "$RUN_DIR"/{metrics-unsent.jsonl,state.json,profile.json,config.yaml,logs} "$OUTDIR/run/" 2>/dev/null

# 3. The real-width run: the built-in model widened, its learner compiled, inductor's cache carried between leases.
wait $WIDEN_PID
grep -v "^Loading\|^Writing" "$OUTDIR/widen-model.log"
if [ "$(cat "$OUTDIR/widen-model.rc" 2>/dev/null)" = 0 ]; then
    "$PY" bench/device_e2e.py cache-load "$CACHE_IN/real-width-inductor.tar.gz" "$WORK/inductor-cache" \
        --note "$OUTDIR/real-width-cache-in.json"
    WIDE_DIR=$RUNS/$WIDE_NAME
    (cd "$OUTDIR" && part "real-width run" $WIDE_S \
        "built-in model at $WIDE_HIDDEN wide, compile $WIDE_BACKEND, $WIDE_STEPS steps" - \
        "${EXGRPO[@]}" train "${WIDE[@]}" "${EXTRA[@]}")
    mkdir -p "$OUTDIR/wide-run"
    cp -r "$WIDE_DIR"/{metrics-unsent.jsonl,state.json,profile.json,config.yaml,logs} "$OUTDIR/wide-run/" 2>/dev/null
    "$PY" bench/device_e2e.py cache-save "$WORK/inductor-cache" "$OUTDIR/compile-cache/real-width-inductor.tar.gz" \
        --max-mib 8 --note "$OUTDIR/real-width-cache-out.json"
else
    printf 'real-width run\t1\t0\t%d\tits model could not be made (widen-model.log)\n' $WIDE_S >> "$OUTDIR/parts.tsv"
fi

# 4-5. The probe and, beside it, the tests only a GPU answers (skipped, and said so, without CUDA): neither judges
# time, and side by side they fit the budget (the probe's tokens/s are measured beside the tests).
wait $MAKE_PID
cat "$OUTDIR/make-model.log"
PROBE_PID=
if [ "$(cat "$OUTDIR/make-model.rc" 2>/dev/null)" = 0 ]; then
    part "mismatch probe" $PROBE_S "random Qwen2, $SIZE's layers, $DTYPE, beside tests/gpu" "$OUTDIR/probe.log" \
        "$PY" bench/device_e2e.py probe --model "$WORK/probe-model-$SIZE" --out "$OUTDIR/probe.json" --device $DEVICE \
        --dtype $DTYPE &
    PROBE_PID=$!
else
    printf 'mismatch probe\t1\t0\t%d\tits model could not be made (make-model.log)\n' $PROBE_S >> "$OUTDIR/parts.tsv"
fi
LEFT=$(( $(left) - 8 ))
if [ $LEFT -ge 20 ]; then
    # inductor's artifacts: the last lease's loaded (the carry's compile-cache/), this one's saved (tests/gpu/conftest.py)
    EXGRPO_GPU_COMPILE_CACHE="$CACHE_IN" EXGRPO_GPU_COMPILE_CACHE_OUT="$OUTDIR/compile-cache" \
        part "tests/gpu" $LEFT "pytest tests/gpu -m gpu" "$OUTDIR/pytest-gpu.log" \
        "$PY" -m pytest tests/gpu -m gpu -v -rs -p no:cacheprovider
    tail -n 12 "$OUTDIR/pytest-gpu.log"
else
    printf 'tests/gpu\t124\t0\t%d\tno time left in DEVICE_E2E_BUDGET_S=%d\n' $LEFT "$BUDGET" >> "$OUTDIR/parts.tsv"
fi
[ -n "$PROBE_PID" ] && wait $PROBE_PID
cat "$OUTDIR/probe.log" 2>/dev/null

# 6. The summary.
summary
}
