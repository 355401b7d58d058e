#!/usr/bin/env bash
# Installs what is missing, builds, and runs the whole test suite:
#   1. every test (unit, integration with real gkv-server processes, gpu-labelled ones skip with a
#      reason without a GPU) on the normal build (build/)
#   2. the wire-protocol fuzzer for a bounded time over its checked-in corpus
#   3. every test again under ASan+UBSan (build-asan/)
#   4. the cache and transport concurrency tests under TSan (build-tsan/)
# Options (environment): GKV_TEST_STEPS="normal fuzz asan tsan" picks steps;
# GKV_FUZZ_SECONDS (default 30). scripts/gpu-check.sh runs the gpu tests on a GPU machine.
# Under TSan, UCX's memory-event hooks (which patch malloc and mmap) fight TSan's own
# interceptors and crash; UCX_MEM_EVENTS=no turns them off for that step (gkv does not use them).
set -euo pipefail
cd "$(dirname "$0")/.."
STEPS=${GKV_TEST_STEPS:-normal fuzz asan tsan}
JOBS=$(nproc)
overall=0
results=()

step() {  # name command...
  local name=$1
  shift
  local t0=$SECONDS
  echo "=== $name"
  if "$@"; then
    results+=("$name: passed ($((SECONDS - t0)) s)")
  else
    results+=("$name: FAILED ($((SECONDS - t0)) s)")
    overall=1
  fi
}

normal() {
  GKV_BUILD_DIR=build scripts/build.sh &&
    ctest --test-dir build --output-on-failure -j "$JOBS" --timeout 300
}
fuzz() { scripts/fuzz.sh "${GKV_FUZZ_SECONDS:-30}"; }
asan() {
  GKV_BUILD_DIR=build-asan scripts/build.sh -DGKV_SANITIZE=address -DGKV_BUILD_BENCH=OFF \
    -DCMAKE_BUILD_TYPE=Debug &&
    ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 \
    UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
    ctest --test-dir build-asan --output-on-failure -j "$JOBS" --timeout 600
}
tsan() {
  GKV_BUILD_DIR=build-tsan GKV_TARGETS="cache_test transport_test" scripts/build.sh \
    -DGKV_SANITIZE=thread -DGKV_BUILD_BENCH=OFF -DCMAKE_BUILD_TYPE=Debug &&
    UCX_MEM_EVENTS=no \
    TSAN_OPTIONS="halt_on_error=1:second_deadlock_stack=1:suppressions=$PWD/tests/tsan.supp" \
    ctest --test-dir build-tsan --output-on-failure -j "$JOBS" --timeout 600 -R Concurrent
}

scripts/deps.sh
for s in $STEPS; do
  case "$s" in
    normal) step "tests (build/)" normal ;;
    fuzz) step "protocol fuzzer" fuzz ;;
    asan) step "tests under ASan+UBSan (build-asan/)" asan ;;
    tsan) step "concurrency tests under TSan (build-tsan/)" tsan ;;
    *) echo "unknown step '$s'" >&2; exit 2 ;;
  esac
done
echo "=== summary"
printf '%s\n' "${results[@]}"
exit $overall
