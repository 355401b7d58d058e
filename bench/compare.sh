#!/usr/bin/env bash
# gkv next to Redis and memcached on this machine: the same value sizes (64 B, 4 KiB, 1 MiB,
# 16 MiB), the same concurrency and the same load generator (gkv-bench speaks RESP and the
# memcached text protocol too), plus ucx_perftest on gkv's transport as the ceiling.
# Every server runs on 127.0.0.1, is started here and stopped by process id.
#   bench/compare.sh [SECONDS_PER_POINT] [THREADS] [CONNECTIONS] [IO_THREADS]
# The gkv node runs IO_THREADS UCX I/O threads (--io-threads, default 1) and memcached as many
# worker threads (override with MC_THREADS), so ops/s compare server threads like for like;
# both counts are printed.
# GKV_BIN_DIR (absolute, or relative to the repository's root): the build whose gkv-server
# (unless GKV_SERVER_BIN names one) and gkv-bench are measured as gkv (default build/bin),
# so an older commit built elsewhere is measured in the same run; Redis and memcached are always
# driven by build/bin/gkv-bench. A gkv-server older than --io-threads runs one I/O thread, so
# IO_THREADS must then be 1.
# Installs redis-server and memcached (Debian packages) when missing. Needs build/.
set -euo pipefail
cd "$(dirname "$0")/.."
SECS=${1:-5}
THREADS=${2:-2}
CONNS=${3:-2}
GKV_IO_THREADS=${4:-1}
MC_THREADS=${MC_THREADS:-$GKV_IO_THREADS}
need=()
command -v redis-server > /dev/null || need+=(redis-server)
command -v memcached > /dev/null || need+=(memcached)
if ((${#need[@]})); then
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" > /dev/null
fi
[ -x build/bin/gkv-bench ] || scripts/build.sh
GKV_BIN=${GKV_BIN_DIR:-build/bin}
export GKV_SERVER_BIN=${GKV_SERVER_BIN:-$GKV_BIN/gkv-server}  # for scripts/cluster.sh
io_args=(--io-threads "$GKV_IO_THREADS")
# The whole help text read before it is searched: `--help | grep -q` under pipefail fails
# whenever grep leaves before the server's last write (which SIGPIPE then kills).
server_help=$("$GKV_SERVER_BIN" --help 2>&1 || true)
if [[ $server_help != *--io-threads* ]]; then
  [[ $server_help == *--cluster* ]] || { echo "$GKV_SERVER_BIN: not a gkv-server" >&2; exit 2; }
  if [ "$GKV_IO_THREADS" != 1 ]; then
    echo "$GKV_SERVER_BIN runs one I/O thread (it has no --io-threads)" >&2
    exit 2
  fi
  io_args=()
fi

DIR=$(mktemp -d /tmp/gkv-compare-XXXXXX)
PIDS=()
cleanup() {
  scripts/cluster.sh stop "$DIR/gkv" > /dev/null 2>&1 || true
  for p in "${PIDS[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
  for p in "${PIDS[@]}"; do wait "$p" 2>/dev/null || true; done
  rm -rf "$DIR"
}
trap cleanup EXIT
port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

REDIS_PORT=$(port)
redis-server --port "$REDIS_PORT" --bind 127.0.0.1 --save '' --appendonly no \
  --protected-mode no --proto-max-bulk-len 64mb > "$DIR/redis.log" 2>&1 &
PIDS+=($!)
MC_PORT=$(port)
MC_USER=()
[ "$(id -u)" -eq 0 ] && MC_USER=(-u root)  # memcached refuses to run as root without -u
memcached "${MC_USER[@]}" -l 127.0.0.1 -p "$MC_PORT" -U 0 -m 4096 -I 32m -t "$MC_THREADS" > "$DIR/memcached.log" 2>&1 &
PIDS+=($!)
scripts/cluster.sh start "$DIR/gkv" 1 --host-mem 4GiB --disk-capacity 8GiB --threads 2 \
  "${io_args[@]}" > /dev/null
sleep 0.5

run() {  # system size op keys -> json
  local sys=$1 size=$2 op=$3 keys=$4 out="$DIR/$1-$2-$3.json"
  local ratio=$([ "$op" = get ] && echo 1:0 || echo 0:1)
  local target=(--cluster "$DIR/gkv/cluster.yaml") bench=$GKV_BIN/gkv-bench
  [ "$sys" = gkv ] || bench=build/bin/gkv-bench
  [ "$sys" = redis ] && target=(--protocol redis --server "127.0.0.1:$REDIS_PORT")
  [ "$sys" = memcached ] && target=(--protocol memcached --server "127.0.0.1:$MC_PORT")
  "$bench" "${target[@]}" --threads "$THREADS" --connections "$CONNS" \
    --keys "$keys" --value-size "$size" --ratio "$ratio" --duration "$SECS" --warmup 1 \
    --json "$out" > "$DIR/$sys-$size-$op.log" 2>&1 || { cat "$DIR/$sys-$size-$op.log" >&2; }
  echo "$out"
}
perf_bw() {  # bytes -> MB/s of ucp_am_bw over tcp
  local p; p=$(port)
  UCX_TLS=tcp scripts/ucx.sh ucx_perftest -p "$p" > /dev/null 2>&1 &
  local s=$!
  sleep 0.5
  UCX_TLS=tcp scripts/ucx.sh ucx_perftest 127.0.0.1 -p "$p" -t ucp_am_bw -s "$1" -n "$2" -w 20 2>&1 |
    awk '/^Final/{print $7}'
  wait "$s" 2>/dev/null || true
}

echo "gkv vs Redis vs memcached: $THREADS threads x $CONNS connections, ${SECS}s per point, 1 node each, loopback"
echo "server threads: gkv $GKV_IO_THREADS I/O thread(s) (+2 executors), memcached $MC_THREADS worker thread(s), redis 1"
printf '%-7s %-4s %-10s %12s %10s %10s %10s %12s %12s\n' size op system "ops/s" "GB/s" "p50 us" \
  "p99 us" "gkv/peer ops" "ceiling GB/s"
for spec in "64:64:10000:20000" "4KiB:4096:10000:20000" "1MiB:1048576:64:2000" "16MiB:16777216:16:200"; do
  IFS=: read -r size bytes keys iters <<< "$spec"
  ceiling=$(perf_bw "$bytes" "$iters")
  for op in get put; do
    g=$(run gkv "$size" "$op" "$keys")
    r=$(run redis "$size" "$op" "$keys")
    m=$(run memcached "$size" "$op" "$keys")
    python3 - "$size" "$op" "$g" "$r" "$m" "$ceiling" <<'PY'
import json, sys
size, op, files, ceiling = sys.argv[1], sys.argv[2], sys.argv[3:6], sys.argv[6]
names = ["gkv", "redis", "memcached"]
data = []
for f in files:
    try:
        data.append(json.load(open(f)))
    except Exception:
        data.append(None)
g = data[0]
for name, d in zip(names, data):
    if d is None:
        print(f"{size:7s} {op:4s} {name:10s} {'failed':>12s}")
        continue
    lat = d["latency_us"].get(op, {"p50": 0, "p99": 0})
    ratio = "" if name == "gkv" or not g or not d["ops_per_s"] else f"{g['ops_per_s']/d['ops_per_s']:.2f}"
    ceil = f"{float(ceiling)*1.048576e6/1e9:.3f}" if name == "gkv" and ceiling else ""
    errs = sum(d["errors"].values())
    note = f"  errors {errs}" if errs else ""
    print(f"{size:7s} {op:4s} {name:10s} {d['ops_per_s']:12.0f} {d['gb_per_s']:10.3f} {lat['p50']:10.1f} {lat['p99']:10.1f} {ratio:>12s} {ceil:>12s}{note}")
PY
  done
done
echo "(ceiling: ucx_perftest ucp_am_bw over tcp, one stream, same size)"
