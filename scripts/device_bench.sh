#!/usr/bin/env bash
# Issue 49's GPU figures in one call of a short GPU lease (15 minutes of device time, machine start included):
# bench/gpu_bench.py's parts, most needed first, each started only while the budget lasts, in one call of at most
# 8 minutes (DEVICE_BUDGET_S=420 s of parts, plus the case already running when it runs out).
#
#   bash scripts/device_bench.sh [--quick] [GPU_BENCH_ARG ...]
#   PARTS="eager ckpt lora" bash scripts/device_bench.sh      # only these parts (say, a second call of a lease)
#
# --quick: the same plan on tiny shapes, on a CPU (the suite runs it); further arguments go to every
# gpu_bench.py call (--peak-tflops, --bucket-mb, ...). The parts, in order:
# 1. defaults: the product's defaults, nothing set (on CUDA: per-layer compile, fused AdamW, padded micro-batches,
#    activation checkpointing auto), on 8 x 8k responses: --runs 1.5B:fixed 1.5B:mixed:padded 3B:mixed
#    1.5B:mixed:packed. 1.5B fixed and mixed padded share one build (one compile, two batch shapes); only 1.5B fixed
#    is profiled (--profile-first). The 1.5B fixed case and its bf16 publication beside the pinned-copy limit; mixed
#    lengths padded; the 3B mixed case (and its publication); then the opt-in lever learner.levers.padding_free=true
#    (flex_attention on CUDA) on the same mixed lengths, for packed / padded. Its tables end with the "Done when",
#    judged. Where a case failed (a lever broke on the GPU), the plain step (no compile, padded, full
#    checkpointing) runs next, so the lease still measures a baseline step and the publication.
# 2. eager: the compile A/B, the 1.5B fixed case with --no-compile.
# 3. ckpt: the 1.5B fixed case with activation checkpointing full, selective and none (none where memory allows:
#    running out is a result), except the mode auto chose in part 1 (measured there).
# 4. lora: the 1.5B fixed case with rank-8 LoRA (the frozen base in bf16): its peak memory, one timed step.
# Parts 2-4 skip the profiled step and the publication (part 1 has both). Every table row shows the recompiles
# after the rank's first step, the seconds from setup to the first step, and the checkpointing mode with the
# numbers auto used.
#
# Budget: no part starts unless its estimate fits in what is left, and within a part gpu_bench starts no case that
# the last case's time says would overrun it; a case already started finishes, so give the call's timeout ~1.15x
# the budget. The estimates are measured: each part's wall seconds of the last lease (part-seconds.txt in the
# compile cache folder below, written at the end of every call), else the H100 lease of 2026-11-27 (PART_S below).
#
# Inductor's compiled artifacts: loaded at the start from COMPILE_CACHE (default runs-gpu-check/inductor-cache, an
# ignored folder: carry it with the call), saved at the end under $OUT/inductor-cache (with part-seconds.txt).
# Output: the tables on stdout and in device_bench.md, the lines of finished cases as they come, a line per part
# skipped, and gpu-bench-*.json + *.log in $OUT (the device tool's folder) or runs-gpu-check/. With OUT set (the
# device tool sets it), the call ends with scripts/device_out.py pack: a call brings back at most 8 files, 16 MiB
# each and 64 MiB together, and one 1.5B build's artifacts are ~50 MB, so OUT is left holding device_bench.md,
# gpu-bench-defaults.json, results.tar.gz (the rest) and compile-cache.tar (the artifacts gzip'd, the defaults'
# first, the others while they fit), in 15 MiB pieces where larger. Here:
#   python3 scripts/device_out.py unpack <files_at> runs-gpu-check/lease --cache-to runs-gpu-check/inductor-cache
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
BUDGET=${DEVICE_BUDGET_S:-420}
PARTS=${PARTS:-defaults eager ckpt lora}
START=$(date +%s)
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
# a part's (one mode's) seconds, from the H100 lease of 2026-11-27 (issue 49): the defaults part took 243 s cold (4
# cases, one profile, 2 publications); one 1.5B case ~15 s of process start and build, 31 s to its first step
# cold (10 s warm), ~15 s of timed steps; eager compiles nothing. part-seconds.txt of the last lease replaces them.
declare -A PART_S=([plain]=40 [eager]=40 [ckpt]=70 [lora]=70)
CACHE_IN=${COMPILE_CACHE:-runs-gpu-check/inductor-cache}
CACHE_OUT=$OUTDIR/inductor-cache
mkdir -p "$CACHE_OUT"
# --quick's tiny CPU seconds never become a GPU lease's estimates
PART_FILE=$CACHE_OUT/part-seconds${QUICK:+-quick}.txt
if [ -d "$CACHE_IN" ] && [ "$(cd "$CACHE_IN" && pwd)" != "$(cd "$CACHE_OUT" && pwd)" ]; then
    cp "$CACHE_IN"/* "$CACHE_OUT"/ 2>/dev/null
fi
if [ -f "$PART_FILE" ]; then  # "part seconds" lines, the last lease's measurements
    while read -r part secs; do
        [ -n "${PART_S[$part]+x}" ] && [[ $secs =~ ^[0-9]+$ ]] && PART_S[$part]=$secs
    done < "$PART_FILE"
    echo "device_bench: part estimates measured by the last lease: $(for k in "${!PART_S[@]}"; do printf '%s %s s, ' "$k" "${PART_S[$k]}"; done)" >&2
fi
declare -A MEASURED=()

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
    SIZE=1.5B; BIG=3B; MODES="full selective none"
else  # tiny shapes; one checkpointing mode (the others cost the suite time and show nothing new on a CPU)
    SIZE=tiny; BIG=; MODES="full"
fi

left() { echo $(( BUDGET - ($(date +%s) - START) )); }
wanted() { [[ " $PARTS " == *" $1 "* ]]; }
STATUS=0
bench() {  # name, the part's estimate in seconds (0: start while any budget is left), then gpu_bench's arguments
    local name=$1 need=$2 budget
    shift 2
    budget=$(left)
    if [ "$budget" -le 0 ] || [ "$budget" -lt "$need" ]; then
        echo "device_bench: SKIPPED $name: ${budget} s of the ${BUDGET} s budget left, it needs ~${need} s" >&2
        return
    fi
    : > "$OUTDIR/gpu-bench-$name.log"  # both streams append to it (one truncating writer would overwrite the other)
    local t0
    t0=$(date +%s)
    "$PY" bench/gpu_bench.py "${QUICK[@]}" "$@" "${EXTRA[@]}" --budget-s "$budget" --out "$OUTDIR/gpu-bench-$name.json" \
        --compile-cache "$CACHE_OUT" \
        > >(tee -a "$OUTDIR/gpu-bench-$name.log") 2> >(grep --line-buffered -v '^USDT:' | tee -a "$OUTDIR/gpu-bench-$name.log" >&2)
    local rc=$?
    wait
    [ $rc -ne 0 ] && STATUS=$rc
    MEASURED[${name%%-*}]=$(( $(date +%s) - t0 ))  # ckpt-full -> ckpt: one mode's seconds
}

failed() {  # whether any case of gpu-bench-NAME.json failed (not out of memory: a failure with a traceback)
    "$PY" -c "import json, sys; sys.exit(0 if any(r.get('failed') for r in json.load(open(sys.argv[1]))['runs']) else 1)" \
        "$OUTDIR/gpu-bench-$1.json" 2>/dev/null
}

chosen_mode() {  # the checkpointing mode part 1's first case ran with (auto resolved), if it ran
    "$PY" -c "import json, sys; r = json.load(open(sys.argv[1]))['runs']; print(r[0]['settings']['activation_checkpointing'] if r and 'error' not in r[0] else '')" \
        "$OUTDIR/gpu-bench-defaults.json" 2>/dev/null
}

takes_mode() {  # whether this tree's learner.levers.activation_checkpointing takes the mode's name (not only true/false)
    "$PY" -c "import sys; sys.path.insert(0, '.'); from common.config import LearnerConfig; LearnerConfig(activation_checkpointing=sys.argv[1])" \
        "$1" 2>/dev/null
}

if wanted defaults; then
    if [ -n "$BIG" ]; then
        bench defaults 0 --profile-first --runs $SIZE:fixed $SIZE:mixed:padded $BIG:mixed $SIZE:mixed:packed
    else
        bench defaults 0 --profile-first --runs $SIZE:fixed $SIZE:mixed:padded $SIZE:mixed:packed
    fi
    if failed defaults; then  # a lever of the defaults broke (compile, checkpointing, flex packing): the plain step
        bench plain "${PART_S[plain]}" --runs $SIZE:fixed --no-compile --no-padding-free --activation-checkpointing full
    fi
fi
if wanted eager && [ ${#QUICK[@]} -eq 0 ]; then  # compile is off on a CPU: no A/B there
    bench eager "${PART_S[eager]}" --runs $SIZE:fixed --no-compile --no-profile --no-publish
fi
if wanted ckpt; then
    auto=$(chosen_mode)
    for mode in $MODES; do
        if [ "$mode" = "$auto" ]; then
            echo "device_bench: checkpointing $mode: measured in part 1 (auto chose it)" >&2
        elif [ "$mode" != full ] && [ "$mode" != none ] && ! takes_mode "$mode"; then
            echo "device_bench: SKIPPED ckpt-$mode: this tree's learner.levers.activation_checkpointing has no $mode" >&2
        else
            bench "ckpt-$mode" "${PART_S[ckpt]}" --runs $SIZE:fixed --activation-checkpointing "$mode" --no-profile \
                --no-publish
        fi
    done
fi
if wanted lora; then
    bench lora "${PART_S[lora]}" --runs $SIZE:fixed --lora 8 --steps 1 --no-profile --no-publish
fi
# the lease on one screen (a device call may return only the end of its output): every case of every part, then
# the "Done when" as part 1 judged it
"$PY" - "$OUTDIR" "$START" <<'SUMMARY' | tee "$OUTDIR/device_bench.md"
import json, sys
from pathlib import Path

sys.path.insert(0, ".")
from bench.gpu_report import checkpointing_cell, first_step_cell

pct = lambda x: "-" if x is None else f"{x:.1%}"
print("\n## device_bench: every case\n\n| part | case | levers on | step s (min-max) | MFU | MFU (torchtitan) | HFU | "
      "peak GiB | first step s | recompiles | checkpointing |")
print("|---|---|---|---|---|---|---|---|---|---|---|")
for path in sorted(Path(sys.argv[1]).glob("gpu-bench-*.json"), key=lambda f: f.stat().st_mtime):
    if path.stat().st_mtime < int(sys.argv[2]):  # an earlier call's
        continue
    r = json.loads(path.read_text())
    for x in r["runs"]:
        s, case = x["settings"], f"{x['size']} {x['case']}"
        ckpt = s.get("activation_checkpointing")
        levers = " ".join(n for n, on in (("packed", s["packs_padding_free"]), ("compile", s.get("compile")),
                                          (f"ckpt {ckpt}", ckpt not in (None, "none")),
                                          (f"lora r{s.get('lora_rank')}", s.get("lora_rank"))) if on) or "none"
        name = path.stem.removeprefix("gpu-bench-")
        if "error" in x:
            print(f"| {name} | {case} | {levers} | {x['error'][:100]} | | | | | | | |")
        elif "step_s" in x:
            mem = x.get("peak_mem_gib", x.get("peak_rss_gib"))
            print(f"| {name} | {case} | {levers} | {x['step_s']:.3f} ({x['step_s_min']:.3f}-{x['step_s_max']:.3f}) | "
                  f"{pct(x['mfu'])} | {pct(x.get('mfu_torchtitan'))} | {pct(x.get('hfu'))} | {mem:.2f} | "
                  f"{first_step_cell(x)} | {x.get('recompiles', '-')} | {checkpointing_cell(s, x.get('checkpointing'))} |")
    for size, p in r["publication"].items():
        print(f"| {path.stem.removeprefix('gpu-bench-')} | {size} publication | bf16 | {p['seconds']:.3f} s, "
              f"{p['gb_per_s']:.2f} GB/s (pinned copy {p['copy_gb_per_s']:.2f}) | | | | | | | |")
done = Path(sys.argv[1]) / "gpu-bench-defaults.json"
if done.exists() and done.stat().st_mtime >= int(sys.argv[2]):
    print("\n| Done when (issue 49), part 1 | target | measured | verdict |\n|---|---|---|---|")
    for t in json.loads(done.read_text()).get("targets", []):
        print(f"| {t['what']} | {t.get('target_text', t['target'])} | {t.get('value_text', t['value'])} | "
              f"{t['verdict']} |")
SUMMARY
# this lease's part seconds replace the last lease's (parts not run this time keep theirs): the next estimates
for part in "${!MEASURED[@]}"; do PART_S[$part]=${MEASURED[$part]}; done
for part in "${!PART_S[@]}"; do echo "$part ${PART_S[$part]}"; done | sort > "$PART_FILE"
if [ -n "${OUT:-}" ]; then  # on the device: leave in $OUT only what one call brings back (8 files, 64 MiB)
    "$PY" scripts/device_out.py pack "$OUTDIR" --keep device_bench.md gpu-bench-defaults.json --cache "$CACHE_OUT" \
        --cache-first gpu-bench-defaults gpu-bench-ckpt gpu-bench-lora >&2
    echo "device_bench: $(( $(date +%s) - START )) s of the ${BUDGET} s budget; the tables in device_bench.md, the" \
         "rest packed: here, 'python3 scripts/device_out.py unpack <files_at> runs-gpu-check/lease" \
         "--cache-to runs-gpu-check/inductor-cache', then carry runs-gpu-check/inductor-cache with the next call" >&2
else
    echo "device_bench: $(( $(date +%s) - START )) s of the ${BUDGET} s budget; JSON and logs in $OUTDIR;" \
         "inductor's artifacts and part-seconds.txt in $CACHE_OUT (carry that folder with the next call as" \
         "COMPILE_CACHE)" >&2
fi
exit $STATUS
