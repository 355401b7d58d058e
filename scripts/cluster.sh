#!/usr/bin/env bash
# Starts or stops a local gkv cluster on loopback (used by the demo and the comparisons).
#   scripts/cluster.sh start DIR N [gkv-server options...]          static membership
#   scripts/cluster.sh start DIR N --etcd [gkv-server options...]   membership in etcd
#   scripts/cluster.sh stop DIR          SIGTERM by process id (nodes, then etcd), then waits
# Writes DIR/cluster.yaml and DIR/pids (the nodes). Ports are free ones picked by the kernel.
# GKV_SERVER_BIN: the gkv-server to start (default build/bin/gkv-server).
# Logs: DIR/nodeI.log. Disk tiers: DIR/diskI.
# With --etcd it first starts an etcd of its own (data in DIR/etcd, log DIR/etcd.log, process id
# in DIR/etcd.pid), writes a cluster file with `membership: etcd` and its endpoint (cluster name
# gkv), and starts each node with --listen 127.0.0.1:PORT, which is the address it registers.
# N may be 0 (etcd alone).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
cmd=${1:-}
dir=${2:-}
usage() { echo "usage: $0 start DIR N [--etcd] [opts] | stop DIR" >&2; exit 2; }
if [ -z "$cmd" ] || [ -z "$dir" ]; then usage; fi

free_port() {
  if command -v python3 > /dev/null; then
    python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1]); s.close()'
    return
  fi
  # No Python (a bare GPU machine): a random port below the ephemeral range that nothing on
  # this host listens on.
  local port
  for _ in $(seq 1 100); do
    port=$((20000 + RANDOM % 12000))
    if ! (exec 3<> "/dev/tcp/127.0.0.1/$port") 2> /dev/null; then echo "$port"; return; fi
  done
  echo "no free port found" >&2
  return 1
}

# Sends SIGTERM to a process and waits up to 10 s for it to go, then SIGKILLs it.
stop_pid() {
  local pid=$1
  kill -TERM "$pid" 2>/dev/null || return 0
  for _ in $(seq 1 100); do kill -0 "$pid" 2>/dev/null || return 0; sleep 0.1; done
  kill -KILL "$pid" 2>/dev/null || true
}

etcd_healthy() {
  python3 - "$1" 2>/dev/null <<'PY'
import sys, urllib.request
with urllib.request.urlopen(sys.argv[1] + "/health", timeout=1) as r:
    sys.exit(0 if b'"true"' in r.read() else 1)
PY
}

start_etcd() {
  if [ -f "$dir/etcd.pid" ] && kill -0 "$(cat "$dir/etcd.pid")" 2>/dev/null; then
    echo "an etcd of $dir runs already (pid $(cat "$dir/etcd.pid")): $0 stop $dir" >&2
    exit 1
  fi
  local client_port peer_port endpoint peer
  client_port=$(free_port)
  peer_port=$(free_port)
  while [ "$peer_port" = "$client_port" ]; do peer_port=$(free_port); done
  endpoint="http://127.0.0.1:$client_port"
  peer="http://127.0.0.1:$peer_port"
  # A fresh data directory: an old one would carry the member's old peer address.
  rm -rf "$dir/etcd"
  etcd --name gkv --data-dir "$dir/etcd" \
    --listen-client-urls "$endpoint" --advertise-client-urls "$endpoint" \
    --listen-peer-urls "$peer" --initial-advertise-peer-urls "$peer" \
    --initial-cluster "gkv=$peer" --initial-cluster-state new > "$dir/etcd.log" 2>&1 &
  echo $! > "$dir/etcd.pid"
  for _ in $(seq 1 100); do
    etcd_healthy "$endpoint" && break
    if ! kill -0 "$(cat "$dir/etcd.pid")" 2>/dev/null; then
      echo "etcd failed to start:" >&2; cat "$dir/etcd.log" >&2; exit 1
    fi
    sleep 0.1
  done
  etcd_healthy "$endpoint" || { echo "etcd did not come up; log: $dir/etcd.log" >&2; exit 1; }
  printf 'membership: etcd\netcd: {endpoints: [%s], cluster: gkv}\n' "$endpoint" > "$dir/cluster.yaml"
  echo "etcd up: $endpoint (pid $(cat "$dir/etcd.pid"))"
}

case "$cmd" in
  start)
    n=${3:-3}
    shift 3 || true
    etcd_mode=0
    if [ "${1:-}" = "--etcd" ]; then
      etcd_mode=1
      shift
    fi
    mkdir -p "$dir"
    listen=()
    if [ "$etcd_mode" = 1 ]; then
      start_etcd
      for i in $(seq 0 $((n - 1))); do listen+=("127.0.0.1:$(free_port)"); done
    else
      echo "nodes:" > "$dir/cluster.yaml"
      for i in $(seq 0 $((n - 1))); do
        echo "  - {id: n$i, address: 127.0.0.1:$(free_port)}" >> "$dir/cluster.yaml"
      done
    fi
    : > "$dir/pids"
    for i in $(seq 0 $((n - 1))); do
      node_args=(--cluster "$dir/cluster.yaml" --node "n$i" --disk "$dir/disk$i")
      if [ "$etcd_mode" = 1 ]; then node_args+=(--listen "${listen[$i]}"); fi
      "${GKV_SERVER_BIN:-$ROOT/build/bin/gkv-server}" "${node_args[@]}" "$@" > "$dir/node$i.log" 2>&1 &
      echo $! >> "$dir/pids"
    done
    # Ready when every node logged that it is up (or fail with its log).
    for i in $(seq 0 $((n - 1))); do
      for _ in $(seq 1 100); do
        grep -q "node n$i up" "$dir/node$i.log" 2>/dev/null && break
        if ! kill -0 "$(sed -n "$((i + 1))p" "$dir/pids")" 2>/dev/null; then
          echo "node n$i failed to start:" >&2; cat "$dir/node$i.log" >&2; exit 1
        fi
        sleep 0.1
      done
      grep -q "node n$i up" "$dir/node$i.log" || { echo "node n$i did not come up" >&2; exit 1; }
    done
    echo "cluster of $n nodes up: $dir/cluster.yaml"
    ;;
  stop)
    # Nodes first: draining or deregistering nodes still need etcd.
    if [ -f "$dir/pids" ]; then
      while read -r pid; do kill -TERM "$pid" 2>/dev/null || true; done < "$dir/pids"
      while read -r pid; do stop_pid "$pid"; done < "$dir/pids"
      rm -f "$dir/pids"
    fi
    if [ -f "$dir/etcd.pid" ]; then
      stop_pid "$(cat "$dir/etcd.pid")"
      rm -f "$dir/etcd.pid"
    fi
    ;;
  *) usage ;;
esac
