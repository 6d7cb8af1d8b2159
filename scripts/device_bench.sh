#!/usr/bin/env bash
# Issue 34's GPU figures in one call of a short GPU lease (15 minutes of device time, machine start included):
# bench/gpu_bench.py's cases in the order the issue needs them, each started only while the budget lasts.
#
#   bash scripts/device_bench.sh [--quick] [GPU_BENCH_ARG ...]
#
# --quick: the same plan on tiny shapes, on a CPU (the suite runs it); further arguments go to every
# gpu_bench.py call (--peak-tflops, --bucket-mb, ...).
#
# 1. --sizes 1.5B 3B 7B --order case --activation-checkpointing: the product's defaults (on CUDA: per-layer
#    compile, fused AdamW, padding-free packing through flex_attention where flash-attention is absent) on
#    8 x 8k responses, 1.5B then 3B (7B trains only where it fits: 16 B/parameter); the bf16 publication of each
#    size beside the pinned-copy limit (7B's alone, without a step); then mixed lengths padded vs packed.
# 2. while budget is left: the compile lever off (--no-compile) on the 1.5B's fixed case, for the A/B.
# 3. while budget is left: the 1.5B's fixed case with rank-8 LoRA (the frozen base in bf16): its peak memory.
# Where a case of part 1 failed (a broken lever), the plain step (no compile, padded) runs right after it, so the
# lease still measures a baseline step and the publication.
#
# DEVICE_BUDGET_S (default 300) is the time after which no case starts: a case already started finishes (a
# first compile takes minutes), so give the call's timeout ~2x the budget, and a 15-minute lease holds a start,
# this and one rerun. Output: the tables on stdout, the lines of finished cases as they come, and
# gpu-bench-*.json + *.log in $OUT (the device tool's folder) or runs-gpu-check/.
#
# Needs python3 with torch, transformers, numpy, safetensors, pyyaml; pydantic where it is missing comes from the
# wheels in wheels/ or .whl/ (`make gpu-wheels` downloads them here; carry the folder with the call).
set -uo pipefail
cd "$(dirname "$0")/.."
QUICK=()
if [ "${1:-}" = "--quick" ]; then QUICK=(--quick); shift; fi
EXTRA=("$@")
OUTDIR=${OUT:-runs-gpu-check}
mkdir -p "$OUTDIR"
BUDGET=${DEVICE_BUDGET_S:-300}
START=$(date +%s)
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1

if ! "$PY" -c "import pydantic" 2>/dev/null; then
    WHEELS=""
    for d in wheels .whl; do ls "$d"/pydantic-*.whl >/dev/null 2>&1 && WHEELS=$d && break; done
    if [ -z "$WHEELS" ]; then
        echo "device_bench: $PY has no pydantic and neither wheels/ nor .whl/ holds its wheels: run" \
             "'make gpu-wheels' here and carry wheels/ with the call" >&2
        exit 2
    fi
    "$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/gpu-bench-site "$WHEELS"/*.whl || exit 2
    export PYTHONPATH=/tmp/gpu-bench-site${PYTHONPATH:+:$PYTHONPATH}
fi
if [ ${#QUICK[@]} -eq 0 ]; then
    nvidia-smi -L || { echo "device_bench: nvidia-smi sees no GPU (use --quick on a CPU)" >&2; exit 2; }
fi

left() { echo $(( BUDGET - ($(date +%s) - START) )); }
STATUS=0
bench() {  # name, then gpu_bench's arguments
    local name=$1 budget
    shift
    budget=$(left)
    if [ "$budget" -le 0 ]; then
        echo "device_bench: SKIPPED $name: the ${BUDGET} s budget is spent" >&2
        return
    fi
    : > "$OUTDIR/gpu-bench-$name.log"  # both streams append to it (one truncating writer would overwrite the other)
    "$PY" bench/gpu_bench.py "${QUICK[@]}" "$@" "${EXTRA[@]}" --budget-s "$budget" --out "$OUTDIR/gpu-bench-$name.json" \
        > >(tee -a "$OUTDIR/gpu-bench-$name.log") 2> >(grep --line-buffered -v '^USDT:' | tee -a "$OUTDIR/gpu-bench-$name.log" >&2)
    local rc=$?
    wait
    [ $rc -ne 0 ] && STATUS=$rc
}

failed() {  # whether any case of gpu-bench-NAME.json failed (not out of memory: a failure with a traceback)
    "$PY" -c "import json, sys; sys.exit(0 if any(r.get('failed') for r in json.load(open(sys.argv[1]))['runs']) else 1)" \
        "$OUTDIR/gpu-bench-$1.json" 2>/dev/null
}

if [ ${#QUICK[@]} -eq 0 ]; then
    bench defaults --sizes 1.5B 3B 7B --order case --activation-checkpointing
    if failed defaults; then  # a lever of the defaults broke (compile, flex_attention packing): the plain step
        bench plain --sizes 1.5B --cases fixed --activation-checkpointing --no-compile --no-padding-free
    fi
    bench eager --sizes 1.5B --cases fixed --activation-checkpointing --no-compile --no-profile
    bench lora --sizes 1.5B --cases fixed --activation-checkpointing --lora 8 --no-profile
else  # the same plan on tiny shapes (compile is off on a CPU, so there is no second part)
    bench defaults --order case --activation-checkpointing
fi
echo "device_bench: $(( $(date +%s) - START )) s; JSON and logs in $OUTDIR" >&2
exit $STATUS
