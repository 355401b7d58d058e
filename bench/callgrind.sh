#!/usr/bin/env bash
# Instructions and heap allocations per request on the hot path, counted with callgrind (stable
# on a noisy machine, unlike timings): GET and PUT of 64 B and 4 KiB values, server side and
# client side. Allocations are calls to malloc and its kin (bench/callgrind_allocs.py). A last
# row counts ucx_perftest's 64 B active-message round trip the same way (UCX's own floor), and
# one before it memcached's 64 B GET (server and load generator).
#   bench/callgrind.sh [N]      (default 2000 requests per run)
# GKV_SERVER_ARGS adds flags to the node's command line (e.g. "--placement-partitions 2").
# GKV_BIN_DIR (absolute, or relative to the repository's root): the build whose gkv-server and
# gkv-bench are counted (default build/bin), so an older commit built elsewhere is counted by
# this same method.
# Method: one node on 127.0.0.1, one client thread with one request in flight (gkv-bench
# --threads 1 --connections 1). For each case the measured side runs under
# `valgrind --tool=callgrind` twice, with N and 2N requests (a fresh node each time), and the
# figure is (Ir(2N) - Ir(N)) / N: start-up, the 16-key load before gets, and shutdown cancel
# out. The client side is gkv-bench itself (its request loop and latency histogram included).
# Busy-polling is off (GKV_BUSY_POLL_US=0) so idle spinning is not counted. Replication is off
# (one node). Instructions that count waiting, not work, are taken out of each total: UCX's
# start-up patching of its memory hooks and contended spin locks' spinning
# (bench/callgrind_allocs.py).
# Needs a build (scripts/build.sh) and valgrind (installed when missing).
set -euo pipefail
shopt -s inherit_errexit  # a reference run that fails inside $(...) stops the script
cd "$(dirname "$0")/.."
N=${1:-2000}
bin=${GKV_BIN_DIR:-$PWD/build/bin}
need=()
command -v valgrind > /dev/null || need+=(valgrind)
command -v memcached > /dev/null || need+=(memcached)
if ((${#need[@]})); then
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${need[@]}" > /dev/null
fi
dir=$(mktemp -d /tmp/gkv-callgrind.XXXXXX)
server_pid=""
cleanup() {
  if [ -n "$server_pid" ]; then kill -TERM "$server_pid" 2> /dev/null || true; fi
  wait 2> /dev/null || true
}
trap cleanup EXIT
export GKV_BUSY_POLL_US=0

free_port() {
  python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1]); s.close()'
}

# start_server [valgrind args...]: a fresh node (under the given wrapper, if any).
start_server() {
  local port
  port=$(free_port)
  printf 'nodes:\n  - {id: n0, address: 127.0.0.1:%s}\n' "$port" > "$dir/cluster.yaml"
  rm -rf "$dir/disk"
  # shellcheck disable=SC2086
  "$@" "$bin/gkv-server" --cluster "$dir/cluster.yaml" --node n0 --host-mem 64MiB \
    --threads 1 ${GKV_SERVER_ARGS:-} > "$dir/server.log" 2>&1 &
  server_pid=$!
  for _ in $(seq 1 300); do
    grep -q "up on" "$dir/server.log" 2> /dev/null && return 0
    kill -0 "$server_pid" 2> /dev/null || break
    sleep 0.1
  done
  echo "gkv-server did not start:" >&2
  cat "$dir/server.log" >&2
  exit 1
}

stop_server() {
  kill -TERM "$server_pid"
  wait "$server_pid" || true
  server_pid=""
}

# bench_args SIZE OP COUNT: the load, printed as an argument list.
bench_args() {
  local ratio=1:0
  if [ "$2" = put ]; then ratio=0:1; fi
  echo --cluster "$dir/cluster.yaml" --keys 16 --value-size "$1" --ratio "$ratio" \
    --requests "$3" --threads 1 --connections 1 --warmup 0 --timeout-ms 30000
}

# total_ir FILE: "INSTRUCTIONS ALLOCATIONS" (instructions less the waiting counted, see above)
total_ir() {
  local ir allocations excluded
  ir=$(awk '/^(summary|totals):/ { print $2; exit }' "$1")
  if [ -z "$ir" ]; then
    echo "no instruction total in $1" >&2
    exit 1
  fi
  read -r allocations excluded < <(python3 bench/callgrind_allocs.py "$1")
  echo "$((ir - excluded)) $allocations"
}

# server_ir SIZE OP COUNT
server_ir() {
  local out="$dir/server.$1.$2.$3.cg"
  start_server valgrind --tool=callgrind --callgrind-out-file="$out"
  # shellcheck disable=SC2046
  "$bin/gkv-bench" $(bench_args "$1" "$2" "$3") > "$dir/bench.log" 2>&1
  stop_server
  total_ir "$out"
}

# client_ir SIZE OP COUNT
client_ir() {
  local out="$dir/client.$1.$2.$3.cg"
  start_server
  # shellcheck disable=SC2046
  valgrind --tool=callgrind --callgrind-out-file="$out" "$bin/gkv-bench" \
    $(bench_args "$1" "$2" "$3") > "$dir/bench.log" 2>&1
  stop_server
  total_ir "$out"
}

printf '%-4s %6s %14s %14s %12s %12s   (per request, N=%d)\n' op value server_instr client_instr \
  server_alloc client_alloc "$N"
for size in 64 4KiB; do
  for op in get put; do
    read -r s1 sa1 < <(server_ir "$size" "$op" "$N")
    read -r s2 sa2 < <(server_ir "$size" "$op" $((2 * N)))
    read -r c1 ca1 < <(client_ir "$size" "$op" "$N")
    read -r c2 ca2 < <(client_ir "$size" "$op" $((2 * N)))
    printf '%-4s %6s %14d %14d %12.1f %12.1f\n' "$op" "$size" $(((s2 - s1) / N)) $(((c2 - c1) / N)) \
      "$(awk -v a="$sa1" -v b="$sa2" -v n="$N" 'BEGIN { print (b - a) / n }')" \
      "$(awk -v a="$ca1" -v b="$ca2" -v n="$N" 'BEGIN { print (b - a) / n }')"
  done
done
# wait_listening PORT PID LOG NAME: returns once something listens on PORT (a reference server
# under valgrind starts slowly); stops the script with LOG if PID exits first or 10 s pass.
wait_listening() {
  for _ in $(seq 1 100); do
    ss -ltn 2> /dev/null | grep -q ":$1 " && return 0
    kill -0 "$2" 2> /dev/null || break
    sleep 0.1
  done
  echo "$4 did not start:" >&2
  cat "$3" >&2
  exit 1
}
# The reference: ucx_perftest ucp_am_lat, 64 B each way, in gkv's endpoint mode (-e -I,
# UCX_MM_ERROR_HANDLING=y) and sleeping while it waits (-E sleep, as busy-polling is off above),
# both sides counted at once. A round trip of it is what a GET's request and reply cost UCX
# alone: the floor under the instructions per GET. perftest_ir COUNT -> "SERVER CLIENT"
perftest_ir() {
  local port sout="$dir/perftest.server.$1.cg" cout="$dir/perftest.client.$1.cg" pid
  port=$(free_port)
  UCX_MM_ERROR_HANDLING=y UCX_TOOL_WRAPPER="valgrind --tool=callgrind --callgrind-out-file=$sout" \
    scripts/ucx.sh ucx_perftest -p "$port" -e -I -E sleep > "$dir/perftest-server.log" 2>&1 &
  pid=$!
  wait_listening "$port" "$pid" "$dir/perftest-server.log" ucx_perftest
  UCX_MM_ERROR_HANDLING=y UCX_TOOL_WRAPPER="valgrind --tool=callgrind --callgrind-out-file=$cout" \
    scripts/ucx.sh ucx_perftest 127.0.0.1 -p "$port" -e -I -E sleep -t ucp_am_lat -s 64 \
    -n "$1" -w 0 > "$dir/perftest-client.log" 2>&1 || { cat "$dir/perftest-client.log" >&2; exit 1; }
  wait "$pid"
  echo "$(total_ir "$sout" | cut -d' ' -f1) $(total_ir "$cout" | cut -d' ' -f1)"
}
# The other reference: memcached (one worker thread) and gkv-bench's memcached text-protocol
# client (build/bin's, whatever GKV_BIN_DIR says), 64 B GETs, one side counted at a time as for
# gkv. On a machine whose cores the load generator and the server share, what each op costs both
# sides bounds ops/s. memcached_ir SIDE COUNT -> instructions
memcached_ir() {
  local out="$dir/memcached.$1.$2.cg" port wrap=() args=()
  port=$(free_port)
  [ "$(id -u)" -eq 0 ] && args=(-u root)  # memcached refuses to run as root without -u
  if [ "$1" = server ]; then
    wrap=(valgrind --tool=callgrind --callgrind-out-file="$out")
    # memcached sets its open-files limit, soft and hard, to its connection count; valgrind
    # (which keeps descriptors of its own) refuses any hard limit but the one it shows.
    args+=(-c "$(valgrind --tool=none sh -c 'ulimit -Hn' 2> /dev/null)")
  fi
  "${wrap[@]}" memcached "${args[@]}" -l 127.0.0.1 -p "$port" -U 0 -t 1 -m 64 \
    > "$dir/memcached.log" 2>&1 &
  server_pid=$!
  wait_listening "$port" "$server_pid" "$dir/memcached.log" memcached
  wrap=()
  [ "$1" = client ] && wrap=(valgrind --tool=callgrind --callgrind-out-file="$out")
  "${wrap[@]}" "$PWD/build/bin/gkv-bench" --protocol memcached --server "127.0.0.1:$port" \
    --keys 16 --value-size 64 --ratio 1:0 --requests "$2" --threads 1 --connections 1 \
    --warmup 0 > "$dir/bench.log" 2>&1 || { cat "$dir/bench.log" >&2; exit 1; }
  stop_server
  total_ir "$out" | cut -d' ' -f1
}
ms1=$(memcached_ir server "$N")
ms2=$(memcached_ir server $((2 * N)))
mc1=$(memcached_ir client "$N")
mc2=$(memcached_ir client $((2 * N)))
printf '%-4s %6s %14d %14d   (memcached -t 1 and gkv-bench --protocol memcached)\n' get 64 \
  $(((ms2 - ms1) / N)) $(((mc2 - mc1) / N))
read -r ps1 pc1 <<< "$(perftest_ir "$N")"
read -r ps2 pc2 <<< "$(perftest_ir $((2 * N)))"
printf '%-4s %6s %14d %14d   (ucx_perftest ucp_am_lat: one round trip, each side)\n' ucx 64 \
  $(((ps2 - ps1) / N)) $(((pc2 - pc1) / N))
echo "callgrind files: $dir"
