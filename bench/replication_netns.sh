#!/usr/bin/env bash
# The effect of adaptive replication when each node's network link is the bottleneck.
#
# Three gkv nodes, each in its own network namespace (gkvbN) on a bridge, behind a veth pair
# whose node side is limited by tc (token bucket, RATE, default 400mbit), so the node holding the
# hottest keys saturates its link first. gkv-bench runs in the root namespace. Three workloads,
# each with the nodes' default flags (adaptive replication on, nothing set) and with
# `--replicate-hot off`:
#   embeddings  gkv-bench --workload embeddings (zipf 0.99 rows of 512 B in MultiGet batches)
#   zipf0.99    single gets, 64 KiB values, zipf 0.99 over 1000 keys
#   zipf1.2     the same at zipf 1.2
# For each it prints throughput, p99, and the busiest node's share of the rows read (gets, batch
# rows and reads served by copies, from the nodes' stats), against an even share of 33.3%, and a
# third run with uniform keys (replication off) as the reference of what the links allow when
# the load is even.
# Everything it creates (namespaces, veths, tc qdiscs, processes) is removed on exit; processes
# are stopped by pid. Needs root, iproute2 and build/.
#   bench/replication_netns.sh [SECONDS] [RATE] [WORKLOADS...]
# Addresses: 10.77.0.1 (the bridge, where gkv-bench runs) and 10.77.0.11-13 (the nodes): the
# script's own test hosts.
set -euo pipefail
cd "$(dirname "$0")/.."
SECS=${1:-15}
RATE=${2:-400mbit}
shift $(( $# > 2 ? 2 : $# ))
WORKLOADS=("$@")
[ ${#WORKLOADS[@]} -gt 0 ] || WORKLOADS=(embeddings zipf0.99 zipf1.2)
N=3
DIR=$(mktemp -d /tmp/gkv-netns-XXXXXX)
PIDS=()

cleanup() {
  for p in "${PIDS[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
  for p in "${PIDS[@]}"; do wait "$p" 2>/dev/null || true; done
  for i in $(seq 0 $((N - 1))); do
    ip link del "gkvb$i-h" 2>/dev/null || true
    ip netns del "gkvb$i" 2>/dev/null || true
  done
  ip link del gkvb-br 2>/dev/null || true
  rm -rf "$DIR"
}
trap cleanup EXIT
command -v ip > /dev/null || { echo "needs iproute2" >&2; exit 2; }
[ "$(id -u)" -eq 0 ] || { echo "needs root (network namespaces)" >&2; exit 2; }
[ -x build/bin/gkv-server ] || scripts/build.sh

ip link add gkvb-br type bridge
ip addr add 10.77.0.1/24 dev gkvb-br
ip link set gkvb-br up
for i in $(seq 0 $((N - 1))); do
  ip netns add "gkvb$i"
  ip link add "gkvb$i-h" type veth peer name "gkvb$i-n"
  ip link set "gkvb$i-n" netns "gkvb$i"
  ip link set "gkvb$i-h" master gkvb-br
  ip link set "gkvb$i-h" up
  ip netns exec "gkvb$i" ip addr add "10.77.0.$((11 + i))/24" dev "gkvb$i-n"
  ip netns exec "gkvb$i" ip link set "gkvb$i-n" up
  ip netns exec "gkvb$i" ip link set lo up
  # The node's outgoing link (its replies, and its copies to other nodes) is the bottleneck.
  ip netns exec "gkvb$i" tc qdisc add dev "gkvb$i-n" root tbf rate "$RATE" burst 256kb latency 50ms
done

run() {  # label workload dist extra-server-args...   (dist "" keeps the workload's own)
  local label=$1 workload=$2 dist=$3
  shift 3
  echo "nodes:" > "$DIR/cluster.yaml"
  for i in $(seq 0 $((N - 1))); do
    echo "  - {id: n$i, address: 10.77.0.$((11 + i)):7000}" >> "$DIR/cluster.yaml"
  done
  PIDS=()
  for i in $(seq 0 $((N - 1))); do
    # Every namespace has its own 127.0.0.1, which UCX would take for a shared one (same host):
    # keep UCX on the veths.
    UCX_NET_DEVICES="gkvb$i-n" ip netns exec "gkvb$i" build/bin/gkv-server --cluster "$DIR/cluster.yaml" --node "n$i" \
      --host-mem 512MiB --threads 2 "$@" > "$DIR/$label-node$i.log" 2>&1 &
    PIDS+=($!)
  done
  for i in $(seq 0 $((N - 1))); do
    for _ in $(seq 1 100); do grep -q "up on" "$DIR/$label-node$i.log" && break; sleep 0.1; done
  done
  local load=()
  case $workload in
    embeddings) load=(--workload embeddings --key-dist "${dist:-zipf:0.99}") ;;
    zipf0.99) load=(--keys 1000 --key-dist "${dist:-zipf:0.99}" --value-size 64KiB --ratio 1:0) ;;
    zipf1.2) load=(--keys 1000 --key-dist "${dist:-zipf:1.2}" --value-size 64KiB --ratio 1:0) ;;
    *) echo "unknown workload $workload" >&2; return 1 ;;
  esac
  # UCX >= 1.15 leaves bridge devices out unless asked.
  export UCX_NET_DEVICES=gkvb-br UCX_TCP_BRIDGE_ENABLE=y
  build/bin/gkv-bench --cluster "$DIR/cluster.yaml" --threads 2 --connections 4 "${load[@]}" \
    --duration "$SECS" --warmup 3 --json "$DIR/$label.json" > "$DIR/$label.bench.log" 2>&1 ||
    { tail -n 20 "$DIR/$label.bench.log" "$DIR/$label"-node*.log >&2; return 1; }
  build/bin/gkv --cluster "$DIR/cluster.yaml" stats --json > "$DIR/$label.stats.json"
  for p in "${PIDS[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
  for p in "${PIDS[@]}"; do wait "$p" 2>/dev/null || true; done
  PIDS=()
  python3 - "$label" "$DIR/$label.json" "$DIR/$label.stats.json" <<'PY'
import json, sys
label, bench, stats = sys.argv[1:4]
b = json.load(open(bench))
nodes = json.load(open(stats))
rows = {n["node"]: n["replication"]["rows_read"] for n in nodes}
served = sum(n["replication"]["reads_served"] for n in nodes)
copies = sum(n["replication"]["created"] for n in nodes)
total = sum(rows.values()) or 1
busiest = max(rows, key=rows.get)
op = "mget" if "mget" in b["latency_us"] else "get"
lat = b["latency_us"][op]
print(f"{label:24s} {b['keys_per_s']:10.0f} rows/s {b['gb_per_s']:7.3f} GB/s  {op} p50 {lat['p50']:8.0f} us"
      f"  p99 {lat['p99']:8.0f} us  busiest {busiest} {100*rows[busiest]/total:5.1f}% of rows"
      f" ({3*rows[busiest]/total:4.2f}x even)  copies {copies}  served by copies {served}"
      f"  errors {sum(b['errors'].values())}")
PY
}

echo "3 nodes, node egress limited to $RATE each; ${SECS}s per run (+3 s warm-up)"
echo "(-even: the same workload with uniform keys and replication off, the links' even-load rate)"
for w in "${WORKLOADS[@]}"; do
  run "$w-default" "$w" ""
  run "$w-off" "$w" "" --replicate-hot off
  run "$w-even" "$w" uniform --replicate-hot off
  python3 - "$DIR/$w-default.json" "$DIR/$w-even.json" <<'PY'
import json, sys
d, e = (json.load(open(f)) for f in sys.argv[1:3])
print(f"  default / even: {d['gb_per_s'] / e['gb_per_s']:.2f}x throughput")
PY
done
