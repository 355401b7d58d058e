#!/usr/bin/env bash
# Streamed against one-message puts of large values (gkv-bench --stream-threshold), same run,
# each point twice, alternating: into host memory and to disk, over shared memory (UCX's
# default on one host) and UCX_TLS=tcp. A fresh one-node cluster (scripts/cluster.sh) per run,
# so the node's peak resident memory growth (VmHWM) printed is that run's own.
#   bench/stream_ab.sh [VALUE_SIZE] [SECONDS]      (default 128MiB, 4 s)
set -euo pipefail
cd "$(dirname "$0")/.."
SIZE=${1:-128MiB}; SECS=${2:-4}
dir=$(mktemp -d /tmp/streamab.XXXX)
trap 'scripts/cluster.sh stop "$dir/c" > /dev/null 2>&1 || true; rm -rf "$dir"' EXIT
for tls in default tcp; do
  for tier in memory disk; do
    mem=$([ "$tier" = memory ] && echo 1GiB || echo 16MiB)  # disk: larger than a memory slice
    for round in 1 2; do
      for threshold in 1TiB 64MiB; do  # one message, then streamed
        if [ "$tls" = tcp ]; then export UCX_TLS=tcp; else unset UCX_TLS; fi
        rm -rf "$dir/c"
        scripts/cluster.sh start "$dir/c" 1 --host-mem "$mem" --disk-capacity 8GiB > /dev/null
        pid=$(cat "$dir/c/pids")
        base=$(awk '/VmHWM/ {print $2}' "/proc/$pid/status")
        out=$(build/bin/gkv-bench --cluster "$dir/c/cluster.yaml" --threads 1 --connections 1 \
          --ratio 0:1 --keys 4 --value-size "$SIZE" --duration "$SECS" --warmup 1 \
          --timeout-ms 60000 --stream-threshold "$threshold" --no-load 2>&1)
        peak=$(awk '/VmHWM/ {print $2}' "/proc/$pid/status")
        scripts/cluster.sh stop "$dir/c" > /dev/null
        how=$([ "$threshold" = 64MiB ] && echo streamed || echo "one message")
        printf '%-7s %-6s round %s %-11s | %s | put p50 %s us | node peak memory +%s MiB\n' \
          "$tls" "$tier" "$round" "$how" \
          "$(echo "$out" | grep -E '^duration' | sed 's/^duration //')" \
          "$(echo "$out" | awk '$1 == "put" {print $3}')" "$(( (peak - base) / 1024 ))"
      done
    done
  done
done
