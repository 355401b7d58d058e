#!/usr/bin/env bash
# Batch throughput of two gkv-server binaries side by side (an A/B of a change to the batch
# path), same run, each point twice, alternating: shared memory (UCX default on one host) and
# UCX_TLS=tcp. One node on 127.0.0.1, 1 I/O thread. MGETs by default; OP=mput measures MPUTs
# (gkv-bench --put-batch) instead. The client is build/bin/gkv-bench for both, unless
# BENCH_A / BENCH_B name the client of each side (to A/B a change to the client too).
#   bench/mget_ab.sh SERVER_A SERVER_B [SECONDS]   (e.g. a build of the previous commit as B)
set -euo pipefail
A=$1; B=$2; SECS=${3:-4}
default_bench=$(cd "$(dirname "$0")/.." && pwd)/build/bin/gkv-bench
BENCH_A=${BENCH_A:-$default_bench}; BENCH_B=${BENCH_B:-$default_bench}
OP=${OP:-mget}
dir=$(mktemp -d /tmp/mgetab.XXXX)
run() { # server bench tls size batch
  local srv=$1 bench=$2 tls=$3 size=$4 batch=$5
  local port; port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1]); s.close()')
  printf 'nodes:\n  - {id: n0, address: 127.0.0.1:%s}\n' "$port" > "$dir/c.yaml"
  if [ "$tls" = default ]; then envs=(); else envs=(UCX_TLS=$tls); fi
  env "${envs[@]}" "$srv" --cluster "$dir/c.yaml" --node n0 --host-mem 2GiB --io-threads 1 > "$dir/s.log" 2>&1 &
  local pid=$!
  for _ in $(seq 1 100); do grep -q "up on" "$dir/s.log" && break; sleep 0.1; done
  if [ "$OP" = mput ]; then ops=(--ratio 0:1 --put-batch "$batch"); else ops=(--ratio 1:0 --batch "$batch"); fi
  env "${envs[@]}" "$bench" --cluster "$dir/c.yaml" --keys 2048 --value-size "$size" "${ops[@]}" \
    --threads 2 --connections 2 --duration "$SECS" --warmup 1 --json "$dir/r.json" > "$dir/b.log" 2>&1 || true
  kill -TERM $pid; wait $pid || true
  python3 -c "import json; d=json.load(open('$dir/r.json')); print(f\"{d['gb_per_s']:.3f} GB/s {d['keys_per_s']:.0f} keys/s errors {sum(d['errors'].values())}\")"
}
printf '%-8s %-6s %-6s %-28s %-28s\n' tls value batch "A" "B"
for tls in default tcp; do
  for spec in 4096:64 65536:64 1048576:8; do
    IFS=: read -r size batch <<< "$spec"
    a=$(run "$A" "$BENCH_A" $tls $size $batch); b=$(run "$B" "$BENCH_B" $tls $size $batch)
    a2=$(run "$A" "$BENCH_A" $tls $size $batch); b2=$(run "$B" "$BENCH_B" $tls $size $batch)
    printf '%-8s %-6s %-6s %-28s %-28s\n' $tls $size $batch "$a" "$b"
    printf '%-8s %-6s %-6s %-28s %-28s\n' $tls $size $batch "$a2" "$b2"
  done
done
rm -rf "$dir"
