#!/usr/bin/env bash
# Run test files N times, optionally beside a competing CPU load, and print pass counts per test.
#
#   scripts/stress_suite.sh                      # the end-to-end files, 3 rounds, no load
#   scripts/stress_suite.sh -n 5 -l 2            # 5 rounds, 2 busy-looping processes competing for the CPUs
#   scripts/stress_suite.sh -n 2 tests/cluster/test_chaos.py
#   make stress N=5 LOAD=2
#
# The load is a pure-Python burner (one process per -l, each spinning a core at normal priority), so it needs
# nothing beyond the project's venv. Every round writes a JUnit report under $OUT (default .stress/); the table
# at the end counts, per test, the rounds it passed, failed, errored and was skipped. Exit status: 0 when every
# test passed (or was skipped) in every round, 1 otherwise.
set -euo pipefail
cd "$(dirname "$0")/.."

ROUNDS=3
LOAD=0
OUT=${OUT:-.stress}
while getopts "n:l:o:h" opt; do
    case $opt in
        n) ROUNDS=$OPTARG ;;
        l) LOAD=$OPTARG ;;
        o) OUT=$OPTARG ;;
        h) sed -n '2,12p' "$0"; exit 0 ;;
        *) exit 2 ;;
    esac
done
shift $((OPTIND - 1))
if [ $# -eq 0 ]; then
    set -- $(ls tests/cluster/test_*e2e*.py tests/cluster/test_chaos.py)
fi
PY=.venv/bin/python
[ -x $PY ] || { echo "no .venv: run 'make setup' first" >&2; exit 2; }

mkdir -p "$OUT"
rm -f "$OUT"/round-*.xml
BURNERS=()
stop_burners() { for pid in "${BURNERS[@]:-}"; do [ -n "$pid" ] && kill "$pid" 2>/dev/null || true; done; }
trap stop_burners EXIT
for _ in $(seq 1 "$LOAD"); do
    $PY -c "while True: pass" &
    BURNERS+=($!)
done

echo "[stress] $ROUNDS round(s) of: $* (competing CPU load: $LOAD busy process(es))" >&2
for r in $(seq 1 "$ROUNDS"); do
    start=$(date +%s)
    $PY -m pytest -q -p no:cacheprovider --junitxml="$OUT/round-$r.xml" "$@" >"$OUT/round-$r.log" 2>&1 || true
    echo "[stress] round $r/$ROUNDS: $(tail -1 "$OUT/round-$r.log") ($(( $(date +%s) - start )) s)" >&2
done
stop_burners

$PY - "$OUT" "$ROUNDS" "$LOAD" "$*" <<'EOF'
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

out, rounds, load, files = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
counts = defaultdict(lambda: dict(passed=0, failed=0, error=0, skipped=0))
for r in range(1, rounds + 1):
    report = out / f"round-{r}.xml"
    if not report.exists():
        print(f"round {r}: no report (see {out}/round-{r}.log)")
        continue
    for case in ET.parse(report).iter("testcase"):
        name = f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}"
        kinds = {child.tag for child in case}
        kind = "failed" if "failure" in kinds else "error" if "error" in kinds else \
            "skipped" if "skipped" in kinds else "passed"
        counts[name][kind] += 1
print(f"\n$ scripts/stress_suite.sh -n {rounds} -l {load} {files}")
print(f"{'test':<100} {'pass':>5} {'fail':>5} {'error':>5} {'skip':>5}")
bad = False
for name, c in sorted(counts.items()):
    print(f"{name[:100]:<100} {c['passed']:>5} {c['failed']:>5} {c['error']:>5} {c['skipped']:>5}")
    bad |= bool(c["failed"] or c["error"]) or c["passed"] + c["skipped"] < rounds
sys.exit(1 if bad or not counts else 0)
EOF
