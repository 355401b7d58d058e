#!/usr/bin/env bash
# Installs what is missing, builds, and runs the whole test suite with ctest.
#   scripts/test.sh            the suite on the normal build (build/)
#   GKV_SANITIZE=address scripts/test.sh   the same under ASan+UBSan (build-asan/)
#   GKV_SANITIZE=thread scripts/test.sh    the concurrency tests under TSan (build-tsan/)
# GPU tests (label gpu) skip with a reason on machines without a GPU; scripts/gpu-check.sh runs
# them on a GPU machine.
set -euo pipefail
cd "$(dirname "$0")/.."
SAN=${GKV_SANITIZE:-}
if [ -z "$SAN" ]; then
  export GKV_BUILD_DIR=build
  scripts/build.sh
  ctest --test-dir build --output-on-failure -j "$(nproc)" --timeout 300
  exit 0
fi
case "$SAN" in
  address) export GKV_BUILD_DIR=build-asan ;;
  thread) export GKV_BUILD_DIR=build-tsan ;;
  *) echo "GKV_SANITIZE must be address or thread" >&2; exit 2 ;;
esac
scripts/build.sh -DGKV_SANITIZE="$SAN" -DGKV_BUILD_BENCH=OFF -DCMAKE_BUILD_TYPE=Debug
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
export TSAN_OPTIONS=${TSAN_OPTIONS:-halt_on_error=1:second_deadlock_stack=1:suppressions=$PWD/tests/tsan.supp}
if [ "$SAN" = thread ]; then
  ctest --test-dir "$GKV_BUILD_DIR" --output-on-failure -j "$(nproc)" --timeout 600 -R Concurrent
else
  ctest --test-dir "$GKV_BUILD_DIR" --output-on-failure -j "$(nproc)" --timeout 600
fi
