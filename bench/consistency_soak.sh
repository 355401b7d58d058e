#!/usr/bin/env bash
# Runs the crash-consistency checker (tests/consistency_test.cc) again and again: its anomalies
# are races that one run in the suite meets rarely. Each run uses its own seed; a failed run
# keeps its log, and its cluster directory (node logs, disk tiers) when the failure was found
# while the cluster ran (an anomaly, a node that would not stop; not the counts checked after
# it), both under $TMPDIR (the paths are printed).
#   bench/consistency_soak.sh [RUNS] [FILTER] [SECONDS_PER_RUN]
# FILTER picks the checker variants (a gtest filter; default all four: R1, R2, WhileObjectsSpill,
# WithStreamedPuts). SECONDS_PER_RUN lengthens each run (GKV_CONSISTENCY_SECONDS; default the
# test's own 6 s). Prints one line per run and a count at the end; exits 1 if any run failed.
# Needs a build (scripts/build.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
RUNS=${1:-20}
FILTER=${2:-ConsistencyTest.*}
SECS=${3:-}
[ -x build/bin/consistency_test ] || { echo "no build/bin/consistency_test: run scripts/build.sh" >&2; exit 2; }
out=$(mktemp -d "${TMPDIR:-/tmp}/gkv-soak-XXXXXX")
failed=0
for i in $(seq 1 "$RUNS"); do
  seed=$((20261202 + i))
  log="$out/run$i.log"
  rc=0
  env GKV_KEEP_FAILED_TEST_DIRS=1 GKV_SEED="$seed" ${SECS:+GKV_CONSISTENCY_SECONDS="$SECS"} \
    build/bin/consistency_test --gtest_filter="$FILTER" > "$log" 2>&1 || rc=$?
  summary=$(grep -o 'anomalies:.*' "$log" | tr '\n' ' ' || true)
  if [ "$rc" = 0 ]; then
    echo "run $i (seed $seed): passed; $summary"
    rm -f "$log"
  else
    failed=$((failed + 1))
    echo "run $i (seed $seed): FAILED (log $log; $(grep -o 'kept .*' "$log" | head -3 | tr '\n' ' '))"
  fi
done
echo "$((RUNS - failed)) of $RUNS runs passed ($FILTER)"
[ "$failed" = 0 ] || exit 1
rmdir "$out" 2> /dev/null || true
