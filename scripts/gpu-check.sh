#!/usr/bin/env bash
# GPU check in two halves, because the GPU machine has no compiler, no packages and no network.
#
#   scripts/gpu-check.sh prepare   here: build with CUDA (static runtime), collect the binaries
#                                  and every shared library they need (from the installed Debian
#                                  packages, found with ldd) into gpu-bundle/ (ignored by git).
#   scripts/gpu-check.sh run       there: run the gpu-labelled tests, the whole unit suite, the
#                                  Python CUDA tests (when that machine has a CUDA torch), the
#                                  storage benchmarks (GPU tier next to cudaMemcpy) and the
#                                  cluster check (below; once more with UCX unable to move CUDA
#                                  memory, so the client's pipelined staging runs on the GPU),
#                                  writing everything under $OUT (or ./gpu-results). A missing
#                                  GPU fails it.
#   scripts/gpu-check.sh cpu [BINDIR]
#                                  here and in CI (a ctest entry): the same cluster check on
#                                  the binaries in BINDIR (default build/bin) in both fake-device
#                                  flavours (host memory standing in for the GPU), small sizes,
#                                  and the gpu tests (which skip without a GPU), so the script
#                                  cannot rot. Its figures measure memcpy, not a GPU.
#
# The cluster check: a 2-node cluster on this machine's one GPU (nodes with --gpu-mem, a host
# tier and a disk tier, started by scripts/cluster.sh), and gkv-gpu-check as its client:
# puts from and gets into cudaMalloc buffers of 4 KiB .. 256 MiB with every byte checked,
# values written past both memory tiers that spill GPU -> host -> disk and are promoted back
# (bytes checked on every read), and the table: GPU-tier put and get (GB/s, p50) next to
# cudaMemcpy device to device and pinned host <-> device of the same sizes, same run.
#
# With the device tool: prepare here, then run with carry=["gpu-bundle"] and the command
# `scripts/gpu-check.sh run`.
set -euo pipefail
cd "$(dirname "$0")/.."
BUNDLE=gpu-bundle

