#!/usr/bin/env bash
# Puts from and gets into device buffers that the client's UCX cannot move: staged whole
# (one message, then the copy; or the copy, then one message) against staged piece by piece
# while other pieces are on the wire (gkv-bench --pipeline-threshold: streamed puts, ranged
# gets), same run, alternating, a fresh one-node cluster per run.
#   bench/pipeline_ab.sh [VALUE_SIZE] [ROUNDS] [SECONDS]      (default 64MiB, 3, 5 s)
# Without a GPU it runs in fake-device mode (GKV_FAKE_DEVICE=1, gkv/cuda.h): "device" buffers
# are host memory and the device-to-host copy is a memcpy, so it measures the overlap of the
# copies with the wire, not a GPU's copy speed. On a GPU machine set GKV_FAKE_DEVICE= (empty)
# and make UCX unable to move CUDA memory (e.g. UCX_TLS=^cuda_copy,cuda_ipc), or nothing is
# staged. A run whose puts failed stops the script with its output.
set -euo pipefail
cd "$(dirname "$0")/.."
SIZE=${1:-64MiB}; ROUNDS=${2:-3}; SECS=${3:-5}
export GKV_FAKE_DEVICE=${GKV_FAKE_DEVICE-1}
[ -n "$GKV_FAKE_DEVICE" ] || unset GKV_FAKE_DEVICE
dir=$(mktemp -d "${TMPDIR:-/tmp}/pipeab.XXXX")
trap 'scripts/cluster.sh stop "$dir/c" > /dev/null 2>&1 || true; rm -rf "$dir"' EXIT
echo "fake device: ${GKV_FAKE_DEVICE:-off}; ${SIZE} values, device buffers, 1 client thread"
for op in put get; do
  ratio=$([ "$op" = put ] && echo 0:1 || echo 1:0)
  for round in $(seq 1 "$ROUNDS"); do
    for how in whole pipelined; do
      threshold=$([ "$how" = pipelined ] && echo 1MiB || echo 1TiB)
      rm -rf "$dir/c"
      scripts/cluster.sh start "$dir/c" 1 --host-mem 2GiB --io-threads 1 > /dev/null
      out=$(build/bin/gkv-bench --cluster "$dir/c/cluster.yaml" --threads 1 --connections 1 \
        --ratio "$ratio" --keys 8 --value-size "$SIZE" --duration "$SECS" --warmup 1 \
        --memory cuda --timeout-ms 60000 --pipeline-threshold "$threshold" 2>&1) ||
        { echo "gkv-bench failed: $out" >&2; exit 1; }
      errors=$(echo "$out" | awk '$1 == "errors" {print $2}')
      [ "$errors" = 0 ] || { echo "$errors ${op}s failed: $out" >&2; exit 1; }
      scripts/cluster.sh stop "$dir/c" > /dev/null
      printf '%s round %s %-9s | %s | p50 %s us\n' "$op" "$round" "$how" \
        "$(echo "$out" | grep -E '^duration' | sed 's/^duration //')" \
        "$(echo "$out" | awk -v op="$op" '$1 == op {print $3}')"
    done
  done
done
