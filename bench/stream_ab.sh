#!/usr/bin/env bash
# Streamed against one-message puts of large values (gkv-bench --stream-threshold), same run,
# each point twice, alternating: into host memory and to disk, over shared memory (UCX's
# default on one host) and UCX_TLS=tcp. A fresh one-node cluster (scripts/cluster.sh) per run,
# so the node's peak resident memory growth (VmHWM) printed is that run's own.
#   bench/stream_ab.sh [VALUE_SIZE] [SECONDS]      (default 128MiB, 4 s)
# The nodes' disk tiers live under GKV_BENCH_DIR (default: TMPDIR, else /tmp): put it on a real
# disk, or the "disk" rows measure memory. A run whose puts failed, or whose node died, stops
# the script with the node's log.
set -euo pipefail
cd "$(dirname "$0")/.."
SIZE=${1:-128MiB}; SECS=${2:-4}
dir=$(mktemp -d "${GKV_BENCH_DIR:-${TMPDIR:-/tmp}}/streamab.XXXX")
trap 'scripts/cluster.sh stop "$dir/c" > /dev/null 2>&1 || true; rm -rf "$dir"' EXIT
fail() { echo "$1" >&2; cat "$dir/c/node0.log" >&2 || true; exit 1; }
for tls in default tcp; do
  for tier in memory disk; do
    mem=$([ "$tier" = memory ] && echo 1GiB || echo 16MiB)  # disk: larger than a memory slice
    for round in 1 2; do
      for how in "one message" streamed; do
        threshold=$([ "$how" = streamed ] && echo 1MiB || echo 1TiB)
        if [ "$tls" = tcp ]; then export UCX_TLS=tcp; else unset UCX_TLS; fi
        rm -rf "$dir/c"
        scripts/cluster.sh start "$dir/c" 1 --host-mem "$mem" --disk-capacity 8GiB > /dev/null
        pid=$(cat "$dir/c/pids")
        base=$(awk '/VmHWM/ {print $2}' "/proc/$pid/status")
        out=$(build/bin/gkv-bench --cluster "$dir/c/cluster.yaml" --threads 1 --connections 1 \
          --ratio 0:1 --keys 4 --value-size "$SIZE" --duration "$SECS" --warmup 1 \
          --timeout-ms 60000 --stream-threshold "$threshold" --no-load 2>&1) ||
          fail "gkv-bench failed: $out"
        kill -0 "$pid" 2> /dev/null || fail "the node died during the run: $out"
        errors=$(echo "$out" | awk '$1 == "errors" {print $2}')
        [ "$errors" = 0 ] || fail "$errors puts failed: $out"
        peak=$(awk '/VmHWM/ {print $2}' "/proc/$pid/status")
        scripts/cluster.sh stop "$dir/c" > /dev/null
        printf '%-7s %-6s round %s %-11s | %s | put p50 %s us | node peak memory +%s MiB\n' \
          "$tls" "$tier" "$round" "$how" \
          "$(echo "$out" | grep -E '^duration' | sed 's/^duration //')" \
          "$(echo "$out" | awk '$1 == "put" {print $3}')" "$(( (peak - base) / 1024 ))"
      done
    done
  done
done
