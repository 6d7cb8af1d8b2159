#!/usr/bin/env bash
# vLLM on the lent GPU machine, which has no network: one part of the vLLM carry per device call, reassembled on the
# machine's disk, installed by the call that brings the last part.
#
#   here first:  .venv/bin/python scripts/vllm_carry.py        (vllm-carry/: manifest.json and part-000 ... part-NNN,
#                                                                at most 60 MB each; it prints how many)
#   each call:   run(command="bash scripts/vllm_install_offline.sh", carry=["vllm-carry/manifest.json",
#                    "vllm-carry/part-000"], timeout_s=300)     then part-001, ... in order or not
#
# It takes as many calls as manifest.json has parts (its "calls"), ALL ON ONE WARM MACHINE: the parts are kept in
# VLLM_STAGE (/tmp) between calls, and a machine that goes back (idle past its warm time, given back, or held 30
# minutes) starts bare: the staging starts again from the first part. Calls that bring a part take ~the transfer of
# 64 MiB each; the last one also joins the parts, checks every sha256 (each part, the joined tar, each wheel),
# pip-installs the wheels with --no-index --no-deps into VLLM_SITE, checks every requirement against what is
# installed there (scripts/vllm_carry.py installed: the image's versions read there, torch untouched), and imports
# vllm. A later call on the same machine finds the install (VLLM_SITE/.carry holds the tar's sha256) and only
# imports. Then, in the same call or the next: PYTHONPATH=$VLLM_SITE python3 -m pytest tests/actors/test_vllm_engine.py.
#
# Environment: PYTHON (default python3, the image's), VLLM_CARRY (default vllm-carry: the folder the parts come in),
# VLLM_STAGE (default /tmp/vllm-carry-stage), VLLM_SITE (default /tmp/vllm-site).
# Exit code: 0 installed and imported, 3 parts still to come (it names them), 2 a sha256 or install failure,
# 1 the installed set fails its requirement check or vllm does not import.
set -uo pipefail
cd "$(dirname "$0")/.."
{  # read whole before it runs
PY=${PYTHON:-python3}
CARRY=${VLLM_CARRY:-vllm-carry}
STAGE=${VLLM_STAGE:-/tmp/vllm-carry-stage}
SITE=${VLLM_SITE:-/tmp/vllm-site}
T0=$(date +%s.%N)
say() { echo "vllm_install [$(awk -v a="$T0" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }') s]: $*"; }

if [ ! -f "$CARRY/manifest.json" ]; then
    say "no $CARRY/manifest.json: carry it with each call (and one part)"; exit 2
fi
WANT=$("$PY" -c 'import json, sys; print(json.load(open(sys.argv[1]))["tar"]["sha256"])' "$CARRY/manifest.json") ||
    exit 2
if [ "$(cat "$SITE/.carry" 2>/dev/null)" != "$WANT" ]; then
    "$PY" scripts/vllm_carry.py stage --from "$CARRY" --stage "$STAGE"
    rc=$?
    [ $rc -eq 3 ] && { say "waiting for the parts above (this machine must stay warm until the last)"; exit 3; }
    [ $rc -ne 0 ] && { say "FAILED: staging"; exit 2; }
    "$PY" scripts/vllm_carry.py assemble --stage "$STAGE" ||
        { say "FAILED: the parts do not join into the carry"; exit 2; }
    say "installing $(ls "$STAGE"/wheels/*.whl | wc -l) wheels into $SITE"
    rm -rf "$SITE"
    "$PY" -m pip install -q --disable-pip-version-check --no-index --no-deps --no-compile --no-cache-dir \
        --target "$SITE" "$STAGE"/wheels/*.whl || { say "FAILED: pip install"; exit 2; }
    echo "$WANT" > "$SITE/.carry"
    say "installed ($(du -sh "$SITE" | cut -f1))"
fi
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
export PATH="$SITE/bin:$PATH"
"$PY" scripts/vllm_carry.py installed --site "$SITE" $([ -d "$STAGE/wheels" ] && echo --wheels "$STAGE/wheels")
check=$?
"$PY" -c "import vllm; print(vllm.__version__)" || { say "FAILED: vllm does not import"; exit 1; }
"$PY" - "$SITE" <<'EOF' || exit 1
import os, sys
import torch
site = os.path.realpath(sys.argv[1])
where = os.path.realpath(torch.__file__)
print(f"torch {torch.__version__} (CUDA {torch.version.cuda}, available {torch.cuda.is_available()}) from {where}")
sys.exit(f"torch comes from {site}: the carry replaced the image's" if where.startswith(site + os.sep) else 0)
EOF
say "done (requirement check: exit $check)"
exit $check
}