prepare() {
  GKV_BUILD_DIR=build-gpu scripts/build.sh -DGKV_WITH_CUDA=ON -DCMAKE_BUILD_TYPE=Release
  rm -rf "$BUNDLE"
  mkdir -p "$BUNDLE/bin" "$BUNDLE/lib"
  local bins=(build-gpu/bin/*)
  cp "${bins[@]}" "$BUNDLE/bin/"
  strip --strip-debug "$BUNDLE"/bin/* 2>/dev/null || true
  # Every resolved shared library except glibc's own (the GPU machine's glibc is used).
  for b in "${bins[@]}"; do ldd "$b"; done | awk '/=> \//{print $3}' | sort -u | while read -r lib; do
    case "$(basename "$lib")" in
      libc.so*|libm.so*|libpthread.so*|libdl.so*|librt.so*|ld-linux*|libcuda.so*) ;;
      *) cp -L "$lib" "$BUNDLE/lib/" ;;
    esac
  done
  strip --strip-unneeded "$BUNDLE"/lib/* 2>/dev/null || true
  # UCX loads its transports (cuda_copy, cuda_ipc, cma, ...) as modules from lib/ucx beside
  # libucs; the wheel's CUDA modules need the CUDA runtime it vendors (libucx_cu13.libs).
  local ucx_prefix
  ucx_prefix=$(sed -n 's/^GKV_UCX_PREFIX:PATH=//p' build-gpu/CMakeCache.txt)
  cp -rL "$ucx_prefix/lib/ucx" "$BUNDLE/lib/ucx"
  rm -f "$BUNDLE"/lib/ucx/*.a "$BUNDLE"/lib/ucx/*.la "$BUNDLE"/lib/ucx/libucx_perftest_cuda*
  if [ -d "$ucx_prefix/../libucx_cu13.libs" ]; then cp -L "$ucx_prefix"/../libucx_cu13.libs/* "$BUNDLE/lib/"; fi
  mkdir -p "$BUNDLE/ucx-bin"
  cp -L "$ucx_prefix/bin/ucx_info" "$ucx_prefix/bin/ucx_perftest" "$BUNDLE/ucx-bin/"
  # The Python package (extension + pure Python) and its tests; they need the same libraries
  # as the binaries, already collected above.
  if [ -d build-gpu/python/gkv ]; then
    mkdir -p "$BUNDLE/python"
    cp -r build-gpu/python/gkv "$BUNDLE/python/"
    cp -r python/tests "$BUNDLE/python-tests"
  fi
  du -sh "$BUNDLE"
}

# cluster_check BINDIR OUT NAME GKV_GPU_CHECK_ARGS... -- GKV_SERVER_ARGS...
cluster_check() {
  local bindir=$1 out=$2 name=$3
  shift 3
  local check_args=()
  while [ $# -gt 0 ] && [ "$1" != "--" ]; do check_args+=("$1"); shift; done
  shift
  local dir rc=0
  dir=$(mktemp -d /tmp/gkv-gpu-check.XXXXXX)
  # Killed midway (a ctest timeout): the nodes stop and the directory goes all the same.
  trap 'scripts/cluster.sh stop "'"$dir"'" > /dev/null 2>&1 || true; rm -rf "'"$dir"'"' EXIT
  if GKV_SERVER_BIN="$bindir/gkv-server" scripts/cluster.sh start "$dir" 2 "$@"; then
    "$bindir/gkv-gpu-check" --cluster "$dir/cluster.yaml" "${check_args[@]}" 2>&1 |
      tee "$out/$name.txt" || rc=1
  else
    echo "gpu-check: the 2-node cluster did not start" | tee "$out/$name.txt"
    rc=1
  fi
  scripts/cluster.sh stop "$dir" || true
  if [ "$rc" -ne 0 ]; then
    for log in "$dir"/node*.log; do echo "== $log"; tail -n 20 "$log"; done
  fi
  for log in "$dir"/node*.log; do cp "$log" "$out/$name-$(basename "$log")" 2> /dev/null || true; done
  rm -rf "$dir"
  trap - EXIT
  return $rc
}

cpu() {
  local bindir=${1:-build/bin}
  local out=${OUT:-} made_out=0
  if [ -z "$out" ]; then
    out=$(mktemp -d /tmp/gkv-gpu-check-cpu.XXXXXX)
    made_out=1
  fi
  mkdir -p "$out"
  local rc=0
  "$bindir/gpu_test" 2>&1 | tail -n 3 || rc=1
  for flavour in ucx 1; do
    echo "== cluster check, GKV_FAKE_DEVICE=$flavour"
    # With UCX moving the stand-in memory the values live in the GPU tier; without, that tier
    # sits behind host memory and new values go to host memory.
    local tier=gpu
    [ "$flavour" = 1 ] && tier=host
    GKV_FAKE_DEVICE=$flavour cluster_check "$bindir" "$out" "cluster_check_fake_$flavour" \
      --sizes 4KiB,64KiB,1MiB,4MiB,20MiB --reps 5 --expect-tier "$tier" \
      --spill-values 160 --spill-value-size 2MiB -- \
      --gpu-mem 32MiB --host-mem 64MiB --disk-capacity 1GiB --threads 2 || rc=1
  done
  if [ "$made_out" = 1 ]; then rm -rf "$out"; fi
  return $rc
}

run() {
  local out=${OUT:-$PWD/gpu-results}
  mkdir -p "$out"
  export LD_LIBRARY_PATH="$PWD/$BUNDLE/lib:${LD_LIBRARY_PATH:-}"
  [ -d "$BUNDLE/lib/ucx" ] && export UCX_MODULE_DIR="$PWD/$BUNDLE/lib/ucx"
  {
    echo "== nvidia-smi"; nvidia-smi || true
    echo "== date"; date -u
  } > "$out/machine.txt" 2>&1
  local rc=0
  # There, a GPU test that finds no GPU fails instead of skipping.
  GKV_REQUIRE_GPU=1 "$BUNDLE/bin/gpu_test" --gtest_output=json:"$out/gpu_test.json" 2>&1 | tee "$out/gpu_test.txt" || rc=1
  for t in common_test storage_test cache_test; do
    "$BUNDLE/bin/$t" 2>&1 | tail -n 3 | tee -a "$out/unit_tests.txt" || rc=1
  done
  # Python CUDA tests (python/tests, the ones that skip without CUDA). They need a Python with
  # numpy, pytest and a CUDA build of torch on that machine, which the bundle can't carry
  # (Debian's torch here is CPU-only); the GPU machine's python3 has them. Where they cannot
  # run, the check fails: a GPU check that skipped its CUDA tensors proved nothing about them.
  local py=${GKV_GPU_PYTHON:-python3}
  if [ -d "$BUNDLE/python" ] && "$py" -c "import numpy, pytest, torch; assert torch.cuda.is_available()" 2>/dev/null; then
    PYTHONPATH="$PWD/$BUNDLE/python" GKV_SERVER_BIN="$PWD/$BUNDLE/bin/gkv-server" \
      "$py" -m pytest -q -rs -p no:cacheprovider -k cuda "$BUNDLE/python-tests" 2>&1 |
      tee "$out/python_cuda.txt" || rc=1
  else
    echo "python CUDA tests FAILED TO RUN: no bundled package, or no Python with numpy," \
      "pytest and CUDA torch here (set GKV_GPU_PYTHON)" | tee "$out/python_cuda.txt"
    rc=1
  fi
  "$BUNDLE/bin/gkv-storage-bench" --benchmark_min_time=0.2 \
    --benchmark_out="$out/storage_bench.json" --benchmark_out_format=json 2>&1 |
    tee "$out/storage_bench.txt" || rc=1
  # Last, so that its table ends the output. 1 GiB GPU tiers hold the 256 MiB values (and an
  # overwrite's new copy beside the old); 320 values of 16 MiB (5 GiB) are more than both
  # nodes' GPU and host tiers hold (4 GiB).
  # The staged paths on the real GPU: UCX without its CUDA transports cannot move device
  # memory, so the client stages through pinned buffers (values over 16 MiB pipelined: streamed
  # puts, ranged gets) and the nodes' GPU tier sits behind host memory.
  echo "== cluster check, staged (UCX_TLS without the CUDA transports)"
  UCX_TLS='^cuda_copy,cuda_ipc,gdr_copy' cluster_check "$BUNDLE/bin" "$out" cluster_check_staged \
    --sizes 4KiB,1MiB,16MiB,64MiB,256MiB --reps 10 --expect-tier host -- \
    --gpu-mem 1GiB --host-mem 1GiB --disk-capacity 16GiB --threads 4 || rc=1
  echo "== cluster check (2 nodes on GPU 0)"
  cluster_check "$BUNDLE/bin" "$out" cluster_check --expect-tier gpu \
    --spill-values 320 --spill-value-size 16MiB -- \
    --gpu-mem 1GiB --host-mem 1GiB --disk-capacity 16GiB --threads 4 || rc=1
  return $rc
}

case "${1:-}" in
  prepare) prepare ;;
  run) run ;;
  cpu) cpu "${2:-build/bin}" ;;
  *) echo "usage: scripts/gpu-check.sh prepare|run|cpu [BINDIR]" >&2; exit 2 ;;
esac
