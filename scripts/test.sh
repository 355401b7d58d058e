#!/usr/bin/env bash
# Installs what is missing, builds, and runs the whole test suite:
#   1. every test (unit, integration with real gkv-server processes, gpu-labelled ones skip with a
#      reason without a GPU) on the normal build (build/)
#   2. the Python package's pytest suite (python/tests) on the normal build's package
#      (build/python), with the project's .venv Python (the system Python plus Debian's numpy,
#      torch and pytest), against real gkv-server processes; CUDA tests skip with a reason
#   3. the client wheel (scripts/wheel.sh) installed with pip into a fresh virtual environment
#      of the system python3 without its site packages, outside the checkout: it imports, and
#      python/tests/test_client.py passes against real nodes (its torch tests skip: the
#      environment holds the wheel, its dependencies from the package index and pytest only)
#   4. the wire-protocol fuzzer for a bounded time over its checked-in corpus
#   5. every test again under ASan+UBSan (build-asan/)
#   6. the cache and transport concurrency tests, the tests of a node's I/O workers (real
#      gkv-server processes built with TSan), of the client's synchronous calls from several
#      threads, of its timed-out transfers and of its staging threads, under TSan (build-tsan/)
# Options (environment): GKV_TEST_STEPS="normal python wheel fuzz asan tsan" picks steps;
# GKV_FUZZ_SECONDS (default 30). scripts/gpu-check.sh runs the gpu tests on a GPU machine.
# Under TSan, UCX's memory-event hooks (which patch malloc and mmap) fight TSan's own
# interceptors and crash; UCX_MEM_EVENTS=no turns them off for that step (gkv does not use them).
set -euo pipefail
cd "$(dirname "$0")/.."
STEPS=${GKV_TEST_STEPS:-normal python wheel fuzz asan tsan}
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
python_tests() {
  GKV_BUILD_DIR=build scripts/build.sh || return 1
  if ! ls build/python/gkv/_gkv*.so > /dev/null 2>&1; then
    echo "the build made no Python extension (build/python/gkv/_gkv*.so): is nanobind in .venv?"
    return 1
  fi
  local rc=0
  PYTHONPATH="$PWD/build/python" GKV_SERVER_BIN="$PWD/build/bin/gkv-server" \
    GKV_TEST_REQUIRE_TORCH=1 .venv/bin/python -m pytest -q -rs -p no:cacheprovider python/tests || rc=$?
  # pytest's 5 means it collected no test: that is a failure too.
  if [ "$rc" -eq 5 ]; then echo "pytest collected no tests"; fi
  return $rc
}
wheel_tests() {
  GKV_BUILD_DIR=build scripts/build.sh || return 1  # the nodes the tests start
  local wheel venv log rc=0 repo=$PWD
  log=$(mktemp)
  scripts/wheel.sh 2>&1 | tee "$log" || { rm -f "$log"; return 1; }
  wheel=$(tail -1 "$log" | cut -d' ' -f1)
  rm -f "$log"
  case "$wheel" in /*) ;; *) wheel="$repo/$wheel" ;; esac  # GKV_WHEEL_DIR may be absolute
  venv=$(mktemp -d /tmp/gkv-wheel-venv-XXXXXX)
  /usr/bin/python3 -m venv "$venv" &&
    "$venv/bin/python" -m pip install -q --disable-pip-version-check "$wheel" pytest==9.2.0 ||
    rc=1
  if [ $rc -eq 0 ]; then
    # From the venv's directory, so `import gkv` can only be the installed wheel.
    (cd "$venv" && "$venv/bin/python" -c \
      'import gkv, sys; f = gkv._gkv.__file__; print("gkv from", f); sys.exit("site-packages" not in f)') ||
      rc=1
  fi
  if [ $rc -eq 0 ]; then
    (cd "$venv" && GKV_SERVER_BIN="$repo/build/bin/gkv-server" \
      "$venv/bin/python" -m pytest -q -rs -p no:cacheprovider "$repo/python/tests/test_client.py") ||
      rc=$?
  fi
  rm -rf "$venv"
  return $rc
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
  # The node tests: a race in a node makes it exit 66, which the harness reports when it stops
  # the node (a graceful stop must exit 0).
  GKV_BUILD_DIR=build-tsan \
    GKV_TARGETS="storage_test cache_test transport_test gkv-server integration_test replication_test guarantees_test fake_device_test" \
    scripts/build.sh -DGKV_SANITIZE=thread -DGKV_BUILD_BENCH=OFF -DCMAKE_BUILD_TYPE=Debug &&
    UCX_MEM_EVENTS=no \
    TSAN_OPTIONS="halt_on_error=1:second_deadlock_stack=1:suppressions=$PWD/tests/tsan.supp" \
    ctest --test-dir build-tsan --output-on-failure -j "$JOBS" --timeout 600 \
    -R 'Concurren|Streamed|Pipelined|^IntegrationTest\..*(IoThread|SeveralClientThreads|SyncCalls)|^ReplicationTest\..*IoThread|^GuaranteesTest\..*(MidTransfer|LeftRunning|Abandoned)'
}

scripts/deps.sh
for s in $STEPS; do
  case "$s" in
    normal) step "tests (build/)" normal ;;
    python) step "Python tests (build/python)" python_tests ;;
    wheel) step "client wheel in a clean venv (dist/)" wheel_tests ;;
    fuzz) step "protocol fuzzer" fuzz ;;
    asan) step "tests under ASan+UBSan (build-asan/)" asan ;;
    tsan) step "concurrency and I/O-worker tests under TSan (build-tsan/)" tsan ;;
    *) echo "unknown step '$s'" >&2; exit 2 ;;
  esac
done
echo "=== summary"
printf '%s\n' "${results[@]}"
exit $overall
