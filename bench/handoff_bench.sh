#!/usr/bin/env bash
# Scale-out under load: what a joining node costs the readers, and how fast keys move.
#   bench/handoff_bench.sh [KEYS] [VALUE_SIZE] [HANDOFF_RATE]     (defaults 6000 64KiB 256MiB)
# Starts etcd and 3 nodes on loopback (scripts/cluster.sh --etcd), writes KEYS values, then runs
# two read-only gkv-bench passes with the same open-loop rate: a baseline, and one during which a
# 4th node joins (the nodes hand it a quarter of the keys). Prints both reports, each node's
# handoff line (keys, bytes, seconds, MB/s) and the 4th node's stats; stops everything by pid.
# Needs a build (scripts/build.sh). Everything binds 127.0.0.1.
set -euo pipefail
cd "$(dirname "$0")/.."
KEYS=${1:-6000}
VALUE=${2:-64KiB}
RATE=${3:-256MiB}
READ_RATE=${GKV_BENCH_RATE:-2000}  # gets/s, open loop (latency counted from the intended send)
SECONDS_EACH=${GKV_BENCH_SECONDS:-12}
dir=$(mktemp -d /tmp/gkv-handoff.XXXXXX)
bin=build/bin
n3_pid=""
cleanup() {
  if [ -n "$n3_pid" ]; then kill -TERM "$n3_pid" 2>/dev/null || true; wait "$n3_pid" 2>/dev/null || true; fi
  scripts/cluster.sh stop "$dir" || true
}
trap cleanup EXIT

node_opts=(--host-mem 256MiB --disk-capacity 4GiB --threads 2 --handoff-rate "$RATE")
scripts/cluster.sh start "$dir" 3 --etcd "${node_opts[@]}"
common=(--cluster "$dir/cluster.yaml" --keys "$KEYS" --value-size "$VALUE" --threads 2
        --connections 4 --timeout-ms 5000)

echo "=== writing $KEYS values of $VALUE"
"$bin/gkv-bench" "${common[@]}" --ratio 1:0 --requests 1 --warmup 0 > "$dir/load.txt"
tail -n 3 "$dir/load.txt"

echo "=== baseline: ${SECONDS_EACH} s of gets at $READ_RATE/s, 3 nodes"
"$bin/gkv-bench" "${common[@]}" --no-load --ratio 1:0 --rate "$READ_RATE" \
  --duration "$SECONDS_EACH" --warmup 1 --json "$dir/before.json" > "$dir/before.txt"
cat "$dir/before.txt"

echo "=== the same while n3 joins (2 s in)"
"$bin/gkv-bench" "${common[@]}" --no-load --ratio 1:0 --rate "$READ_RATE" \
  --duration "$SECONDS_EACH" --warmup 1 --json "$dir/during.json" > "$dir/during.txt" &
bench_pid=$!
sleep 3
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1]); s.close()')
"$bin/gkv-server" --cluster "$dir/cluster.yaml" --node n3 --listen "127.0.0.1:$port" \
  --disk "$dir/disk3" "${node_opts[@]}" > "$dir/node3.log" 2>&1 &
n3_pid=$!
wait "$bench_pid"
cat "$dir/during.txt"

echo "=== handoff lines"
grep -h "handoff for ring epoch" "$dir"/node*.log || echo "(no handoff line)"
echo "=== n3"
grep -h "up on\|ring epoch" "$dir/node3.log" | head -3 || true
"$bin/gkv" --cluster "$dir/cluster.yaml" stats --json > "$dir/stats.json" 2>/dev/null || true
python3 - "$dir/stats.json" <<'PY'
import json, sys
try:
    data = json.load(open(sys.argv[1]))
except Exception as e:
    sys.exit(f"(stats unreadable: {e})")
for n in data if isinstance(data, list) else data.get("nodes", [data]):
    t, m = n.get("tiers", {}), n.get("membership", {})
    objs = sum(t.get(k, {}).get("objects", 0) for k in ("gpu", "host", "disk"))
    print(f"{n.get('node', '?')}: {objs} objects; handoff in {m.get('handoff_keys_in')} keys "
          f"({m.get('handoff_bytes_in')} B), out {m.get('handoff_keys_out')} keys; "
          f"ring epoch {m.get('ring_epoch')}")
PY
