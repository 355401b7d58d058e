#!/usr/bin/env bash
# gkv's data path next to its ceiling, measured in the same run on the same transport:
#   - get and put bandwidth for 1 MiB and 16 MiB values (one client thread, one node)
#     vs ucx_perftest ucp_am_bw at the same size
#   - get latency p50/p99 for 4 KiB values vs ucx_perftest ucp_am_lat round trip (2 x one-way)
# Two transport sets, each a table: UCX_TLS=tcp (what two hosts use without RDMA), and "same
# host", UCX's own choice with every transport on. A UCX_TLS in the environment replaces both
# with one table on that set.
# ucx_perftest runs as gkv's endpoints do: PEER error handling (-e), a context with the wakeup
# feature (-I), and shared-memory error handling on (UCX_MM_ERROR_HANDLING=y, which gkv sets
# for itself). That mode decides the protocol: on one host both then move large messages as
# "rendezvous fragmented copy-in copy-out" over sysv shared memory. Without -e ucx_perftest
# picks CMA's zero-copy read instead, which UCX 1.22 does not select for endpoints with error
# handling (UCX_PROTO_INFO=y shows either choice), so that would not be the same transport.
# ucx_perftest is the one of the UCX gkv links (scripts/ucx.sh). Needs build/ (scripts/build.sh).
# GKV_BIN_DIR (absolute, or relative to the repository's root): the build whose gkv-server
# (unless GKV_SERVER_BIN names one) and gkv-bench are measured (default build/bin), so an older
# commit built elsewhere is measured against the same references.
#   bench/ucx_compare.sh [SECONDS_PER_POINT]
set -euo pipefail
cd "$(dirname "$0")/.."
SECS=${1:-5}
GKV_BIN=${GKV_BIN_DIR:-build/bin}
export GKV_SERVER_BIN=${GKV_SERVER_BIN:-$GKV_BIN/gkv-server}  # for scripts/cluster.sh
if [ -n "${UCX_TLS:-}" ]; then SETS=("$UCX_TLS"); else SETS=(tcp same-host); fi
# Both sides on the loopback device only (gkv nodes on loopback do so by themselves, unless
# UCX_TLS is set): the same lanes for both, and no UCX listener on another address.
export UCX_NET_DEVICES=${UCX_NET_DEVICES:-lo}
DIR=$(mktemp -d /tmp/gkv-ucxcmp-XXXXXX)
PERF_SERVER_PID=""
trap 'scripts/cluster.sh stop "$DIR" >/dev/null 2>&1 || true; [ -n "$PERF_SERVER_PID" ] && kill "$PERF_SERVER_PID" 2>/dev/null; rm -rf "$DIR"' EXIT
PORT=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')

PERF_MODE=(-e -I)  # PEER error handling and the wakeup feature, as gkv's endpoints have
perftest() {  # test size iterations -> prints the "Final:" line
  UCX_MM_ERROR_HANDLING=y scripts/ucx.sh ucx_perftest -p "$PORT" "${PERF_MODE[@]}" \
    > "$DIR/perf-server.log" 2>&1 &
  PERF_SERVER_PID=$!
  sleep 0.5
  UCX_MM_ERROR_HANDLING=y scripts/ucx.sh ucx_perftest 127.0.0.1 -p "$PORT" "${PERF_MODE[@]}" \
    -t "$1" -s "$2" -n "$3" -w 50 2>&1 | grep '^Final' || true
  wait "$PERF_SERVER_PID" 2>/dev/null || true
  PERF_SERVER_PID=""
}
# Final: iterations 50% avg overall avg_bw overall_bw avg_mr overall_mr (latency in us, MB/s)
perf_bw() { perftest ucp_am_bw "$1" "$2" | awk '{print $7}'; }          # MB/s
perf_tag_bw() { perftest tag_bw "$1" "$2" | awk '{print $7}'; }         # MB/s
perf_lat() { perftest ucp_am_lat "$1" "$2" | awk '{print $3}'; }        # one-way us, median

bench() {  # size ratio keys -> json file
  local out="$DIR/b-$1-$2.json"
  "$GKV_BIN/gkv-bench" --cluster "$DIR/cluster.yaml" --threads 1 --keys "$3" --value-size "$1" \
    --ratio "$2" --duration "$SECS" --warmup 1 --json "$out" > /dev/null
  echo "$out"
}
json() { python3 -c "import json,sys; d=json.load(open('$1')); print($2)"; }

table() {
printf '%-26s %14s %18s %8s %18s %8s\n' "metric" "gkv" "perftest ucp_am" "ratio" "perftest tag_bw" "ratio"
for size in 1MiB 16MiB; do
  bytes=$(python3 -c "print({'1MiB':1<<20,'16MiB':16<<20}['$size'])")
  [ "$size" = 1MiB ] && iters=4000 || iters=400
  ref=$(perf_bw "$bytes" "$iters")
  tag=$(perf_tag_bw "$bytes" "$iters")
  for op in get put; do
    ratio=$([ "$op" = get ] && echo 1:0 || echo 0:1)
    f=$(bench "$size" "$ratio" 32)
    gbs=$(json "$f" "d['gb_per_s']")
    python3 - "$op" "$size" "$gbs" "$ref" "$tag" <<'PY'
import sys
op, size, gbs = sys.argv[1], sys.argv[2], float(sys.argv[3])
ref, tag = (float(x) * 1.048576e6 / 1e9 for x in sys.argv[4:6])
print(f"{op+' bandwidth '+size:26s} {gbs:9.3f} GB/s {ref:13.3f} GB/s {gbs/ref:8.2f} {tag:13.3f} GB/s {gbs/tag:8.2f}")
PY
  done
done
lat=$(perf_lat 4096 20000)
f=$(bench 4KiB 1:0 1000)
python3 - "$f" "$lat" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))["latency_us"]["get"]
rtt = 2 * float(sys.argv[2])
print(f"{'get latency 4KiB p50':26s} {d['p50']:9.1f} us   {rtt:13.1f} us   {d['p50']/rtt:8.2f}")
print(f"{'get latency 4KiB p99':26s} {d['p99']:9.1f} us   {rtt:13.1f} us   {d['p99']/rtt:8.2f}")
PY
echo "(reference latency: ucx_perftest ucp_am_lat 4 KiB, median one-way x 2 = round trip;"
echo " ucx_perftest with -e -I and UCX_MM_ERROR_HANDLING=y, the endpoint mode gkv uses)"
}

for set in "${SETS[@]}"; do
  if [ "$set" = same-host ]; then unset UCX_TLS; else export UCX_TLS=$set; fi
  echo "== transports: $set"
  scripts/cluster.sh start "$DIR" 1 --host-mem 2GiB --disk-capacity 8GiB --threads 2 > /dev/null
  table
  scripts/cluster.sh stop "$DIR" > /dev/null
  rm -rf "$DIR"/disk0
done
